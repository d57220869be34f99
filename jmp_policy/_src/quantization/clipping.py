"""The clipping search: each group's int4/int8 scale shrunk below its abs-max where that
lowers the quantization error (GPTQ's ``mse=True`` grid, AWQ's ``auto_clip``).

Round-to-nearest's abs-max scale spends grid levels on the few largest weights of a group;
a scale ``r · amax / qmax`` with ``r < 1`` clips them and rounds the rest more finely. For
each scale (one per group and last-axis index, as :class:`~jmp_policy.QuantizedArray`
stores it) the ratio ``r`` is the best of ``1, 1 - 1/grid, ..., 1 - (k-1)/grid`` for
``k = int(max_shrink · grid)`` (the reference code's grid of 100 ratios down to 0.21);
``r = 1`` comes first and only a strictly lower error replaces it, so the search never does
worse than abs-max on its own objective. On int4's full range (``amax / 7.5``, codes
``-8..7``) the ratios also go above 1, to ``7.5 / 7``: at ``r = 1`` a group's positive
abs-max sits half a step above the top code and is clipped by it, and the scales up to
``amax / 7`` (where it is a code) are candidates too, so the search on the full range
covers every scale it covers on the narrow grid (measured on Gemma 3 270M: AWQ's held-out
gap 0.017 nats lower at full size, GPTQ's level; docs/quantization.md). The objective is
either the weights' own error, ``Σ |w - ŵ|^p`` (GPTQ's reference, ``p = 2.4``), or the
group's share of the layer's output error on the calibration inputs, ``dᵀ H_g d`` for
``H_g`` the group's block of ``XᵀX`` (AWQ's ``auto_clip``). Nothing here knows Flax.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jmp_policy._src.quantization.symmetric_grid import SymmetricGrid, as_grid, round_to_grid

#: The reference code's grid: ratios ``1 - i / CLIP_GRID`` for ``i < CLIP_MAX_SHRINK · CLIP_GRID``.
CLIP_GRID = 100
CLIP_MAX_SHRINK = 0.8
#: GPTQ's reference norm of the weight error (``|w - ŵ|^2.4``).
WEIGHT_NORM = 2.4
_HIGHEST = jax.lax.Precision.HIGHEST


def clip_ratios(
    grid: int = CLIP_GRID, max_shrink: float = CLIP_MAX_SHRINK, widen: float = 1.0
) -> jax.Array:
    """The candidate ratios ``1, 1 - 1/grid, ...`` (``int(max_shrink · grid)`` of them),
    then, for ``widen`` above 1, ``1 + 1/grid, ...`` below ``widen`` and ``widen`` itself.

    Examples:
        >>> [round(float(r), 4) for r in clip_ratios(100, 0.03, widen=7.5 / 7)]
        [1.0, 0.99, 0.98, 1.01, 1.02, 1.03, 1.04, 1.05, 1.06, 1.07, 1.0714]
    """
    shrink = 1.0 - jnp.arange(max(int(max_shrink * grid), 1), dtype=jnp.float32) / grid
    if widen <= 1.0:
        return shrink
    above = [1.0 + i / grid for i in range(1, grid) if 1.0 + i / grid < widen - 1e-6]
    return jnp.concatenate([shrink, jnp.asarray([*above, widen], jnp.float32)])


def abs_max(rows: jax.Array, rest: tuple[int, ...]) -> jax.Array:
    """The abs-max of ``rows`` (``[r, M]``, ``M = prod(rest)``) per index of ``rest``'s last
    axis (``[n]``): the axes a stored scale covers."""
    cols = jnp.max(jnp.abs(rows), axis=0).reshape(-1, rest[-1])
    return jnp.max(cols, axis=0)


def broadcast_scale(scale: jax.Array, rest: tuple[int, ...]) -> jax.Array:
    """A ``[n]`` scale broadcast to the ``[M]`` columns of ``rows``."""
    return jnp.broadcast_to(scale, rest).reshape(-1)


def best_ratio(
    rows: jax.Array,
    rest: tuple[int, ...],
    real: Callable[[jax.Array], jax.Array],
    gram: jax.Array | None = None,
    *,
    grid: int = CLIP_GRID,
    max_shrink: float = CLIP_MAX_SHRINK,
    norm: float = WEIGHT_NORM,
    widen: float = 1.0,
) -> jax.Array:
    """The clip search of one group of rows ``[r, M]`` on any grid: the best ratio (``[n]``,
    one per index of ``rest``'s last axis) of :func:`clip_ratios` (``widen`` as there) by
    ``dᵀ gram d`` when ``gram`` (``[r, r]``) is given, else ``Σ |d|^norm``, for
    ``d = rows - real(ratio)`` and ``real(ratio)`` the rows quantized and dequantized on the
    grid clipped by ``ratio``.
    The first minimum wins (``r = 1`` unless strictly beaten); a NaN error never does.
    Both grids search so: the symmetric one (:func:`search_scale`) and the asymmetric one
    (:mod:`~jmp_policy._src.quantization.asymmetric_grid`)."""
    ratios = clip_ratios(grid, max_shrink, widen)

    def error(r: jax.Array) -> jax.Array:
        d = rows - real(r)
        if gram is None:
            e = jnp.sum(jnp.abs(d) ** norm, axis=0)
        else:
            e = jnp.sum(d * jnp.matmul(gram, d, precision=_HIGHEST), axis=0)
        return e.reshape(-1, rest[-1]).sum(axis=0)

    errors = jax.lax.map(error, ratios)  # [ratios, n]
    errors = jnp.where(jnp.isnan(errors), jnp.inf, errors)
    return ratios[jnp.argmin(errors, axis=0)]


def search_scale(
    rows: jax.Array,
    rest: tuple[int, ...],
    qmax: float | SymmetricGrid,
    gram: jax.Array | None = None,
    *,
    grid: int = CLIP_GRID,
    max_shrink: float = CLIP_MAX_SHRINK,
    norm: float = WEIGHT_NORM,
) -> jax.Array:
    """The best clipped scale (``[n]``) of one group of rows ``[r, M]`` on the symmetric
    grid ``qmax`` (a :class:`~jmp_policy._src.quantization.symmetric_grid.SymmetricGrid`,
    or a number: ``amax / qmax``, ``-qmax..qmax``; see the module docstring and
    :func:`best_ratio`): ``r · amax / bound``.

    A scale whose group is all zero is 1 (as :func:`~jmp_policy._src.quantization.
    quantized_array.abs_max_scale` gives); a non-finite group keeps a NaN scale.

    Examples:
        >>> import jax.numpy as jnp
        >>> w = jnp.array([[0.1], [0.2], [0.3], [2.0]])   # one outlier in the group
        >>> float(search_scale(w, (1,), 7.0)[0]) < 2.0 / 7
        True
    """
    amax, g = abs_max(rows, rest), as_grid(qmax)

    def real(r: jax.Array) -> jax.Array:
        s = broadcast_scale(amax * r / g.bound, rest)
        s = jnp.where(s > 0, s, 1.0)
        return round_to_grid(rows, s, g) * s

    # On the full range (bound 7.5 above the top code 7) the ratios reach bound / high: the
    # scale amax / 7, where both signs' abs-max are codes (the narrow grid's), is a candidate.
    widen = g.bound / g.high if g.bound > g.high else 1.0
    ratio = best_ratio(
        rows, rest, real, gram, grid=grid, max_shrink=max_shrink, norm=norm, widen=widen
    )
    scale = amax * ratio / g.bound
    scale = jnp.where(scale > 0, scale, 1.0)
    return jnp.where(jnp.isfinite(amax), scale, jnp.nan)


def quantize_groups(
    w: jax.Array,
    rest: tuple[int, ...],
    qmax: float | SymmetricGrid,
    size: int,
    gram: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """``w`` (``[rows, M]``, float32) rounded with a clipped scale per group of ``size``
    rows and index of ``rest``'s last axis: integer values (float32, ``[rows, M]``) and
    scales ``[groups, n]``. With ``gram`` (``[rows, rows]``) each group's clip minimises its
    block's output error, else its weight error."""
    rows, m = w.shape
    size = min(size, rows)  # a group longer than the kernel: one group of its rows
    groups = -(-rows // size)
    padded = groups * size
    wb = jnp.pad(w, ((0, padded - rows), (0, 0))).reshape(groups, size, m)
    if gram is None:
        scales = jax.vmap(lambda g: search_scale(g, rest, qmax))(wb)
    else:
        gp = jnp.pad(gram, ((0, padded - rows), (0, padded - rows)))
        idx = jnp.arange(groups)
        blocks = gp.reshape(groups, size, groups, size)[idx, :, idx, :]  # [groups, size, size]
        scales = jax.vmap(lambda g, h: search_scale(g, rest, qmax, h))(wb, blocks)
    s_rows = jax.vmap(lambda s: broadcast_scale(s, rest))(scales)[:, None, :]
    q = round_to_grid(wb, s_rows, qmax).reshape(padded, m)[:rows]
    return q, scales
