"""The pytree side of a :class:`~jmp_policy.QuantizedArray`: flattening, value equality, the
library's construction, and ``flax.serialization`` state dicts.

JAX's pytree contract: unflatten accepts any leaves (tracers, ``None``, strings, specs,
placeholders, stacked arrays), so it builds the instance without ``__init__`` and checks
nothing. The children are the array fields (``values``, ``scale``, the optional
``zero_point``, an AWQ kernel's ``input_scale``); an optional one is a child only where the
array has it (its presence is static metadata, so a symmetric array has the children it
always had, and a tree operation that puts ``None`` there keeps it a child). The static
metadata is the mode, the int4 block, the shape of one layer (the kernel after its stacked
axes), the original dtype and the children present: it never repeats a child's shape, so a
QuantizedArray and its ``vmap``/``scan``-stacked form have one tree structure. ``shape`` and
``stacked`` follow the leaves: the axes that ``values`` has beyond one layer's are the stacked
ones (none when ``values`` has no shape: a string, ``None``, a placeholder). Where they lie is
static too (``stacked_at``, ``0``: leading): a stack that keeps its parameters on axis 1
(values ``[in, depth, out]``) has them at axis 1 when the values there fit one layer's shape
around them, else leading as for ``stacked_at=0``; values of one layer's rank are one layer
(``stacked_at=0``).

Construction is checked twice over: a user's ``QuantizedArray(...)`` refuses a NaN scale; the
library's :func:`make` accepts one (``quantize`` keeps a non-finite kernel non-finite: its
channel's scale is NaN). Nothing here imports flax.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from jmp_policy._src import dtypes as dt
from jmp_policy._src.state_pytree import register_flax_state

C = TypeVar("C", bound=type)
Q = TypeVar("Q")

# The static fields, in the order of the tree's auxiliary data (one layer's shape between).
SETTINGS = ("mode", "block_size", "original_dtype")


def layer_shape(q: Any) -> tuple[int, ...]:
    """The shape of one layer of ``q`` (its ``shape`` without the stacked axes, which lie
    at ``q.stacked_at``)."""
    at, k = getattr(q, "stacked_at", 0), q.stacked
    return tuple(q.shape[:at]) + tuple(q.shape[at + k :])


def stack_layout(values: Any, layer: tuple[int, ...], at: int) -> tuple[tuple[int, ...], int, int]:
    """``(shape, stacked, stacked_at)`` of a QuantizedArray of these ``values`` whose one
    layer is ``layer`` and whose stacked axes were at ``at``: the axes beyond one layer's at
    ``at`` where the values there fit the layer's shape around them, else leading."""
    if at:
        shape = getattr(values, "shape", None)
        if isinstance(shape, tuple) and all(isinstance(d, int) for d in shape):
            n = len(shape) - len(layer)
            if n > 0 and at <= len(layer) and (*shape[:at], *shape[at + n :]) == tuple(layer):
                return tuple(shape), n, at
    lead = lead_axes(values, layer)
    return (*lead, *layer), len(lead), 0


def lead_axes(values: Any, layer: tuple[int, ...]) -> tuple[int, ...]:
    """The leading axes ``values`` has beyond one ``layer``'s: ``()`` when it has fewer or
    no shape at all (a string, ``None``, a placeholder of a tree utility)."""
    shape = getattr(values, "shape", None)
    if not isinstance(shape, tuple) or len(shape) <= len(layer):
        return ()
    lead = shape[: len(shape) - len(layer)]
    return tuple(lead) if all(isinstance(d, int) for d in lead) else ()


def new(cls: type[Q], fields: dict[str, Any]) -> Q:
    """An instance with these field values, without ``__init__`` and its checks."""
    obj = object.__new__(cls)
    for name, value in fields.items():
        object.__setattr__(obj, name, value)
    return obj


def make(cls: type[Q], *args: Any, **kwargs: Any) -> Q:
    """The library's construction: the fields given as to the class, checked as a user's
    are, except that a NaN scale is accepted (the mark of a non-finite kernel)."""
    fields = {
        f.name: f.default
        for f in dataclasses.fields(cls)  # type: ignore[arg-type]
        if f.default is not dataclasses.MISSING
    }
    names = [f.name for f in dataclasses.fields(cls) if not f.kw_only]  # type: ignore[arg-type]
    fields.update(zip(names[: len(args)], args, strict=True))
    fields.update(kwargs)
    q = new(cls, fields)
    q._validate(nan_scale=True)  # type: ignore[attr-defined]
    return q


def replace(q: Q, **changes: Any) -> Q:
    """``q`` with some fields changed, checked as :func:`make` checks."""
    fields = {f.name: getattr(q, f.name) for f in dataclasses.fields(q)}  # type: ignore[arg-type]
    return make(type(q), **{**fields, **changes})


def register(data_fields: tuple[str, ...], optional: tuple[str, ...] = ()) -> Any:
    """Registers a QuantizedArray class as a pytree (``data_fields`` its children, in this
    order; an ``optional`` one only where the array has it) and, once flax is loaded, as a
    ``flax.serialization`` state."""

    def decorate(cls: C) -> C:
        keys = {name: jax.tree_util.GetAttrKey(name) for name in data_fields}

        def fields_of(q: Any) -> tuple[str, ...]:
            held = getattr(q, _HELD, ())  # optional children unflattened as None
            return tuple(
                n
                for n in data_fields
                if n not in optional or getattr(q, n) is not None or n in held
            )

        def flatten(q: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
            names = fields_of(q)
            aux = (q.mode, q.block_size, layer_shape(q), q.original_dtype, q.stacked_at, names)
            return tuple(getattr(q, name) for name in names), aux

        def flatten_with_keys(q: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
            children, aux = flatten(q)
            return tuple(zip((keys[n] for n in aux[-1]), children, strict=True)), aux

        def unflatten(aux: tuple[Any, ...], children: Any) -> Any:
            mode, block_size, layer, original_dtype, at, names = aux
            fields = {n: None for n in optional}
            fields.update(zip(names, children, strict=True))
            shape, stacked, stacked_at = stack_layout(fields["values"], layer, at)
            held = tuple(n for n in optional if n in names and fields[n] is None)
            return new(
                cls,
                {
                    **fields,
                    "mode": mode,
                    "block_size": block_size,
                    "shape": shape,
                    "original_dtype": original_dtype,
                    "stacked": stacked,
                    "stacked_at": stacked_at,
                    **({_HELD: held} if held else {}),
                },
            )

        jax.tree_util.register_pytree_with_keys(cls, flatten_with_keys, unflatten, flatten)
        register_flax_state(
            cls,
            lambda q: _to_state_dict(q, data_fields),
            lambda target, state: _from_state_dict(target, state, data_fields),
        )
        return cls

    return decorate


# An instance's optional children that a tree operation set to ``None`` (a mask, a
# placeholder): still children, so the tree keeps its structure.
_HELD = "_held_children"


def equal(a: Any, b: Any) -> Any:
    """``a == b`` for QuantizedArrays: the same class, settings, shape, and leaves of the
    same dtypes, shapes and values (NaN scales equal where both are NaN). A bool; under
    tracing (leaves that are tracers), a scalar bool array."""
    if type(a) is not type(b):
        return NotImplemented
    leaves_a, tree_a = jax.tree.flatten(a)
    leaves_b, tree_b = jax.tree.flatten(b)
    if tree_a != tree_b or a.shape != b.shape:  # type: ignore[operator]
        return False
    pairs = list(zip(leaves_a, leaves_b, strict=True))
    if any(isinstance(x, jax.core.Tracer) for x in (*leaves_a, *leaves_b)):
        return jnp.all(jnp.asarray([_traced_equal(x, y) for x, y in pairs], bool))
    return all(_leaf_equal(x, y) for x, y in pairs)


def _has_array_shape(x: Any) -> bool:
    return isinstance(getattr(x, "shape", None), tuple) and hasattr(x, "dtype")


def _leaf_equal(x: Any, y: Any) -> bool:
    if not (_has_array_shape(x) and _has_array_shape(y)):
        try:
            return bool(x is y or x == y)
        except Exception:  # a leaf whose `==` raises or returns no bool: not equal
            return False
    if np.dtype(x.dtype) != np.dtype(y.dtype) or tuple(x.shape) != tuple(y.shape):
        return False
    dtype = np.dtype(x.dtype)
    if dtype == np.dtype(jax.dtypes.float0):
        return True  # a cotangent of integer values holds no values
    if dt.is_floating(dtype):
        return bool(np.array_equal(_host(x, np.float64), _host(y, np.float64), equal_nan=True))
    return bool(np.array_equal(_host(x, np.int64), _host(y, np.int64)))


def _host(x: Any, dtype: Any) -> np.ndarray:
    return np.asarray(x).astype(dtype)


def _traced_equal(x: Any, y: Any) -> Any:
    if not (_has_array_shape(x) and _has_array_shape(y)):
        return _leaf_equal(x, y)
    if np.dtype(x.dtype) != np.dtype(y.dtype) or tuple(x.shape) != tuple(y.shape):
        return False
    if dt.is_floating(np.dtype(x.dtype)):
        return jnp.array_equal(x, y, equal_nan=True)
    return jnp.array_equal(x, y)


def _to_state_dict(q: Any, data_fields: tuple[str, ...]) -> dict[str, Any]:
    """Its arrays and its settings (so ``msgpack_restore`` without a target has all
    :func:`~jmp_policy.rebuild_quantized` needs)."""
    serialization = sys.modules["flax.serialization"]
    state = {
        name: serialization.to_state_dict(getattr(q, name))
        for name in data_fields
        if getattr(q, name) is not None
    }
    return {**state, **settings_of(q)}


def settings_of(q: Any) -> dict[str, Any]:
    """The settings of ``q`` as JSON-ready values (a dtype by its name, a shape a list)."""
    return {
        "mode": q.mode,
        "block_size": q.block_size,
        "original_dtype": np.dtype(q.original_dtype).name,
        "shape": [int(d) for d in q.shape],
        "stacked": int(q.stacked),
        "stacked_at": int(q.stacked_at),
    }


def _from_state_dict(target: Any, state: Any, data_fields: tuple[str, ...]) -> Any:
    serialization = sys.modules["flax.serialization"]
    kind = type(target).__name__
    if not isinstance(state, dict):
        raise ValueError(
            f"Cannot restore a {kind} from {type(state).__name__}: a checkpoint holds it as "
            f"a dict of its fields. Received: {dt.bounded_repr(state)}"
        )
    names = [name for name in data_fields if getattr(target, name) is not None]
    missing = [name for name in names if name not in state]
    unread = [name for name in data_fields if name not in names and name in state]
    if unread:  # a zero point the target has none of: restoring without it changes values
        raise ValueError(
            f"Cannot restore the {kind} {target!r} from a state dict with the fields "
            f"{unread} that the target does not have: restore into a target of the saved "
            "format (quantized with the same policy)."
        )
    if missing:
        raise ValueError(
            f"Cannot restore a {kind} from a state dict without the fields {missing}; it has "
            f"{sorted(state)}."
        )
    expected = settings_of(target)
    found = {key: state[key] for key in expected if key in state}
    if "shape" in found:  # msgpack gives a list or a tuple
        found["shape"] = [int(d) for d in found["shape"]]
    if "stacked_at" not in state:  # a state dict written before `stacked_at`: leading
        found["stacked_at"] = 0
    if any(found[key] != expected[key] for key in found):
        raise ValueError(
            f"Cannot restore the {kind} {target!r} from a checkpoint of another format or "
            f"shape: it holds {found}, the target {expected}."
        )
    leaves = {
        name: serialization.from_state_dict(getattr(target, name), state[name]) for name in names
    }
    shape, stacked, at = stack_layout(leaves["values"], layer_shape(target), target.stacked_at)
    return replace(target, **leaves, shape=shape, stacked=stacked, stacked_at=at)
