"""The symmetric grids: one scale per group, ``real = values * scale``, no zero point.

A grid scales a group by ``amax / bound`` and rounds ``x / scale`` into ``[low, high]``:

* int4's default (``"int4"``, ``"int4/<block>"``, GPTQ's and AWQ's symmetric int4): the
  full range, qwix's grid, ``amax / 7.5`` and the 16 codes ``-8..7`` (the largest bucket
  covers ``[6.5, 7.5)`` steps, so the weights within half a step of ``amax`` share the end
  code: ``7.5`` clips to ``7``, ``-7.5`` rounds to even, ``-8``, whatever the last bit of
  the division: :func:`round_to_grid`);
* int4's narrow grid (``"int4/<block>/narrow"``, the default before the full range): ``amax / 7`` and
  the 15 codes ``-7..7`` (one code never used);
* int8: ``amax / 127`` and ``-127..127``.

A grid changes only how values are chosen: every one stores an ordinary
:class:`~jmp_policy.QuantizedArray` that dequantizes, serves and checkpoints as
``values * scale``, so kernels stored on any grid keep their values.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SymmetricGrid:
    """``scale = amax / bound``; values ``clip(round(x / scale), low, high)``.

    Examples:
        >>> import jax.numpy as jnp
        >>> x = jnp.asarray([[-1.5], [0.8], [1.5]])
        >>> s = abs_max_scale(x, (0,), INT4)
        >>> round_to_grid(x, s, INT4).ravel().tolist(), round(float(s[0, 0]), 6)
        ([-8.0, 4.0, 7.0], 0.2)
        >>> round_to_grid(x, abs_max_scale(x, (0,), 7.0), 7.0).ravel().tolist()
        [-7.0, 4.0, 7.0]
    """

    bound: float
    low: float
    high: float


#: int4's default: the full range (qwix's grid).
INT4 = SymmetricGrid(7.5, -8.0, 7.0)
#: int4's 15-code grid (``"int4/<block>/narrow"``).
INT4_NARROW = SymmetricGrid(7.0, -7.0, 7.0)
INT8 = SymmetricGrid(127.0, -127.0, 127.0)


def of(mode: str, qmax: float | None = None) -> SymmetricGrid:
    """The default grid of a storage ``mode`` (``"int4"``: the full range; another mode:
    ``-qmax..qmax``, int8's ``qmax`` 127 unless given)."""
    if mode == "int4":
        return INT4
    return INT8 if qmax is None else as_grid(qmax)


def as_grid(grid: float | SymmetricGrid) -> SymmetricGrid:
    """``grid`` itself, or a ``qmax`` number as the grid ``amax / qmax``, ``-qmax..qmax``."""
    if isinstance(grid, SymmetricGrid):
        return grid
    return SymmetricGrid(float(grid), -float(grid), float(grid))


def abs_max_scale(x: jax.Array, axes: tuple[int, ...], grid: float | SymmetricGrid) -> jax.Array:
    """The symmetric scale ``amax / bound`` over ``axes`` (``grid``: a :class:`SymmetricGrid`
    or a ``qmax``; 1 where it is 0, the amax 0 or so small that the division underflows:
    always positive); NaN where the slice holds a non-finite value, so a NaN or inf in a
    kernel stays non-finite (its whole channel or block dequantizes to NaN) instead of
    silently becoming a finite number."""
    amax = jnp.max(jnp.abs(x), axis=axes, keepdims=True)
    scale = amax / as_grid(grid).bound
    scale = jnp.where(scale > 0, scale, jnp.ones_like(scale))
    return jnp.where(jnp.isfinite(amax), scale, jnp.nan)


#: On the full range, ``x / scale`` this close to ``-bound`` is the tie ``-bound`` itself.
TIE = 1e-5


def round_to_grid(x: jax.Array, scale: jax.Array, grid: float | SymmetricGrid) -> jax.Array:
    """``x / scale`` rounded and clipped to the grid's codes (float32 integers).

    On the full range a group's negative abs-max lands on the tie ``-7.5`` steps, which the
    last bit of the division (XLA's fusions differ there, eager against ``jit``) would round
    to ``-8`` or ``-7``: within :data:`TIE` of it, it is the tie, rounded to even (``-8``)."""
    g = as_grid(grid)
    t = x / scale
    if g.low + 0.5 == -g.bound:
        t = jnp.where(jnp.abs(t + g.bound) < TIE, -g.bound, t)
    return jnp.clip(jnp.round(t), g.low, g.high)
