"""The matmul of a layer whose ``QuantizedArray`` kernel reaches it whole.

:func:`quantized_kernel_dot_general` reads the quantized kernel itself: weight-only with
the per-channel scale applied to the result, int4 blocks as a matmul per block and a
scaled sum, or int8 x int8 (an int8 policy with int8 weights, at enough rows) in cuBLAS's
int8 GEMM layout (:func:`jmp_policy._src.quantization.quantized_matmul.int8_weights_dot`);
on a GPU at few rows, when the ``serving_kernel`` option asks for it, the library's Pallas
kernel (:mod:`jmp_policy._src.quantization.pallas_matmul`, chosen by
:mod:`jmp_policy._src.quantization.serving_kernels`).

Nothing here knows Flax: :mod:`jmp_policy._src.quantization.matmuls` picks the layers that run these.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jmp_policy._src import dtypes as dt
from jmp_policy._src.quantization import pallas_matmul, serving_kernels
from jmp_policy._src.quantization.quantized_array import QuantizedArray
from jmp_policy._src.quantization.quantized_matmul import (
    JNP_EINSUM,
    DimensionNumbers,
    int8_weights_dot,
    normalize_dims,
)
from jmp_policy._src.quantization.quantized_tree import replace
from jmp_policy._src.quantization.storage import storage_of

# Rows (the product of the input's free dimensions) from which an int8 policy's int8 x int8
# GEMM replaces the weight-only form: below, a matmul is bound by the weight bytes it reads
# and the weight-only form reads the same int8 bytes without quantizing the activations.
INT8_GEMM_MIN_ROWS = 128

# Rows from which an int4 kernel in blocks is dequantized to the compute dtype (values times
# scales in float32, then cast) and multiplied by one GEMM, instead of one matmul per block
# and a scaled sum. Measured on one H200 (jax 0.11.2, 2026-11-26; 8 layers of 8192 x 8192,
# blocks of 128, `benchmarks/int4_block_forms.py`), bf16's time over each form's:
#   rows                    1     16     32     64    128    256
#   a matmul per block   1.02   0.85   0.67   0.56   0.30   0.19-0.23
#   dequantized GEMM     0.46   0.45   0.49   0.56   0.52   0.55-0.63
# The dequantized form writes a compute-dtype copy of the kernel first (a fixed cost); the
# per-block form's cost grows with the rows and passes it between 32 and 64 rows (level at
# 64 within noise).
INT4_BLOCKS_MAX_ROWS = 64
DEQUANTIZED_FORMS = ("dequantized", "dequantized, one GEMM")
PALLAS_FORM = "Pallas kernel (weight-only, split-K)"


def _per_channel(q: QuantizedArray) -> bool:
    return not storage_of(q.mode).blocked or q.block_size in (None, -1) or q.scale.shape[0] == 1


def _block(q: QuantizedArray) -> int | None:
    """int4's rows per block, ``None`` per channel (one block of scales included)."""
    return None if _per_channel(q) else q.block_size


def kernel_form(q: QuantizedArray, dims: Any, rows: int, int8_compute: bool) -> str:
    """The matmul a ``QuantizedArray`` kernel (the right operand) runs, by its layout and
    the rows of the input: ``"int8 x int8"``, :data:`PALLAS_FORM` (a 2-D kernel, where
    :func:`jmp_policy._src.quantization.serving_kernels.pallas_rows` allows),
    ``"weight-only, scale after"``, ``"int4 blocks"``, ``"dequantized, one GEMM"`` (int4
    blocks from :data:`INT4_BLOCKS_MAX_ROWS` rows) or ``"dequantized"`` (a layout no fast
    form covers)."""
    (lc, rc), (lb, rb) = normalize_dims(dims)
    last_free = q.ndim - 1 not in rc and q.ndim - 1 not in rb
    kind = storage_of(q.mode)
    if q.packed or q.stacked or lb or rb or not last_free or kind.has_zero_point:
        return "dequantized"
    if not q.reads_as_stored:
        return "dequantized"  # an AWQ kernel outside its scheme's matmul (which divides x)
    # A zero point is folded into every fast form after its product.
    if int8_compute and kind.integer_gemm and rows >= INT8_GEMM_MIN_ROWS:
        return "int8 x int8"
    if (
        q.ndim == 2
        and rc == (0,)
        and len(lc) == 1
        and rows <= serving_kernels.pallas_rows()
        and pallas_matmul.supports(q.values, _block(q), rows)
    ):
        return PALLAS_FORM
    if _per_channel(q):
        return "weight-only, scale after"
    if q.ndim == 2 and rc == (0,) and len(lc) == 1:
        return "int4 blocks" if rows < INT4_BLOCKS_MAX_ROWS else "dequantized, one GEMM"
    return "dequantized"


def zero_point_of(q: QuantizedArray) -> jax.Array | None:
    """The zero point of ``q``'s groups (``real = (values - zero_point) * scale``), or
    ``None`` for symmetric storage."""
    return q.zero_point


def _rows(lhs: jax.Array, dims: DimensionNumbers) -> int:
    (lc, _), (lb, _) = dims
    return int(np.prod([d for i, d in enumerate(lhs.shape) if i not in lc and i not in lb]))


def _scaled(y: jax.Array, scale: jax.Array, out: np.dtype) -> jax.Array:
    """``y`` times per-channel ``scale`` (its last axis), in float32, then ``out``."""
    return (y.astype(jnp.float32) * scale.reshape(-1)).astype(out)


def quantized_kernel_dot_general(
    q: QuantizedArray, int8_compute: bool = False, record: Any = None
) -> Any:
    """A drop-in ``jax.lax.dot_general`` whose right operand is ``q``'s kernel.

    The operand it is handed (the layer's kernel as Flax saw it: ``q``'s values in the
    compute dtype, unscaled) only gives the shape; the matmul reads ``q`` itself:

    * ``"weight-only, scale after"`` (int8, int4 per channel): ``(x @ convert(values)) *
      scale``, the integer values exact in the compute dtype, the scale applied to the
      float32 result;
    * :data:`PALLAS_FORM` (a 2-D kernel at few rows on a GPU, when the ``serving_kernel``
      option asks for it): the library's Pallas kernel reads the integer weights and
      applies the scales itself (zero points: ``Σ_b sum(x_b) z_b s_b`` taken from its
      float32 result);
    * ``"int4 blocks"`` (a 2-D kernel, fewer than :data:`INT4_BLOCKS_MAX_ROWS` rows): one
      matmul per block of rows and a scaled sum;
    * ``"dequantized, one GEMM"`` (the same kernel from :data:`INT4_BLOCKS_MAX_ROWS` rows):
      the kernel dequantized to the compute dtype, then one matmul (faster there on a GPU);
    * ``"int8 x int8"`` (``int8_compute`` and at least :data:`INT8_GEMM_MIN_ROWS` rows):
      the input quantized per row, ``dot_general(int8, int8) -> int32`` contracting the
      last dimension of both (the layout cuBLAS's int8 GEMM takes), both scales applied to
      the result; its gradient with respect to the input is the float matmul's;
    * ``"dequantized"``: any other layout, the kernel dequantized to the compute dtype.

    ``record(form)``, when given, is told the form at trace time (for ``explain``).
    """

    # The signature of `jax.lax.dot_general` (what Flax and `jnp.einsum` call); other
    # keywords have no meaning for a quantized kernel and are dropped.
    def dot_general(
        lhs: Any, rhs: Any, dimension_numbers: Any, precision: Any = None,
        preferred_element_type: Any = None, **_: Any,
    ) -> jax.Array:  # fmt: skip
        lhs = jnp.asarray(lhs)
        dims = normalize_dims(dimension_numbers)
        compute = np.dtype(getattr(rhs, "dtype", lhs.dtype))
        if not dt.is_floating(compute):
            compute = np.dtype(lhs.dtype)
        out = np.dtype(preferred_element_type or jnp.result_type(lhs.dtype, compute))
        shape = tuple(getattr(rhs, "shape", q.shape))
        kernel = _as_called(q, shape)
        rows = _rows(lhs, dims)
        form = "dequantized" if kernel is None else kernel_form(kernel, dims, rows, int8_compute)
        if record is not None:
            folded = kernel is not None and zero_point_of(kernel) is not None
            fast = form not in (*DEQUANTIZED_FORMS, "dequantized")
            record(f"{form}, zero point folded" if folded and fast else form)
        if kernel is None:  # reshaped by its layer, in a layout no fast form covers
            w = q.dequantize(compute).reshape(shape)
        elif form in DEQUANTIZED_FORMS:
            w = kernel.dequantize(compute)
        else:
            return _fast(form, lhs, kernel, dims, compute, out, precision, rows)
        return jax.lax.dot_general(
            lhs.astype(compute), w, dims, precision=precision, preferred_element_type=out
        )

    return dot_general


def _as_called(q: QuantizedArray, shape: tuple[int, ...]) -> QuantizedArray | None:
    """``q`` in the ``shape`` its layer handed the matmul: a layer may reshape its kernel
    before the matmul (Flax's DenseGeneral). ``None``: a reshape only dequantizing covers."""
    if shape == q.shape:
        return q
    if math.prod(shape) != q.size or shape[-1:] != q.shape[-1:]:
        raise ValueError(
            f"A quantized kernel of shape {q.shape} reached a matmul as shape "
            f"{shape}: run the model through jmp_policy's apply wrappers, which "
            "pass quantized kernels whole."
        )
    if q.stacked or not _per_channel(q) or not q.reads_as_stored:
        return None
    return replace(q, values=q.values.reshape(shape), shape=shape)


def _fast(
    form: str,
    lhs: jax.Array,
    kernel: QuantizedArray,
    dims: DimensionNumbers,
    compute: np.dtype,
    out: np.dtype,
    precision: Any,
    rows: int,
) -> jax.Array:
    """The matmul of a fast ``form`` (:func:`kernel_form`) on ``kernel``; ``rows``: the
    product of ``lhs``'s free dimensions."""
    if form == PALLAS_FORM:  # one contracted axis, moved last; the free ones lead the result
        (lc, _), _ = dims
        x = jnp.moveaxis(lhs.astype(compute), lc[0], -1)
        x2 = x.reshape(rows, x.shape[-1])
        folded = zero_point_of(kernel) is not None
        y = pallas_matmul.weight_only_matmul(
            x2, kernel.values, kernel.scale, _block(kernel), jnp.float32 if folded else out,
            interpret=serving_kernels.interpret(),
        )  # fmt: skip
        if folded:
            y = (y - _zero_term(x2, kernel)).astype(out)
        return y.reshape(*x.shape[:-1], kernel.shape[1])
    if form == "weight-only, scale after":
        x = lhs.astype(compute)
        (lc, _), _ = dims
        free = [i for i in range(x.ndim) if i not in lc]  # this form has no batch dims
        # A single row is multiplied as two (a zero row added, then dropped), as in
        # `_int4_blocks`: for one row and a float32 result XLA's GPU compiler converts both
        # operands to float32 (an f32 GEMM reading the integer weights); two rows keep the
        # compute-dtype GEMM with float32 accumulation (compiled for an H100).
        one_row = rows == 1 and bool(free)
        if one_row:
            x = jnp.concatenate([x, jnp.zeros_like(x)], axis=free[0])
        y = jax.lax.dot_general(
            x, kernel.values.astype(compute), dims, precision=precision,
            preferred_element_type=jnp.float32,
        )  # fmt: skip
        if one_row:  # the lhs's free axes lead the result (no batch dims)
            y = jax.lax.slice_in_dim(y, 0, 1, axis=0)
        zero = zero_point_of(kernel)
        if zero is not None:  # x @ (q - z) = x @ q - sum(x) z, per output channel
            sums = jnp.sum(lhs.astype(compute).astype(jnp.float32), axis=lc)  # lhs free axes
            sums = sums.reshape(*sums.shape, *([1] * (y.ndim - sums.ndim)))
            y = y - sums * zero.reshape(-1).astype(jnp.float32)
        return _scaled(y, kernel.scale, out)
    if form == "int4 blocks":
        return _int4_blocks(lhs.astype(compute), kernel, out)
    return int8_weights_dot(lhs, kernel, dims, out)  # type: ignore[no-any-return]


def _zero_term(x2: jax.Array, q: QuantizedArray) -> jax.Array:
    """What a 2-D kernel's zero points take from ``x2 @ (values * scale)`` (float32, ``[rows,
    out]``): ``Σ_b sum(x_b) z_b s_b`` over its blocks of rows (one per channel), from ``x2``'s
    block sums and the ``[blocks, out]`` products ``z s``, with no copy of the weights."""
    n = q.shape[-1]
    zs = (jnp.asarray(q.zero_point, jnp.float32) * q.scale).reshape(-1, n)
    x32 = x2.astype(jnp.float32)
    block = _block(q)
    if block is None:
        return jnp.sum(x32, axis=1, keepdims=True) * zs
    blocks = zs.shape[0]
    x32 = jnp.pad(x32, ((0, 0), (0, blocks * block - x32.shape[1])))
    sums = jnp.sum(x32.reshape(x32.shape[0], blocks, block), axis=2)
    return jnp.matmul(sums, zs, precision=jax.lax.Precision.HIGHEST)


def _int4_blocks(x: jax.Array, q: QuantizedArray, out: np.dtype) -> jax.Array:
    """``x @ kernel`` for an int4 kernel of blocks of rows: a matmul per block (batched
    over blocks), then the sum of the blocks' results times their scales.

    A single row is multiplied as two (a zero row added, then dropped): XLA's GPU compiler
    turns a batched matrix-vector product into a multiply and a reduction, and the multiply
    writes a float32 array of the kernel's size; two rows keep the GEMM, which reads the
    int4 weights inside its fusion."""
    rows, n = q.shape
    blocks = q.scale.shape[0]
    size = int(q.block_size)  # type: ignore[arg-type]  # the last block may be shorter
    pad = blocks * size - rows
    lead = x.shape[:-1]
    x2 = x.reshape(-1, rows)
    m = x2.shape[0]
    values = q.values
    if pad:
        x2 = jnp.pad(x2, ((0, 0), (0, pad)))
        values = jnp.pad(values, ((0, pad), (0, 0)))
    if m == 1:
        x2 = jnp.pad(x2, ((0, 1), (0, 0)))
    xb = x2.reshape(x2.shape[0], blocks, size)
    wb = values.reshape(blocks, size, n).astype(x.dtype)
    part = jax.lax.dot_general(
        xb, wb, (((2,), (1,)), ((1,), (0,))), preferred_element_type=jnp.float32
    )  # (blocks, m, n)
    zero = zero_point_of(q)
    if zero is not None:  # x_b @ (q_b - z_b) = x_b @ q_b - sum(x_b) z_b: elementwise, no GEMM
        sums = jnp.sum(xb.astype(jnp.float32), axis=2).T  # (blocks, m)
        part = part - sums[:, :, None] * zero.astype(jnp.float32)[:, None, :]
    y = JNP_EINSUM("bmn,bn->mn", part, q.scale)  # not the glue's routed jnp.einsum
    return y[:m].astype(out).reshape(*lead, n)
