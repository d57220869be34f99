"""The checks of a :class:`~jmp_policy.QuantizedArray`'s fields, and of the settings that
:func:`~jmp_policy._src.quantization.quantize` shares with it (``stacked``, int4's block).

The static fields are checked always; ``values``, ``scale`` and ``zero_point`` only when they are concrete
arrays (under ``jit`` a user's QuantizedArray holds tracers, which are left alone). Tree
operations and transforms never run these checks: unflatten checks nothing
(:mod:`jmp_policy._src.quantization.quantized_tree`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jmp_policy._src import dtypes as dt
from jmp_policy._src.int_arguments import check_int
from jmp_policy._src.quantization.storage import modes, storage_of

# The storage modes built in (:mod:`jmp_policy._src.quantization.storage` holds them all).
MODES = modes()
# Python values that are no array at all (an array-like of another kind is left alone).
_NOT_ARRAYS = (str, bytes, int, float, complex, list, tuple, dict)


def is_bad_block(block: Any) -> bool:
    """Whether ``block`` is no int4 block size (``-1`` or from 1 to ``MAX_INT4_BLOCK``)."""
    return (
        isinstance(block, bool)
        or not isinstance(block, int)
        or block == 0
        or block < -1
        or block > dt.MAX_INT4_BLOCK
    )


def int4_block(block_size: Any) -> int:
    """int4's block size, checked: ``None`` is -1 (per channel)."""
    block = -1 if block_size is None else block_size
    if is_bad_block(block):
        raise ValueError(
            f"`block_size` must be -1 (per channel) or from 1 to {dt.MAX_INT4_BLOCK}. "
            f"Received: block_size={block_size!r}"
        )
    return block  # type: ignore[no-any-return]


def check_stacked(stacked: Any) -> int:
    """``stacked`` as an int, checked: a non-negative integer."""
    return check_int(stacked, "stacked", 0, why=" (the number of leading stacked-layer axes)")


def check_array(x: Any, stacked: Any) -> int:
    """``stacked``, checked with the array ``quantize`` is given: a floating array whose
    layers (after ``stacked`` leading axes) have rank >= 2.

    Raises:
        TypeError: ``x`` is not a floating array, or ``stacked`` no integer.
        ValueError: a negative ``stacked``, or layers of rank < 2.
    """
    if not isinstance(x, (jax.Array, np.ndarray)) or not dt.is_floating(np.dtype(x.dtype)):
        raise TypeError(
            f"Only floating arrays can be quantized. Received: {type(x).__name__} "
            f"of dtype {getattr(x, 'dtype', None)}"
        )
    if x.ndim < 2:
        raise ValueError(
            "Only arrays of rank >= 2 (kernels) are quantized; biases and norm scales stay "
            f"float. Received an array of shape {tuple(x.shape)}"
        )
    stacked = check_stacked(stacked)
    if x.ndim - stacked < 2:
        raise ValueError(
            "Each stacked layer must be of rank >= 2 (a kernel): with `stacked` leading "
            f"axes the array needs rank >= {stacked + 2}. Received: an array of shape "
            f"{tuple(x.shape)} and stacked={stacked!r}"
        )
    return stacked  # type: ignore[no-any-return]


def stack_to_front(shape: tuple[int, ...], k: int, at: int) -> tuple[int, ...]:
    """``shape`` with its ``k`` stacked axes at ``at`` moved to the front."""
    return (*shape[at : at + k], *shape[:at], *shape[at + k :])


def stack_from_front(shape: tuple[int, ...], k: int, at: int) -> tuple[int, ...]:
    """``shape`` with its ``k`` leading stacked axes moved to ``at``."""
    return (*shape[k : k + at], *shape[:k], *shape[k + at :])


def _concrete(x: Any) -> bool:
    """A concrete array, not a tracer, and not ``float0`` (the cotangent of integer values
    that ``jax.grad(..., allow_int=True)`` builds a QuantizedArray of)."""
    concrete = isinstance(x, np.ndarray) or (
        isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
    )
    return concrete and np.dtype(x.dtype) != np.dtype(jax.dtypes.float0)


def validate(q: Any, *, nan_scale: bool = False) -> None:
    """Checks the fields of the QuantizedArray ``q``; raises ``ValueError``/``TypeError``.
    A NaN scale passes only with ``nan_scale`` (the library's own construction, which
    marks a non-finite kernel's channel so)."""
    _check_settings(q)
    _check_original_dtype(q.original_dtype)
    _check_values(q)
    _check_scale(q, nan_scale)
    _check_zero_point(q)


def _check_settings(q: Any) -> None:
    """``mode``, ``block_size``, ``stacked`` and ``shape``."""
    kind = storage_of(q.mode)
    block = q.block_size
    if not kind.blocked and block is not None:
        raise ValueError(
            f"`block_size` must be None for {q.mode} (a scale per channel). "
            f"Received: block_size={block!r}"
        )
    if kind.blocked and is_bad_block(block):
        raise ValueError(
            f"`block_size` must be -1 (per channel) or from 1 to {dt.MAX_INT4_BLOCK} for "
            f"{q.mode}. Received: block_size={block!r}"
        )
    k = q.stacked
    check_stacked(k)
    at = check_int(q.stacked_at, "stacked_at", 0, why=" (the axis of the first stacked axis)")
    if at and isinstance(q.shape, tuple) and (not k or at > len(q.shape) - k):
        raise ValueError(
            f"`stacked_at` must be 0, or with `stacked` > 0 an axis of the layer's kernel "
            f"(at most {max(len(q.shape) - k, 0)} here). "
            f"Received: stacked_at={at!r}, stacked={k!r}, shape={q.shape!r}"
        )
    if (
        not isinstance(q.shape, tuple)
        or len(q.shape) < 2 + k
        or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in q.shape)
    ):
        raise ValueError(
            f"`shape` must be a tuple of {2 + k} or more non-negative ints (a kernel's shape, "
            f"after its {k} stacked axes). Received: shape={q.shape!r}, stacked={k!r}"
        )


def _check_original_dtype(original_dtype: Any) -> None:
    original: np.dtype | None = None
    # `np.dtype(None)` is float64: None names no dtype here.
    if original_dtype is not None and not isinstance(
        original_dtype, (jax.Array, np.ndarray, np.generic, bool, int, float)
    ):
        try:
            original = np.dtype(original_dtype)
        except (TypeError, ValueError):
            original = None
    if original is None or not dt.is_floating(original):
        raise ValueError(
            "`original_dtype` must be a floating dtype (the kernel's). "
            f"Received: original_dtype={original_dtype!r}"
        )


def _check_values(q: Any) -> None:
    values, k = q.values, q.stacked
    if not _concrete(values):
        if not hasattr(values, "shape") and isinstance(values, _NOT_ARRAYS):
            raise TypeError(f"`values` must be an integer array. Received: values={values!r}")
        return
    kind = storage_of(q.mode)
    allowed = kind.dtype_names
    if np.dtype(values.dtype).name not in allowed:
        raise TypeError(
            f"`values` of a {q.mode} QuantizedArray must be of dtype {' or '.join(allowed)}. "
            f"Received: values of dtype {values.dtype}"
        )
    packed = kind.is_packed(values)
    if packed and k:
        raise TypeError(
            f"`values` of a stacked {q.mode} QuantizedArray must be of dtype {allowed[0]} (the "
            f"packed {values.dtype} layout of earlier versions has no stacked form). "
            f"Received: stacked={k!r} and values of dtype {values.dtype}"
        )
    want = ((q.shape[0] + 1) // 2, *q.shape[1:]) if packed else q.shape
    if tuple(values.shape) != want:
        raise ValueError(
            f"`values` must have shape {want} for a kernel of `shape` {q.shape}. "
            f"Received: values of shape {tuple(values.shape)} and shape={q.shape!r}"
        )


def _check_scale(q: Any, nan_scale: bool) -> None:
    scale, k = q.scale, q.stacked
    if not _concrete(scale):
        if isinstance(scale, _NOT_ARRAYS):
            raise TypeError(f"`scale` must be a floating array. Received: scale={scale!r}")
        return
    if not dt.is_floating(np.dtype(scale.dtype)):
        raise TypeError(f"`scale` must be a floating array. Received: scale of dtype {scale.dtype}")
    n, lead = q.shape[-1], q.shape[q.stacked_at : q.stacked_at + k]
    blocked = storage_of(q.mode).blocked
    if not blocked:
        ok = tuple(scale.shape) == (*lead, n)
    else:
        ok = scale.ndim == k + 2 and tuple(scale.shape[:k]) == lead and scale.shape[-1] == n
    if not ok:
        prefix = "".join(f"{d}, " for d in lead)
        want = f"({prefix}{n})" if not blocked else f"({prefix}blocks, {n})"
        raise ValueError(
            f"`scale` must have shape {want} for a {q.mode} kernel of `shape` "
            f"{q.shape}. Received: scale of shape {tuple(scale.shape)} and "
            f"shape={q.shape!r}"
        )
    _check_scale_values(q, nan_scale)


def _check_scale_values(q: Any, nan_scale: bool) -> None:
    """Scales finite and positive. NaN marks a channel (or block) of a non-finite kernel
    (quantize keeps a NaN or inf weight non-finite, #20): accepted from the library, refused
    from a user (``nan_scale``). Zero only in an
    all-zero QuantizedArray (``jax.tree.map(jnp.zeros_like, q)``, as optimizers and
    autodiff make). Not checked for a cotangent (``float0`` values), whose scale holds
    gradients of any sign."""
    values = q.values
    if hasattr(values, "dtype") and np.dtype(values.dtype) == np.dtype(jax.dtypes.float0):
        return
    scale = np.asarray(q.scale, np.float32)
    bad = np.isinf(scale) | (scale < 0) | (np.isnan(scale) & (not nan_scale))
    if not bad.any() and (scale == 0).any() and _concrete(values):
        bad = (scale == 0) if bool(jnp.any(jnp.asarray(values) != 0)) else bad
    if bad.any():
        first = np.unravel_index(int(np.argmax(bad)), scale.shape)
        raise ValueError(
            "`scale` must be finite and positive (0 only where every value is 0, as "
            "`zeros_like` makes; NaN only from `quantize`, where the kernel held a NaN or "
            "inf). Received: "
            f"scale[{', '.join(map(str, first))}]={float(scale[first])!r} ({int(bad.sum())} "
            f"of {scale.size} scales bad)"
        )


def _check_zero_point(q: Any) -> None:
    """``None``, or an integer array of the scale's shape (checked when both are concrete)."""
    z = getattr(q, "zero_point", None)
    if z is None:
        return
    if not _concrete(z):
        if isinstance(z, _NOT_ARRAYS):
            raise TypeError(
                f"`zero_point` must be None or an integer array. Received: zero_point={z!r}"
            )
        return
    if not np.issubdtype(np.dtype(z.dtype), np.integer):
        raise TypeError(
            f"`zero_point` must be an integer array. Received: zero_point of dtype {z.dtype}"
        )
    s = q.scale
    if hasattr(s, "shape") and tuple(z.shape) != tuple(s.shape):
        raise ValueError(
            f"`zero_point` must have the scale's shape {tuple(s.shape)}. "
            f"Received: zero_point of shape {tuple(z.shape)}"
        )
