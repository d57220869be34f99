"""Loss scales (no-op, static, dynamic) and the tree helpers they need.

A loss scale multiplies the loss before differentiation so that small gradients survive a
16-bit backward pass, and divides the gradients afterwards. The classes here are frozen
dataclasses registered as pytrees from their fields (see ``_register_pytree``): the arrays
(scale, counters) are leaves, the settings (period, factor, bounds) are static metadata, so nothing is lost when a
loss scale crosses ``jit``, ``scan``, ``tree.map`` or a checkpoint, and a new scale value never
forces a recompile.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
from typing import Any, TypeAlias, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

T = TypeVar("T")

#: The default initial scale (Keras, tf.keras and jmp's documentation).
DEFAULT_LOSS_SCALE = 2.0**15
#: The default floor: float16's smallest normal number. Low enough that training never stalls
#: (a float16 gradient that overflows even at this scale is a real gradient above 1e9), high
#: enough that ``1 / scale`` is exact and a collapsed scale recovers in a bounded time.
DEFAULT_MIN_LOSS_SCALE = 2.0**-14
#: The default ceiling: float16's smallest subnormal is ``2**-24``, so a larger scale lifts no
#: float16-representable gradient further; it keeps ``scale * loss`` far from float32's maximum.
DEFAULT_MAX_LOSS_SCALE = 2.0**24


def is_float_leaf(x: Any) -> bool:
    """True for Python floats/complex and arrays of a floating or complex dtype."""
    if isinstance(x, (float, complex)):
        return True
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        return False
    return bool(jnp.issubdtype(dtype, jnp.inexact))


def _compute_dtype(dtype: Any) -> Any:
    """The dtype a scale/unscale computes in: float32, or wider when the leaf is wider."""
    dtype = np.dtype(dtype)
    if dtype.itemsize > 4 or jnp.issubdtype(dtype, jnp.complexfloating):
        return dtype
    return np.dtype(np.float32)


def _as_leaf(value: Any, dtype: Any, argument: str) -> Any:
    """Canonicalises a data field to a ``dtype`` array (on construction, not on unflattening)."""
    if isinstance(value, bool):
        raise TypeError(
            f"`{argument}` must be a number or a scalar array, not a bool. Received: "
            f"{argument}={value!r}"
        )
    if isinstance(value, (int, float)):
        return jnp.asarray(value, dtype)
    if isinstance(value, (np.ndarray, np.generic)):
        if not (np.issubdtype(value.dtype, np.number) or jnp.issubdtype(value.dtype, jnp.floating)):
            raise TypeError(
                f"`{argument}` must have a numeric dtype. Received: {argument}={value!r} "
                f"(dtype {value.dtype})"
            )
        return jnp.asarray(value, dtype)
    if isinstance(value, jax.Array) and value.dtype != dtype:
        return value.astype(dtype)
    return value


def _host_value(value: Any) -> np.ndarray | None:
    """The value as a NumPy array when it is known on the host without waiting for a device."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float, np.ndarray, np.generic)):
        return np.asarray(value, np.float64)
    return None


def _static_float(value: Any, argument: str) -> float:
    """Turns a min/max setting (a Python number or a concrete array) into a Python float."""
    if isinstance(value, bool):
        raise TypeError(f"`{argument}` must be a positive number. Received: {argument}={value!r}")
    if isinstance(value, jax.core.Tracer):
        raise TypeError(
            f"`{argument}` is a setting and must be a concrete number, not a traced value "
            f"(received {value!r}); build the loss scale outside `jit` or pass a Python float."
        )
    try:
        array = np.asarray(value, np.float64)
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"`{argument}` must be a positive number or a scalar array. Received: "
            f"{argument}={value!r}"
        ) from e
    if array.shape != ():
        raise ValueError(
            f"`{argument}` must be a scalar. Received: {argument}={value!r} (shape {array.shape})"
        )
    result = float(array)
    if not (math.isfinite(result) and result > 0):
        raise ValueError(
            f"`{argument}` must be a finite number > 0. Received: {argument}={value!r}"
        )
    return result


def _check_positive_scale(value: Any, argument: str) -> None:
    host = _host_value(value)
    if host is not None and not (np.all(np.isfinite(host)) and np.all(host > 0)):
        raise ValueError(
            f"`{argument}` must be a finite number > 0. Received: {argument}={value!r}"
        )


def _scale_tree(tree: T, loss_scale: ArrayLike) -> T:
    loss_scale = jnp.asarray(loss_scale, jnp.float32)

    def scale(x: Any) -> Any:
        if not is_float_leaf(x):
            return x
        x = jnp.asarray(x)
        dtype = _compute_dtype(x.dtype)
        return x.astype(dtype) * loss_scale.astype(dtype)

    return jax.tree.map(scale, tree)


def _unscale_tree(tree: T, loss_scale: ArrayLike) -> T:
    inverse = 1.0 / jnp.asarray(
        loss_scale, jnp.float32
    )  # one scalar division; the leaves are multiplied.

    def unscale(x: Any) -> Any:
        if not is_float_leaf(x):
            return x
        x = jnp.asarray(x)
        dtype = _compute_dtype(x.dtype)
        return (x.astype(dtype) * inverse.astype(dtype)).astype(x.dtype)

    return jax.tree.map(unscale, tree)


def _register_pytree(cls: type[T]) -> type[T]:
    """Registers a frozen dataclass as a pytree: fields marked ``static`` are metadata, the
    others children.

    Flattening is derived from the dataclass fields, so no field can be forgotten (jmp 0.0.4's
    hand-written flattening drops ``min_loss_scale``). Unflattening bypasses ``__init__``, as
    JAX recommends for classes that validate their arguments: tree utilities put placeholders
    in leaf positions (``tree.map(lambda _: 0, state)`` for ``vmap``'s ``in_axes``, ``None``,
    ``True``, ``object()``, ``np.zeros_like``), and they must come back as they were, neither
    rejected as a bad scale nor cast to float32.
    """
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    data = tuple(f.name for f in fields if not f.metadata.get("static"))
    meta = tuple(f.name for f in fields if f.metadata.get("static"))
    keys = tuple(jax.tree_util.GetAttrKey(name) for name in data)

    def flatten(obj: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        return tuple(getattr(obj, n) for n in data), tuple(getattr(obj, n) for n in meta)

    def flatten_with_keys(obj: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        children, aux = flatten(obj)
        return tuple(zip(keys, children, strict=True)), aux

    def unflatten(aux: tuple[Any, ...], children: Any) -> Any:
        obj = object.__new__(cls)
        for name, value in zip(meta, aux, strict=True):
            object.__setattr__(obj, name, value)
        for name, value in zip(data, children, strict=True):
            object.__setattr__(obj, name, value)
        return obj

    jax.tree_util.register_pytree_with_keys(cls, flatten_with_keys, unflatten, flatten)
    return cls


def _tree_equal(a: Any, b: Any) -> Any:
    """Value equality of two loss scales: same class, settings and leaf values.

    For concrete values (tests, checkpoints); under ``jit`` leaves are tracers, which have
    no concrete value to compare.
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


@_register_pytree
@dataclasses.dataclass(frozen=True, eq=False)
class NoOpLossScale:
    """A loss scale that does nothing: a drop-in for when no scaling is wanted.

    ``scale`` and ``unscale`` return their argument itself; ``adjust`` returns ``self``. It has
    no leaves, so it costs nothing under ``jit``.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jmp_policy as jp
        >>> loss_scale = jp.NoOpLossScale()
        >>> tree = {"g": jnp.ones(2)}
        >>> loss_scale.unscale(tree) is tree
        True
        >>> float(loss_scale.loss_scale)
        1.0
    """

    __eq__ = _tree_equal
    __hash__ = None  # type: ignore[assignment]  # array leaves

    def __post_init__(self) -> None:
        _register_with_flax_serialization()

    @property
    def loss_scale(self) -> jax.Array:
        """The scale, always ``1.0`` (float32)."""
        return jnp.ones((), jnp.float32)

    def scale(self, tree: T) -> T:
        """Returns ``tree`` unchanged."""
        return tree

    def unscale(self, tree: T) -> T:
        """Returns ``tree`` unchanged."""
        return tree

    def adjust(self, grads_finite: jax.Array) -> NoOpLossScale:
        """Returns ``self``."""
        del grads_finite
        return self


class _ScaleByLeaf:
    """``scale`` and ``unscale`` by an array leaf ``loss_scale`` (static and dynamic scales)."""

    loss_scale: Any

    def scale(self, tree: T) -> T:
        """Multiplies every floating leaf by the scale, in float32 (16-bit leaves come back
        float32, so a scaled loss cannot overflow); other leaves are returned as they are."""
        return _scale_tree(tree, self.loss_scale)

    def unscale(self, tree: T) -> T:
        """Divides every floating leaf by the scale, computing in float32 and returning each
        leaf in its own dtype; other leaves are returned as they are."""
        return _unscale_tree(tree, self.loss_scale)


@_register_pytree
@dataclasses.dataclass(frozen=True, eq=False)
class StaticLossScale(_ScaleByLeaf):
    """A constant loss scale.

    Args:
        loss_scale: a finite number > 0 (a Python number or a scalar array); stored as a float32
            array leaf.

    Raises:
        ValueError: ``loss_scale`` is not a finite number > 0.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jmp_policy as jp
        >>> loss_scale = jp.StaticLossScale(128.0)
        >>> loss_scale.scale(jnp.float16(2.0))  # computed in float32
        Array(256., dtype=float32)
        >>> loss_scale.unscale({"g": jnp.ones(2, jnp.float16) * 256})["g"]
        Array([2., 2.], dtype=float16)
    """

    loss_scale: ArrayLike

    __eq__ = _tree_equal
    __hash__ = None  # type: ignore[assignment]  # array leaves

    def __post_init__(self) -> None:
        _register_with_flax_serialization()
        _check_positive_scale(self.loss_scale, "loss_scale")
        object.__setattr__(self, "loss_scale", _as_leaf(self.loss_scale, jnp.float32, "loss_scale"))

    def adjust(self, grads_finite: jax.Array) -> StaticLossScale:
        """Returns ``self``: a static scale never changes."""
        del grads_finite
        return self


@_register_pytree
@dataclasses.dataclass(frozen=True, eq=False)
class DynamicLossScale(_ScaleByLeaf):
    """A loss scale that grows while gradients are finite and shrinks when they are not.

    The rule is jmp's and PyTorch ``GradScaler``'s: on the ``period``-th consecutive finite
    step the scale is multiplied by ``factor`` (only if the result is finite and at most
    ``max_loss_scale``) and the counter resets; on a non-finite step the scale is divided by
    ``factor``, never below ``min_loss_scale``, and the counter resets. With ``hysteresis=n``
    (Megatron-LM's rule) the first ``n - 1`` non-finite steps since the last growth keep the
    scale; later ones back off as usual.

    It is a pytree: ``loss_scale`` and ``counter`` (and ``overflows`` with hysteresis) are
    array leaves (so a new
    value never recompiles a jitted step), the settings are static metadata (so ``jit``,
    ``scan``, ``tree.map`` and checkpoints keep them). ``adjust`` is pure ``jnp`` code: it runs
    under ``jit`` with no host synchronisation. Across devices, pass every device the same
    ``grads_finite`` (as :func:`jmp_policy.loss_scaling` does) and the scales stay identical.

    Args:
        loss_scale: the initial scale (default ``2**15``), a number or scalar array of any
            float dtype (stored as float32, so ``jnp.float16(2**15)`` works).
        counter: consecutive finite steps so far (int32).
        period: finite steps between growths, an ``int >= 1`` (default 2000).
        factor: growth and backoff factor, a number ``> 1`` (default 2).
        min_loss_scale: the floor, a positive Python float or concrete array (default
            ``2**-14``; never 1, which stalls training whose gradients overflow float16).
        max_loss_scale: the ceiling, a finite positive Python float or concrete array (default
            ``2**24``), so the scale never reaches inf.
        hysteresis: non-finite steps tolerated since the last growth before backing off, an
            ``int >= 1`` (default 1: back off on every non-finite step).
        overflows: non-finite steps since the last growth (an int32 leaf only when
            ``hysteresis > 1``; ``None`` otherwise, so the leaves are jmp's
            ``[loss_scale, counter]``).

    Raises:
        ValueError: ``period < 1``, ``factor <= 1``, ``hysteresis < 1``, a non-positive or
            non-finite scale, ``min_loss_scale > max_loss_scale``, or an initial scale outside
            ``[min_loss_scale, max_loss_scale]``.
        TypeError: a setting of the wrong type (``period=2.5``, ``factor="2"``).

    Examples:
        >>> import jax
        >>> import jax.numpy as jnp
        >>> import jmp_policy as jp
        >>> loss_scale = jp.DynamicLossScale(2.0**15, period=2)
        >>> loss_scale = loss_scale.adjust(jnp.array(True))
        >>> loss_scale = loss_scale.adjust(jnp.array(True))  # 2nd finite step: grow
        >>> float(loss_scale.loss_scale)
        65536.0
        >>> loss_scale = jax.jit(lambda s: s.adjust(jnp.array(False)))(loss_scale)
        >>> float(loss_scale.loss_scale), int(loss_scale.counter), loss_scale.period
        (32768.0, 0, 2)
    """

    loss_scale: ArrayLike = DEFAULT_LOSS_SCALE
    counter: ArrayLike = 0
    period: int = dataclasses.field(default=2000, metadata={"static": True})
    factor: float = dataclasses.field(default=2.0, metadata={"static": True})
    min_loss_scale: float = dataclasses.field(
        default=DEFAULT_MIN_LOSS_SCALE, metadata={"static": True}
    )
    max_loss_scale: float = dataclasses.field(
        default=DEFAULT_MAX_LOSS_SCALE, metadata={"static": True}
    )
    hysteresis: int = dataclasses.field(default=1, metadata={"static": True})
    overflows: ArrayLike | None = None

    __eq__ = _tree_equal
    __hash__ = None  # type: ignore[assignment]  # array leaves

    def __post_init__(self) -> None:
        _register_with_flax_serialization()
        for argument in ("period", "hysteresis"):
            value = getattr(self, argument)
            if isinstance(value, (float, np.floating)) and float(value).is_integer():
                value = int(value)  # jmp's own tests pass `period=5.`
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise TypeError(
                    f"`{argument}` must be an int >= 1. Received: {argument}={value!r} "
                    f"(of type {type(value).__name__})"
                )
            if value < 1:
                raise ValueError(
                    f"`{argument}` must be an int >= 1. Received: {argument}={value!r}"
                )
            object.__setattr__(self, argument, int(value))
        factor = self.factor
        if isinstance(factor, bool) or not isinstance(
            factor, (int, float, np.integer, np.floating)
        ):
            raise TypeError(
                f"`factor` must be a number > 1. Received: factor={factor!r} "
                f"(of type {type(factor).__name__})"
            )
        if not (math.isfinite(float(factor)) and factor > 1):
            raise ValueError(f"`factor` must be a finite number > 1. Received: factor={factor!r}")
        object.__setattr__(self, "factor", float(factor))
        low = _static_float(self.min_loss_scale, "min_loss_scale")
        high = _static_float(self.max_loss_scale, "max_loss_scale")
        if low > high:
            raise ValueError(
                f"`min_loss_scale` must be <= `max_loss_scale`. Received: "
                f"min_loss_scale={low!r}, max_loss_scale={high!r}"
            )
        object.__setattr__(self, "min_loss_scale", low)
        object.__setattr__(self, "max_loss_scale", high)
        _check_positive_scale(self.loss_scale, "loss_scale")
        host = _host_value(self.loss_scale)
        if host is not None and not (np.all(host >= low) and np.all(host <= high)):
            raise ValueError(
                f"`loss_scale` must lie within [min_loss_scale, max_loss_scale] = "
                f"[{low!r}, {high!r}]. Received: loss_scale={self.loss_scale!r}; widen the "
                f"bounds (for example max_loss_scale=2.0**32) or pick another initial scale."
            )
        object.__setattr__(self, "loss_scale", _as_leaf(self.loss_scale, jnp.float32, "loss_scale"))
        object.__setattr__(self, "counter", _as_leaf(self.counter, jnp.int32, "counter"))
        # Without hysteresis there is nothing to count: no leaf (jmp's leaves are exactly
        # `[loss_scale, counter]`).
        overflows = (
            None if self.hysteresis == 1 else (0 if self.overflows is None else self.overflows)
        )
        if overflows is not None:
            overflows = _as_leaf(overflows, jnp.int32, "overflows")
        object.__setattr__(self, "overflows", overflows)

    def adjust(self, grads_finite: jax.Array) -> DynamicLossScale:
        """Returns the loss scale for the next step.

        Args:
            grads_finite: a scalar bool (array): whether this step's gradients were finite.
                Agree on it across devices first (see :func:`all_finite`).

        Returns:
            A new ``DynamicLossScale`` with the same settings.
        """
        finite = _scalar_bool(grads_finite, "grads_finite")
        loss_scale = jnp.asarray(self.loss_scale, jnp.float32)
        counter = jnp.asarray(self.counter, jnp.int32)
        grow = counter >= self.period - 1
        grown = loss_scale * self.factor
        may_grow = jnp.isfinite(grown) & (grown <= self.max_loss_scale)
        finite_scale = jnp.where(grow & may_grow, grown, loss_scale)
        finite_counter = jnp.where(grow, 0, counter + 1)
        backed_off = jnp.maximum(loss_scale / self.factor, self.min_loss_scale)
        new_overflows = None
        if self.overflows is None:  # hysteresis == 1: back off on every non-finite step
            bad_scale = backed_off
        else:
            overflows = jnp.asarray(self.overflows, jnp.int32)
            bad_overflows = jnp.minimum(overflows + 1, self.hysteresis)
            bad_scale = jnp.where(bad_overflows >= self.hysteresis, backed_off, loss_scale)
            finite_overflows = jnp.where(grow, 0, overflows)
            new_overflows = jnp.where(finite, finite_overflows, bad_overflows).astype(jnp.int32)

        return dataclasses.replace(
            self,
            loss_scale=jnp.where(finite, finite_scale, bad_scale).astype(jnp.float32),
            counter=jnp.where(finite, finite_counter, 0).astype(jnp.int32),
            overflows=new_overflows,
        )


LossScale: TypeAlias = NoOpLossScale | StaticLossScale | DynamicLossScale

_LOSS_SCALE_CLASSES = (NoOpLossScale, StaticLossScale, DynamicLossScale)
_flax_registered = False


def _data_fields(loss_scale: Any) -> list[str]:
    """The names of the array fields (the leaves) that ``loss_scale`` holds."""
    return [
        f.name
        for f in dataclasses.fields(loss_scale)
        if not f.metadata.get("static") and getattr(loss_scale, f.name) is not None
    ]


def _to_state_dict(loss_scale: Any) -> dict[str, Any]:
    serialization = sys.modules["flax.serialization"]
    return {
        name: serialization.to_state_dict(getattr(loss_scale, name))
        for name in _data_fields(loss_scale)
    }


def _from_state_dict(target: Any, state: dict[str, Any]) -> Any:
    serialization = sys.modules["flax.serialization"]
    names = _data_fields(target)
    missing = [name for name in names if name not in state]
    if missing:
        raise ValueError(
            f"Cannot restore a {type(target).__name__} from a state dict without the fields "
            f"{missing}; it has {sorted(state)}."
        )
    values = {
        name: serialization.from_state_dict(getattr(target, name), state[name]) for name in names
    }
    return dataclasses.replace(target, **values) if values else target


def _register_with_flax_serialization() -> None:
    """Teaches ``flax.serialization`` (``to_state_dict``, ``to_bytes``, checkpoints) the loss
    scales: their array fields become a dict, the settings come from the restore target.

    ``import jmp_policy`` does not import flax, so this runs once flax is there: when this
    module is imported and whenever a loss scale is built (every ``jit``/``tree.map`` rebuilds
    one), a dictionary lookup until it has run.
    """
    global _flax_registered
    if _flax_registered:
        return
    serialization = sys.modules.get("flax.serialization")
    if serialization is None:
        return
    for cls in _LOSS_SCALE_CLASSES:
        serialization.register_serialization_state(
            cls, _to_state_dict, _from_state_dict, override=True
        )
    _flax_registered = True


def _scalar_bool(pred: Any, argument: str) -> jax.Array:
    shape = np.shape(pred)
    dtype = getattr(pred, "dtype", None)
    if dtype is None and isinstance(pred, bool):
        dtype = np.dtype(bool)
    if dtype is None or np.dtype(dtype) != np.bool_:
        raise TypeError(
            f"`{argument}` must be a scalar bool array (such as the result of `all_finite`). "
            f"Received: {argument}={pred!r}"
        )
    if shape != ():
        raise ValueError(
            f"`{argument}` must be a scalar bool array, not of shape {shape}. Received: "
            f"{argument}={pred!r}"
        )
    return jnp.asarray(pred)


def all_finite(tree: Any) -> jax.Array:
    """Whether every floating (and complex) leaf of ``tree`` is free of inf and NaN.

    Other leaves (integers, bools, ``None``, objects) are ignored, so a tree with no floating
    leaf gives ``True``. Under ``jit`` with sharded arrays the reduction is global (XLA adds the
    cross-device step); inside ``shard_map``/``pmap`` it sees only the local shard: combine it
    across devices yourself (``lax.pmin``), or let :func:`jmp_policy.loss_scaling` do it with
    ``axis_name``.

    Args:
        tree: any pytree.

    Returns:
        A scalar bool array. Nothing waits for the device.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jmp_policy as jp
        >>> jp.all_finite({"a": jnp.ones(3), "step": 3})
        Array(True, dtype=bool)
        >>> jp.all_finite([jnp.ones(3), jnp.array([1.0, jnp.nan])])
        Array(False, dtype=bool)
    """
    # `sum(x - x)` is 0 when every element is finite and NaN otherwise (inf - inf is NaN), and
    # can never overflow. It is one plain float reduction per leaf with no broadcast operand:
    # on CPU about half the cost of reducing `isfinite` booleans, and as cheap elsewhere.
    result = jnp.array(True)
    for x in jax.tree.leaves(tree):
        if is_float_leaf(x):
            x = jnp.asarray(x)
            result = result & jnp.isfinite(jnp.sum(x - x))
    return result


def select_tree(pred: jax.Array, on_true: T, on_false: T) -> T:
    """Picks ``on_true`` or ``on_false`` leaf by leaf, with no host synchronisation.

    Works under ``jit`` (it compiles to elementwise selects that XLA fuses into their
    producers) and with sharded arrays (each leaf keeps its sharding).

    Args:
        pred: a scalar bool array.
        on_true: a pytree.
        on_false: a pytree of the same structure.

    Returns:
        ``on_true`` where ``pred`` holds, else ``on_false``.

    Raises:
        TypeError: ``pred`` is not a bool array.
        ValueError: ``pred`` is not a scalar, or the two trees differ in structure.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jmp_policy as jp
        >>> jp.select_tree(jnp.array(False), {"a": jnp.ones(2)}, {"a": jnp.zeros(2)})
        {'a': Array([0., 0.], dtype=float32)}
    """
    pred = _scalar_bool(pred, "pred")
    true_def = jax.tree.structure(on_true)
    false_def = jax.tree.structure(on_false)
    if true_def != false_def:  # type: ignore[operator]
        raise ValueError(
            f"`on_true` and `on_false` must have the same tree structure. Received: "
            f"{true_def} and {false_def}"
        )
    return jax.tree.map(functools.partial(jnp.where, pred), on_true, on_false)


_register_with_flax_serialization()
