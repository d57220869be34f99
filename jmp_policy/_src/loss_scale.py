"""Loss scales: no-op, static and dynamic, with the rule that adapts a dynamic scale.

A loss scale multiplies the loss before differentiation so that small gradients survive a
16-bit backward pass, and divides the gradients afterwards. The classes are state pytrees
(see ``state_pytree``): the arrays (scale, counters) are leaves, the settings (period, factor,
bounds) are static metadata, so nothing is lost when a loss scale crosses ``jit``, ``scan``,
``tree.map`` or a checkpoint, and a new scale value never forces a recompile. Settings are
validated when their values are known, whatever their type (Python, NumPy or JAX scalars).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, TypeAlias, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jmp_policy._src import numerics
from jmp_policy._src.state_pytree import register_state, replace_leaves, tree_equal
from jmp_policy._src.state_pytree import register_with_flax_serialization as _register_flax

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
#: The counter is int32: ``counter >= period - 1`` must be representable.
_MAX_PERIOD = 2**31
_MAX_HYSTERESIS = 2**31 - 1


def _concrete(value: Any) -> np.ndarray | None:
    """``value`` as a NumPy array when it is concrete (Python, NumPy or a JAX array outside
    tracing); ``None`` for traced values, which have no value to check yet."""
    if isinstance(value, jax.core.Tracer):
        return None
    if isinstance(value, jax.Array):
        try:
            return np.asarray(value)
        except Exception:  # not addressable from this process: leave it unchecked
            return None
    if isinstance(value, (int, float, np.ndarray, np.generic)):
        return np.asarray(value)
    return None


def _overflow_hint(value: Any) -> str:
    dtype = np.dtype(getattr(value, "dtype", np.float64))
    if dtype.itemsize > 2 or not jnp.issubdtype(dtype, jnp.floating):
        return ""
    return f" (beyond {dtype.name}'s range a value is inf: pass a Python float or float32)"


_F32 = np.finfo(np.float32)
_INT32_MAX = 2**31 - 1


def _float32_range_hint(number: float) -> str:
    """Why a finite positive number is no float32 scale (``""`` when it is one)."""
    stored = np.float32(number) if number <= float(_F32.max) else np.float32(np.inf)
    if np.isfinite(stored) and stored >= _F32.tiny:
        return ""
    return (
        f" (it is stored in float32, where it is {float(stored)!r}: a scale or bound lies in "
        f"float32's normal range [{float(_F32.tiny)!r}, {float(_F32.max)!r}], so that it can "
        "never reach 0 or inf)"
    )


def _to_float(number: Any) -> float:
    try:
        return float(number)
    except OverflowError:  # a Python int beyond float64
        return math.inf if number > 0 else -math.inf


def _as_leaf(value: Any, dtype: Any, argument: str) -> Any:
    """Canonicalises an array field to a scalar ``dtype`` array (on construction, not on
    unflattening).

    A concrete value (Python, NumPy or a JAX array outside tracing) must be a real number
    of the right kind, a scalar, and in range: a float32 scale finite, positive and normal,
    an int32 counter in ``[0, 2**31 - 1]``. A traced value is only cast: under ``jit``
    there is no value to check.
    """
    integer = bool(jnp.issubdtype(dtype, jnp.integer))
    accepted = (
        "a non-negative int (a Python int or an integer scalar array)"
        if integer
        else "a finite number > 0 (a Python number or a real scalar array)"
    )
    if isinstance(value, jax.core.Tracer):
        return jnp.asarray(value).astype(dtype)
    is_array = isinstance(value, (np.ndarray, np.generic, jax.Array))
    value_dtype = np.dtype(value.dtype) if is_array else None
    if isinstance(value, (bool, np.bool_)) or value_dtype == np.bool_:
        raise TypeError(
            f"`{argument}` must be a number or a scalar array, not a bool: {accepted}. "
            f"Received: {argument}={value!r}"
        )
    real = value_dtype is not None and bool(
        jnp.issubdtype(value_dtype, jnp.integer) or jnp.issubdtype(value_dtype, jnp.floating)
    )
    if not (isinstance(value, (int, float)) or real):
        kind = f"dtype {value_dtype}" if value_dtype is not None else f"type {type(value).__name__}"
        raise TypeError(
            f"`{argument}` must be {accepted}. Received: {argument}={value!r} (of {kind})"
        )
    if integer and (
        isinstance(value, float)
        or (value_dtype is not None and not jnp.issubdtype(value_dtype, jnp.integer))
    ):
        raise TypeError(
            f"`{argument}` must be {accepted}; a float is not a count. Received: "
            f"{argument}={value!r}"
        )
    if isinstance(value, (int, float)):
        scalar: Any = value
    else:
        host = _concrete(value)
        if host is None:  # not addressable from this process: leave it unchecked
            return jnp.asarray(value).astype(dtype)
        if host.shape != ():
            raise ValueError(
                f"`{argument}` must be a scalar, not an array of shape {host.shape}. "
                f"Received: {argument}={value!r}"
            )
        scalar = host.item()
    if integer:
        count = int(scalar)
        if not 0 <= count <= _INT32_MAX:
            raise ValueError(
                f"`{argument}` must be an int in [0, {_INT32_MAX}] (it is stored in int32). "
                f"Received: {argument}={value!r}"
            )
        return jnp.asarray(count, dtype)
    number = _to_float(scalar)
    if not (math.isfinite(number) and number > 0):
        raise ValueError(
            f"`{argument}` must be a finite number > 0. Received: {argument}={value!r}"
            f"{_overflow_hint(value)}"
        )
    hint = _float32_range_hint(number)
    if hint:
        raise ValueError(
            f"`{argument}` must be a finite number > 0. Received: {argument}={value!r}{hint}"
        )
    return jnp.asarray(number, dtype)


def _setting(value: Any, argument: str, accepted: str, integer: bool) -> Any:
    """A static setting as a Python number, from a Python, NumPy or concrete JAX scalar."""
    bad_type = isinstance(value, (bool, np.bool_, str)) or (
        getattr(value, "dtype", None) is not None and not jnp.issubdtype(value.dtype, jnp.number)
    )
    if isinstance(value, jax.core.Tracer):
        raise TypeError(
            f"`{argument}` is a setting and must be a concrete number, not a traced value "
            f"(received {value!r}); build the loss scale outside `jit` or pass a Python number."
        )
    host = None if bad_type else _concrete(value)
    if host is None or host.shape != ():
        shape = "" if host is None else f" (shape {host.shape})"
        raise TypeError(
            f"`{argument}` must be {accepted}. Received: {argument}={value!r}{shape} (of type "
            f"{type(value).__name__})"
        )
    number = host.item()
    if integer:
        if isinstance(number, float) and number.is_integer():
            number = int(number)  # jmp's own tests pass `period=5.`
        if not isinstance(number, int):
            raise TypeError(
                f"`{argument}` must be {accepted}. Received: {argument}={value!r} (of type "
                f"{type(value).__name__})"
            )
    return number


def _bound(value: Any, argument: str) -> float:
    """A min/max setting as a Python float: a finite number > 0."""
    number = _to_float(_setting(value, argument, "a positive number or a scalar array", False))
    if not (math.isfinite(number) and number > 0):
        raise ValueError(
            f"`{argument}` must be a finite number > 0. Received: {argument}={value!r}"
            f"{_overflow_hint(value)}"
        )
    hint = _float32_range_hint(number)
    if hint:
        raise ValueError(
            f"`{argument}` must be a finite number > 0. Received: {argument}={value!r}{hint}"
        )
    return number


def _count(value: Any, argument: str, maximum: int) -> int:
    """A period/hysteresis setting as a Python int in ``[1, maximum]``."""
    number = _setting(value, argument, "an int >= 1", True)
    if number < 1:
        raise ValueError(f"`{argument}` must be an int >= 1. Received: {argument}={value!r}")
    if number > maximum:
        raise ValueError(
            f"`{argument}` must fit the int32 counter (at most {maximum}). Received: "
            f"{argument}={value!r}"
        )
    return int(number)


@register_state
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

    __eq__ = tree_equal
    __hash__ = None  # type: ignore[assignment]  # array leaves

    def __post_init__(self) -> None:
        _register_flax()

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
        return numerics.scale_tree(tree, self.loss_scale)

    def unscale(self, tree: T) -> T:
        """Divides every floating leaf by the scale, computing in float32 and returning each
        leaf in its own dtype; other leaves are returned as they are."""
        return numerics.unscale_tree(tree, self.loss_scale)


@register_state
@dataclasses.dataclass(frozen=True, eq=False)
class StaticLossScale(_ScaleByLeaf):
    """A constant loss scale.

    Args:
        loss_scale: a finite number > 0 (a Python number or a NumPy or JAX scalar, validated
            when concrete); stored as a float32 array leaf.

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

    __eq__ = tree_equal
    __hash__ = None  # type: ignore[assignment]  # array leaves

    def __post_init__(self) -> None:
        _register_flax()
        object.__setattr__(self, "loss_scale", _as_leaf(self.loss_scale, jnp.float32, "loss_scale"))

    def adjust(self, grads_finite: jax.Array) -> StaticLossScale:
        """Returns ``self``: a static scale never changes."""
        del grads_finite
        return self


@register_state
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
    array leaves (so a new value never recompiles a jitted step), the settings are static
    metadata (so ``jit``, ``scan``, ``tree.map`` and checkpoints keep them). ``adjust`` is pure
    ``jnp`` code: it runs under ``jit`` with no host synchronisation. Across devices, pass
    every device the same ``grads_finite`` (as :func:`jmp_policy.loss_scaling` does) and the
    scales stay identical.

    Every setting may be a Python number or a NumPy or JAX scalar, and is validated when its
    value is known: ``jnp.float16(2**16)`` is inf and is rejected like ``float("inf")``. Under
    ``jit`` the scale and counter are traced and are not checked; the static settings must be
    concrete there too.

    Args:
        loss_scale: the initial scale (default ``2**15``), a number or scalar array of any
            float dtype (stored as float32, so ``jnp.float16(2**15)`` works).
        counter: consecutive finite steps so far (int32).
        period: finite steps between growths, an integer in ``[1, 2**31]`` (the counter is
            int32; default 2000).
        factor: growth and backoff factor, a finite number ``> 1`` (default 2).
        min_loss_scale: the floor, a finite positive number (default ``2**-14``; never 1,
            which stalls training whose gradients overflow float16).
        max_loss_scale: the ceiling, a finite positive number (default ``2**24``), so the
            scale never reaches inf.
        hysteresis: non-finite steps tolerated since the last growth before backing off, an
            integer in ``[1, 2**31 - 1]`` (default 1: back off on every non-finite step).
        overflows: non-finite steps since the last growth (an int32 leaf only when
            ``hysteresis > 1``; ``None`` otherwise, so the leaves are jmp's
            ``[loss_scale, counter]``).

    Raises:
        ValueError: ``period`` or ``hysteresis`` out of range, ``factor <= 1``, a non-positive
            or non-finite scale or bound, ``min_loss_scale > max_loss_scale``, or an initial
            scale outside ``[min_loss_scale, max_loss_scale]``; each quoting the value.
        TypeError: a setting of the wrong type (``period=2.5``, ``factor="2"``, a traced
            setting, a non-scalar array).

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

    __eq__ = tree_equal
    __hash__ = None  # type: ignore[assignment]  # array leaves

    def __post_init__(self) -> None:
        _register_flax()
        object.__setattr__(self, "period", _count(self.period, "period", _MAX_PERIOD))
        hysteresis = _count(self.hysteresis, "hysteresis", _MAX_HYSTERESIS)
        object.__setattr__(self, "hysteresis", hysteresis)
        factor = _to_float(_setting(self.factor, "factor", "a number > 1", False))
        if not (math.isfinite(factor) and factor > 1):
            raise ValueError(
                f"`factor` must be a finite number > 1. Received: factor={self.factor!r}"
            )
        if not 1 < np.float32(min(factor, float(_F32.max))) < np.inf:
            raise ValueError(
                f"`factor` must be a finite number > 1 in float32, where the scale is "
                f"multiplied by it (there it is {float(np.float32(factor))!r}). Received: "
                f"factor={self.factor!r}"
            )
        object.__setattr__(self, "factor", factor)
        low = _bound(self.min_loss_scale, "min_loss_scale")
        high = _bound(self.max_loss_scale, "max_loss_scale")
        if low > high:
            raise ValueError(
                f"`min_loss_scale` must be <= `max_loss_scale`. Received: "
                f"min_loss_scale={low!r}, max_loss_scale={high!r}"
            )
        object.__setattr__(self, "min_loss_scale", low)
        object.__setattr__(self, "max_loss_scale", high)
        leaf = _as_leaf(self.loss_scale, jnp.float32, "loss_scale")
        host = None if isinstance(leaf, jax.core.Tracer) else _concrete(leaf)
        host = None if host is None else host.astype(np.float64)
        # Compared in float32, as `adjust` compares them.
        low32, high32 = float(np.float32(low)), float(np.float32(high))
        if host is not None and not (np.all(host >= low32) and np.all(host <= high32)):
            raise ValueError(
                f"`loss_scale` must lie within [min_loss_scale, max_loss_scale] = "
                f"[{low!r}, {high!r}]. Received: loss_scale={self.loss_scale!r}; widen the "
                f"bounds (for example max_loss_scale=2.0**32) or pick another initial scale."
            )
        object.__setattr__(self, "loss_scale", leaf)
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
        finite = numerics.scalar_bool(grads_finite, "grads_finite")
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

        return replace_leaves(
            self,
            loss_scale=jnp.where(finite, finite_scale, bad_scale).astype(jnp.float32),
            counter=jnp.where(finite, finite_counter, 0).astype(jnp.int32),
            overflows=new_overflows,
        )


LossScale: TypeAlias = NoOpLossScale | StaticLossScale | DynamicLossScale
