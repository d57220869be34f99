"""int4 weights' layout: blocks of rows along axis 0, and the packed ``uint8`` layout of
earlier versions (two values per byte, row ``2i`` in the low nibble), still read."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def blocked(x: jax.Array, size: int, blocks: int) -> jax.Array:
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


def unpack_int4(packed: jax.Array, rows: int) -> jax.Array:
    """The inverse of :func:`pack_int4`: int32 values of ``rows`` rows."""
    v = jnp.asarray(packed).astype(jnp.int32)
    nibbles = jnp.stack([v & 0xF, (v >> 4) & 0xF], axis=1)
    nibbles = jnp.where(nibbles >= 8, nibbles - 16, nibbles)
    return nibbles.reshape(-1, *packed.shape[1:])[:rows]


def dequantize_int4(
    values: jax.Array, scale: jax.Array, block_size: int | None, shape: tuple[int, ...]
) -> jax.Array:
    """The float32 values of one (unstacked) int4 kernel of ``shape``: ``values`` (int4,
    or packed ``uint8``) times the ``(blocks, n)`` ``scale`` of their block."""
    rows = shape[0]
    if np.dtype(values.dtype) == np.dtype(np.uint8):  # the packed layout of earlier versions
        q = unpack_int4(values, rows).astype(jnp.float32)
    else:
        q = jnp.asarray(values).astype(jnp.float32)
    size = rows if block_size in (None, -1) else int(block_size)  # type: ignore[arg-type]
    blocks = scale.shape[0]
    qb = blocked(q, size, blocks)
    scale = scale.reshape(blocks, *([1] * (len(shape) - 1)), shape[-1])
    return (qb * scale).reshape(blocks * size, *shape[1:])[:rows]


def zero_offset(
    zero: jax.Array, scale: jax.Array, block_size: int | None, shape: tuple[int, ...]
) -> jax.Array:
    """``zero * scale`` (float32, ``(blocks, n)``) over each block's rows of one (unstacked)
    kernel of ``shape``: what the zero point takes off ``values * scale``, broadcast as
    ``(rows, 1, ..., n)``."""
    rows = shape[0]
    ones = jnp.ones((rows, 1, 1), jnp.float32)
    off = dequantize_int4(ones, zero * scale, block_size, (rows, 1, shape[-1]))
    return off.reshape(rows, *([1] * (len(shape) - 2)), shape[-1])
