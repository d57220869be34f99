"""Quantization: int8 and int4 weights (:class:`QuantizedArray`) and the int8 matmul.

Weights: symmetric abs-max, ``real ≈ values * scale``. int8 keeps one float32 scale per
index of the last axis (the output channel of a Flax kernel), abs-max over every other
axis. int4 cuts axis 0 (the input axis of a Flax kernel) into blocks of ``block_size``
rows (``-1``: one block, per channel), one scale per block and last-axis index; a block
size that does not divide axis 0 leaves the last block shorter (no padding is stored).
int4 values are stored as ``jnp.int4`` (XLA packs them two per byte and its GEMM fusions
read them natively); the packed ``uint8`` layout of earlier versions (row ``2i`` in the
low nibble) still loads and dequantizes.

The matmuls that read quantized values (int8 compute, and a ``QuantizedArray`` kernel
reaching its layer) are :mod:`jmp_policy._src.quantized_matmul`.

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
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jmp_policy._src import dtypes as dt
from jmp_policy._src.tree_paths import leaf_path

INT8_MAX = 127.0
INT4_MAX = 7.0
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


def abs_max_scale(x: jax.Array, axes: tuple[int, ...], qmax: float) -> jax.Array:
    """The symmetric scale ``amax / qmax`` over ``axes`` (1 where the amax is 0); NaN where the slice holds a
    non-finite value, so a NaN or inf in a kernel stays non-finite (its whole channel or
    block dequantizes to NaN) instead of silently becoming a finite number."""
    amax = jnp.max(jnp.abs(x), axis=axes, keepdims=True)
    scale = jnp.where(amax > 0, amax / qmax, jnp.ones_like(amax))
    return jnp.where(jnp.isfinite(amax), scale, jnp.nan)


def round_to_grid(x: jax.Array, scale: jax.Array, qmax: float) -> jax.Array:
    """``x / scale`` rounded and clipped to ``[-qmax, qmax]`` (float32 integers)."""
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
        scale = abs_max_scale(x32, tuple(range(x32.ndim - 1)), INT8_MAX)
        return round_to_grid(x32, scale, INT8_MAX).astype(jnp.int8), scale.reshape(-1)
    rows = x32.shape[0]
    size = rows if block == -1 else int(block)  # type: ignore[arg-type]
    blocks = -(-rows // size)
    xb = _blocked(x32, size, blocks)  # (blocks, size, ..., n)
    scale = abs_max_scale(xb, tuple(range(1, xb.ndim - 1)), INT4_MAX)
    q = round_to_grid(xb, scale, INT4_MAX).astype(jnp.int4)
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
        # The map's keys' own check: a pattern that could backtrack without bound is refused.
        from jmp_policy._src.policy_map._key_cost import compile_key  # imports nothing of ours

        try:
            pattern = compile_key(key)
        except ValueError as e:
            raise ValueError(f"The key {key!r} of `stacked_axes` is not accepted: {e}") from None
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
    stacked_of = stacked_axes_of(stacked_axes)

    def leaf(key_path: Any, x: Any) -> Any:
        k = stacked_of(leaf_path(key_path))
        return quantize(x, mode, block_size, k) if quantizable_layers(x, k) else x

    return jax.tree_util.tree_map_with_path(leaf, tree, is_leaf=is_quantized)


def dequantize_leaf(x: Any, dtype: Any) -> Any:
    """``x.dequantize(dtype)`` for a QuantizedArray, ``x`` otherwise."""
    return x.dequantize(dtype) if isinstance(x, QuantizedArray) else x
