"""GPTQ (Frantar et al., 2022): int4/int8 weights that minimise the layer's output error on
calibration inputs, ``‖XW - XŴ‖``, given their Gram matrix ``H = XᵀX``.

The kernel's input rows (axis 0 of a Flax kernel ``[in, ..., out]``) are quantized one at a
time, in blocks; each row's rounding error is spread over the rows not yet quantized through
the upper Cholesky factor ``U`` of the damped inverse Hessian (``H⁻¹ = UᵀU``): row ``i``'s
error ``e = (w_i - ŵ_i) / U[i, i]`` moves each later row ``j`` by ``-U[i, j] e`` (within a
block at once, to later blocks once per block). Damping adds ``hessian_damping`` times the
mean diagonal to the diagonal (Keras's default 0.01); an input never seen (a zero diagonal)
gets a diagonal of 1, so its row is rounded to nearest.

The result is stored exactly as round-to-nearest stores it
(:func:`jmp_policy._src.quantization.quantize`): symmetric abs-max scales on the same grid
(int4's full range ``-8..7``, :mod:`~jmp_policy._src.quantization.symmetric_grid`), int4 in groups
of ``group_size`` rows (``-1``: per channel; a group's scale is taken from the rows as GPTQ
has updated them when the group starts), int8 per channel. So the serving matmuls read a
GPTQ kernel as they read any other. With ``clip_search`` each group's scale is the
reference code's ``mse=True`` choice (:mod:`~jmp_policy._src.quantization.clipping`)
instead of abs-max. A kernel contracted over several leading axes (attention's output
projection ``[heads, head_dim, out]``) is solved as its 2-D kernel. Nothing here knows Flax.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jmp_policy._src import dtypes as dt
from jmp_policy._src.int_arguments import check_int
from jmp_policy._src.quantization import asymmetric_grid, clipping, symmetric_grid, zero_point
from jmp_policy._src.quantization.asymmetric_grid import check_symmetric
from jmp_policy._src.quantization.quantized_array import QuantizedArray, quantize
from jmp_policy._src.quantization.quantized_array_checks import check_stacked
from jmp_policy._src.quantization.quantized_tree import make
from jmp_policy._src.quantization.symmetric_grid import (
    SymmetricGrid,
    abs_max_scale,
    round_to_grid,
)

BITS = (4, 8)
DEFAULT_HESSIAN_DAMPING = 0.01
DEFAULT_BLOCK_SIZE = 128
_HIGHEST = jax.lax.Precision.HIGHEST


def check_bits_and_group(bits: Any, group_size: Any, what: str = "GPTQ") -> int:
    """``bits`` and ``group_size`` checked; returns int4's block (-1 per channel) or -1."""
    if isinstance(bits, bool) or bits not in BITS:
        raise ValueError(
            f"`weight_bits` must be 4 or 8 for {what} (stored as jnp.int4 or jnp.int8); 2 "
            f"and 3 bits have no storage here. Received: weight_bits={bits!r}"
        )
    if (
        isinstance(group_size, bool)
        or not isinstance(group_size, int)
        or group_size == 0
        or group_size < -1
        or group_size > dt.MAX_INT4_BLOCK
    ):
        raise ValueError(
            f"`group_size` must be -1 (per channel) or from 1 to {dt.MAX_INT4_BLOCK}. "
            f"Received: group_size={group_size!r}"
        )
    if bits == 8 and group_size != -1:
        raise ValueError(
            f"8-bit {what} weights are stored as int8 per output channel: use group_size=-1 "
            f"(or 4 bits for groups). Received: weight_bits=8, group_size={group_size!r}"
        )
    return group_size  # type: ignore[no-any-return]


def check_kernel(kernel: Any, stacked: Any) -> tuple[int, ...]:
    """``kernel`` must be a floating array of rank >= 2 after ``stacked`` axes; its shape."""
    check_stacked(stacked)
    if not isinstance(kernel, (jax.Array, np.ndarray)) or not dt.is_floating(
        np.dtype(kernel.dtype)
    ):
        raise TypeError(
            "`kernel` must be a floating array. Received: "
            f"{type(kernel).__name__} of dtype {getattr(kernel, 'dtype', None)}"
        )
    shape = tuple(kernel.shape)
    if len(shape) - stacked < 2:
        raise ValueError(
            f"`kernel` must have rank >= {stacked + 2} (a kernel after {stacked} stacked "
            f"axes). Received: a kernel of shape {shape}"
        )
    return shape


def check_in_axes(in_axes: Any, shape: tuple[int, ...], stacked: int) -> int:
    """``in_axes`` must leave at least one output axis of the kernel ``shape``."""
    top = len(shape) - stacked - 1
    why = (
        " (the kernel's leading input axes, leaving an output axis) for a kernel of shape "
        f"{shape} (stacked={stacked})"
    )
    return check_int(in_axes, "in_axes", 1, top, why=why)


def damped_hessian(hessian: jax.Array, damping: Any) -> jax.Array:
    """``hessian`` with a zero diagonal entry set to 1 and ``damping`` times the mean
    diagonal added to the diagonal (as GPTQ's reference code and Keras do)."""
    h = jnp.asarray(hessian, jnp.float32)
    diag = jnp.diagonal(h)
    diag = jnp.where(diag == 0, 1.0, diag)
    diag = diag + damping * jnp.mean(diag)
    return h - jnp.diag(jnp.diagonal(h)) + jnp.diag(diag)


def inverse_cholesky(h: jax.Array) -> jax.Array:
    """The upper Cholesky factor ``U`` of ``h``'s inverse (``h⁻¹ = UᵀU``); NaN where ``h``
    is not positive definite."""
    low = jnp.linalg.cholesky(h)
    eye = jnp.eye(h.shape[0], dtype=h.dtype)
    h_inv = jax.scipy.linalg.cho_solve((low, True), eye)
    h_inv = (h_inv + h_inv.T) / 2
    return jnp.linalg.cholesky(h_inv).T


def _channel_scale(
    rows: jax.Array,
    rest: tuple[int, ...],
    sgrid: SymmetricGrid,
    clip: bool = False,
    sym: bool = True,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The scale and zero point of ``rows`` (``[r, M]``, ``M = prod(rest)``) per index of the
    last axis of ``rest``, broadcast back to ``[M]``, and the ``[n]`` ones themselves:
    abs-max (zero points 0), or with ``clip`` the clipping search's (the reference code's
    ``mse=True`` grid); ``sym=False``: the asymmetric grid's (:mod:`~jmp_policy._src.
    quantization.asymmetric_grid`)."""
    if not sym:
        scale, zero = asymmetric_grid.column_grid(rows, rest, clip)
    elif clip:
        scale, zero = clipping.search_scale(rows, rest, sgrid), jnp.zeros(rest[-1])
    else:
        cols = jnp.max(jnp.abs(rows), axis=0).reshape(rest)
        scale = abs_max_scale(cols, tuple(range(len(rest) - 1)), sgrid).reshape(rest[-1])
        zero = jnp.zeros_like(scale)
    broadcast = clipping.broadcast_scale
    return broadcast(scale, rest), broadcast(zero, rest), scale, zero


@functools.partial(jax.jit, static_argnames=("bits", "group", "block", "rest", "clip", "sym"))
def _solve(
    w2: jax.Array,
    hessian: jax.Array,
    damping: jax.Array,
    *,
    bits: int,
    group: int,
    block: int,
    rest: tuple[int, ...],
    clip: bool = False,
    sym: bool = True,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """GPTQ on one kernel ``w2`` (``[in, M]``, float32): integer values (float32, ``[in, M]``),
    scales and zero points (``[groups, n]``; ``[n]`` per channel) and whether the
    factorisation was finite."""
    sgrid = symmetric_grid.of("int4" if bits == 4 else "int8")
    lo, hi = asymmetric_grid.QMIN, asymmetric_grid.QMAX
    rows, m = w2.shape
    # A group (or block) longer than the kernel is one block of its rows: padding it out
    # would change nothing but the size of the Cholesky factor and of the row loop.
    size = min(group if group > 0 else block, rows)
    blocks = -(-rows // size)
    padded = blocks * size
    # Padded rows: zero weights and a unit, uncoupled diagonal, so they change nothing.
    w = jnp.pad(w2, ((0, padded - rows), (0, 0)))
    h = damped_hessian(hessian, damping)
    h = jnp.pad(h, ((0, padded - rows), (0, padded - rows)))
    pad_diag = jnp.arange(padded) >= rows
    h = h + jnp.diag(pad_diag.astype(h.dtype))
    u = inverse_cholesky(h)
    ok = jnp.all(jnp.isfinite(u))
    per_channel = _channel_scale(w2, rest, sgrid, clip and group <= 0, sym)
    later = jnp.arange(size)[None, :] > jnp.arange(size)[:, None]  # [j, k]: k after j

    def one_block(w: jax.Array, k: jax.Array) -> tuple[jax.Array, tuple[jax.Array, ...]]:
        start = k * size
        w1 = jax.lax.dynamic_slice(w, (start, 0), (size, m))
        u1 = jax.lax.dynamic_slice(u, (start, start), (size, size))
        grid = _channel_scale(w1, rest, sgrid, clip, sym) if group > 0 else per_channel
        scale_m, zero_m, scale_n, zero_n = grid

        def one_row(j: jax.Array, carry: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
            w1, q1, err1 = carry
            row = w1[j]
            if sym:  # the grid's rounding (its tie at -amax), as round-to-nearest's
                q = round_to_grid(row, scale_m, sgrid)
            else:
                q = jnp.clip(jnp.round(row / scale_m) + zero_m, lo, hi)
            e = (row - (q - zero_m) * scale_m) / u1[j, j]
            w1 = w1 - jnp.outer(jnp.where(later[j], u1[j], 0.0), e)
            return w1, q1.at[j].set(q), err1.at[j].set(e)

        zeros = jnp.zeros((size, m), jnp.float32)
        _, q1, err1 = jax.lax.fori_loop(0, size, one_row, (w1, zeros, zeros))
        # Later blocks: U is upper triangular, so the rows before this block stay as they are
        # (the rows of this block are quantized already and are not read again).
        u_rows = jax.lax.dynamic_slice(u, (start, 0), (size, padded))
        w = w - jnp.matmul(u_rows.T, err1, precision=_HIGHEST)
        return w, (q1, scale_n, zero_n)

    _, (q, scales, zeros) = jax.lax.scan(one_block, w, jnp.arange(blocks))
    q = q.reshape(padded, m)[:rows]
    if group <= 0:
        scales, zeros = per_channel[2], per_channel[3]
    return q, scales, zeros, ok


def gptq_quantize(
    kernel: Any,
    hessian: Any,
    *,
    weight_bits: int = 4,
    group_size: int = 128,
    hessian_damping: float = DEFAULT_HESSIAN_DAMPING,
    block_size: int = DEFAULT_BLOCK_SIZE,
    stacked: int = 0,
    in_axes: int = 1,
    clip_search: bool = False,
    symmetric: bool = True,
) -> QuantizedArray:
    """GPTQ-quantizes ``kernel`` for inputs whose Gram matrix is ``hessian``.

    Args:
        kernel: a floating kernel ``[in, ..., out]`` (Flax's layout; with ``stacked``
            leading layer axes, ``[*depth, in, ..., out]``).
        hessian: ``XᵀX`` of the layer's inputs, ``[in, in]`` (``[*depth, in, in]``); any
            positive multiple gives the same result. With ``in_axes`` > 1, ``in`` is the
            product of the input axes (flattened in order).
        weight_bits: 4 (``jnp.int4`` values) or 8 (``jnp.int8``, per channel only).
        group_size: int4's rows per scale (``-1``: per channel), as ``int4/<group_size>``.
        hessian_damping: the fraction of the mean diagonal added to the diagonal.
        block_size: rows per block of the lazy batch update when ``group_size`` is -1
            (groups are the blocks otherwise); changes the speed, not the result.
        stacked: leading axes of ``kernel`` that stack layers, each solved on its own.
        in_axes: the kernel's leading axes (after ``stacked``) that the layer contracts
            with its inputs: 2 for attention's output projection ``[heads, head_dim,
            out]``, solved as the 2-D kernel ``[heads · head_dim, out]`` (its int4 groups
            of ``group_size`` heads are ``group_size · head_dim`` rows there).
        clip_search: choose each group's scale by the clipping search (GPTQ's reference
            ``mse=True`` grid: :func:`~jmp_policy._src.quantization.clipping.search_scale`
            on the weights as GPTQ has updated them when the group starts) instead of
            abs-max.
        symmetric: ``False`` (4 bits): each group on the asymmetric grid (a zero point
            per group, all 16 codes; GPTQ's reference ``sym=False``), the clipping search
            shrinking both ends of its range.

    Returns:
        A :class:`~jmp_policy.QuantizedArray` in the storage round-to-nearest gives
        (``int4/<group_size>`` or ``int8``; with a ``zero_point`` when not symmetric). If a Hessian cannot be factorised, that layer
        is rounded to nearest (with a warning outside ``jit``). Works under ``jit``.

    Raises:
        ValueError: unsupported ``weight_bits``/``group_size``, ``block_size``/``in_axes``/
            ``stacked`` out of range, or shapes that disagree.
        TypeError: ``kernel`` is not a floating array, or ``block_size``/``in_axes``/
            ``stacked`` no integer.
    """
    group = check_bits_and_group(weight_bits, group_size)
    block_size = check_int(block_size, "block_size", 1)
    shape = check_kernel(kernel, stacked)
    in_axes = check_in_axes(in_axes, shape, stacked)
    lead, ins = shape[:stacked], shape[stacked : stacked + in_axes]
    rows, rest = math.prod(ins), shape[stacked + in_axes :]
    hessian = jnp.asarray(hessian)
    if tuple(hessian.shape) != (*lead, rows, rows):
        raise ValueError(
            f"`hessian` must have shape {(*lead, rows, rows)} for a kernel of shape {shape} "
            f"(stacked={stacked}). Received: hessian of shape {tuple(hessian.shape)}"
        )
    mode = "int4" if weight_bits == 4 else "int8"
    sym = check_symmetric(symmetric, weight_bits)
    rtn = _round_to_nearest(kernel, weight_bits, group, stacked, sym)
    if rows == 0 or math.prod(rest) == 0:
        return rtn
    inner = math.prod(ins[1:])  # rows of the 2-D kernel per row of the stored kernel
    solve = functools.partial(
        _solve, bits=weight_bits, group=group * inner if group > 0 else group,
        block=block_size, rest=rest, clip=bool(clip_search), sym=sym,
    )  # fmt: skip
    for _ in range(stacked):
        solve = jax.vmap(solve, in_axes=(0, 0, None))
    w2 = jnp.asarray(kernel).astype(jnp.float32).reshape(*lead, rows, -1)
    q, scales, zeros, ok = solve(w2, hessian.astype(jnp.float32), jnp.float32(hessian_damping))
    if weight_bits == 4 and group == -1:
        scales, zeros = scales[..., None, :], zeros[..., None, :]  # int4 per channel: one block
    dtype = jnp.int4 if weight_bits == 4 else jnp.int8
    ok_b = ok.reshape(*lead, *([1] * (q.ndim - stacked)))
    values = jnp.where(ok_b, q.reshape(shape), rtn.values.astype(jnp.float32)).astype(dtype)
    ok_s = ok.reshape(*lead, *([1] * (scales.ndim - stacked)))
    scales = jnp.where(ok_s, scales, rtn.scale)
    _warn_if_unfactorised(ok)
    if not sym:
        zeros = jnp.where(ok_s, zeros, rtn.zero_point).astype(jnp.int8)
        return make(
            QuantizedArray, values, scales, mode, group, shape,
            np.dtype(kernel.dtype), stacked, zero_point=zeros,
        )  # fmt: skip
    return make(
        QuantizedArray, values, scales, mode, group if weight_bits == 4 else None, shape,
        np.dtype(kernel.dtype), stacked,
    )  # fmt: skip


def _warn_if_unfactorised(ok: jax.Array) -> None:
    """Warns (outside ``jit``) where a layer's Hessian could not be factorised."""
    if not isinstance(ok, jax.core.Tracer) and not bool(jnp.all(ok)):
        warnings.warn(
            "GPTQ could not factorise a Hessian (a layer whose calibration inputs make it "
            "singular even after damping): that layer is rounded to nearest. Raise "
            "`hessian_damping` or calibrate on more varied batches.",
            stacklevel=3,
        )


def _round_to_nearest(
    kernel: Any, weight_bits: int, group: int, stacked: int, sym: bool
) -> QuantizedArray:
    """``kernel`` rounded to nearest on GPTQ's grid (what a layer whose Hessian cannot be
    factorised keeps)."""
    if not sym:
        return zero_point.quantize_asymmetric(kernel, group, stacked)
    mode, block = ("int4", group) if weight_bits == 4 else ("int8", None)
    return quantize(kernel, mode, block, stacked)
