"""int4 weights with a zero point per group (asymmetric): :func:`quantize_asymmetric`.

Each group (a block of ``block_size`` input rows and one output channel; ``-1``: the whole
input axis) is rounded onto int4's 16 codes ``-8..7`` between its own minimum and maximum
(each widened to include 0, as GPTQ's reference ``find_params`` does, so that 0 is exact):
``scale = (max - min) / 15``, ``zero_point = round(-min / scale) - 8`` and
``values = clip(round(w / scale) + zero_point, -8, 7)``, so ``real = (values - zero_point)
* scale``. The symmetric grid (``"int4"``) uses 15 codes ``-7..7`` around 0 and cannot
shift to a skewed group; this one uses all 16 and follows the group's range (Keras's int4
with ``symmetric=False``, AutoAWQ's and GPTQ's ``sym=False`` default).

The zero point is a field of the stored weights (:class:`~jmp_policy.QuantizedArray`'s
``zero_point``, a pytree child), stored as ``int8`` beside the ``float32`` scale (the same
shape: ``(*depth, blocks, n)``), so bytes count ``0.5`` a value, ``4`` a scale and ``1`` a zero
point. The serving matmul reads the integer values and folds the zero point in after the
product (``x @ (s (q - z)) = s (x @ q) - s z sum(x)`` per group:
:mod:`~jmp_policy._src.quantization.kernel_matmul`), never a float copy of the weights.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jmp_policy._src.quantization import asymmetric_grid
from jmp_policy._src.quantization.quantized_array import QuantizedArray
from jmp_policy._src.quantization.quantized_array_checks import check_array, int4_block
from jmp_policy._src.quantization.quantized_tree import make


def quantize_asymmetric(x: Any, block_size: Any = -1, stacked: int = 0) -> QuantizedArray:
    """int4 with a zero point per group (see the module docstring).

    Examples:
        >>> import jax.numpy as jnp
        >>> q = quantize_asymmetric(jnp.asarray([[0.0, -1.5], [3.0, 0.0]]), block_size=2)
        >>> q.zero_point.dtype, q.zero_point.shape, q.nbytes
        (dtype('int8'), (1, 2), 12)
        >>> jnp.round(q.dequantize(), 4).tolist()
        [[0.0, -1.5], [3.0, 0.0]]

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
            QuantizedArray, jnp.zeros(shape, jnp.int4),
            jnp.ones((*lead, blocks, shape[-1]), jnp.float32), "int4", block, shape, dtype,
            stacked, zero_point=jnp.zeros((*lead, blocks, shape[-1]), jnp.int8),
        )  # fmt: skip
    one = functools.partial(_asymmetric_layer, size=size)
    for _ in range(stacked):
        one = jax.vmap(one)
    values, scale, zero = one(jnp.asarray(x).astype(jnp.float32))
    return make(
        QuantizedArray, values, scale, "int4", block, shape, dtype, stacked, zero_point=zero
    )


@functools.partial(jax.jit, static_argnames=("size",))
def _asymmetric_layer(x32: jax.Array, size: int) -> tuple[Any, Any, Any]:
    """Values (int4), scales (float32) and zero points (int8) of one kernel."""
    rest = tuple(x32.shape[1:])
    q, scale, zero = asymmetric_grid.quantize_groups(
        x32.reshape(x32.shape[0], -1), rest, size, clip=False
    )
    return q.reshape(x32.shape).astype(jnp.int4), scale, zero.astype(jnp.int8)
