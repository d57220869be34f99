"""What calibration gathers about a layer's inputs: the Gram matrix ``XᵀX`` (GPTQ's Hessian,
AWQ's output error), the per-input-channel mean magnitude ``mean |x|`` (AWQ's saliency) and
the per-input-channel ``max |x|`` (SmoothQuant's).

The first two are running sums (the last a running maximum) in float32 over the rows of every batch a layer sees (all axes but
the last flattened), so batches of any number of rows add up; :class:`LayerStats` keeps
them with the row count. Nothing here knows Flax.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

_HIGHEST = jax.lax.Precision.HIGHEST


def rows_of(x: Any, features: int) -> jax.Array:
    """``x`` as float32 rows of ``features`` (every axis but the last flattened)."""
    x = jnp.asarray(x)
    if x.ndim < 1 or x.shape[-1] != features:
        raise ValueError(
            f"Calibration inputs must end in the layer's {features} input features. "
            f"Received: an input of shape {tuple(x.shape)}"
        )
    return x.reshape(-1, features).astype(jnp.float32)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["gram", "abs_sum", "count", "abs_max"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class LayerStats:
    """Running input statistics of one layer: ``gram = Σ xᵀx`` (``[in, in]``), ``abs_sum =
    Σ |x|`` (``[in]``), ``count``, the rows seen (float32, so that it sums under ``jit``),
    and ``abs_max = max |x|`` (``[in]``)."""

    gram: jax.Array
    abs_sum: jax.Array
    count: jax.Array
    abs_max: jax.Array

    @classmethod
    def zeros(cls, features: int) -> LayerStats:
        """No rows seen yet, for a layer of ``features`` inputs."""
        return cls(
            jnp.zeros((features, features), jnp.float32),
            jnp.zeros((features,), jnp.float32),
            jnp.zeros((), jnp.float32),
            jnp.zeros((features,), jnp.float32),
        )

    def merge(self, other: LayerStats) -> LayerStats:
        """The statistics of both sets of rows (sums added, maxima the larger)."""
        return LayerStats(
            self.gram + other.gram,
            self.abs_sum + other.abs_sum,
            self.count + other.count,
            jnp.maximum(self.abs_max, other.abs_max),
        )

    def total(self) -> LayerStats:
        """Statistics stacked along a leading axis, merged over it."""
        return LayerStats(
            self.gram.sum(0), self.abs_sum.sum(0), self.count.sum(0), self.abs_max.max(0)
        )

    @property
    def features(self) -> int:
        """The layer's number of input features."""
        return int(self.abs_sum.shape[-1])

    def update(self, x: Any) -> LayerStats:
        """These statistics with the rows of ``x`` (``[..., in]``) added; works under ``jit``."""
        return _update(self, rows_of(x, self.features))

    @property
    def mean_abs(self) -> jax.Array:
        """``mean |x|`` per input channel (0 before any row)."""
        return self.abs_sum / jnp.maximum(self.count, 1.0)


@jax.jit
def _update(stats: LayerStats, rows: jax.Array) -> LayerStats:
    gram = jnp.matmul(rows.T, rows, precision=_HIGHEST)
    return LayerStats(
        stats.gram + gram,
        stats.abs_sum + jnp.abs(rows).sum(0),
        stats.count + rows.shape[0],
        jnp.maximum(stats.abs_max, jnp.abs(rows).max(0, initial=0.0)),
    )


def gram(x: Any) -> jax.Array:
    """``XᵀX`` in float32 of the rows of ``x`` (``[..., in]``): GPTQ's Hessian up to a factor.

    Examples:
        >>> import jax.numpy as jnp
        >>> gram(jnp.ones((2, 3, 4))).shape, float(gram(jnp.ones((2, 3, 4)))[0, 0])
        ((4, 4), 6.0)
    """
    x = jnp.asarray(x)
    return LayerStats.zeros(int(x.shape[-1])).update(x).gram
