"""Creating NNX float8 state: a copy of the model whose float8 layers hold their state."""

from __future__ import annotations

from typing import Any, TypeVar

from flax import nnx

from jmp_policy._src.framework import state
from jmp_policy._src.framework.shared_docs import fill
from jmp_policy.nnx._adapter import ADAPTER
from jmp_policy.nnx._modules import prepare

M = TypeVar("M", bound=nnx.Module)


@fill
def init_float8(model: M, policy_or_map: Any, **options: Any) -> M:
    """A copy of ``model`` whose float8 layers hold their float8 state.

    Every ``nnx.Linear``, ``nnx.LinearGeneral`` and ``nnx.Einsum`` with NNX's own matmul
    (no ``dot_general``, ``dot_general_cls`` or ``einsum_op`` of the user's) whose policy
    (resolved as :func:`apply` resolves it) is float8 gets the attribute ``float8``, a fresh
    :class:`Float8State`; a layer created stacked (``nnx.vmap``) gets one per layer. NNX
    keeps one state per layer: a float8 layer called twice in one :func:`apply` run is a
    ``ValueError``; two runs in one differentiated function would sum their new states.
    {float8_state}

    Args:
        model: an ``nnx.Module``; never modified (the copy, made with ``nnx.clone``,
            shares its parameter arrays until either is updated).
        policy_or_map: the policy or map that :func:`apply` will run.
        **options: the options of :func:`apply`: they can change a layer's policy.

    Returns:
        The copy of ``model`` with its float8 state.

    Raises:
        TypeError, ValueError: as :func:`apply` (``model``, ``policy_or_map``, an option).
        ValueError: no layer runs under a float8 policy, or a layer's ``float8`` is not a
            ``Float8State``.

    Examples:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import jmp_policy as jp
        >>> model = nnx.Sequential(nnx.Linear(3, 8, rngs=nnx.Rngs(0)),
        ...                        nnx.Linear(8, 1, rngs=nnx.Rngs(1)))
        >>> policy_map = jp.DTypePolicyMap(
        ...     jp.QuantizedFloat8DTypePolicy("float8", "mixed_bfloat16",
        ...                                   amax_history_length=16),
        ...     {"layers/1": "float32"})
        >>> fp8_model = jp.nnx.init_float8(model, policy_map)
        >>> fp8_model.layers[0].float8.get_value()["kernel_amax_history"].shape
        (16,)
        >>> hasattr(fp8_model.layers[1], "float8"), hasattr(model.layers[0], "float8")
        (False, False)
        >>> jp.nnx.apply(fp8_model, policy_map)(jnp.ones((2, 3))).dtype
        dtype('float32')
    """
    policies, opts = prepare(model, policy_or_map, options)
    copy, found = state.init_states(ADAPTER, model, policies, opts)
    if not found:
        raise ValueError(
            "No layer of the model runs under a float8 policy: `init_float8` creates float8 "
            "state for nnx.Linear, nnx.LinearGeneral and nnx.Einsum layers with NNX's own "
            "matmul whose policy is float8 (such as 'float8_from_mixed_bfloat16'). Received: "
            f"policy_or_map={policy_or_map!r} for a {type(model).__name__}"
        )
    return copy
