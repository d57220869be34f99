"""Quantization: int8 and int4 weights (:class:`QuantizedArray`).

Weights: symmetric abs-max, ``real ≈ values * scale``, on a grid of
:mod:`~jmp_policy._src.quantization.symmetric_grid` (int4's full range ``-8..7`` by
default). int8 keeps one float32 scale per index of the last axis (the output channel of a
Flax kernel), abs-max over every other axis. int4 cuts axis 0 (the input axis of a Flax kernel) into blocks of ``block_size``
rows (``-1``: one block, per channel), one scale per block and last-axis index; a block
size that does not divide axis 0 leaves the last block shorter (no padding is stored).
int4 values are stored as ``jnp.int4`` (XLA packs them two per byte and its GEMM fusions
read them natively); the packed ``uint8`` layout of earlier versions still loads
(:mod:`jmp_policy._src.quantization.int4_layout`).

The fields' checks are :mod:`jmp_policy._src.quantization.quantized_array_checks`; the matmuls that
read quantized values are :mod:`jmp_policy._src.quantization.quantized_matmul` (int8 compute) and
:mod:`jmp_policy._src.quantization.kernel_matmul` (a ``QuantizedArray`` kernel reaching its layer).
Nothing here knows Flax: the glue decides which module calls use these.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jmp_policy._src import dtypes as dt
from jmp_policy._src.quantization.int4_layout import blocked, dequantize_int4, zero_offset
from jmp_policy._src.quantization.quantized_array_checks import (
    check_array,
    int4_block,
    stack_from_front,
    stack_to_front,
    validate,
)
from jmp_policy._src.quantization.quantized_tree import equal, make, register, replace
from jmp_policy._src.quantization.storage import INT4, INT8, storage_of
from jmp_policy._src.quantization.symmetric_grid import SymmetricGrid
from jmp_policy._src.quantization.symmetric_grid import abs_max_scale as abs_max_scale
from jmp_policy._src.quantization.symmetric_grid import of as grid_of
from jmp_policy._src.quantization.symmetric_grid import round_to_grid as round_to_grid
from jmp_policy._src.state_pytree import register_with_flax_serialization

INT8_MAX = INT8.qmax
INT4_MAX = INT4.qmax


@register(("values", "scale", "zero_point"), optional=("zero_point",))
@dataclasses.dataclass(frozen=True, eq=False)
class QuantizedArray:
    """A quantized weight: integer ``values`` and float32 ``scale``, ``real ≈ values * scale``
    (``(values - zero_point) * scale`` with a zero point).

    A registered pytree: ``values``, ``scale`` and, where there is one, ``zero_point`` are
    its children (a symmetric array has no zero-point child), the rest is static
    metadata, so it crosses ``jit``, ``tree_map`` and checkpoints (orbax,
    ``flax.serialization``) whole. Its unflatten accepts any leaves and checks nothing (JAX's
    contract); ``shape`` and ``stacked`` follow the leaves, so ``vmap`` or ``scan`` that stack
    QuantizedArrays give a stacked one. Constructing one checks its fields (a NaN ``scale``
    is refused: only ``quantize`` marks a non-finite kernel so). ``==`` compares values
    (``True`` or ``False``; a bool array under ``jit``); like an array it is unhashable. Every tree walk
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
        mode: the storage (:mod:`jmp_policy._src.quantization.storage`): ``"int8"``
            (a scale per output channel) or ``"int4"`` (blocks of rows).
        block_size: int4's rows per block (``-1``: per channel); ``None`` for int8.
        shape: the shape of the array it stands for.
        original_dtype: the dtype of the array it was quantized from.
        stacked: how many leading axes of ``shape`` are stacked layers (an ``nn.scan``,
            ``nnx.scan`` or vmapped layer stack, ``[depth, in, out]``): each layer is
            quantized on its own, its scales carry the leading axes (int8 ``(*lead,
            n)``, int4 ``(*lead, blocks, n)``) and int4 blocks are cut along the layer's
            own input axis. ``0`` (the default): one kernel.
        stacked_at: where the stacked axes lie in ``shape`` and ``values``
            (``shape[stacked_at : stacked_at + stacked]``): ``0`` (the default) for
            leading ones; ``1`` for an ``nn.scan(..., variable_axes={"params": 1})``
            stack, whose loop slices axis 1. The scales carry the stacked axes leading
            whatever ``stacked_at`` is.
        zero_point: ``None`` (symmetric, the default), or the ``int8`` zero point of each
            scale (the scale's shape): ``real = (values - zero_point) * scale``
            (``"int4/<block>/asym"``, ``"int8/asym"``, Keras's ``symmetric=False``).

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

    #: Whether ``values * scale`` is the kernel a matmul multiplies by as stored (an AWQ
    #: kernel also divides the layer's inputs: no fast form reads it outside its scheme).
    reads_as_stored: ClassVar[bool] = True

    values: jax.Array
    scale: jax.Array
    mode: str
    block_size: int | None
    shape: tuple[int, ...]
    original_dtype: np.dtype
    stacked: int = 0
    # Keyword-only: the positional fields (and AWQ's `input_scale` after them) stay as they were.
    stacked_at: int = dataclasses.field(default=0, kw_only=True)
    zero_point: Any = dataclasses.field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        self._validate(nan_scale=False)

    def _validate(self, *, nan_scale: bool) -> None:
        """Checks the fields (a NaN scale only where ``nan_scale``: the library's own)."""
        validate(self, nan_scale=nan_scale)
        object.__setattr__(self, "original_dtype", np.dtype(self.original_dtype))
        register_with_flax_serialization()

    def __eq__(self, other: object) -> Any:
        return equal(self, other)

    __hash__ = None  # type: ignore[assignment]  # equal by value, like an array

    def front(self) -> QuantizedArray:
        """This array with its stacked axes leading (``stacked_at=0``): the values'
        axes moved, the scales as they are. ``self`` when they already lead."""
        if not self.stacked_at:
            return self
        k, at = self.stacked, self.stacked_at
        values = jnp.moveaxis(self.values, range(at, at + k), range(k))
        shape = stack_to_front(self.shape, k, at)
        return replace(self, values=values, shape=shape, stacked_at=0)

    def stacked_to(self, at: int) -> QuantizedArray:
        """This leading-stacked array (``stacked_at=0``) with its stacked axes at ``at``
        of the values and shape (the layout a stack's loop slices)."""
        k = self.stacked
        if not at or not k:
            return self
        values = jnp.moveaxis(self.values, range(k), range(at, at + k))
        shape = stack_from_front(self.shape, k, at)
        return replace(self, values=values, shape=shape, stacked_at=at)

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
        """Bytes stored: the values (int4: half a byte each), the scales and the zero points."""
        bits = np.dtype(self.values.dtype).itemsize * 8
        if np.dtype(self.values.dtype) == np.dtype(jnp.int4):
            bits = 4
        z = self.zero_point
        zero = 0 if z is None else int(z.size) * np.dtype(z.dtype).itemsize
        return (
            -(-int(self.values.size) * bits // 8)
            + int(self.scale.size * self.scale.dtype.itemsize)
            + zero
        )

    @property
    def packed(self) -> bool:
        """Whether the values are int4 packed two per ``uint8`` byte (the earlier layout,
        which loads and dequantizes but reaches no fast matmul: re-quantize it)."""
        return storage_of(self.mode).is_packed(self.values)

    def dequantize(self, dtype: Any = None) -> jax.Array:
        """The real values (``values * scale``, or ``(values - zero_point) * scale``, computed
        in float32 as ``values * scale - zero_point * scale``) in ``dtype``.

        Args:
            dtype: the result's dtype; ``None`` is :attr:`original_dtype`.
        """
        if dtype is None:
            dtype = self.original_dtype
        elif (found := dt.dtype_or_none(dtype)) is None or not dt.is_floating(found):
            raise TypeError(
                "`dtype` must be a floating dtype such as 'bfloat16' or jnp.float32 (or None: "
                f"the original dtype). Received: dtype={dt.bounded_repr(dtype)}"
            )
        if self.stacked_at:
            k, at = self.stacked, self.stacked_at
            real_front = self.front().dequantize(dtype)
            return jnp.moveaxis(real_front, range(k), range(at, at + k))
        scale = jnp.asarray(self.scale, jnp.float32)
        z = None if self.zero_point is None else jnp.asarray(self.zero_point, jnp.float32)
        lead, layer = self.shape[: self.stacked], self.shape[self.stacked :]
        if not storage_of(self.mode).blocked:
            scale = scale.reshape(*lead, *([1] * (len(layer) - 1)), layer[-1])
            real = jnp.asarray(self.values).astype(jnp.float32) * scale
            if z is not None:
                real = real - z.reshape(scale.shape) * scale
        else:

            def one(values: jax.Array, s: jax.Array, z: Any) -> jax.Array:
                real = dequantize_int4(values, s, self.block_size, layer)
                return real if z is None else real - zero_offset(z, s, self.block_size, layer)

            for _ in range(self.stacked):  # each stacked layer on its own
                one = jax.vmap(one)
            real = one(self.values, scale, z)
        return real.astype(dtype)

    def __jax_array__(self) -> jax.Array:
        raise TypeError(_NOT_AN_ARRAY)

    def __array__(self, *args: Any, **kwargs: Any) -> np.ndarray:
        raise TypeError(_NOT_AN_ARRAY)

    def __repr__(self) -> str:
        block = "" if self.block_size is None else f"/{self.block_size}"
        stacked = f", stacked={self.stacked}" if self.stacked else ""
        stacked += f", stacked_at={self.stacked_at}" if self.stacked_at else ""
        if self.zero_point is not None:
            stacked += f", zero_point={getattr(self.zero_point, 'dtype', '?')}"
        return (
            f"QuantizedArray({self.mode}{block}, shape={self.shape}, "
            f"original_dtype={np.dtype(self.original_dtype).name}{stacked})"
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


def quantize(
    x: Any,
    mode: str,
    block_size: int | None = None,
    stacked: int = 0,
    grid: SymmetricGrid | None = None,
) -> QuantizedArray:
    """Quantizes one floating array of rank >= 2 (see the module docstring).

    Args:
        x: a floating array of rank >= 2 (``stacked`` + 2 with stacked axes).
        mode: ``"int8"`` or ``"int4"``.
        block_size: int4's rows per block along the layer's input axis (axis ``stacked``;
            ``-1`` or ``None``: per channel).
        stacked: the number of leading axes that stack layers (``[depth, in, out]``:
            1); each layer is quantized on its own.
        grid: the :class:`~jmp_policy._src.quantization.symmetric_grid.SymmetricGrid`
            (``None``: the mode's default, int4's full range ``-8..7``).

    Raises:
        ValueError: another mode, a bad block size, a negative ``stacked``, or an array
            whose layers have rank < 2.
        TypeError: ``x`` is not a floating array, or ``stacked`` no integer.
    """
    kind = storage_of(mode)  # a ValueError naming the modes
    stacked = check_array(x, stacked)
    block = int4_block(block_size) if kind.blocked else None
    x32 = jnp.asarray(x).astype(jnp.float32)
    shape, dtype = tuple(x.shape), np.dtype(x.dtype)
    if x.size == 0:  # nothing to scale: zero-size values, scales of 1
        return _empty(shape, mode, block, dtype, stacked)
    grid = grid_of(mode, kind.qmax) if grid is None else grid
    one = functools.partial(_quantize_layer, mode=mode, block=block, grid=grid)
    for _ in range(stacked):  # each stacked layer on its own
        one = jax.vmap(one)
    values, scale = one(x32)
    return make(QuantizedArray, values, scale, mode, block, shape, dtype, stacked)


@functools.partial(jax.jit, static_argnames=("mode", "block", "grid"))
def _quantize_layer(
    x32: jax.Array, mode: str, block: int | None, grid: SymmetricGrid
) -> tuple[jax.Array, jax.Array]:
    """The values and scale of one (unstacked) float32 kernel (one compiled program per
    shape and format, not a dispatch and compile per operation when called eagerly):
    symmetric abs-max on ``grid``."""
    kind = storage_of(mode)
    if kind.has_zero_point or not kind.signed:
        raise ValueError(f"`quantize` writes symmetric storage only. Received: mode={mode!r}")
    if not kind.blocked:
        scale = abs_max_scale(x32, tuple(range(x32.ndim - 1)), grid)
        values = round_to_grid(x32, scale, grid).astype(kind.value_dtype)
        return values, scale.reshape(-1)
    rows = x32.shape[0]
    size = rows if block == -1 else min(int(block), rows)  # type: ignore[arg-type]
    blocks = -(-rows // size)
    xb = blocked(x32, size, blocks)  # (blocks, size, ..., n)
    scale = abs_max_scale(xb, tuple(range(1, xb.ndim - 1)), grid)
    q = round_to_grid(xb, scale, grid).astype(kind.value_dtype)
    q = q.reshape(blocks * size, *x32.shape[1:])[:rows]
    return q, scale.reshape(blocks, x32.shape[-1])


def _empty(
    shape: tuple[int, ...], mode: str, block: int | None, dtype: np.dtype, stacked: int = 0
) -> QuantizedArray:
    lead = shape[:stacked]
    kind = storage_of(mode)
    values = jnp.zeros(shape, kind.value_dtype)
    if not kind.blocked:
        return make(
            QuantizedArray, values, jnp.ones((*lead, shape[-1]), jnp.float32), mode, None,
            shape, dtype, stacked,
        )  # fmt: skip
    rows = shape[stacked]
    blocks = 1 if block == -1 or rows == 0 else -(-rows // int(block))  # type: ignore[arg-type]
    return make(
        QuantizedArray, values, jnp.ones((*lead, blocks, shape[-1]), jnp.float32), mode,
        block, shape, dtype, stacked,
    )  # fmt: skip
