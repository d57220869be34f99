"""Quantization: int8 and int4 weights (:class:`QuantizedArray`) and the int8 matmul.

Weights: symmetric abs-max, ``real ≈ values * scale``. int8 keeps one float32 scale per
index of the last axis (the output channel of a Flax kernel), abs-max over every other
axis. int4 cuts axis 0 (the input axis of a Flax kernel) into blocks of ``block_size``
rows (``-1``: one block, per channel), one scale per block and last-axis index; a block
size that does not divide axis 0 leaves the last block shorter (no padding is stored).
int4 values are packed two per byte (``uint8``), so the stored bytes are what a
checkpoint or device holds.

Compute: :func:`int8_dot_general` is a drop-in ``jax.lax.dot_general`` that quantizes
each operand to int8 by abs-max over its own contracting dimensions (per row for
activations, per output channel for kernels), multiplies int8 by int8 with int32
accumulation, and rescales by the product of the two scales (itself computed with the
same dimension numbers, so any layout works: several contracting axes, batch axes). Its
gradient is straight-through: the gradient of the float matmul, so a float kernel keeps
training (quantization-aware training). :func:`int8_einsum` is ``jnp.einsum`` on it.

Nothing here knows Flax: the glue decides which module calls use these.
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

# Captured at import: the Linen glue may route `jnp.einsum` here for a call.
JNP_EINSUM = jnp.einsum
_INT8_MAX = 127.0
_INT4_MAX = 7.0
MODES = ("int8", "int4")


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["values", "scale"],
    meta_fields=["mode", "block_size", "shape", "original_dtype"],
)
@dataclasses.dataclass(frozen=True)
class QuantizedArray:
    """A quantized weight: integer ``values`` and float32 ``scale``, ``real ≈ values * scale``.

    A registered pytree: ``values`` and ``scale`` are its children, the rest is static
    metadata, so it crosses ``jit``, ``tree_map`` and checkpoints whole. Every tree walk
    of jmp_policy (``DTypePolicyMap.policy_tree``, ``cast_to_*``, ``explain``, the apply
    wrappers) treats it as one leaf at the kernel's path. ``cast_to_compute`` dequantizes
    it to the compute dtype; ``cast_to_variable`` keeps it quantized. It is not an array:
    give it to ``jnp`` and you get a ``TypeError`` that says to dequantize it first.
    Made by ``DTypePolicyMap.quantize`` and ``QuantizedDTypePolicy.quantize``.

    Attributes:
        values: ``int8`` values (int8 mode), or ``uint8`` holding two int4 values per byte
            along axis 0 (int4 mode: row ``2i`` in the low nibble, ``2i + 1`` in the high).
        scale: float32; int8: shape ``(n,)`` for a last axis of ``n``; int4: shape
            ``(blocks, n)``.
        mode: ``"int8"`` or ``"int4"``.
        block_size: int4's rows per block (``-1``: per channel); ``None`` for int8.
        shape: the shape of the array it stands for.
        original_dtype: the dtype of the array it was quantized from.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jmp_policy as jp
        >>> policy = jp.QuantizedDTypePolicy("int8", "mixed_bfloat16")
        >>> params = policy.quantize({"kernel": jnp.ones((64, 8)), "bias": jnp.ones(8)})
        >>> q = params["kernel"]
        >>> q.values.dtype, q.scale.shape, q.shape
        (dtype('int8'), (8,), (64, 8))
        >>> params["bias"].dtype  # rank-1 leaves stay float
        dtype('float32')
        >>> q.nbytes / (64 * 8 * 4)   # of float32's bytes
        0.265625
        >>> policy.cast_to_compute(params)["kernel"].dtype
        dtype(bfloat16)
        >>> q.dequantize().dtype
        dtype('float32')
    """

    values: jax.Array
    scale: jax.Array
    mode: str
    block_size: int | None
    shape: tuple[int, ...]
    original_dtype: np.dtype

    @property
    def ndim(self) -> int:
        """The rank of the array it stands for."""
        return len(self.shape)

    @property
    def size(self) -> int:
        """The number of elements of the array it stands for."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes stored: the values and the scales."""
        return int(self.values.size * self.values.dtype.itemsize) + int(
            self.scale.size * self.scale.dtype.itemsize
        )

    def dequantize(self, dtype: Any = None) -> jax.Array:
        """The real values (``values * scale``, computed in float32) in ``dtype``.

        Args:
            dtype: the result's dtype; ``None`` is :attr:`original_dtype`.
        """
        dtype = self.original_dtype if dtype is None else dtype
        scale = jnp.asarray(self.scale, jnp.float32)
        if self.mode == "int8":
            real = jnp.asarray(self.values).astype(jnp.float32) * scale
        else:
            real = _int4_dequantize(self.values, scale, self.block_size, self.shape)
        return real.astype(dtype)

    def __jax_array__(self) -> jax.Array:
        raise TypeError(_NOT_AN_ARRAY)

    def __array__(self, *args: Any, **kwargs: Any) -> np.ndarray:
        raise TypeError(_NOT_AN_ARRAY)

    def __repr__(self) -> str:
        block = "" if self.block_size is None else f"/{self.block_size}"
        return (
            f"QuantizedArray({self.mode}{block}, shape={self.shape}, "
            f"original_dtype={np.dtype(self.original_dtype).name})"
        )


_NOT_AN_ARRAY = (
    "A QuantizedArray is not an array: dequantize it first (`q.dequantize(dtype)`, or a "
    "policy's or map's `cast_to_compute`, which the apply wrappers run for you)."
)


def is_quantized(x: Any) -> bool:
    """Whether ``x`` is a :class:`QuantizedArray` (the ``is_leaf`` of every tree walk)."""
    return isinstance(x, QuantizedArray)


def is_quantizable(x: Any) -> bool:
    """A floating JAX or NumPy array of rank >= 2 (biases and norm scales stay float)."""
    return (
        isinstance(x, (jax.Array, np.ndarray)) and x.ndim >= 2 and dt.is_floating(np.dtype(x.dtype))
    )


def _abs_max_scale(x: jax.Array, axes: tuple[int, ...], qmax: float) -> jax.Array:
    amax = jnp.max(jnp.abs(x), axis=axes, keepdims=True)
    return jnp.where(amax > 0, amax / qmax, jnp.ones_like(amax))


def _round(x: jax.Array, scale: jax.Array, qmax: float) -> jax.Array:
    return jnp.clip(jnp.round(x / scale), -qmax, qmax)


def quantize(x: Any, mode: str, block_size: int | None = None) -> QuantizedArray:
    """Quantizes one floating array of rank >= 2 (see the module docstring).

    Args:
        x: a floating array of rank >= 2.
        mode: ``"int8"`` or ``"int4"``.
        block_size: int4's rows per block along axis 0 (``-1`` or ``None``: per channel).

    Raises:
        ValueError: another mode, a bad block size, or an array of rank < 2.
        TypeError: ``x`` is not a floating array.
    """
    if mode not in MODES:
        raise ValueError(f"`mode` must be one of {MODES}. Received: mode={mode!r}")
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
    x32 = jnp.asarray(x).astype(jnp.float32)
    if mode == "int8":
        scale = _abs_max_scale(x32, tuple(range(x.ndim - 1)), _INT8_MAX)
        values = _round(x32, scale, _INT8_MAX).astype(jnp.int8)
        return QuantizedArray(
            values, scale.reshape(-1), "int8", None, tuple(x.shape), np.dtype(x.dtype)
        )
    block = -1 if block_size is None else block_size
    if isinstance(block, bool) or not isinstance(block, int) or block == 0 or block < -1:
        raise ValueError(
            "`block_size` must be -1 (per channel) or a positive integer. "
            f"Received: block_size={block_size!r}"
        )
    rows = x.shape[0]
    size = rows if block == -1 else block
    blocks = -(-rows // size)
    xb = _blocked(x32, size, blocks)  # (blocks, size, ..., n)
    scale = _abs_max_scale(xb, tuple(range(1, xb.ndim - 1)), _INT4_MAX)
    q = _round(xb, scale, _INT4_MAX).astype(jnp.int8)
    q = q.reshape(blocks * size, *x.shape[1:])[:rows]
    scale = scale.reshape(blocks, x.shape[-1])
    return QuantizedArray(_pack(q), scale, "int4", block, tuple(x.shape), np.dtype(x.dtype))


def _blocked(x: jax.Array, size: int, blocks: int) -> jax.Array:
    """``x`` with axis 0 padded to ``blocks * size`` rows and split into blocks."""
    pad = blocks * size - x.shape[0]
    if pad:
        x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
    return x.reshape(blocks, size, *x.shape[1:])


def _pack(q: jax.Array) -> jax.Array:
    """int4 values in [-8, 7] (int8 array) to two per byte along axis 0."""
    if q.shape[0] % 2:
        q = jnp.pad(q, [(0, 1)] + [(0, 0)] * (q.ndim - 1))
    low = q[0::2].astype(jnp.uint8) & 0xF
    high = q[1::2].astype(jnp.uint8) & 0xF
    return low | (high << 4)


def _unpack(packed: jax.Array, rows: int) -> jax.Array:
    """The inverse of :func:`_pack`: int32 values of ``rows`` rows."""
    v = jnp.asarray(packed).astype(jnp.int32)
    nibbles = jnp.stack([v & 0xF, (v >> 4) & 0xF], axis=1)
    nibbles = jnp.where(nibbles >= 8, nibbles - 16, nibbles)
    return nibbles.reshape(-1, *packed.shape[1:])[:rows]


def _int4_dequantize(
    values: jax.Array, scale: jax.Array, block_size: int | None, shape: tuple[int, ...]
) -> jax.Array:
    rows = shape[0]
    q = _unpack(values, rows).astype(jnp.float32)
    size = rows if block_size in (None, -1) else int(block_size)  # type: ignore[arg-type]
    blocks = scale.shape[0]
    qb = _blocked(q, size, blocks)
    scale = scale.reshape(blocks, *([1] * (len(shape) - 1)), shape[-1])
    return (qb * scale).reshape(blocks * size, *shape[1:])[:rows]


def quantize_tree(tree: Any, mode: str, block_size: int | None) -> Any:
    """Every quantizable leaf of ``tree`` quantized; others (and QuantizedArrays) kept."""

    def leaf(x: Any) -> Any:
        return quantize(x, mode, block_size) if is_quantizable(x) else x

    return jax.tree.map(leaf, tree, is_leaf=is_quantized)


def dequantize_leaf(x: Any, dtype: Any) -> Any:
    """``x.dequantize(dtype)`` for a QuantizedArray, ``x`` otherwise."""
    return x.dequantize(dtype) if isinstance(x, QuantizedArray) else x


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
    scale = _abs_max_scale(x32, contracting, _INT8_MAX)
    return _round(x32, scale, _INT8_MAX).astype(jnp.int8), scale


def _int8_forward(
    lhs: jax.Array, rhs: jax.Array, dn: DimensionNumbers, out_dtype: np.dtype
) -> jax.Array:
    (lc, rc), _ = dn
    lq, ls = _quantize_operand(lhs, lc)
    rq, rs = _quantize_operand(rhs, rc)
    acc = jax.lax.dot_general(lq, rq, dn, preferred_element_type=jnp.int32)
    return (acc.astype(jnp.float32) * _output_scale(ls, rs, dn)).astype(out_dtype)


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
    """``jax.lax.dot_general`` on int8 operands with int32 accumulation, rescaled.

    Each operand is quantized by abs-max over its own contracting dimensions; the
    result comes back in ``preferred_element_type`` (when floating) or the operands'
    result type. The gradient is the float matmul's (straight-through). Non-floating
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
