"""Quantization: int8 and int4 weights (:class:`QuantizedArray`) and the int8 matmul.

Weights: symmetric abs-max, ``real ≈ values * scale``. int8 keeps one float32 scale per
index of the last axis (the output channel of a Flax kernel), abs-max over every other
axis. int4 cuts axis 0 (the input axis of a Flax kernel) into blocks of ``block_size``
rows (``-1``: one block, per channel), one scale per block and last-axis index; a block
size that does not divide axis 0 leaves the last block shorter (no padding is stored).
int4 values are stored as ``jnp.int4`` (XLA packs them two per byte and its GEMM fusions
read them natively); the packed ``uint8`` layout of earlier versions (row ``2i`` in the
low nibble) still loads and dequantizes.

Matmuls on quantized kernels (what the Linen and NNX glue run when a ``QuantizedArray``
kernel reaches a layer): :func:`weight_only_dot_general` reads the integer values
converted to the compute dtype, exact, and applies the per-channel scales to the result
(``(x @ convert(w)) * scale``: XLA fuses the convert into the GEMM, so the weight bytes
are the only weight bytes read); int4 in blocks runs a matmul per block and a scaled sum.
:func:`int8_weight_dot_general` (an int8 policy with int8 weights) quantizes the
activations per row and multiplies int8 by int8 with int32 accumulation.

Compute: :func:`int8_dot_general` is a drop-in ``jax.lax.dot_general`` that quantizes
each operand to int8 by abs-max over its own contracting dimensions (per row for
activations, per output channel for kernels), multiplies the integers exactly (a GEMM of
the compute dtype on them, float32 accumulation), and rescales by the product of the two
scales (itself computed with the
same dimension numbers, so any layout works: several contracting axes, batch axes). Its
gradient is straight-through: the gradient of the float matmul, so a float kernel keeps
training (quantization-aware training). :func:`int8_einsum` is ``jnp.einsum`` on it.

Nothing here knows Flax: the glue decides which module calls use these.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Callable, Mapping
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
    meta_fields=["mode", "block_size", "shape", "original_dtype", "stacked"],
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
        values: ``int8`` values (int8 mode) or ``int4`` values (int4 mode), of the
            kernel's shape (a ``uint8`` array of two int4 values per byte along axis 0,
            the layout of earlier versions, still loads).
        scale: float32; int8: shape ``(n,)`` for a last axis of ``n``; int4: shape
            ``(blocks, n)``.
        mode: ``"int8"`` or ``"int4"``.
        block_size: int4's rows per block (``-1``: per channel); ``None`` for int8.
        shape: the shape of the array it stands for.
        original_dtype: the dtype of the array it was quantized from.
        stacked: how many leading axes of ``shape`` are stacked layers (an ``nn.scan``,
            ``nnx.scan`` or vmapped layer stack, ``[depth, in, out]``): each layer is
            quantized on its own, its scales carry the leading axes (int8 ``(*lead,
            n)``, int4 ``(*lead, blocks, n)``) and int4 blocks are cut along the layer's
            own input axis. ``0`` (the default): one kernel.

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
    stacked: int = 0

    def __post_init__(self) -> None:
        _validate(self)

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
        """Bytes stored: the values (int4: half a byte each) and the scales."""
        bits = np.dtype(self.values.dtype).itemsize * 8
        if np.dtype(self.values.dtype) == np.dtype(jnp.int4):
            bits = 4
        return -(-int(self.values.size) * bits // 8) + int(
            self.scale.size * self.scale.dtype.itemsize
        )

    @property
    def packed(self) -> bool:
        """Whether the values are int4 packed two per ``uint8`` byte (the earlier layout,
        which loads and dequantizes but reaches no fast matmul: re-quantize it)."""
        return self.mode == "int4" and np.dtype(self.values.dtype) == np.dtype(np.uint8)

    def dequantize(self, dtype: Any = None) -> jax.Array:
        """The real values (``values * scale``, computed in float32) in ``dtype``.

        Args:
            dtype: the result's dtype; ``None`` is :attr:`original_dtype`.
        """
        dtype = self.original_dtype if dtype is None else dtype
        scale = jnp.asarray(self.scale, jnp.float32)
        lead, layer = self.shape[: self.stacked], self.shape[self.stacked :]
        if self.mode == "int8":
            scale = scale.reshape(*lead, *([1] * (len(layer) - 1)), layer[-1])
            real = jnp.asarray(self.values).astype(jnp.float32) * scale
        else:

            def one(values: jax.Array, s: jax.Array) -> jax.Array:
                return _int4_dequantize(values, s, self.block_size, layer)

            for _ in range(self.stacked):  # each stacked layer on its own
                one = jax.vmap(one)
            real = one(self.values, scale)
        return real.astype(dtype)

    def __jax_array__(self) -> jax.Array:
        raise TypeError(_NOT_AN_ARRAY)

    def __array__(self, *args: Any, **kwargs: Any) -> np.ndarray:
        raise TypeError(_NOT_AN_ARRAY)

    def __repr__(self) -> str:
        block = "" if self.block_size is None else f"/{self.block_size}"
        stacked = f", stacked={self.stacked}" if self.stacked else ""
        return (
            f"QuantizedArray({self.mode}{block}, shape={self.shape}, "
            f"original_dtype={np.dtype(self.original_dtype).name}{stacked})"
        )


def _concrete(x: Any) -> bool:
    """A concrete array, not a tracer, and not ``float0`` (the cotangent of integer values
    that ``jax.grad(..., allow_int=True)`` builds a QuantizedArray of)."""
    concrete = isinstance(x, np.ndarray) or (
        isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
    )
    return concrete and np.dtype(x.dtype) != np.dtype(jax.dtypes.float0)


def _validate(q: QuantizedArray) -> None:
    """The checks of a QuantizedArray's fields: the static ones always, the arrays when
    they are concrete (tree operations and transforms rebuild it from tracers and other
    leaves, which are left alone)."""
    if q.mode not in MODES:
        raise ValueError(f"`mode` must be one of {MODES}. Received: mode={q.mode!r}")
    block = q.block_size
    if q.mode == "int8" and block is not None:
        raise ValueError(f"`block_size` must be None for int8. Received: block_size={block!r}")
    if q.mode == "int4" and (
        isinstance(block, bool) or not isinstance(block, int) or block == 0 or block < -1
    ):
        raise ValueError(
            "`block_size` must be -1 (per channel) or a positive integer for int4. "
            f"Received: block_size={block!r}"
        )
    k = q.stacked
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(
            "`stacked` must be a non-negative int (the number of leading stacked-layer "
            f"axes). Received: stacked={k!r}"
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
    original: np.dtype | None = None
    if not isinstance(q.original_dtype, (jax.Array, np.ndarray, np.generic, bool, int, float)):
        try:
            original = np.dtype(q.original_dtype)
        except (TypeError, ValueError):
            original = None
    if original is None or not dt.is_floating(original):
        raise ValueError(
            "`original_dtype` must be a floating dtype (the kernel's). "
            f"Received: original_dtype={q.original_dtype!r}"
        )
    values, scale = q.values, q.scale
    if _concrete(values):
        allowed = ("int8",) if q.mode == "int8" else ("int4", "uint8")
        if np.dtype(values.dtype).name not in allowed:
            raise TypeError(
                f"`values` of a {q.mode} QuantizedArray must be of dtype {' or '.join(allowed)}. "
                f"Received: values of dtype {values.dtype}"
            )
        packed = np.dtype(values.dtype) == np.dtype(np.uint8)
        if packed and k:
            raise TypeError(
                "`values` of a stacked int4 QuantizedArray must be of dtype int4 (the packed "
                f"uint8 layout of earlier versions has no stacked form). Received: stacked={k!r} "
                "and values of dtype uint8"
            )
        want = ((q.shape[0] + 1) // 2, *q.shape[1:]) if packed else q.shape
        if tuple(values.shape) != want:
            raise ValueError(
                f"`values` must have shape {want} for a kernel of `shape` {q.shape}. "
                f"Received: values of shape {tuple(values.shape)} and shape={q.shape!r}"
            )
    elif not hasattr(values, "shape") and isinstance(
        values, (str, bytes, int, float, complex, list, tuple, dict)
    ):
        raise TypeError(f"`values` must be an integer array. Received: values={values!r}")
    if _concrete(scale):
        if not dt.is_floating(np.dtype(scale.dtype)):
            raise TypeError(
                f"`scale` must be a floating array. Received: scale of dtype {scale.dtype}"
            )
        n = q.shape[-1]
        lead = q.shape[:k]
        ok = (
            tuple(scale.shape) == (*lead, n)
            if q.mode == "int8"
            else (scale.ndim == k + 2 and tuple(scale.shape[:k]) == lead and scale.shape[-1] == n)
        )
        if not ok:
            prefix = "".join(f"{d}, " for d in lead)
            want_text = f"({prefix}{n})" if q.mode == "int8" else f"({prefix}blocks, {n})"
            raise ValueError(
                f"`scale` must have shape {want_text} for a {q.mode} kernel of `shape` "
                f"{q.shape}. Received: scale of shape {tuple(scale.shape)} and "
                f"shape={q.shape!r}"
            )
    elif isinstance(scale, (str, bytes, int, float, complex, list, tuple, dict)):
        raise TypeError(f"`scale` must be a floating array. Received: scale={scale!r}")


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
    """``amax / qmax`` over ``axes`` (1 where the amax is 0); NaN where the slice holds a
    non-finite value, so a NaN or inf in a kernel stays non-finite (its whole channel or
    block dequantizes to NaN) instead of silently becoming a finite number."""
    amax = jnp.max(jnp.abs(x), axis=axes, keepdims=True)
    scale = jnp.where(amax > 0, amax / qmax, jnp.ones_like(amax))
    return jnp.where(jnp.isfinite(amax), scale, jnp.nan)


def _round(x: jax.Array, scale: jax.Array, qmax: float) -> jax.Array:
    return jnp.clip(jnp.round(x / scale), -qmax, qmax)


def quantize(x: Any, mode: str, block_size: int | None = None, stacked: int = 0) -> QuantizedArray:
    """Quantizes one floating array of rank >= 2 (see the module docstring).

    Args:
        x: a floating array of rank >= 2 (``stacked`` + 2 with stacked axes).
        mode: ``"int8"`` or ``"int4"``.
        block_size: int4's rows per block along the layer's input axis (axis ``stacked``;
            ``-1`` or ``None``: per channel).
        stacked: the number of leading axes that stack layers (``[depth, in, out]``:
            1); each layer is quantized on its own.

    Raises:
        ValueError: another mode, a bad block size or ``stacked``, or an array whose
            layers have rank < 2.
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
    if isinstance(stacked, bool) or not isinstance(stacked, int) or stacked < 0:
        raise ValueError(
            "`stacked` must be a non-negative int (the number of leading stacked-layer "
            f"axes). Received: stacked={stacked!r}"
        )
    if x.ndim - stacked < 2:
        raise ValueError(
            "Each stacked layer must be of rank >= 2 (a kernel): with `stacked` leading "
            f"axes the array needs rank >= {stacked + 2}. Received: an array of shape "
            f"{tuple(x.shape)} and stacked={stacked!r}"
        )
    block: int | None = None
    if mode == "int4":
        block = -1 if block_size is None else block_size
        if isinstance(block, bool) or not isinstance(block, int) or block == 0 or block < -1:
            raise ValueError(
                "`block_size` must be -1 (per channel) or a positive integer. "
                f"Received: block_size={block_size!r}"
            )
    x32 = jnp.asarray(x).astype(jnp.float32)
    shape, dtype = tuple(x.shape), np.dtype(x.dtype)
    if x.size == 0:  # nothing to scale: zero-size values, scales of 1
        return _empty(shape, mode, block, dtype, stacked)
    one = functools.partial(_quantize_layer, mode=mode, block=block)
    for _ in range(stacked):  # each stacked layer on its own
        one = jax.vmap(one)
    values, scale = one(x32)
    return QuantizedArray(values, scale, mode, block, shape, dtype, stacked)


def _quantize_layer(x32: jax.Array, mode: str, block: int | None) -> tuple[jax.Array, jax.Array]:
    """The values and scale of one (unstacked) float32 kernel."""
    if mode == "int8":
        scale = _abs_max_scale(x32, tuple(range(x32.ndim - 1)), _INT8_MAX)
        return _round(x32, scale, _INT8_MAX).astype(jnp.int8), scale.reshape(-1)
    rows = x32.shape[0]
    size = rows if block == -1 else int(block)  # type: ignore[arg-type]
    blocks = -(-rows // size)
    xb = _blocked(x32, size, blocks)  # (blocks, size, ..., n)
    scale = _abs_max_scale(xb, tuple(range(1, xb.ndim - 1)), _INT4_MAX)
    q = _round(xb, scale, _INT4_MAX).astype(jnp.int4)
    q = q.reshape(blocks * size, *x32.shape[1:])[:rows]
    return q, scale.reshape(blocks, x32.shape[-1])


def _empty(
    shape: tuple[int, ...], mode: str, block: int | None, dtype: np.dtype, stacked: int = 0
) -> QuantizedArray:
    lead = shape[:stacked]
    if mode == "int8":
        return QuantizedArray(
            jnp.zeros(shape, jnp.int8), jnp.ones((*lead, shape[-1]), jnp.float32), "int8",
            None, shape, dtype, stacked,
        )  # fmt: skip
    rows = shape[stacked]
    blocks = 1 if block == -1 or rows == 0 else -(-rows // int(block))  # type: ignore[arg-type]
    return QuantizedArray(
        jnp.zeros(shape, jnp.int4), jnp.ones((*lead, blocks, shape[-1]), jnp.float32), "int4",
        block, shape, dtype, stacked,
    )  # fmt: skip


def _blocked(x: jax.Array, size: int, blocks: int) -> jax.Array:
    """``x`` with axis 0 padded to ``blocks * size`` rows and split into blocks."""
    pad = blocks * size - x.shape[0]
    if pad:
        x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
    return x.reshape(blocks, size, *x.shape[1:])


def pack_int4(q: Any) -> jax.Array:
    """int4 values in [-8, 7] to two per ``uint8`` byte along axis 0 (the layout of
    earlier versions; kept to read and write their checkpoints)."""
    q = jnp.asarray(q).astype(jnp.int8)
    if q.shape[0] % 2:
        q = jnp.pad(q, [(0, 1)] + [(0, 0)] * (q.ndim - 1))
    low = q[0::2].astype(jnp.uint8) & 0xF
    high = q[1::2].astype(jnp.uint8) & 0xF
    return low | (high << 4)


def _unpack(packed: jax.Array, rows: int) -> jax.Array:
    """The inverse of :func:`pack_int4`: int32 values of ``rows`` rows."""
    v = jnp.asarray(packed).astype(jnp.int32)
    nibbles = jnp.stack([v & 0xF, (v >> 4) & 0xF], axis=1)
    nibbles = jnp.where(nibbles >= 8, nibbles - 16, nibbles)
    return nibbles.reshape(-1, *packed.shape[1:])[:rows]


def _int4_dequantize(
    values: jax.Array, scale: jax.Array, block_size: int | None, shape: tuple[int, ...]
) -> jax.Array:
    rows = shape[0]
    if np.dtype(values.dtype) == np.dtype(np.uint8):  # the packed layout of earlier versions
        q = _unpack(values, rows).astype(jnp.float32)
    else:
        q = jnp.asarray(values).astype(jnp.float32)
    size = rows if block_size in (None, -1) else int(block_size)  # type: ignore[arg-type]
    blocks = scale.shape[0]
    qb = _blocked(q, size, blocks)
    scale = scale.reshape(blocks, *([1] * (len(shape) - 1)), shape[-1])
    return (qb * scale).reshape(blocks * size, *shape[1:])[:rows]


def stacked_axes_of(stacked_axes: Any) -> Callable[[str], int]:
    """``stacked_axes`` (``None``, an int, or a mapping from path regex to int, the first
    key that fully matches a leaf's path wins) as a function of a leaf's path.

    Raises:
        TypeError: ``stacked_axes`` is none of those, or a key is not a string.
        ValueError: a count is not a non-negative int, or a key is not a valid regex.
    """

    def count(n: Any, where: str) -> int:
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
            raise ValueError(
                "`stacked_axes` must give a non-negative int (the number of leading "
                f"stacked-layer axes of a kernel). Received: {where}"
            )
        return int(n)

    if stacked_axes is None:
        return lambda path: 0
    if isinstance(stacked_axes, (int, np.integer)) and not isinstance(stacked_axes, bool):
        n = count(stacked_axes, f"stacked_axes={stacked_axes!r}")
        return lambda path: n
    if not isinstance(stacked_axes, Mapping):
        raise TypeError(
            "`stacked_axes` must be None, an int, or a mapping from path regular expression "
            f"to int (such as {{'layers/.*': 1}}). Received: stacked_axes={stacked_axes!r}"
        )
    rules = []
    for key, n in stacked_axes.items():
        if not isinstance(key, str):
            raise TypeError(
                "The keys of `stacked_axes` must be path regular expressions (strings). "
                f"Received: key {key!r} in stacked_axes={stacked_axes!r}"
            )
        try:
            pattern = re.compile(key)
        except re.error as e:
            raise ValueError(
                f"The key {key!r} of `stacked_axes` is not a valid regular expression ({e})"
            ) from None
        rules.append((pattern, count(n, f"{n!r} for {key!r} in stacked_axes={stacked_axes!r}")))

    def of(path: str) -> int:
        for pattern, n in rules:
            if pattern.fullmatch(path):
                return n
        return 0

    return of


def quantizable_layers(x: Any, stacked: int) -> bool:
    """A quantizable array whose layers (after ``stacked`` leading axes) have rank >= 2:
    a stacked bias ``[depth, n]`` stays float."""
    return is_quantizable(x) and x.ndim - stacked >= 2


def quantize_tree(tree: Any, mode: str, block_size: int | None, stacked_axes: Any = None) -> Any:
    """Every quantizable leaf of ``tree`` quantized, with the leading stacked axes that
    ``stacked_axes`` gives its path; others (and QuantizedArrays) kept."""
    from jmp_policy._src.policy_map._trees import map_leaves  # a cycle at import time

    stacked_of = stacked_axes_of(stacked_axes)

    def leaf(module: str, name: str, x: Any) -> Any:
        k = stacked_of(f"{module}/{name}" if module else name)
        return quantize(x, mode, block_size, k) if quantizable_layers(x, k) else x

    return map_leaves(tree, leaf)


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
    scale = _abs_max_scale(x32, contracting, _INT8_MAX)
    return _round(x32, scale, _INT8_MAX), scale


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
