"""Searching a policy map for an Equinox model: the core's ``search_map`` with the adapter."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jmp_policy._src import map_search
from jmp_policy._src.framework.search import search_map as search_once
from jmp_policy._src.framework.shared_docs import fill
from jmp_policy.equinox._api import ADAPTER, options_of


@fill
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
    """Chooses a policy per layer under ``budget``, by each format's measured effect.

    The layers are the model's ``eqx.nn.Linear`` weights; the candidates run on quantized
    copies. The passes run eagerly (call it outside ``jit``). The returned map's paths are
    the ones :func:`apply`, :func:`quantize` and ``cast_apply`` read.
    {search_description}

    Args:
        model: an ``eqx.Module`` with float weights.
        {search_args}

    {search_tail}

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
