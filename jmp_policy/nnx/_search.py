"""Searching a policy map for an NNX model: its runs handed to the core's search."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from flax import nnx

from jmp_policy._src import map_search
from jmp_policy._src.framework.search import search_call
from jmp_policy._src.options import Options
from jmp_policy.nnx._adapter import ADAPTER
from jmp_policy.nnx._apply import apply_with
from jmp_policy.nnx._modules import check_model, prepare


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
    """Chooses a policy per layer under ``budget``: :func:`jmp_policy.linen.search_map`
    for NNX.

    The layers are the ``nnx.Param`` kernels of rank >= 2 (``nnx.Linear``,
    ``nnx.LinearGeneral``, ``nnx.Einsum``, ``nnx.Conv``); ``model`` is not modified (the
    candidates run on quantized copies). The passes run eagerly (call it outside
    ``nnx.jit``). A layer stack (made by ``nnx.vmap``, run under ``nnx.scan`` or
    ``nnx.vmap``) is one path of the map, so it is scored and chosen per stack, as the
    table says. A function that ``nnx.remat`` or ``nnx.vmap`` wraps while the model runs
    is seen into; one wrapped before (at import) is not: its layers keep ``base``, as the
    table says.

    Args:
        model: an ``nnx.Module`` with float parameters.
        batches: calibration batches; each is passed to the model (see ``inputs``).
        loss_fn: ``loss_fn(outputs, batch) -> scalar``, the mean over the batch's examples.
        budget: as for :func:`jmp_policy.linen.search_map`.
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
        >>> from flax import nnx
        >>> import jmp_policy as jp
        >>> class MLP(nnx.Module):
        ...     def __init__(self, rngs):
        ...         self.up = nnx.Linear(128, 256, rngs=rngs)
        ...         self.head = nnx.Linear(256, 4, rngs=rngs)
        ...     def __call__(self, x):
        ...         return self.head(nnx.relu(self.up(x)))
        >>> model, x = MLP(nnx.Rngs(0)), jax.random.normal(jax.random.key(0), (16, 128))
        >>> loss = lambda out, batch: (out.astype(jnp.float32) ** 2).mean()
        >>> result = jp.nnx.search_map(model, [x], loss, budget={"effective_bits": 8})
        >>> result.effective_bits <= 8
        True
    """
    check_model(model)

    def apply(runner: nnx.Module, policy_map: Any, taps: tuple[Any, ...]) -> Any:
        return apply_with(runner, *prepare(runner, policy_map, dict(options)), "__call__", taps)

    return search_call(ADAPTER, locals(), options=Options())
