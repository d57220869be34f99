"""Searching a policy map for an Equinox model: the core's ``search_map`` with the adapter."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jmp_policy._src import map_search
from jmp_policy._src.framework.search import search_map as search_once
from jmp_policy.equinox._api import ADAPTER, options_of


def search_map(
    model: Any,
    batches: Sequence[Any],
    loss_fn: Callable[[Any, Any], Any],
    *,
    budget: Mapping[str, float],
    candidates: Sequence[str] = map_search.DEFAULT_CANDIDATES,
    base: str = "mixed_bfloat16",
    inputs: Callable[[Any], tuple[Any, ...]] | None = None,
    progress: Callable[[str], None] | None = None,
    **options: Any,
) -> map_search.SearchResult:
    """Chooses a policy per layer under ``budget``: :func:`jmp_policy.linen.search_map`
    for Equinox.

    The layers are the model's ``eqx.nn.Linear`` weights; ``model`` is not modified (the
    candidates run on quantized copies). The passes run eagerly (call it outside
    ``jit``). A stack made with ``eqx.filter_vmap`` and run with ``jax.lax.scan`` is one
    path of the map, scored and chosen whole. The returned map's paths are the ones
    :func:`apply`, :func:`quantize` and ``cast_apply`` read.

    Args:
        model: an ``eqx.Module`` with float weights.
        batches: calibration batches; each is passed to the model (see ``inputs``).
        loss_fn: ``loss_fn(outputs, batch) -> scalar``.
        budget: ``{"weight_bytes": n}``, ``{"effective_bits": b}`` or
            ``{"loss_increase": e}``, as for :func:`jmp_policy.linen.search_map`.
        candidates: quantized policy names.
        base: the float policy of unquantized layers, and the map's default.
        inputs: ``inputs(batch) -> args`` of the model's call (default ``(batch,)``).
        progress: ``progress(message)`` called before each pass.
        **options: as for :func:`apply`.

    Returns:
        A ``SearchResult`` ``(policy_map, table, weight_bytes, effective_bits,
        loss_increase, method)``.

    Raises:
        TypeError, ValueError: as :func:`jmp_policy.linen.search_map`.

    Examples:
        >>> import jax
        >>> import jax.numpy as jnp
        >>> import equinox as eqx
        >>> import jmp_policy as jp
        >>> class Batched(eqx.Module):
        ...     mlp: eqx.nn.MLP
        ...     def __call__(self, x):
        ...         return jax.vmap(self.mlp)(x)
        >>> model = Batched(eqx.nn.MLP(128, 4, 256, depth=1, key=jax.random.key(0)))
        >>> x = jax.random.normal(jax.random.key(1), (16, 128))
        >>> loss = lambda out, batch: (out.astype(jnp.float32) ** 2).mean()
        >>> result = jp.equinox.search_map(model, [x], loss, budget={"effective_bits": 8})
        >>> result.effective_bits <= 8
        True
    """
    return search_once(
        ADAPTER,
        model,
        batches,
        loss_fn,
        budget=budget,
        candidates=candidates,
        base=base,
        inputs=inputs,
        progress=progress,
        options=options_of(options),
    )
