"""``apply``, ``quantize`` and ``explain``, written once against the adapter protocol.

Each takes an :class:`~jmp_policy._src.framework.protocol.Adapter` first and the user's
arguments after it; a framework's public function is this call with its adapter and its
own docstring. What runs in each layer is decided here and in the hook, never in an
adapter: the policy (:class:`~jmp_policy._src.resolution.Resolver`), the matmul
(:func:`jmp_policy._src.quantization.matmuls.pick`), the quantized storage
(``DTypePolicyMap.quantize``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jmp_policy._src import interception
from jmp_policy._src.calibration_report import format_calibration
from jmp_policy._src.explain import format_matmuls, format_rows
from jmp_policy._src.framework.protocol import OUT_IN, Adapter, Layer
from jmp_policy._src.framework.routing import routed_matmuls as routed_matmuls
from jmp_policy._src.kv_cache import arguments as cache_arguments
from jmp_policy._src.options import Options, floating_policy_or_map, quantizing_policy_or_map
from jmp_policy._src.quantization import is_quantized, matmuls
from jmp_policy._src.resolution import ModuleInfo, Resolver
from jmp_policy._src.run_report import float8_not_run, resolved_rows, unused_keys_note
from jmp_policy._src.tree_paths import leaf_path, parent_path


def class_name(adapter: Adapter, model: Any) -> str:
    """The model's class in messages: the adapter's optional ``class_name(model)``, else
    the model's type (a framework whose model is a pair names its module's class)."""
    named = getattr(adapter, "class_name", None)
    return type(model).__name__ if named is None else str(named(model))


def resolver_for(adapter: Adapter, model: Any, policies: Any, options: Options) -> Resolver:
    """A resolver that knows every module of ``model`` (its class and own dtype)."""
    infos = {layer.path: ModuleInfo(layer.cls, layer.own_dtype) for layer in adapter.layers(model)}
    resolver = Resolver(policies, options, infos)
    for path in sorted(infos, key=len):  # the root first: a child inherits its parent's
        resolver.module(path)
    return resolver


def apply(
    adapter: Adapter,
    model: Any,
    policy_or_map: Any,
    options: Options,
    extensions: tuple[Any, ...],
    invoke: Callable[..., Any] | None = None,
) -> Callable[..., Any]:
    """A function with ``model``'s call signature that runs it per submodule.

    ``invoke(copy, resolver, extensions, args, kwargs)``, when given, calls the
    policy-running copy instead of ``copy(*args, **kwargs)`` (another method of it)."""
    adapter.check(model)
    policies = floating_policy_or_map(policy_or_map)
    # Quantized and float8 matmuls innermost, on the layers whose kernel the core routes.
    every = (*extensions, routed_matmuls(adapter))

    def run(*args: Any, **kwargs: Any) -> Any:
        resolver = resolver_for(adapter, model, policies, options)

        def call(copy: Any) -> Any:
            if invoke is None:
                return copy(*args, **kwargs)
            return invoke(copy, resolver, every, args, kwargs)

        with interception.model_run(options):
            return adapter.run(model, resolver, options, every, call)

    return run


def canonical(kernel: Any, layer: Layer) -> Any:
    """``kernel`` in the library's ``[in, out]`` layout (its stacked axes leading)."""
    return jax.numpy.swapaxes(kernel, -1, -2) if layer.layout == OUT_IN else kernel


def quantize(adapter: Adapter, model: Any, policy_or_map: Any) -> Any:
    """A new model whose routable layers under int8/int4 policies hold ``QuantizedArray``
    kernels (``[in, out]``; a stacked layer quantized per layer); an adapter with the
    optional ``weights`` operation names the weights its quantize covers itself."""
    adapter.check(model)
    policies = quantizing_policy_or_map(policy_or_map)
    weights = getattr(adapter, "weights", None)
    tree, stacked_axes, rebuild = (weights or _layer_kernels(adapter))(model)
    return rebuild(policies.quantize(tree, stacked_axes=stacked_axes))


def _layer_kernels(adapter: Adapter) -> Callable[[Any], Any]:
    """``weights`` from the adapter's layers: each routable float kernel as ``[in, out]``
    in a module tree, a stacked one's stacked axes leading; put back by ``with_kernels``."""

    def weights(model: Any) -> tuple[Any, Any, Callable[[Any], Any]]:
        tree: dict[str, Any] = {}
        stacked_axes: dict[str, tuple[int, int]] = {}
        for layer in adapter.layers(model):
            if layer.kernel_name is None or is_quantized(layer.kernel):
                continue
            parts = [*(layer.path.split("/") if layer.path else []), layer.kernel_name]
            node = tree
            for part in parts[:-1]:  # nested by path: the map resolves it as a module tree
                node = node.setdefault(part, {})
            node[parts[-1]] = canonical(layer.kernel, layer)
            if layer.stacked:
                stacked_axes[re.escape("/".join(parts))] = (len(layer.stacked), 0)

        def rebuild(quantized: Any) -> Any:
            found = jax.tree_util.tree_flatten_with_path(quantized, is_leaf=is_quantized)[0]
            kernels = {}
            for key_path, q in found:
                if is_quantized(q):
                    kernels[parent_path(leaf_path(key_path)) or ""] = q
            return adapter.with_kernels(model, kernels)

        return tree, stacked_axes, rebuild

    return weights


def explain(
    adapter: Adapter,
    model: Any,
    policy_or_map: Any,
    options: Options,
    extensions: tuple[Any, ...],
    args: tuple[Any, ...],
    calibration: Any = None,
    *,
    trace: bool = False,
) -> str:
    """The table of each module's policy and why; with ``args`` (or ``trace``: a model
    called with none), the matmul each layer runs (traced shape-only: nothing is
    computed)."""
    adapter.check(model)
    policies = floating_policy_or_map(policy_or_map)
    params = dict(adapter.params(model))
    calibrated = format_calibration(calibration, params)
    resolver = resolver_for(adapter, model, policies, options)
    rows = resolved_rows(resolver, params, is_leaf=is_quantized)
    table = format_rows(rows) + unused_keys_note(resolver, class_name(adapter, model))
    if not args and not trace:
        return table + calibrated
    run = apply(adapter, model, policies, options, extensions)
    with matmuls.recording() as forms, cache_arguments.recording(options.kv_cache) as caches:
        eval_shapes(lambda given: run(*given), args)
    float8_not_run(resolver, rows, params, forms)
    return table + format_matmuls(forms) + cache_arguments.table(caches) + calibrated


def eval_shapes(fn: Callable[[Any], Any], tree: Any) -> Any:
    """``fn(tree)`` traced shape-only (``jax.eval_shape``): its arrays (and
    ``jax.ShapeDtypeStruct`` leaves) traced, every other leaf held as given (a Python flag
    such as a model's ``enable_dropout`` stays a bool, as under ``eqx.filter_eval_shape``)."""
    leaves, treedef = jax.tree.flatten(tree)
    traced = [isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct)) for x in leaves]

    def shapes_only(*arrays: Any) -> Any:
        it = iter(arrays)
        full = [next(it) if flag else x for x, flag in zip(leaves, traced, strict=True)]
        return fn(jax.tree.unflatten(treedef, full))

    return jax.eval_shape(shapes_only, *[x for x, flag in zip(leaves, traced, strict=True) if flag])
