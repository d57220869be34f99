"""State pytrees: frozen dataclasses whose arrays are leaves and whose settings are static.

How jmp_policy's state classes (the loss scales; float8's scaling state is a plain dict
of arrays and needs none of this) become pytrees and checkpoints: flattening derived from
the dataclass fields (a field marked ``metadata={"static": True}`` is metadata, every other
field a child), value equality, a ``replace`` that skips validation, and registration with
``flax.serialization`` once flax is loaded. Nothing here imports flax.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import numpy as np

C = TypeVar("C", bound=type)
T = TypeVar("T")

# Every pytree class of the library, with its flax.serialization state-dict functions.
_registered: dict[type, tuple[Callable[..., Any], Callable[..., Any]]] = {}
_flax_registered: set[type] = set()


def _data_fields(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls) if not f.metadata.get("static"))


def _static_fields(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls) if f.metadata.get("static"))


def _build(cls: type[T], values: dict[str, Any]) -> T:
    """An instance with these field values, bypassing ``__init__`` and its validation."""
    obj = object.__new__(cls)
    for name, value in values.items():
        object.__setattr__(obj, name, value)
    return obj


def register_state(cls: C) -> C:
    """Registers a frozen dataclass as a pytree and (once flax is loaded) a flax state.

    Flattening is derived from the dataclass fields, so no field can be forgotten (jmp 0.0.4's
    hand-written flattening drops ``min_loss_scale``). Unflattening bypasses ``__init__``, as
    JAX recommends for classes that validate their arguments: tree utilities put placeholders
    in leaf positions (``tree.map(lambda _: 0, state)`` for ``vmap``'s ``in_axes``, ``None``,
    ``True``, ``object()``, ``np.zeros_like``), and they must come back as they were, neither
    rejected as a bad value nor cast.
    """
    data = _data_fields(cls)
    meta = _static_fields(cls)
    keys = tuple(jax.tree_util.GetAttrKey(name) for name in data)

    def flatten(obj: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        return tuple(getattr(obj, n) for n in data), tuple(getattr(obj, n) for n in meta)

    def flatten_with_keys(obj: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        children, aux = flatten(obj)
        return tuple(zip(keys, children, strict=True)), aux

    def unflatten(aux: tuple[Any, ...], children: Any) -> Any:
        return _build(
            cls, {**dict(zip(meta, aux, strict=True)), **dict(zip(data, children, strict=True))}
        )

    jax.tree_util.register_pytree_with_keys(cls, flatten_with_keys, unflatten, flatten)
    register_flax_state(cls, _to_state_dict, _from_state_dict)
    return cls


def register_flax_state(
    cls: type, to_state_dict: Callable[..., Any], from_state_dict: Callable[..., Any]
) -> None:
    """Has ``flax.serialization`` turn ``cls`` into a state dict with ``to_state_dict`` and
    back with ``from_state_dict``, now if flax is loaded, else once it is (see
    :func:`register_with_flax_serialization`)."""
    _registered[cls] = (to_state_dict, from_state_dict)
    register_with_flax_serialization()


def replace_leaves(obj: T, **leaves: Any) -> T:
    """``obj`` with new values for some of its array fields, settings unchanged.

    Unlike ``dataclasses.replace`` it does not run ``__post_init__``: the values are computed
    by the class itself (under ``jit`` or not), so they need no validation, and validating a
    concrete array would wait for the device.
    """
    cls = type(obj)
    values = {f.name: getattr(obj, f.name) for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = set(leaves) - set(_data_fields(cls))
    if unknown:
        raise ValueError(f"{cls.__name__} has no array fields {sorted(unknown)}.")
    return _build(cls, {**values, **leaves})


def tree_equal(a: Any, b: Any) -> Any:
    """Value equality of two states: same class, settings and leaf values.

    For concrete values (tests, checkpoints); under ``jit`` leaves are tracers, which have no
    concrete value to compare.
    """
    if type(a) is not type(b):
        return NotImplemented
    leaves_a, treedef_a = jax.tree.flatten(a)
    leaves_b, treedef_b = jax.tree.flatten(b)
    same_settings: bool = treedef_a == treedef_b  # type: ignore[operator]
    return same_settings and all(
        np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(leaves_a, leaves_b, strict=True)
    )


def _present_fields(state: Any) -> list[str]:
    """The array fields that ``state`` holds (an optional field set to ``None`` is absent)."""
    return [name for name in _data_fields(type(state)) if getattr(state, name) is not None]


def _to_state_dict(state: Any) -> dict[str, Any]:
    serialization = sys.modules["flax.serialization"]
    return {
        name: serialization.to_state_dict(getattr(state, name)) for name in _present_fields(state)
    }


def _from_state_dict(target: Any, state: dict[str, Any]) -> Any:
    serialization = sys.modules["flax.serialization"]
    names = _present_fields(target)
    missing = [name for name in names if name not in state]
    if missing:
        raise ValueError(
            f"Cannot restore a {type(target).__name__} from a state dict without the fields "
            f"{missing}; it has {sorted(state)}."
        )
    values = {
        name: serialization.from_state_dict(getattr(target, name), state[name]) for name in names
    }
    shapes = {name: np.shape(getattr(target, name)) for name in names}
    for name, value in values.items():
        if np.shape(value) != shapes[name]:
            raise ValueError(
                f"Cannot restore a {type(target).__name__}: its field `{name}` has shape "
                f"{shapes[name]}, the checkpoint's {np.shape(value)}. Received: "
                f"{name}={value!r}"
            )
    if any(shape != () for shape in shapes.values()):
        # A state stacked per device (replicated for `pmap`): same shapes as the target,
        # cast to its dtypes; `__init__` takes scalars only.
        return replace_leaves(
            target,
            **{n: np.asarray(v, np.asarray(getattr(target, n)).dtype) for n, v in values.items()},
        )
    # Through `__init__`: what a checkpoint holds is validated and canonicalised like user input.
    return dataclasses.replace(target, **values) if values else target


def register_with_flax_serialization() -> None:
    """Teaches ``flax.serialization`` (``to_state_dict``, ``to_bytes``, checkpoints) every
    state class: its array fields become a dict, the settings come from the restore target.

    ``import jmp_policy`` does not import flax, so this runs whenever flax may have arrived:
    when a class is registered, when a state or a ``QuantizedArray`` is built, when an
    optimizer state is initialised and when ``jmp_policy.linen`` or ``jmp_policy.nnx`` is
    imported; a length comparison once it has run.
    """
    if len(_flax_registered) == len(_registered):
        return
    serialization = sys.modules.get("flax.serialization")
    if serialization is None:
        return
    for cls, (to_state_dict, from_state_dict) in list(_registered.items()):
        if cls not in _flax_registered:
            serialization.register_serialization_state(
                cls, to_state_dict, from_state_dict, override=True
            )
            _flax_registered.add(cls)
