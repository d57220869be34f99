"""Searching a policy map for an NNX model: its runs handed to the core's search."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from flax import nnx

from jmp_policy._src import map_search
from jmp_policy._src.framework.search import search_call
from jmp_policy._src.framework.shared_docs import fill
from jmp_policy._src.options import Options
from jmp_policy.nnx._adapter import ADAPTER
from jmp_policy.nnx._apply import apply_with
from jmp_policy.nnx._modules import check_model, prepare


@fill
def search_map(
    model: nnx.Module,
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

    {search_description}
    The layers are the ``nnx.Param`` kernels of rank >= 2 (``nnx.Linear``,
    ``nnx.LinearGeneral``, ``nnx.Einsum``, ``nnx.Conv``); the candidates run on quantized
    copies. The passes run eagerly (call it outside ``nnx.jit``). A function that
    ``nnx.remat`` or ``nnx.vmap`` wraps while the model runs is seen into; one wrapped
    before (at import) is not.

    Args:
        model: an ``nnx.Module`` with float parameters.
        {search_args}

    {search_tail}

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from flax import nnx
        >>> import jmp_policy as jp
        >>> model = nnx.Sequential(nnx.Linear(128, 256, rngs=nnx.Rngs(0)), nnx.relu,
        ...                        nnx.Linear(256, 4, rngs=nnx.Rngs(1)))
        >>> x = jax.random.normal(jax.random.key(0), (16, 128))
        >>> loss = lambda out, batch: (out.astype(jnp.float32) ** 2).mean()
        >>> result = jp.nnx.search_map(model, [x], loss, budget={"effective_bits": 8})
        >>> result.effective_bits <= 8
        True
    """
    check_model(model)

    def apply(runner: nnx.Module, policy_map: Any, taps: tuple[Any, ...]) -> Any:
        return apply_with(runner, *prepare(runner, policy_map, dict(options)), "__call__", taps)

    return search_call(ADAPTER, locals(), options=Options())
