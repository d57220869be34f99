"""int4 and int8 weights with a zero point per group (asymmetric): :func:`quantize_asymmetric`.

Each group (a block of ``block_size`` input rows and one output channel; ``-1``: the whole
input axis) is rounded onto int4's 16 codes ``-8..7`` between its own minimum and maximum
(each widened to include 0, as GPTQ's reference ``find_params`` does, so that 0 is exact):
``scale = (max - min) / 15``, ``zero_point = round(-min / scale) - 8`` and
``values = clip(round(w / scale) + zero_point, -8, 7)``, so ``real = (values - zero_point)
* scale``. The symmetric grid (``"int4"``: ``-8..7`` around 0, ``amax / 7.5``) cannot
shift to a skewed group; this one follows the group's range (Keras's int4
with ``symmetric=False``, AutoAWQ's and GPTQ's ``sym=False`` default). int8 (``"int8/asym"``)
does the same per output channel on its 256 codes ``-128..127``: ``scale = (max - min) / 255``.

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
from jmp_policy._src.quantization.storage import storage_of


def quantize_asymmetric(
    x: Any, block_size: Any = -1, stacked: int = 0, mode: str = "int4"
) -> QuantizedArray:
    """Weights with a zero point per group (see the module docstring).

    Args:
        x: a floating array of rank >= 2 (``stacked`` + 2 with stacked axes).
        block_size: int4's rows per group along the layer's input axis (``-1`` or
            ``None``: one group per output channel); ``None`` for int8.
        stacked: leading axes that stack layers, each quantized on its own.
        mode: ``"int4"`` (codes ``-8..7``) or ``"int8"`` (codes ``-128..127``, one scale
            and zero point per output channel, as int8's symmetric scale).

    Returns:
        A :class:`~jmp_policy.QuantizedArray` whose ``zero_point`` (``int8``) has the
        scale's shape.

    Raises:
        ValueError: a bad block size, rank or mode; TypeError: ``x`` no floating array.

    Examples:
        >>> import jax.numpy as jnp
        >>> q = quantize_asymmetric(jnp.asarray([[0.0, -1.5], [3.0, 0.0]]), block_size=2)
        >>> q.zero_point.dtype, q.zero_point.shape, q.nbytes
        (dtype('int8'), (1, 2), 12)
        >>> jnp.round(q.dequantize(), 4).tolist()
        [[0.0, -1.5], [3.0, 0.0]]
        >>> quantize_asymmetric(jnp.ones((4, 3)), None, mode="int8").zero_point.shape
        (3,)
    """
    kind = storage_of(mode)  # a ValueError naming the modes
    if kind.bits not in (4, 8) or not kind.signed or kind.has_zero_point:
        raise ValueError(f"`mode` must be 'int4' or 'int8'. Received: mode={mode!r}")
    stacked = check_array(x, stacked)
    shape, dtype = tuple(x.shape), np.dtype(x.dtype)
    lead = shape[:stacked]
    if not kind.blocked:  # int8: one group per output channel over every other axis
        if block_size is not None:
            raise ValueError(
                f"`block_size` must be None for {mode} (a scale per channel). "
                f"Received: block_size={block_size!r}"
            )
        block, size, scales = None, 0, (*lead, shape[-1])
    else:
        block = int4_block(block_size)
        rows = shape[stacked]
        size = rows if block == -1 else min(block, max(rows, 1))
        scales = (*lead, max(-(-rows // max(size, 1)), 1), shape[-1])
    if x.size == 0:
        return make(
            QuantizedArray, jnp.zeros(shape, kind.value_dtype), jnp.ones(scales, jnp.float32),
            mode, block, shape, dtype, stacked, zero_point=jnp.zeros(scales, jnp.int8),
        )  # fmt: skip
    one = functools.partial(_asymmetric_layer, size=size, mode=mode)
    for _ in range(stacked):
        one = jax.vmap(one)
    values, scale, zero = one(jnp.asarray(x).astype(jnp.float32))
    return make(QuantizedArray, values, scale, mode, block, shape, dtype, stacked, zero_point=zero)


@functools.partial(jax.jit, static_argnames=("size", "mode"))
def _asymmetric_layer(x32: jax.Array, size: int, mode: str) -> tuple[Any, Any, Any]:
    """Values, scales (float32) and zero points (int8) of one kernel."""
    kind = storage_of(mode)
    if not kind.blocked:  # all rows one group; a scale per output channel
        n = x32.shape[-1]
        q, scale, zero = asymmetric_grid.quantize_groups(
            x32.reshape(-1, n), (n,), max(x32.size // max(n, 1), 1), clip=False, bits=kind.bits
        )
        values = q.reshape(x32.shape).astype(kind.value_dtype)
        return values, scale.reshape(n), zero.reshape(n).astype(jnp.int8)
    rest = tuple(x32.shape[1:])
    q, scale, zero = asymmetric_grid.quantize_groups(
        x32.reshape(x32.shape[0], -1), rest, size, clip=False, bits=kind.bits
    )
    return q.reshape(x32.shape).astype(kind.value_dtype), scale, zero.astype(jnp.int8)
