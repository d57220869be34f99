"""``search_map``, written once against the adapter protocol: the model's runs handed to
the core's search (:func:`jmp_policy._src.map_search.search`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

from jmp_policy._src import map_search
from jmp_policy._src.framework import entry_points
from jmp_policy._src.framework.protocol import Adapter
from jmp_policy._src.options import Options
from jmp_policy._src.quantization import is_quantized
from jmp_policy._src.tree_paths import leaf_path


def search_map(
    adapter: Adapter,
    model: Any,
    batches: Sequence[Any],
    loss_fn: Callable[[Any, Any], Any],
    *,
    budget: Mapping[str, float],
    candidates: Sequence[str],
    base: str,
    inputs: Callable[[Any], tuple[Any, ...]] | None,
    progress: Callable[[str], None] | None,
    options: Options,
    apply: Callable[[Any, Any, tuple[Any, ...]], Callable[..., Any]] | None = None,
    jit: bool = False,
    reuse: tuple[Any, ...] | None = None,
) -> map_search.SearchResult:
    """One policy per layer under ``budget`` (a stack is one path, chosen whole); ``model``
    is not modified (the candidates run on quantized copies).

    The layers are the routable ones, or those the adapter's optional ``search_kernels``
    names (``(kernels, stacked_at)``: layer path -> float kernel, and the axis a stacked
    one's layers start at where it is not 0); ``apply(model, policy_map, extensions)``
    runs a candidate (default: the core's ``apply``). With ``jit``, each pass is compiled,
    the model's arrays (``adapter.split``) its argument, and ``reuse`` (what the runs are
    functions of besides them) keeps the compiled passes across searches."""
    adapter.check(model)
    args_of = inputs or (lambda batch: (batch,))
    found = getattr(adapter, "search_kernels", None)
    kernels, stacked_at = (found or _routed_kernels(adapter))(model)

    def make_loss(policy_map: Any) -> tuple[Callable[[Any, Any], Any], Any]:
        stores = map_search.stores_weights(policy_map)
        runner = entry_points.quantize(adapter, model, policy_map) if stores else model
        taps = (map_search.ScoreTaps(),)

        def run_on(live: Any) -> Callable[..., Any]:
            if apply is None:
                return entry_points.apply(adapter, live, policy_map, options, taps)
            return apply(live, policy_map, taps)

        if jit:  # the arrays an argument of the compiled pass, not constants of it
            arrays, rebuild = adapter.split(runner)

            def compiled_loss(arrays: Any, batch: Any) -> Any:
                return loss_fn(run_on(rebuild(arrays))(*args_of(batch)), batch)

            return compiled_loss, arrays
        run = run_on(runner)

        def loss(_: Any, batch: Any) -> Any:
            return loss_fn(run(*args_of(batch)), batch)

        return loss, None

    return map_search.search(
        kernels,
        make_loss,
        batches,
        candidates=candidates,
        budget=budget,
        base=base,
        jit=jit,
        progress=progress,
        stacked_at=stacked_at,
        reuse=reuse,
    )


def search_call(
    adapter: Adapter, arguments: Mapping[str, Any], **given: Any
) -> map_search.SearchResult:
    """:func:`search_map` with a framework's public ``search_map``'s arguments by name (its
    ``locals()``: ``model``, ``batches``, ``loss_fn`` and the keywords), ``given`` replacing
    them (``options``: built, not the user's keywords)."""
    return search_map(adapter, **{**arguments, **given})


def param_kernels(params: Any) -> dict[str, Any]:
    """Layer path -> each leaf named ``kernel`` of rank >= 2 of a parameter tree (every
    layer's, a convolution's too): the layers of an adapter's ``search_kernels``."""
    kernels = {}
    for key_path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        layer, _, name = leaf_path(key_path).rpartition("/")
        if name == "kernel" and getattr(leaf, "ndim", 0) >= 2:
            kernels[layer] = leaf
    return kernels


def _routed_kernels(adapter: Adapter) -> Callable[[Any], tuple[dict[str, Any], dict[str, int]]]:
    def kernels(model: Any) -> tuple[dict[str, Any], dict[str, int]]:
        found = {
            layer.path: entry_points.canonical(layer.kernel, layer)
            for layer in adapter.layers(model)
            if layer.kernel_name is not None and not is_quantized(layer.kernel)
        }
        return found, {}

    return kernels
