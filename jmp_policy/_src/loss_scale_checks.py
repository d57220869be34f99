"""The checks of the loss scales' arguments: array leaves and static settings.

Each value is checked when it is known, whatever its type (a Python number, a NumPy or a
concrete JAX scalar), and comes back canonical: a leaf as a scalar array of its dtype, a
setting as a Python number. A traced leaf has no value to check yet and is only cast.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

_F32 = np.finfo(np.float32)
_INT32_MAX = 2**31 - 1


def concrete(value: Any) -> np.ndarray | None:
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


def to_float(number: Any) -> float:
    try:
        return float(number)
    except OverflowError:  # a Python int beyond float64
        return math.inf if number > 0 else -math.inf


def _finite_positive(number: float, value: Any, argument: str) -> float:
    """``number`` (``value`` as given, converted) when it is a finite float32 number > 0."""
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


def _check_leaf_type(value: Any, argument: str, integer: bool) -> None:
    """Raises ``TypeError`` unless ``value`` is a real number of the leaf's kind (an integer
    for a counter, any real number for a scale), never a bool."""
    accepted = (
        "a non-negative int (a Python int or an integer scalar array)"
        if integer
        else "a finite number > 0 (a Python number or a real scalar array)"
    )
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


def _host_scalar(value: Any, argument: str) -> Any:
    """``value`` as a Python scalar; ``None`` when it is not addressable from this process."""
    if isinstance(value, (int, float)):
        return value
    host = concrete(value)
    if host is None:
        return None
    if host.shape != ():
        raise ValueError(
            f"`{argument}` must be a scalar, not an array of shape {host.shape}. "
            f"Received: {argument}={value!r}"
        )
    return host.item()


def as_leaf(value: Any, dtype: Any, argument: str) -> Any:
    """Canonicalises an array field to a scalar ``dtype`` array (on construction, not on
    unflattening).

    A concrete value (Python, NumPy or a JAX array outside tracing) must be a real number
    of the right kind, a scalar, and in range: a float32 scale finite, positive and normal,
    an int32 counter in ``[0, 2**31 - 1]``. A traced value is only cast: under ``jit``
    there is no value to check.
    """
    if isinstance(value, jax.core.Tracer):
        return jnp.asarray(value).astype(dtype)
    integer = bool(jnp.issubdtype(dtype, jnp.integer))
    _check_leaf_type(value, argument, integer)
    scalar = _host_scalar(value, argument)
    if scalar is None:  # not addressable from this process: leave it unchecked
        return jnp.asarray(value).astype(dtype)
    if integer:
        counter = int(scalar)
        if not 0 <= counter <= _INT32_MAX:
            raise ValueError(
                f"`{argument}` must be an int in [0, {_INT32_MAX}] (it is stored in int32). "
                f"Received: {argument}={value!r}"
            )
        return jnp.asarray(counter, dtype)
    return jnp.asarray(_finite_positive(to_float(scalar), value, argument), dtype)


def setting(value: Any, argument: str, accepted: str, integer: bool) -> Any:
    """A static setting as a Python number, from a Python, NumPy or concrete JAX scalar."""
    bad_type = isinstance(value, (bool, np.bool_, str)) or (
        getattr(value, "dtype", None) is not None and not jnp.issubdtype(value.dtype, jnp.number)
    )
    if isinstance(value, jax.core.Tracer):
        raise TypeError(
            f"`{argument}` is a setting and must be a concrete number, not a traced value "
            f"(received {value!r}); build the loss scale outside `jit` or pass a Python number."
        )
    host = None if bad_type else concrete(value)
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


def bound(value: Any, argument: str) -> float:
    """A min/max setting as a Python float: a finite number > 0."""
    number = to_float(setting(value, argument, "a positive number or a scalar array", False))
    return _finite_positive(number, value, argument)


def count(value: Any, argument: str, maximum: int) -> int:
    """A period/hysteresis setting as a Python int in ``[1, maximum]``."""
    number = setting(value, argument, "an int >= 1", True)
    if number < 1:
        raise ValueError(f"`{argument}` must be an int >= 1. Received: {argument}={value!r}")
    if number > maximum:
        raise ValueError(
            f"`{argument}` must fit the int32 counter (at most {maximum}). Received: "
            f"{argument}={value!r}"
        )
    return int(number)


def factor(value: Any) -> float:
    """The growth/backoff factor as a Python float: finite and > 1, in float32 too."""
    number = to_float(setting(value, "factor", "a number > 1", False))
    if not (math.isfinite(number) and number > 1):
        raise ValueError(f"`factor` must be a finite number > 1. Received: factor={value!r}")
    if not 1 < np.float32(min(number, float(_F32.max))) < np.inf:
        raise ValueError(
            f"`factor` must be a finite number > 1 in float32, where the scale is "
            f"multiplied by it (there it is {float(np.float32(number))!r}). Received: "
            f"factor={value!r}"
        )
    return number


def within_bounds(leaf: Any, given: Any, low: float, high: float) -> None:
    """Raises unless the concrete initial scale ``leaf`` (``given`` as passed) lies in
    ``[low, high]``, compared in float32 as ``adjust`` compares them."""
    host = None if isinstance(leaf, jax.core.Tracer) else concrete(leaf)
    host = None if host is None else host.astype(np.float64)
    low32, high32 = float(np.float32(low)), float(np.float32(high))
    if host is not None and not (np.all(host >= low32) and np.all(host <= high32)):
        raise ValueError(
            f"`loss_scale` must lie within [min_loss_scale, max_loss_scale] = "
            f"[{low!r}, {high!r}]. Received: loss_scale={given!r}; widen the "
            f"bounds (for example max_loss_scale=2.0**32) or pick another initial scale."
        )
