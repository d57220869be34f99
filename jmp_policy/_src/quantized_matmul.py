"""Matmuls on int8 values: int8 compute, and quantized kernels that reach their layer.

:func:`int8_dot_general` (int8 compute, quantization-aware training) quantizes both
operands to the int8 grid in the step and multiplies them exactly; its gradient is the
float matmul's. :func:`quantized_kernel_dot_general` is the matmul of a layer whose
``QuantizedArray`` kernel reaches it whole: weight-only with the per-channel scale
applied to the result, int4 blocks as a matmul per block and a scaled sum, or int8 x int8
(an int8 policy with int8 weights, at enough rows) in cuBLAS's int8 GEMM layout.

Nothing here knows Flax: :mod:`jmp_policy._src.matmuls` picks the layers that run these.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jmp_policy._src import dtypes as dt
from jmp_policy._src.quantization import (
    INT8_MAX,
    QuantizedArray,
    abs_max_scale,
    round_to_grid,
)

# Captured at import: the Linen glue may route `jnp.einsum` here for a call.
JNP_EINSUM = jnp.einsum


# -- int8 compute ---------------------------------------------------------------------------

DimensionNumbers = tuple[
    tuple[tuple[int, ...], tuple[int, ...]], tuple[tuple[int, ...], tuple[int, ...]]
]


def _normalize(dimension_numbers: Any) -> DimensionNumbers:
    (lc, rc), (lb, rb) = dimension_numbers
    return (
        (tuple(int(i) for i in lc), tuple(int(i) for i in rc)),
        (tuple(int(i) for i in lb), tuple(int(i) for i in rb)),
    )


def _quantize_operand(x: jax.Array, contracting: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    x32 = x.astype(jnp.float32)
    scale = abs_max_scale(x32, contracting, INT8_MAX)
    return round_to_grid(x32, scale, INT8_MAX).astype(jnp.int8), scale


# The name scope of an int8 matmul (its equations in a jaxpr, its ops in a profile).
INT8_SCOPE = "int8_matmul"


def _int8_forward(
    lhs: jax.Array, rhs: jax.Array, dn: DimensionNumbers, out_dtype: np.dtype
) -> jax.Array:
    """Both operands on the int8 grid, multiplied exactly.

    The integers (|q| <= 127) are exact in bfloat16 and their products in float32, so the
    matmul runs as a GEMM of the compute dtype (bfloat16 for a bfloat16 result, float32
    otherwise) with float32 accumulation, the scales applied to the result: the int32
    product exactly while the sums stay below 2**24 (K <= 1040 at worst), float32
    rounding past that. An int8 x int8 -> int32 GEMM made inside the step is what XLA
    turns into a slow Triton fusion (0.40x bf16 on an H100), while a GEMM of the compute
    dtype on integer values runs at its usual speed (fake quantization: 1.09x bf16's
    step, ``../shared/gpu/README.md``).
    """
    (lc, rc), _ = dn
    gemm = np.dtype(jnp.bfloat16) if out_dtype == np.dtype(jnp.bfloat16) else np.dtype(jnp.float32)
    with jax.named_scope(INT8_SCOPE):
        lq, ls = _grid_operand(lhs, lc)
        rq, rs = _grid_operand(rhs, rc)
        acc = jax.lax.dot_general(
            lq.astype(gemm), rq.astype(gemm), dn, preferred_element_type=jnp.float32
        )
        return (acc * _output_scale(ls, rs, dn)).astype(out_dtype)


def _grid_operand(x: jax.Array, contracting: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    """``x`` rounded to the int8 grid (float32 integers in [-127, 127]) and its scale."""
    x32 = x.astype(jnp.float32)
    scale = abs_max_scale(x32, contracting, INT8_MAX)
    return round_to_grid(x32, scale, INT8_MAX), scale


def _output_scale(ls: jax.Array, rs: jax.Array, dn: DimensionNumbers) -> jax.Array:
    """The product of the operands' scales in ``dot_general``'s output layout (batch axes,
    then the lhs's free axes, then the rhs's), by broadcasting: no second matmul."""
    (lc, rc), (lb, rb) = dn

    def layout(s: jax.Array, contracting: tuple[int, ...], batch: tuple[int, ...]) -> jax.Array:
        free = tuple(i for i in range(s.ndim) if i not in contracting and i not in batch)
        moved = jnp.transpose(s, batch + free + contracting)
        return moved.reshape(moved.shape[: len(batch) + len(free)])

    left, right = layout(ls, lc, lb), layout(rs, rc, rb)
    n_batch = len(lb)
    n_left, n_right = left.ndim - n_batch, right.ndim - n_batch
    left = left.reshape(left.shape + (1,) * n_right)
    right = right.reshape(right.shape[:n_batch] + (1,) * n_left + right.shape[n_batch:])
    return left * right


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _int8_dot(lhs: jax.Array, rhs: jax.Array, dn: DimensionNumbers, out_dtype: np.dtype) -> Any:
    return _int8_forward(lhs, rhs, dn, out_dtype)


def _int8_dot_fwd(lhs: jax.Array, rhs: jax.Array, dn: DimensionNumbers, out_dtype: np.dtype) -> Any:
    return _int8_forward(lhs, rhs, dn, out_dtype), (lhs, rhs)


def _int8_dot_bwd(dn: DimensionNumbers, out_dtype: np.dtype, res: Any, g: jax.Array) -> Any:
    lhs, rhs = res
    g = g.astype(out_dtype)

    def float_dot(a: jax.Array, b: jax.Array) -> jax.Array:
        return jax.lax.dot_general(a, b, dn, preferred_element_type=out_dtype)

    # The transposes alone (`jax.vjp` would also trace the unused float forward matmul).
    like = jax.ShapeDtypeStruct
    (g_lhs,) = jax.linear_transpose(lambda a: float_dot(a, rhs), like(lhs.shape, lhs.dtype))(g)
    (g_rhs,) = jax.linear_transpose(lambda b: float_dot(lhs, b), like(rhs.shape, rhs.dtype))(g)
    return g_lhs, g_rhs


_int8_dot.defvjp(_int8_dot_fwd, _int8_dot_bwd)


def int8_dot_general(
    lhs: Any,
    rhs: Any,
    dimension_numbers: Any,
    precision: Any = None,
    preferred_element_type: Any = None,
    **kwargs: Any,
) -> jax.Array:
    """``jax.lax.dot_general`` of both operands quantized to int8, multiplied exactly.

    Each operand is quantized by abs-max over its own contracting dimensions (per row for
    activations, per output channel for kernels); the integer products are exact and the
    matmul runs as a GEMM of the compute dtype on those integers with float32 accumulation
    (see ``_int8_forward``: the fast form on GPUs, the same values as int32 accumulation
    while the sums stay below 2**24), under the name scope ``"int8_matmul"``. The result
    comes back in ``preferred_element_type`` (when floating) or the operands' result
    type. The gradient is the float matmul's (straight-through). Non-floating
    operands, or an integer ``preferred_element_type``, go to ``jax.lax.dot_general``
    unchanged. ``precision`` has no meaning for int8 and is ignored.
    """
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    floating = dt.is_floating(np.dtype(lhs.dtype)) and dt.is_floating(np.dtype(rhs.dtype))
    if preferred_element_type is not None:
        out_dtype = np.dtype(preferred_element_type)
    else:
        out_dtype = np.dtype(jnp.result_type(lhs, rhs))
    if not floating or not dt.is_floating(out_dtype):
        return jax.lax.dot_general(
            lhs,
            rhs,
            dimension_numbers,
            precision=precision,
            preferred_element_type=preferred_element_type,
            **kwargs,
        )
    return _int8_dot(lhs, rhs, _normalize(dimension_numbers), out_dtype)  # type: ignore[no-any-return]


def int8_einsum(subscripts: str, /, *operands: Any, **kwargs: Any) -> jax.Array:
    """``jnp.einsum`` whose contractions run through :func:`int8_dot_general`.

    Uses ``jnp.einsum``'s ``_dot_general`` argument (private to JAX, the route its own
    AQT integration takes); ``out_sharding=None`` is dropped.
    """
    if kwargs.get("out_sharding", 0) is None:
        kwargs.pop("out_sharding")
    return JNP_EINSUM(subscripts, *operands, _dot_general=int8_dot_general, **kwargs)  # type: ignore[no-any-return]


def is_int8(policy: Any) -> bool:
    """Whether ``policy`` asks for int8 compute (an int8 quantized policy)."""
    return getattr(policy, "quantization_mode", None) == "int8"


# -- matmuls on quantized kernels -----------------------------------------------------------

# Rows (the product of the input's free dimensions) from which an int8 policy's int8 x int8
# GEMM replaces the weight-only form: below, a matmul is bound by the weight bytes it reads
# and the weight-only form reads the same int8 bytes without quantizing the activations.
INT8_GEMM_MIN_ROWS = 128


def _per_channel(q: QuantizedArray) -> bool:
    return q.mode == "int8" or q.block_size in (None, -1) or q.scale.shape[0] == 1


def kernel_form(q: QuantizedArray, dims: Any, rows: int, int8_compute: bool) -> str:
    """The matmul a ``QuantizedArray`` kernel (the right operand) runs, by its layout and
    the rows of the input: ``"int8 x int8"``, ``"weight-only, scale after"``,
    ``"int4 blocks"`` or ``"dequantized"`` (a layout no fast form covers)."""
    (lc, rc), (lb, rb) = _normalize(dims)
    last_free = q.ndim - 1 not in rc and q.ndim - 1 not in rb
    if q.packed or q.stacked or lb or rb or not last_free:
        return "dequantized"
    if int8_compute and q.mode == "int8" and rows >= INT8_GEMM_MIN_ROWS:
        return "int8 x int8"
    if _per_channel(q):
        return "weight-only, scale after"
    if q.ndim == 2 and rc == (0,) and len(lc) == 1:
        return "int4 blocks"
    return "dequantized"


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
    * ``"int4 blocks"`` (a 2-D kernel): one matmul per block of rows and a scaled sum;
    * ``"int8 x int8"`` (``int8_compute`` and at least :data:`INT8_GEMM_MIN_ROWS` rows):
      the input quantized per row, ``dot_general(int8, int8) -> int32`` contracting the
      last dimension of both (the layout cuBLAS's int8 GEMM takes), both scales applied to
      the result; its gradient with respect to the input is the float matmul's;
    * ``"dequantized"``: any other layout, the kernel dequantized to the compute dtype.

    ``record(form)``, when given, is told the form at trace time (for ``explain``).
    """

    def dot_general(
        lhs: Any,
        rhs: Any,
        dimension_numbers: Any,
        precision: Any = None,
        preferred_element_type: Any = None,
        **kwargs: Any,
    ) -> jax.Array:
        lhs = jnp.asarray(lhs)
        dims = _normalize(dimension_numbers)
        compute = np.dtype(getattr(rhs, "dtype", lhs.dtype))
        if not dt.is_floating(compute):
            compute = np.dtype(lhs.dtype)
        out = np.dtype(preferred_element_type or jnp.result_type(lhs.dtype, compute))
        kernel = q
        shape = tuple(getattr(rhs, "shape", q.shape))
        if shape != q.shape:
            # A layer that reshapes its kernel before the matmul (Flax's DenseGeneral).
            if math.prod(shape) != q.size or shape[-1:] != q.shape[-1:]:
                raise ValueError(
                    f"A quantized kernel of shape {q.shape} reached a matmul as shape "
                    f"{shape}: run the model through jmp_policy's apply wrappers, which "
                    "pass quantized kernels whole."
                )
            if q.stacked or not _per_channel(q):
                if record is not None:
                    record("dequantized")
                w = q.dequantize(compute).reshape(shape)
                return jax.lax.dot_general(
                    lhs.astype(compute), w, dims, precision=precision, preferred_element_type=out
                )
            kernel = dataclasses.replace(q, values=q.values.reshape(shape), shape=shape)
        form = kernel_form(kernel, dims, _rows(lhs, dims), int8_compute)
        if record is not None:
            record(form)
        if form == "weight-only, scale after":
            y = jax.lax.dot_general(
                lhs.astype(compute), kernel.values.astype(compute), dims, precision=precision,
                preferred_element_type=jnp.float32,
            )  # fmt: skip
            return _scaled(y, kernel.scale, out)
        if form == "int4 blocks":
            return _int4_blocks(lhs.astype(compute), kernel, out)
        if form == "int8 x int8":
            return _int8_weights(lhs, kernel, dims, out)  # type: ignore[no-any-return]
        w = kernel.dequantize(compute)
        return jax.lax.dot_general(
            lhs.astype(compute), w, dims, precision=precision, preferred_element_type=out
        )

    return dot_general


def _int4_blocks(x: jax.Array, q: QuantizedArray, out: np.dtype) -> jax.Array:
    """``x @ kernel`` for an int4 kernel of blocks of rows: a matmul per block (batched
    over blocks), then the sum of the blocks' results times their scales."""
    rows, n = q.shape
    blocks = q.scale.shape[0]
    size = -(-rows // blocks)
    pad = blocks * size - rows
    lead = x.shape[:-1]
    x2 = x.reshape(-1, rows)
    values = q.values
    if pad:
        x2 = jnp.pad(x2, ((0, 0), (0, pad)))
        values = jnp.pad(values, ((0, pad), (0, 0)))
    xb = x2.reshape(x2.shape[0], blocks, size)
    wb = values.reshape(blocks, size, n).astype(x.dtype)
    part = jax.lax.dot_general(
        xb, wb, (((2,), (1,)), ((1,), (0,))), preferred_element_type=jnp.float32
    )  # (blocks, m, n)
    y = JNP_EINSUM("bmn,bn->mn", part, q.scale)  # not the glue's routed jnp.einsum
    return y.astype(out).reshape(*lead, n)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _int8_weights_core(
    lhs: jax.Array, q: QuantizedArray, dims: DimensionNumbers, out: np.dtype, _: Any
) -> jax.Array:
    (lc, rc), _b = dims
    xq, xs = _quantize_operand(lhs, lc)
    # The kernel with its contracting axes last: "contract the last dimension of both",
    # the layout cuBLAS's int8 GEMM takes.
    free = tuple(i for i in range(q.ndim) if i not in rc)
    w = jnp.transpose(q.values, free + rc)
    k = len(rc)
    dims_t = ((lc, tuple(range(w.ndim - k, w.ndim))), ((), ()))
    xq = jax.lax.optimization_barrier(xq)
    acc = jax.lax.optimization_barrier(
        jax.lax.dot_general(xq, w, dims_t, preferred_element_type=jnp.int32)
    )
    x_scale = _output_scale(xs, jnp.ones((1,) * q.ndim, jnp.float32), dims)
    return (acc.astype(jnp.float32) * x_scale * q.scale.reshape(-1)).astype(out)


def _int8_weights_fwd(lhs: Any, q: Any, dims: Any, out: Any, _: Any) -> Any:
    return _int8_weights_core(lhs, q, dims, out, _), q


def _int8_weights_bwd(dims: Any, out: Any, _: Any, q: Any, g: jax.Array) -> Any:
    w = q.dequantize(g.dtype)
    zeros = jax.ShapeDtypeStruct(_, g.dtype)
    (g_lhs,) = jax.linear_transpose(
        lambda a: jax.lax.dot_general(a, w, dims, preferred_element_type=g.dtype), zeros
    )(g)
    return g_lhs, jax.tree.map(jnp.zeros_like, q)


_int8_weights_core.defvjp(_int8_weights_fwd, _int8_weights_bwd)


def _int8_weights(lhs: jax.Array, q: QuantizedArray, dims: DimensionNumbers, out: Any) -> Any:
    return _int8_weights_core(lhs, q, dims, np.dtype(out), tuple(lhs.shape))
