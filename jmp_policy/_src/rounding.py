"""Adding a float32 update to a 16-bit parameter: stochastic rounding and Kahan compensation.

Plain functions of arrays, under the optax wrappers of ``rounded_updates``. Each returns the
new 16-bit parameter and the float32 update that ``optax.apply_updates`` turns into it: the
update ``f32(new) - f32(param)`` lands exactly on ``new`` (``param + update`` in float32, then
the cast back) whenever ``|new| >= 2**-16 * |param|`` (bfloat16; ``2**-13`` for float16);
below that, where an update cancels a parameter, it lands within half a float32 unit of
``|param|`` of it, as a float32 master would (``tests/rounded_updates_test.py`` checks both).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# The storage dtypes rounded here: the 16-bit floats. Any other leaf passes through.
SIXTEEN_BIT = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))


def is_sixteen_bit(x: object) -> bool:
    """Whether ``x`` is an array stored in bfloat16 or float16."""
    return getattr(x, "dtype", None) in SIXTEEN_BIT


def stochastic_round(x: jax.Array, dtype: jnp.dtype, key: jax.Array) -> jax.Array:
    """``x`` (float32) rounded to ``dtype`` (bfloat16 or float16), up or down at random.

    The result is one of the two ``dtype`` values around ``x`` (``x`` itself when it is
    representable), the farther one with probability proportional to the distance, so that
    ``E[result] == x``: an update below half a unit in the last place is applied on average
    instead of lost. Non-finite values round as to nearest.
    """
    x = x.astype(jnp.float32)
    if np.dtype(dtype) == jnp.bfloat16:
        # bfloat16 is float32's top half: add 16 random bits below it, then truncate.
        noise = jax.random.bits(key, x.shape, jnp.uint32) >> 16
        bits = lax.bitcast_convert_type(x, jnp.uint32)
        finite = jnp.isfinite(x)
        bits = jnp.where(finite, (bits + noise) & jnp.uint32(0xFFFF0000), bits)
        truncated = lax.bitcast_convert_type(bits, jnp.float32).astype(jnp.bfloat16)
        return jnp.where(finite, truncated, x.astype(jnp.bfloat16))
    # Otherwise (float16): the nearest value and its neighbour on x's other side (one step
    # of the bit pattern, which orders the magnitudes), the neighbour taken with probability
    # |x - nearest| / |neighbour - nearest| (exact in float32: the values are 16-bit).
    nearest = x.astype(dtype)
    magnitude_up = jnp.abs(nearest.astype(jnp.float32)) < jnp.abs(x)
    bits = lax.bitcast_convert_type(nearest, jnp.uint16)
    step = jnp.where(magnitude_up, jnp.uint16(1), jnp.uint16(0xFFFF))  # +1 or -1, mod 2**16
    other = lax.bitcast_convert_type(bits + step, dtype)
    near32, other32 = nearest.astype(jnp.float32), other.astype(jnp.float32)
    probability = jnp.abs(x - near32) / jnp.abs(other32 - near32)
    take_other = jax.random.uniform(key, x.shape, jnp.float32) < probability
    exact = near32 == x
    return jnp.where(exact | ~take_other | ~jnp.isfinite(x), nearest, other)


def stochastic_add(
    param: jax.Array, update: jax.Array, key: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """``param + update`` stochastically rounded to ``param``'s dtype, and its float32 update.

    Returns ``(new_param, float32 update)``, the update being ``f32(new) - f32(param)``.
    """
    p32 = param.astype(jnp.float32)
    new = stochastic_round(p32 + update.astype(jnp.float32), param.dtype, key)
    return new, new.astype(jnp.float32) - p32


def kahan_add(
    param: jax.Array, update: jax.Array, compensation: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``param + update`` with Kahan compensation, in ``param``'s dtype.

    ``compensation`` (in ``param``'s dtype) holds what earlier roundings lost; it is added to
    this update, the sum rounded to nearest, and what this rounding lost is kept for the
    next step. Returns ``(new_param, float32 update, new_compensation)``.
    """
    p32 = param.astype(jnp.float32)
    wanted = update.astype(jnp.float32) + compensation.astype(jnp.float32)
    new = (p32 + wanted).astype(param.dtype)
    applied = new.astype(jnp.float32) - p32
    # A non-finite step must not poison the buffer for good: it restarts from zero.
    lost = jnp.where(jnp.isfinite(wanted), wanted - applied, 0.0)
    return new, applied, lost.astype(compensation.dtype)
