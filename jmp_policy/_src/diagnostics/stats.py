"""The statistics of a group of arrays, as the diagnostics taps record them.

For the floating leaves of a submodule call's inputs, its outputs, or the cotangents that
reach its outputs:

* ``max_abs``: the largest finite absolute value;
* ``non_finite``: how many values are ``inf`` or ``nan``;
* ``underflow``: how many are nonzero but below the smallest normal of the module's
  compute dtype (they lose precision, then flush to zero);
* ``near_overflow``: how many finite values are within a factor 2 of its largest value;
* ``zeros`` and ``size``.

All ``jnp`` ops: they work under ``jit``, ``grad`` and ``scan`` with no host synchronisation.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

NUM_STATS = 6  # max_abs, non_finite, underflow, near_overflow, zeros, size


@dataclasses.dataclass(frozen=True)
class Stats:
    """Statistics of a group of arrays (a call's inputs, outputs or output cotangents).

    ``max_abs`` is float32; the counts are int32 (under ``jax_enable_x64``, too) and
    add up over the calls of one path. Read from a concrete report (outside ``jit``) they
    are NumPy values; inside ``jit``, traced arrays.
    """

    max_abs: jax.Array
    non_finite: jax.Array
    underflow: jax.Array
    near_overflow: jax.Array
    zeros: jax.Array
    size: jax.Array

    @property
    def underflow_fraction(self) -> jax.Array:
        """The fraction of values that are nonzero but below the smallest normal."""
        return self.underflow / jnp.maximum(self.size, 1)

    @property
    def near_overflow_fraction(self) -> jax.Array:
        """The fraction of values within a factor 2 of the largest finite value."""
        return self.near_overflow / jnp.maximum(self.size, 1)

    def row(self) -> jax.Array:
        """The statistics as one float32 vector (the probe's layout)."""
        return jnp.stack([jnp.asarray(v, jnp.float32) for v in dataclasses.astuple(self)])

    @classmethod
    def from_row(cls, row: jax.Array) -> Stats:
        counts = [jnp.round(row[..., i]).astype(jnp.int32) for i in range(1, NUM_STATS)]
        return cls(row[..., 0], *counts)

    def merge(self, other: Stats) -> Stats:
        """The statistics of both groups together."""
        return Stats(
            jnp.maximum(self.max_abs, other.max_abs),
            *(
                a + b
                for a, b in zip(
                    dataclasses.astuple(self)[1:], dataclasses.astuple(other)[1:], strict=True
                )
            ),
        )


jax.tree_util.register_dataclass(
    Stats,
    data_fields=["max_abs", "non_finite", "underflow", "near_overflow", "zeros", "size"],
    meta_fields=[],
)


def stats_of(leaves: list[Any], dtype: Any) -> Stats:
    """:class:`Stats` of the floating ``leaves``, thresholds from floating ``dtype``.

    Each leaf is read once: its statistics are one variadic ``lax.reduce`` (a max and
    four counts over the same elementwise tests), which XLA compiles into one reduction
    fusion, not five passes over memory.
    """
    info = jnp.finfo(dtype)
    tiny, near = float(info.tiny), float(info.max) / 2
    max_abs = jnp.zeros((), jnp.float32)
    counts = [jnp.zeros((), jnp.int32) for _ in range(4)]
    size = 0
    for leaf in leaves:
        x = jax.lax.stop_gradient(jnp.asarray(leaf))  # statistics are never differentiated
        leaf_max, *leaf_counts = _one_pass(x, tiny, near)
        max_abs = jnp.maximum(max_abs, leaf_max.astype(jnp.float32))
        counts = [c + n for c, n in zip(counts, leaf_counts, strict=True)]
        size += int(np.prod(x.shape))
    non_finite, underflow, near_overflow, zeros = counts
    return Stats(max_abs, non_finite, underflow, near_overflow, zeros, jnp.asarray(size, jnp.int32))


def no_stats() -> Stats:
    """The statistics of a step that is not sampled: all zero, ``size`` too."""
    return Stats(jnp.zeros((), jnp.float32), *(jnp.zeros((), jnp.int32) for _ in range(5)))


def _one_pass(x: jax.Array, tiny: float, near: float) -> tuple[jax.Array, ...]:
    """Max finite |x| and the counts of non-finite, underflowing, near-overflow and zero
    values of ``x``, as one reduction over all its axes."""
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        x = jnp.abs(x)
    a = jnp.abs(x.astype(jnp.promote_types(x.dtype, jnp.float32)))
    finite = jnp.isfinite(a)
    masks = (~finite, (a > 0) & (a < tiny), finite & (a >= near), a == 0)
    operands = (jnp.where(finite, a, 0), *(m.astype(jnp.int32) for m in masks))
    init = (np.zeros((), a.dtype), *(np.zeros((), np.int32) for _ in masks))
    return tuple(jax.lax.reduce(operands, init, _combine, tuple(range(a.ndim))))


def _combine(x: tuple[jax.Array, ...], y: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    return (
        jax.lax.max(x[0], y[0]),
        *(jax.lax.add(a, b) for a, b in zip(x[1:], y[1:], strict=True)),
    )
