"""Creating NNX float8 state: a copy of the model whose float8 layers hold their state."""

from __future__ import annotations

from typing import Any, TypeVar

from flax import nnx

from jmp_policy._src.framework import entry_points, state
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


@fill
def quantize(model: M, policy_or_map: Any) -> M:
    """A copy of ``model`` whose kernels under int8 or int4 policies are quantized.

    What ``policy_or_map.quantize(nnx.state(model, nnx.Param))`` does, with the leading
    stacked axes of each layer found from the model.
    {quantize_description}
    A layer is stacked when it is created stacked (``nnx.vmap`` of its constructor): an
    ``nnx.Linear``, ``nnx.LinearGeneral``, ``nnx.Einsum`` or ``nnx.Conv`` whose kernel has
    more axes than the layer's own.

    Args:
        model: an ``nnx.Module``; never modified (the copy is made with ``nnx.clone``).
        {quantize_policy_or_map}

    Returns:
        The quantized copy of ``model``.

    Raises:
        TypeError: ``model`` is not an ``nnx.Module``.
        {quantize_error}

    Examples:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import jmp_policy as jp
        >>> class Stack(nnx.Module):
        ...     def __init__(self, rngs):
        ...         @nnx.split_rngs(splits=4)
        ...         @nnx.vmap
        ...         def make(rngs):
        ...             return nnx.Linear(8, 8, rngs=rngs)
        ...         self.layers = make(rngs)   # kernels [4, 8, 8]
        ...     def __call__(self, x):
        ...         @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        ...         def body(x, layer):
        ...             return layer(x)
        ...         return body(x, self.layers)
        >>> model = Stack(nnx.Rngs(0))
        >>> q = jp.nnx.quantize(model, "int8_from_float32")
        >>> q.layers.kernel.get_value()
        QuantizedArray(int8, shape=(4, 8, 8), original_dtype=float32, stacked=1)
        >>> q.layers.kernel.get_value().scale.shape   # a scale per layer and channel
        (4, 8)
        >>> q.layers.bias.get_value().dtype   # the stacked bias stays float
        dtype('float32')
        >>> jp.nnx.apply(q, "int8_from_float32")(jnp.ones((2, 8))).shape
        (2, 8)
    """
    return entry_points.quantize(ADAPTER, model, policy_or_map)  # type: ignore[no-any-return]
