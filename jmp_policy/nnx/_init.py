"""Creating NNX float8 state: a copy of the model whose float8 layers hold their state."""

from __future__ import annotations

from typing import Any, TypeVar

import jax
import jax.numpy as jnp
from flax import nnx

import jmp_policy.nnx._modules as m
from jmp_policy._src import float8
from jmp_policy._src.resolution import as_policy_or_map, check_floating
from jmp_policy.nnx._apply import resolver_for
from jmp_policy.nnx._quantization import ATTR, Float8State, routable

M = TypeVar("M", bound=nnx.Module)


def _stacked(module: Any) -> tuple[int, ...]:
    """The leading axes of a layer created stacked (``nnx.vmap`` of its constructor, for
    ``nnx.scan`` over layers): its kernel's axes before the layer's own."""
    if isinstance(module, nnx.Linear):
        own = 2
    elif isinstance(module, nnx.LinearGeneral):
        own = len(module.batch_axis) + len(module.in_features) + len(module.out_features)
    else:
        own = len(module.kernel_shape)
    shape = tuple(getattr(module.kernel.get_value(), "shape", ()))
    return shape[: max(len(shape) - own, 0)]


def _state(policy: Any, module: Any) -> Float8State:
    lead = _stacked(module)
    state = float8.init_state(policy.amax_history_length)
    return Float8State(jax.tree.map(lambda x: jnp.broadcast_to(x, lead + x.shape), state))


def init_float8(model: M, policy_or_map: Any, **options: Any) -> M:
    """A copy of ``model`` whose float8 layers hold their float8 state.

    Every ``nnx.Linear`` whose ``dot_general`` is ``jax.lax.dot_general``,
    ``nnx.LinearGeneral`` whose user set neither ``dot_general`` nor ``dot_general_cls``,
    and ``nnx.Einsum`` whose ``einsum_op`` is ``jnp.einsum``, whose policy (resolved from
    ``policy_or_map`` and ``options`` exactly as :func:`jmp_policy.nnx.apply` does) is a
    ``QuantizedFloat8DTypePolicy``, gets the attribute ``float8``: a
    :class:`~jmp_policy.nnx.Float8State` holding scales of 1 and zero amax histories of
    the policy's ``amax_history_length`` (float32). A state already there is replaced by
    a fresh one. Other layers get nothing. A layer created stacked (``nnx.vmap`` of its
    constructor, to run under ``nnx.scan`` over layers) gets its state stacked the same
    way (over its kernel's leading axes), so each scanned layer has its own. :func:`jmp_policy.nnx.apply` with the same
    ``policy_or_map`` then runs those layers' matmuls through float8 with delayed scaling
    (inputs and kernels in ``float8_e4m3fn``, output gradients in ``float8_e5m2``).

    **One state per layer.** NNX keeps a float8 layer's state on the layer, so a float8
    layer may run once per :func:`~jmp_policy.nnx.apply` run: calling a shared layer twice
    in one run is a ``ValueError`` (``jmp_policy.linen`` keeps a state per call). Run the
    model once per differentiated function: two runs in one loss would sum their new
    states.

    Args:
        model: an ``nnx.Module``; never modified (the copy, made with ``nnx.clone``,
            shares its parameter arrays until either is updated).
        policy_or_map: the policy or map that :func:`jmp_policy.nnx.apply` will run.
        **options: the options of :func:`jmp_policy.nnx.apply` (``type_policies``,
            ``module_dtype``, ``autocast_exclude``): they can change a layer's policy.

    Returns:
        The copy of ``model`` with its float8 state.

    Raises:
        TypeError: ``model`` is not an ``nnx.Module``, or an option has the wrong type.
        ValueError: ``policy_or_map`` is not a valid floating policy or map, no layer of
            the model runs under a float8 policy, or a float8 layer's attribute
            ``float8`` is something else than a ``Float8State``.

    Examples:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import jmp_policy as jp
        >>> class MLP(nnx.Module):
        ...     def __init__(self, rngs):
        ...         self.hidden = nnx.Linear(3, 8, rngs=rngs)
        ...         self.head = nnx.Linear(8, 1, rngs=rngs)
        ...     def __call__(self, x):
        ...         return self.head(nnx.relu(self.hidden(x)))
        >>> model = MLP(nnx.Rngs(0))
        >>> policy_map = jp.DTypePolicyMap(
        ...     jp.QuantizedFloat8DTypePolicy("float8", "mixed_bfloat16",
        ...                                   amax_history_length=16),
        ...     {"head": "float32"})
        >>> fp8_model = jp.nnx.init_float8(model, policy_map)
        >>> fp8_model.hidden.float8.get_value()["kernel_amax_history"].shape
        (16,)
        >>> hasattr(fp8_model.head, "float8"), hasattr(model.hidden, "float8")
        (False, False)
        >>> jp.nnx.apply(fp8_model, policy_map)(jnp.ones((2, 3))).dtype
        dtype('float32')
    """
    m.check_model(model)
    resolved = as_policy_or_map(policy_or_map)
    check_floating(resolved)
    opts = m.options(options)
    copy = nnx.clone(model)
    resolver = resolver_for(copy, resolved, opts)
    found = 0
    for parts, module in list(nnx.iter_modules(copy)):
        path = m.path_of(parts)
        policy: Any = resolver.module(path).policy
        if not (float8.is_float8(policy) and routable(module)):
            continue
        found += 1
        if not float8.is_delayed(policy):
            continue  # current scaling keeps no state
        current = getattr(module, ATTR, None)
        if current is not None and not isinstance(current, Float8State):
            raise ValueError(
                f"{type(module).__name__} at {path or 'the root'!r} runs under the float8 "
                f"policy {policy.name!r}, but its attribute {ATTR!r}, where its float8 state "
                f"goes, already holds {current!r}. Rename that attribute."
            )
        setattr(module, ATTR, _state(policy, module))
    if not found:
        raise ValueError(
            "No layer of the model runs under a float8 policy: `init_float8` creates float8 "
            "state for nnx.Linear, nnx.LinearGeneral and nnx.Einsum layers with NNX's own "
            "matmul whose policy is float8 (such as 'float8_from_mixed_bfloat16'). Received: "
            f"policy_or_map={policy_or_map!r} for a {type(model).__name__}"
        )
    return copy
