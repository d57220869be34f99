"""What calibration gathers about a layer's inputs: the Gram matrix ``XᵀX`` (GPTQ's Hessian,
AWQ's output error) and the per-input-channel mean magnitude ``mean |x|`` (AWQ's saliency).

Both are running sums in float32 over the rows of every batch a layer sees (all axes but
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
    data_fields=["gram", "abs_sum", "count"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class LayerStats:
    """Running input statistics of one layer: ``gram = Σ xᵀx`` (``[in, in]``), ``abs_sum =
    Σ |x|`` (``[in]``) and ``count``, the rows seen (float32, so that it sums under ``jit``)."""

    gram: jax.Array
    abs_sum: jax.Array
    count: jax.Array

    @classmethod
    def zeros(cls, features: int) -> LayerStats:
        """No rows seen yet, for a layer of ``features`` inputs."""
        return cls(
            jnp.zeros((features, features), jnp.float32),
            jnp.zeros((features,), jnp.float32),
            jnp.zeros((), jnp.float32),
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
