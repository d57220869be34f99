"""The Equinox per-layer state slot: where an ``eqx.nn.Linear`` holds the state its
scheme keeps (float8 delayed scaling's scales and amax histories).

An ``eqx.nn.Linear`` has no field for it, and Equinox modules are frozen dataclasses: a
layer given state becomes an instance of a cached subclass of its class (same name, same
fields, same ``__call__``) with one more field, named by the scheme's ``state_kind``
(``float8``), holding a :class:`Float8State`. Its arrays are leaves of the model's pytree
(``eqx.partition``, ``eqx.filter_grad`` and ``optax`` see them); its path is the layer's
(``attn/query_proj/float8/...``), so a map by path is unchanged. The matmul returns the new
state as the state's gradient (Flax's convention); :func:`split_gradients` separates it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from jmp_policy._src.framework.shared_docs import fill
from jmp_policy._src.framework.state import fits

# A state-holding subclass's name for its original class and its slot's field.
_PUBLIC = "_jmp_policy_public_class"
_SLOT = "_jmp_policy_slot"
_HOLDERS: dict[tuple[type, str], type] = {}


@fill
class Float8State(eqx.Module):
    """A layer's float8 state (``value``: a dict of float32 arrays), held by an
    ``eqx.nn.Linear`` that :func:`jmp_policy.equinox.init_float8` gave it.

    {float8_state}
    Its "gradient" under ``eqx.filter_grad``/``jax.grad`` is its new value: take it out with
    :func:`jmp_policy.equinox.split_gradients`, never through an optimizer.

    Examples:
        >>> import jax
        >>> import equinox as eqx
        >>> import jmp_policy as jp
        >>> layer = eqx.nn.Linear(3, 4, key=jax.random.key(0))
        >>> layer = jp.equinox.init_float8(layer, "float8_from_float32")
        >>> isinstance(layer.float8, jp.equinox.Float8State)
        True
        >>> layer.float8.value["input_amax_history"].shape
        (1024,)
    """

    value: dict[str, jax.Array]


def is_slot(x: Any) -> bool:
    """Whether ``x`` is a layer's state (kept whole: never cast, never a module)."""
    return isinstance(x, Float8State)


def public_class(cls: type) -> type:
    """The class a state-holding subclass stands for (``eqx.nn.Linear``), else ``cls``."""
    return getattr(cls, _PUBLIC, cls)


def _holder(cls: type, kind: str) -> type:
    """The subclass of ``cls`` with a field ``kind`` holding the layer's state."""
    cls = public_class(cls)
    key = (cls, kind)
    if key not in _HOLDERS:
        namespace = {
            "__annotations__": {kind: Any},
            kind: eqx.field(default=None),
            _PUBLIC: cls,
            _SLOT: kind,
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
        }
        _HOLDERS[key] = type(cls)(cls.__name__, (cls,), namespace)
    return _HOLDERS[key]


def holding(module: Any, kind: str, value: Any) -> Any:
    """A copy of ``module`` holding ``value`` (its state of kind ``kind``)."""
    cls = _holder(type(module), kind)
    copy: Any = object.__new__(cls)
    for field in dataclasses.fields(module):
        object.__setattr__(copy, field.name, getattr(module, field.name))
    object.__setattr__(copy, kind, Float8State(value))
    return copy


def slot_of(module: Any) -> Float8State | None:
    """The state ``module`` holds, or ``None``."""
    kind = getattr(type(module), _SLOT, None)
    found = None if kind is None else getattr(module, kind, None)
    return found if is_slot(found) else None


def state_value(call: Any, scheme: Any) -> Any:
    """The slot's value for the layer of ``call`` (see the adapter's ``layer_state``)."""
    module, policy = call.module, call.resolution.policy
    where = f"{type(module).__name__} at {call.path or 'the root'!r}"
    slot = slot_of(module)
    if slot is None or getattr(type(module), _SLOT) != scheme.state_kind:
        raise ValueError(
            f"{where} runs under {policy.name!r}, whose scheme keeps float8 state per layer "
            "(delayed scaling), but holds none. Create it with `model = "
            "jmp_policy.equinox.init_float8(model, policy_or_map)` (a new model with the "
            "state) and take its new value with `jmp_policy.equinox.split_gradients`, or "
            "use current scaling, 'float8_current_from_<source>' (no state)."
        )
    if not fits(slot.value, scheme):
        length = getattr(policy, "amax_history_length", None)
        raise ValueError(
            f"{where} runs under {policy.name!r} with amax_history_length={length}, but "
            f"its float8 state holds shapes {jax.tree.map(jnp.shape, slot.value)}. Create "
            "the state with the map you apply: `jmp_policy.equinox.init_float8(model, "
            "policy_or_map)`."
        )
    return slot.value


@fill
def split_gradients(grads: Any) -> tuple[Any, Any]:
    """Splits Equinox gradients into what the optimizer updates and the new float8 state.

    {float8_gradient}

    Args:
        grads: gradients of a model (or of its ``eqx.partition``-ed arrays) holding
            float8 state, from ``eqx.filter_grad`` or ``jax.grad``.

    Returns:
        ``(param_grads, float8_state)``: ``grads`` with each :class:`Float8State` zeroed
        (the same structure, for ``optax``), and ``grads`` with only the new states (``None``
        elsewhere): put them in with ``eqx.combine(float8_state, model)`` after the
        optimizer's step.

    Raises:
        TypeError: ``grads`` is not a pytree holding a ``Float8State``.

    Examples:
        >>> import jax
        >>> import jax.numpy as jnp
        >>> import equinox as eqx
        >>> import optax
        >>> import jmp_policy as jp
        >>> model = jp.equinox.init_float8(
        ...     eqx.nn.Linear(3, 2, key=jax.random.key(0)), "float8_from_float32")
        >>> tx = optax.sgd(0.1)
        >>> opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))
        >>> loss = lambda m, x: jp.equinox.apply(m, "float8_from_float32")(x).sum()
        >>> grads = eqx.filter_grad(loss)(model, jnp.full(3, 0.5))
        >>> param_grads, float8_state = jp.equinox.split_gradients(grads)
        >>> updates, opt_state = tx.update(param_grads, opt_state)
        >>> model = eqx.combine(float8_state, eqx.apply_updates(model, updates))
        >>> model.float8.value["input_amax_history"][:2]
        Array([0.5, 0. ], dtype=float32)
    """
    states, _ = eqx.partition(grads, is_slot, is_leaf=is_slot)
    if not any(is_slot(x) for x in jax.tree.leaves(states, is_leaf=is_slot)):
        raise TypeError(
            "`grads` must be the gradients of a model holding float8 state (made by "
            "`jmp_policy.equinox.init_float8`). Received: grads of type "
            f"{type(grads).__name__} with no Float8State"
        )
    zeroed = jax.tree.map(
        lambda x: jax.tree.map(jnp.zeros_like, x) if is_slot(x) else x, grads, is_leaf=is_slot
    )
    return zeroed, states
