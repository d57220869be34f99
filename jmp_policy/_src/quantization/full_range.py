"""Symmetric int4 on all 16 codes (``"int4/<block>/full"``): qwix's default int4 grid.

The default symmetric grid scales a group by ``amax / 7`` and uses the 15 codes ``-7..7``.
This one scales by ``amax / 7.5`` (qwix's bound ``qmax + 0.5``: the largest bucket covers
``[6.5, 7.5)`` steps), a step a fifteenth finer, and rounds to ``-8..7``: the weights within
half a step of ``amax`` share the end code (``7.5`` clipped to ``7``; ``-7.5`` rounds to
even, ``-8``, where the division lands on it exactly), no zero point stored. The stored array is an ordinary int4
:class:`~jmp_policy.QuantizedArray` (``real = values * scale``): it serves, dequantizes and
checkpoints as the default grid's does. Nothing here knows Flax.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jmp_policy._src.quantization.int4_layout import blocked
from jmp_policy._src.quantization.quantized_array import QuantizedArray, abs_max_scale, quantize
from jmp_policy._src.quantization.quantized_array_checks import check_array, int4_block
from jmp_policy._src.quantization.quantized_tree import make

#: The scale's bound: ``amax / BOUND`` (int4's ``qmax + 0.5``, as qwix's symmetric bound).
BOUND = 7.5
QMIN, QMAX = -8.0, 7.0


def quantize_full_range(x: Any, block_size: Any = -1, stacked: int = 0) -> QuantizedArray:
    """int4 on all 16 codes, symmetric (see the module docstring).

    Args:
        x: a floating array of rank >= 2 (``stacked`` + 2 with stacked axes).
        block_size: rows per block along the layer's input axis (``-1`` or ``None``: per
            channel).
        stacked: leading axes that stack layers, each quantized on its own.

    Returns:
        An int4 :class:`~jmp_policy.QuantizedArray` with values in ``-8..7``.

    Raises:
        ValueError: a bad block size or rank; TypeError: ``x`` no floating array.

    Examples:
        >>> import jax.numpy as jnp
        >>> q = quantize_full_range(jnp.asarray([[-1.5], [0.8], [1.5]]))
        >>> q.values.ravel().tolist(), round(float(q.scale[0, 0]), 6)   # amax / 7.5
        ([-7, 4, 7], 0.2)
    """
    stacked = check_array(x, stacked)
    block = int4_block(block_size)
    if x.size == 0:
        return quantize(x, "int4", block, stacked)  # scales of 1, nothing to round
    one = functools.partial(_full_range_layer, block=block)
    for _ in range(stacked):
        one = jax.vmap(one)
    values, scale = one(jnp.asarray(x).astype(jnp.float32))
    shape, dtype = tuple(x.shape), np.dtype(x.dtype)
    return make(QuantizedArray, values, scale, "int4", block, shape, dtype, stacked)


@functools.partial(jax.jit, static_argnames=("block",))
def _full_range_layer(x32: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
    rows = x32.shape[0]
    size = rows if block == -1 else min(block, rows)
    blocks = -(-rows // size)
    xb = blocked(x32, size, blocks)  # (blocks, size, ..., n)
    scale = abs_max_scale(xb, tuple(range(1, xb.ndim - 1)), BOUND)
    q = jnp.clip(jnp.round(xb / scale), QMIN, QMAX).astype(jnp.int4)
    q = q.reshape(blocks * size, *x32.shape[1:])[:rows]
    return q, scale.reshape(blocks, x32.shape[-1])
