"""int4 weights with a zero point per group (asymmetric): :class:`ZeroPointArray`.

Each group (a block of ``block_size`` input rows and one output channel; ``-1``: the whole
input axis) is rounded onto int4's 16 codes ``-8..7`` between its own minimum and maximum
(each widened to include 0, as GPTQ's reference ``find_params`` does, so that 0 is exact):
``scale = (max - min) / 15``, ``zero_point = round(-min / scale) - 8`` and
``values = clip(round(w / scale) + zero_point, -8, 7)``, so ``real = (values - zero_point)
* scale``. The symmetric grid (``"int4"``) uses 15 codes ``-7..7`` around 0 and cannot
shift to a skewed group; this one uses all 16 and follows the group's range (Keras's int4
with ``symmetric=False``, AutoAWQ's and GPTQ's ``sym=False`` default).

The zero point is stored as ``int8`` beside the ``float32`` scale (the same shape:
``(*depth, blocks, n)``), so bytes count ``0.5`` a value, ``4`` a scale and ``1`` a zero
point. The serving matmul reads the integer values and folds the zero point in after the
product (``x @ (s (q - z)) = s (x @ q) - s z sum(x)`` per group:
:mod:`~jmp_policy._src.quantization.kernel_matmul`), never a float copy of the weights.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jmp_policy._src.quantization import asymmetric_grid
from jmp_policy._src.quantization.int4_layout import dequantize_int4
from jmp_policy._src.quantization.quantized_array import QuantizedArray
from jmp_policy._src.quantization.quantized_array_checks import check_array, int4_block
from jmp_policy._src.quantization.quantized_tree import make, register
from jmp_policy._src.quantization.storage import INT4


@register(("values", "scale", "zero_point"))
@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class ZeroPointArray(QuantizedArray):
    """An int4 kernel with a zero point per group: ``real = (values - zero_point) * scale``.

    A :class:`~jmp_policy.QuantizedArray` (mode ``"int4"``) whose ``zero_point`` (``int8``,
    the scale's shape) is a third child; made by :func:`quantize_asymmetric` (a policy
    ``"int4/<block>/asym"``, or ``Int4DTypePolicy(..., symmetric=False)``).

    Examples:
        >>> import jax.numpy as jnp
        >>> import jmp_policy as jp
        >>> policy = jp.Int4DTypePolicy("int4", "float32", block_size=2, symmetric=False)
        >>> q = policy.quantize({"kernel": jnp.asarray([[0.0, -1.5], [3.0, 0.0]])})["kernel"]
        >>> q.zero_point.dtype, q.zero_point.shape, q.nbytes
        (dtype('int8'), (1, 2), 12)
        >>> jnp.round(q.dequantize(), 4).tolist()
        [[0.0, -1.5], [3.0, 0.0]]
    """

    zero_point: Any = None

    def _validate(self, *, nan_scale: bool) -> None:
        super()._validate(nan_scale=nan_scale)
        if self.mode != INT4.mode:
            raise ValueError(f"A zero point is int4's only. Received: mode={self.mode!r}")
        z, s = self.zero_point, self.scale
        concrete = isinstance(z, (jax.Array, np.ndarray)) and not isinstance(z, jax.core.Tracer)
        if not concrete:
            return
        if not np.issubdtype(np.dtype(z.dtype), np.integer):
            raise TypeError(
                f"`zero_point` must be an integer array. Received: zero_point of dtype {z.dtype}"
            )
        if tuple(z.shape) != tuple(getattr(s, "shape", ())):
            raise ValueError(
                f"`zero_point` must have the scale's shape {tuple(s.shape)}. "
                f"Received: zero_point of shape {tuple(z.shape)}"
            )

    def dequantize(self, dtype: Any = None) -> jax.Array:
        if self.stacked_at:
            return super().dequantize(dtype)  # dequantizes front(), then moves its axes
        if dtype is not None:
            super().dequantize(dtype)  # checks `dtype` (a TypeError naming it)
        dtype = self.original_dtype if dtype is None else dtype
        plain = super().dequantize(jnp.float32)  # values * scale
        layer = tuple(self.shape[self.stacked :])

        def offset(z: jax.Array, s: jax.Array) -> jax.Array:  # z * s over each group's rows
            ones = jnp.ones((layer[0], 1, 1), jnp.float32)
            return dequantize_int4(ones, z * s, self.block_size, (layer[0], 1, layer[-1]))

        for _ in range(self.stacked):
            offset = jax.vmap(offset)
        z = jnp.asarray(self.zero_point, jnp.float32)
        off = offset(z, jnp.asarray(self.scale, jnp.float32))  # (*lead, rows, 1, n)
        lead = self.shape[: self.stacked]
        off = off.reshape(*lead, layer[0], *([1] * (len(layer) - 2)), layer[-1])
        return (plain - off).astype(dtype)

    def __repr__(self) -> str:
        return f"ZeroPointArray({super().__repr__().partition('(')[2]}"

    @property
    def nbytes(self) -> int:
        """Bytes stored: values (half a byte each), scales and zero points."""
        return super().nbytes + int(self.zero_point.size) * self.zero_point.dtype.itemsize


def quantize_asymmetric(x: Any, block_size: Any = -1, stacked: int = 0) -> ZeroPointArray:
    """int4 with a zero point per group (see the module docstring).

    Args:
        x: a floating array of rank >= 2 (``stacked`` + 2 with stacked axes).
        block_size: rows per group along the layer's input axis (``-1`` or ``None``: one
            group per output channel).
        stacked: leading axes that stack layers, each quantized on its own.

    Raises:
        ValueError: a bad block size or rank; TypeError: ``x`` no floating array.
    """
    stacked = check_array(x, stacked)
    block = int4_block(block_size)
    shape, dtype = tuple(x.shape), np.dtype(x.dtype)
    rows = shape[stacked]
    size = rows if block == -1 else min(block, max(rows, 1))
    blocks = max(-(-rows // max(size, 1)), 1)
    if x.size == 0:
        lead = shape[:stacked]
        return make(
            ZeroPointArray, jnp.zeros(shape, jnp.int4),
            jnp.ones((*lead, blocks, shape[-1]), jnp.float32), "int4", block, shape, dtype,
            stacked, zero_point=jnp.zeros((*lead, blocks, shape[-1]), jnp.int8),
        )  # fmt: skip
    one = functools.partial(_asymmetric_layer, size=size)
    for _ in range(stacked):
        one = jax.vmap(one)
    values, scale, zero = one(jnp.asarray(x).astype(jnp.float32))
    return make(
        ZeroPointArray, values, scale, "int4", block, shape, dtype, stacked, zero_point=zero
    )


@functools.partial(jax.jit, static_argnames=("size",))
def _asymmetric_layer(x32: jax.Array, size: int) -> tuple[Any, Any, Any]:
    """Values (int4), scales (float32) and zero points (int8) of one kernel."""
    rest = tuple(x32.shape[1:])
    q, scale, zero = asymmetric_grid.quantize_groups(
        x32.reshape(x32.shape[0], -1), rest, size, clip=False
    )
    return q.reshape(x32.shape).astype(jnp.int4), scale, zero.astype(jnp.int8)
