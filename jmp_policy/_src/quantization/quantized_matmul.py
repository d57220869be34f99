"""Matmuls on int8 values: int8 compute, and int8 x int8 of int8 weights.

:func:`int8_dot_general` (int8 compute, quantization-aware training) quantizes both
operands to the int8 grid in the step, by abs-max over each one's own contracting
dimensions (per row for activations, per output channel for kernels), and multiplies them
exactly; its gradient is the float matmul's (straight-through), so a float kernel keeps
training. :func:`int8_weights_dot` is the
int8 x int8 GEMM of a layer whose int8 ``QuantizedArray`` kernel reaches it
(:mod:`jmp_policy._src.quantization.kernel_matmul` picks it).

Nothing here knows Flax: :mod:`jmp_policy._src.quantization.matmuls` picks the layers that run these.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jmp_policy._src import dtypes as dt
from jmp_policy._src.quantization.quantized_array import INT8_MAX, QuantizedArray
from jmp_policy._src.quantization.symmetric_grid import abs_max_scale, round_to_grid

# Captured at import: the Linen glue may route `jnp.einsum` here for a call.
JNP_EINSUM = jnp.einsum


# -- int8 compute ---------------------------------------------------------------------------

DimensionNumbers = tuple[
    tuple[tuple[int, ...], tuple[int, ...]], tuple[tuple[int, ...], tuple[int, ...]]
]


def normalize_dims(dimension_numbers: Any) -> DimensionNumbers:
    """``dot_general``'s dimension numbers as tuples of ints (hashable: a static argument)."""
    (lc, rc), (lb, rb) = dimension_numbers
    return (
        (tuple(int(i) for i in lc), tuple(int(i) for i in rc)),
        (tuple(int(i) for i in lb), tuple(int(i) for i in rb)),
    )


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
    rounding past that. XLA turns an int8 x int8 -> int32 GEMM made inside the step into a
    slow fusion, while a GEMM of the compute dtype on integer values runs at its usual
    speed.
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


def _quantize_operand(x: jax.Array, contracting: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    """``x`` quantized to int8 by abs-max over ``contracting``, and its scale."""
    grid, scale = _grid_operand(x, contracting)
    return grid.astype(jnp.int8), scale


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
    return _int8_dot(lhs, rhs, normalize_dims(dimension_numbers), out_dtype)  # type: ignore[no-any-return]


# -- int8 x int8 of int8 weights ---------------------------------------------------------


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
    if q.zero_point is not None:  # xq @ (wq - z) = xq @ wq - sum(xq) z, exact in int32
        sums = jnp.sum(xq.astype(jnp.int32), axis=lc)  # the lhs's free axes (no batch dims)
        sums = sums.reshape(*sums.shape, *([1] * (acc.ndim - sums.ndim)))
        acc = acc - sums * q.zero_point.astype(jnp.int32).reshape(-1)
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


def int8_weights_dot(lhs: jax.Array, q: QuantizedArray, dims: DimensionNumbers, out: Any) -> Any:
    """``lhs`` quantized per row times int8 weights ``q``: an int8 x int8 -> int32 GEMM in
    cuBLAS's layout, a zero point folded in int32 (``sum(xq) z`` per row and channel taken
    from the product), both scales applied to the result; the input's gradient is the float
    matmul's."""
    return _int8_weights_core(lhs, q, dims, np.dtype(out), tuple(lhs.shape))
