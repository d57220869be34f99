"""Quantized compute for NNX: the adapter's answers to the core's matmul routing.

A routable layer (``nnx.Linear`` with JAX's ``dot_general``, ``nnx.LinearGeneral`` with
neither ``dot_general`` nor ``dot_general_cls`` set, ``nnx.Einsum`` with ``jnp.einsum``)
gets the routed matmul in that attribute for the call, on the policy-running copy. A
stateful scheme's state is the layer's attribute named by its ``state_kind`` (float8:
``float8``, a :class:`Float8State`), one per layer: a float8 layer called twice in one run
is a ``ValueError``.
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

from jmp_policy._src.framework import run_kernels
from jmp_policy._src.framework.shared_docs import fill
from jmp_policy._src.framework.state import fits, shapes

ATTR = "float8"  # the attribute of a float8 layer that holds its Float8State


@fill
class Float8State(nnx.Variable):
    """The float8 delayed-scaling state of one NNX layer (a ``dict`` value).

    :func:`jmp_policy.nnx.init_float8` creates it, as the attribute ``float8`` of each
    float8 layer.
    {float8_state}
    It is not an ``nnx.Param``: ``nnx.Optimizer(model, tx, wrt=nnx.Param)`` leaves it alone,
    and its gradient (taken with a filter that includes it, such as ``nnx.DiffState(0,
    nnx.Any(nnx.Param, Float8State))``) is its new value, which
    :func:`jmp_policy.nnx.split_gradients` hands back for ``nnx.update``.

    Examples:
        >>> from flax import nnx
        >>> import jmp_policy as jp
        >>> layer = nnx.Linear(3, 4, rngs=nnx.Rngs(0))
        >>> layer = jp.nnx.init_float8(layer, "float8_from_mixed_bfloat16")
        >>> isinstance(layer.float8, jp.nnx.Float8State)
        True
        >>> layer.float8.get_value()["input_amax_history"].shape   # amax_history_length
        (1024,)
        >>> sorted(nnx.state(layer, jp.nnx.Float8State)["float8"].get_value())[:2]
        ['input_amax_history', 'input_scale']
    """


class SchemeState(nnx.Variable):
    """The state of a stateful scheme other than float8 (a toy format's), on its layer."""


def state_type(kind: str) -> type[nnx.Variable[Any]]:
    """The variable type holding a layer's state of kind ``kind`` (the scheme's
    ``state_kind``): :class:`Float8State` for float8's."""
    return Float8State if kind == ATTR else SchemeState


def _where(call: Any) -> str:
    return f"{type(call.module).__name__} at {call.path or 'the root'!r}"


def layer_state(call: Any, scheme: Any) -> dict[str, jax.Array]:
    """The state slot: the state of kind ``scheme.state_kind`` of a layer's call, after
    checking it is there, fits the scheme and is read once in the run."""
    module, policy = call.module, call.resolution.policy
    variable: Any = getattr(module, scheme.state_kind, None)
    if not isinstance(variable, state_type(scheme.state_kind)):
        raise ValueError(
            f"{_where(call)} runs under the float8 policy {policy.name!r} but has no float8 "
            f"state (a `jmp_policy.nnx.Float8State` attribute {ATTR!r}). Create it with "
            "`model = jmp_policy.nnx.init_float8(model, policy_or_map)` (a copy of the "
            "model with the state) and take gradients with respect to it too: "
            "`nnx.grad(loss, argnums=nnx.DiffState(0, nnx.Any(nnx.Param, "
            "jmp_policy.nnx.Float8State)))`, then `jmp_policy.nnx.split_gradients`."
        )
    if not run_kernels.first_call(module):
        raise ValueError(
            f"{_where(call)} runs under the float8 policy {policy.name!r} and is called "
            "a second time in one run (a shared module). jmp_policy's NNX route keeps one "
            "float8 state per layer, and the new states of two calls would be summed "
            "into a corrupted one: one state per call is not supported in NNX (it is in "
            "Linen). Use a separate layer per call, or give this module a float32 or "
            "bfloat16 policy in the map."
        )
    state = variable.get_value()
    if not fits(state, scheme):
        history = shapes(state.get("input_amax_history") if isinstance(state, dict) else None)
        length = getattr(policy, "amax_history_length", None)
        raise ValueError(
            f"{_where(call)} runs under the float8 policy {policy.name!r} with "
            f"amax_history_length={length}, but its float8 state holds "
            f"an amax history of shape {history}. Create the state with the map you apply: "
            "`jmp_policy.nnx.init_float8(model, policy_or_map)`."
        )
    return state  # type: ignore[no-any-return]


@fill
def split_gradients(grads: nnx.State) -> tuple[nnx.State, nnx.State]:
    """Splits NNX gradients into what the optimizer updates and the new float8 state.

    {float8_gradient}

    Args:
        grads: an ``nnx.State`` of gradients taken with respect to the parameters and the
            float8 state, e.g. ``nnx.grad(loss, argnums=nnx.DiffState(0,
            nnx.Any(nnx.Param, jmp_policy.nnx.Float8State)))(model, ...)``.

    Returns:
        ``(param_grads, float8_state)``: ``grads`` without its :class:`Float8State`
        entries (for ``optimizer.update(model, param_grads)``), and those entries, the new
        states (for ``nnx.update(model, float8_state)``; empty when there are none). A
        float8 layer whose matmul did not run in the differentiated function gets a zero
        "new state": differentiate the function that runs every float8 layer once.

    Raises:
        TypeError: ``grads`` is not an ``nnx.State``.

    Examples:
        >>> import jax.numpy as jnp, optax
        >>> from flax import nnx
        >>> import jmp_policy as jp
        >>> policy_map = jp.DTypePolicyMap("float8_from_float32", {"layers/1": "float32"})
        >>> model = jp.nnx.init_float8(nnx.Sequential(nnx.Linear(3, 8, rngs=nnx.Rngs(0)),
        ...     nnx.Linear(8, 1, rngs=nnx.Rngs(1))), policy_map)
        >>> optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
        >>> def loss(model, x, y):
        ...     return jnp.mean((jp.nnx.apply(model, policy_map)(x) - y) ** 2)
        >>> @nnx.jit
        ... def train_step(model, optimizer, x, y):
        ...     wrt = nnx.DiffState(0, nnx.Any(nnx.Param, jp.nnx.Float8State))
        ...     grads = nnx.grad(loss, argnums=wrt)(model, x, y)
        ...     param_grads, float8_state = jp.nnx.split_gradients(grads)
        ...     optimizer.update(model, param_grads)
        ...     nnx.update(model, float8_state)
        >>> x, y = jnp.full((4, 3), 0.5), jnp.ones((4, 1))
        >>> train_step(model, optimizer, x, y)
        >>> model.layers[0].float8.get_value()["input_amax_history"][:2]
        Array([0.5, 0. ], dtype=float32)
        >>> float(model.layers[0].float8.get_value()["input_scale"])   # 448 / 0.5
        896.0
    """
    if not isinstance(grads, nnx.State):
        raise TypeError(
            "`grads` must be an `nnx.State` of gradients with respect to the model's "
            "parameters and float8 state, e.g. `nnx.grad(loss, argnums=nnx.DiffState(0, "
            "nnx.Any(nnx.Param, jmp_policy.nnx.Float8State)))(model, ...)`. Received: grads "
            f"of type {type(grads).__name__}"
        )
    float8_state, param_grads = nnx.filter_state(grads, Float8State, ...)
    return param_grads, float8_state
