"""The asymmetric grid: a scale and a zero point per group, all ``2^bits`` codes (int4's
``-8..7``, int8's ``-128..127``).

A group's range ``[min(w, 0), max(w, 0)]`` (times a clip ratio ``r <= 1``) is cut into
``2^bits - 1`` steps (int4: ``scale = (high - low) / 15``, ``zero = round(-low / scale) -
8``, values ``clip(round(w / scale) + zero, -8, 7)``), real ``(values - zero) * scale``. Round-to-nearest
(:mod:`~jmp_policy._src.quantization.zero_point`), GPTQ and AWQ use it for
``symmetric=False``; the clip search here is GPTQ's reference ``mse=True`` grid for
asymmetric groups (both ends shrunk by ``r``) and AWQ's ``auto_clip`` (by the group's share
of the output error), as :mod:`~jmp_policy._src.quantization.clipping` does for the
symmetric grid. Nothing here knows Flax.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jmp_policy._src.dtypes import bounded_repr
from jmp_policy._src.quantization import clipping
from jmp_policy._src.quantization.clipping import broadcast_scale

QMIN, QMAX = -8.0, 7.0  # int4's codes


def codes(bits: int = 4) -> tuple[float, float]:
    """The lowest and highest code of ``bits``-bit signed values (``(-8.0, 7.0)`` for 4)."""
    return float(-(2 ** (bits - 1))), float(2 ** (bits - 1) - 1)


#: The end of a mode whose groups carry a zero point (``"int4/128/asym"``).
ASYM = "/asym"


def check_symmetric(symmetric: Any, weight_bits: int = 4, allow_asymmetric: bool = False) -> bool:
    """``symmetric``, checked: a ``bool`` (Keras's config key); ``False`` only for 4 bits
    (or ``allow_asymmetric``: round-to-nearest int8)."""
    if not isinstance(symmetric, (bool, np.bool_)):
        raise TypeError(
            "`symmetric` must be True (abs-max, codes -8..7 for int4) or False (a zero point "
            f"per group, all the codes). Received: symmetric={bounded_repr(symmetric)} "
            f"(of type {type(symmetric).__name__})"
        )
    if not symmetric and weight_bits != 4 and not allow_asymmetric:
        raise ValueError(
            "A zero point per group (`symmetric=False`) is int4's only for GPTQ and AWQ: "
            "their 8-bit weights are symmetric here (round-to-nearest 'int8/asym' has zero "
            f"points). Received: weight_bits={weight_bits!r}, symmetric=False"
        )
    return bool(symmetric)


def grid(low: jax.Array, high: jax.Array, bits: int = 4) -> tuple[jax.Array, jax.Array]:
    """The scale and zero point (float32 integers) of groups spanning ``[low, high]`` (each
    widened to include 0: 0 is exact). A scale is 1 where the range is 0, NaN where it is
    not finite (a non-finite kernel stays non-finite)."""
    qmin, qmax = codes(bits)
    low, high = jnp.minimum(low, 0.0), jnp.maximum(high, 0.0)
    scale = (high - low) / (qmax - qmin)
    scale = jnp.where(scale > 0, scale, jnp.ones_like(scale))
    scale = jnp.where(jnp.isfinite(low) & jnp.isfinite(high), scale, jnp.nan)
    zero = jnp.clip(jnp.round(-low / scale) + qmin, qmin, qmax)
    return scale, jnp.where(jnp.isfinite(zero), zero, 0.0)


def round_values(x: jax.Array, scale: jax.Array, zero: jax.Array, bits: int = 4) -> jax.Array:
    """``x`` on the grid: ``clip(round(x / scale) + zero, qmin, qmax)`` (float32 integers)."""
    return jnp.clip(jnp.round(x / scale) + zero, *codes(bits))


def real(q: jax.Array, scale: jax.Array, zero: jax.Array) -> jax.Array:
    """The real values of grid values ``q``: ``(q - zero) * scale``."""
    return (q - zero) * scale


def column_range(rows: jax.Array, rest: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    """The min and max of ``rows`` (``[r, M]``, ``M = prod(rest)``) per index of ``rest``'s
    last axis (``[n]``): the axes one stored scale covers."""
    n = rest[-1]
    low = jnp.min(jnp.min(rows, axis=0).reshape(-1, n), axis=0)
    high = jnp.max(jnp.max(rows, axis=0).reshape(-1, n), axis=0)
    return low, high


def column_grid(
    rows: jax.Array,
    rest: tuple[int, ...],
    clip: bool = False,
    gram: jax.Array | None = None,
    bits: int = 4,
) -> tuple[jax.Array, jax.Array]:
    """The ``[n]`` scale and zero point of one group of ``rows``: its range, or with
    ``clip`` the best of the clipped ranges ``r · [low, high]`` (``r = 1, 0.99, ...`` as
    :func:`~jmp_policy._src.quantization.clipping.best_ratio` searches them on any grid)
    by ``dᵀ gram d`` when ``gram`` is given, else ``Σ |d|^2.4``."""
    low, high = column_range(rows, rest)
    if not clip:
        return grid(low, high, bits)

    def dequantized(r: jax.Array) -> jax.Array:
        scale, zero = grid(low * r, high * r, bits)
        s, z = broadcast_scale(scale, rest), broadcast_scale(zero, rest)
        return real(round_values(rows, s, z, bits), s, z)

    ratio = clipping.best_ratio(rows, rest, dequantized, gram)
    return grid(low * ratio, high * ratio, bits)


def quantize_groups(
    w: jax.Array,
    rest: tuple[int, ...],
    size: int,
    gram: jax.Array | None = None,
    clip: bool = True,
    bits: int = 4,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``w`` (``[rows, M]``, float32) on the grid of each group of ``size`` rows and index of
    ``rest``'s last axis: values (float32, ``[rows, M]``), scales and zero points
    (``[groups, n]``); with ``clip``, each group's range clipped by its block of ``gram``
    (``[rows, rows]``) or its weight error."""
    rows, m = w.shape
    size = min(size, rows)
    groups = -(-rows // size)
    padded = groups * size
    wb = jnp.pad(w, ((0, padded - rows), (0, 0))).reshape(groups, size, m)
    if gram is None:
        scales, zeros = jax.vmap(lambda g: column_grid(g, rest, clip, bits=bits))(wb)
    else:
        gp = jnp.pad(gram, ((0, padded - rows), (0, padded - rows)))
        idx = jnp.arange(groups)
        blocks = gp.reshape(groups, size, groups, size)[idx, :, idx, :]
        scales, zeros = jax.vmap(lambda g, h: column_grid(g, rest, clip, h, bits))(wb, blocks)
    s = jax.vmap(lambda x: broadcast_scale(x, rest))(scales)[:, None, :]
    z = jax.vmap(lambda x: broadcast_scale(x, rest))(zeros)[:, None, :]
    q = round_values(wb, s, z, bits).reshape(padded, m)[:rows]
    return q, scales, zeros
