"""AWQ (Lin et al., 2023): int4 weights with a per-input-channel scale ``s`` chosen so that
the channels that see large activations are rounded more finely.

The kernel's input rows are multiplied by ``s`` before round-to-nearest and the layer's
inputs divided by ``s`` in the matmul: ``y = (x / s) @ Q(diag(s) W)``, equal to ``x @ W`` up
to rounding. ``s = m^alpha`` for ``m`` the mean input magnitude per channel (the paper's
statistic; Keras uses the max), normalised so that ``max(s) · min(s) = 1``; ``alpha`` is the
best of ``num_grid_points + 1`` values in ``[0, 1]`` (Keras's grid) by the layer's output
error on the calibration inputs, ``‖XW - XŴ‖² = tr((W - Ŵ)ᵀ XᵀX (W - Ŵ))``, computed from
their Gram matrix. ``alpha = 0`` is round-to-nearest, so the search never does worse than it on
the calibration inputs. Nothing here knows Flax.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jmp_policy._src.quantization.gptq import check_bits_and_group, check_kernel, check_positive
from jmp_policy._src.quantization.quantized_array import QuantizedArray, quantize

DEFAULT_NUM_GRID_POINTS = 20
_HIGHEST = jax.lax.Precision.HIGHEST


def candidate_scales(mean_abs: jax.Array, alpha: jax.Array) -> jax.Array:
    """The per-input-channel scale ``s`` for exponent ``alpha``: ``m^alpha`` (an ``m`` below
    1e-8 counts as 1), at least 1e-4, divided by ``sqrt(max(s) · min(s))``."""
    m = jnp.asarray(mean_abs, jnp.float32)
    m = jnp.where(m < 1e-8, 1.0, m)
    s = jnp.maximum(jnp.power(m, alpha), 1e-4)
    return s / jnp.maximum(jnp.sqrt(jnp.max(s) * jnp.min(s)), 1e-8)


def _rows_times(w: jax.Array, s: jax.Array) -> jax.Array:
    """``w`` (``[in, ...]``) with each input row ``i`` multiplied by ``s[i]``."""
    return w * s.reshape(-1, *([1] * (w.ndim - 1)))


def output_error(w: jax.Array, w_hat: jax.Array, gram: jax.Array) -> jax.Array:
    """``‖XW - XŴ‖²`` from ``gram = XᵀX`` (kernels ``[in, ...]``)."""
    d = (w - w_hat).reshape(w.shape[0], -1)
    return jnp.sum(jnp.matmul(gram, d, precision=_HIGHEST) * d)


@functools.partial(jax.jit, static_argnames=("mode", "group", "num_grid_points"))
def _search(
    w: jax.Array,
    mean_abs: jax.Array,
    gram: jax.Array,
    *,
    mode: str,
    group: int | None,
    num_grid_points: int,
) -> tuple[jax.Array, jax.Array]:
    """The best ``s`` for one kernel ``w`` (float32) and every candidate's output error."""

    def loss(alpha: jax.Array) -> jax.Array:
        s = candidate_scales(mean_abs, alpha)
        q = quantize(_rows_times(w, s), mode, group)
        return output_error(w, _rows_times(q.dequantize(jnp.float32), 1.0 / s), gram)

    alphas = jnp.arange(num_grid_points + 1, dtype=jnp.float32) / num_grid_points
    losses = jax.lax.map(loss, alphas)
    best = jnp.argmin(jnp.where(jnp.isnan(losses), jnp.inf, losses))  # first minimum
    return candidate_scales(mean_abs, alphas[best]), losses


def awq_quantize(
    kernel: Any,
    mean_abs: Any,
    gram: Any,
    *,
    weight_bits: int = 4,
    group_size: int = 128,
    num_grid_points: int = DEFAULT_NUM_GRID_POINTS,
    stacked: int = 0,
) -> InputScaledArray:
    """AWQ-quantizes ``kernel``: ``Q(diag(s) W)`` with the searched input scale ``s``.

    Args:
        kernel: a floating kernel ``[in, ..., out]`` (``[*depth, in, ..., out]`` stacked).
        mean_abs: the mean magnitude of each input channel over the calibration inputs,
            ``[in]`` (``[*depth, in]``).
        gram: ``XᵀX`` of the calibration inputs, ``[in, in]`` (``[*depth, in, in]``).
        weight_bits: 4 (``jnp.int4``) or 8 (``jnp.int8``, per channel only).
        group_size: int4's rows per scale (``-1``: per channel).
        num_grid_points: the exponent grid is ``0, 1/n, ..., 1`` for ``n`` this.
        stacked: leading axes of ``kernel`` that stack layers, each searched on its own.

    Returns:
        An :class:`InputScaledArray`: the scaled kernel in round-to-nearest's storage and
        ``input_scale`` ``s`` (float32, ``[*depth, in]``), the scale the matmul divides the
        layer's inputs by; its ``dequantize()`` is ``W``'s estimate. Works under ``jit``.

    Raises:
        ValueError: unsupported ``weight_bits``/``group_size``/``num_grid_points``, or
            shapes that disagree.
        TypeError: ``kernel`` is not a floating array.
    """
    group = check_bits_and_group(weight_bits, group_size, "AWQ")
    check_positive(num_grid_points, "num_grid_points")
    shape = check_kernel(kernel, stacked)
    lead, rows = shape[:stacked], shape[stacked]
    mean_abs, gram = jnp.asarray(mean_abs), jnp.asarray(gram)
    for name, x, want in (
        ("mean_abs", mean_abs, (*lead, rows)),
        ("gram", gram, (*lead, rows, rows)),
    ):
        if tuple(x.shape) != want:
            raise ValueError(
                f"`{name}` must have shape {want} for a kernel of shape {shape} "
                f"(stacked={stacked}). Received: {name} of shape {tuple(x.shape)}"
            )
    mode = "int4" if weight_bits == 4 else "int8"
    block = group if weight_bits == 4 else None
    search = functools.partial(_search, mode=mode, group=block, num_grid_points=num_grid_points)
    for _ in range(stacked):
        search = jax.vmap(search)
    w32 = jnp.asarray(kernel).astype(jnp.float32)
    s, _ = search(w32, mean_abs.astype(jnp.float32), gram.astype(jnp.float32))
    scaled = w32 * s.reshape(*lead, rows, *([1] * (len(shape) - stacked - 1)))
    q = quantize(scaled, mode, block, stacked)
    return InputScaledArray(
        q.values, q.scale, mode, block, shape, np.dtype(kernel.dtype), stacked, s
    )


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["values", "scale", "input_scale"],
    meta_fields=["mode", "block_size", "shape", "original_dtype", "stacked"],
)
@dataclasses.dataclass(frozen=True)
class InputScaledArray(QuantizedArray):
    """An AWQ kernel: a :class:`~jmp_policy.QuantizedArray` of ``diag(s) W`` and ``s``,
    ``input_scale`` (float32, ``[*depth, in]``), which the matmul divides the layer's inputs
    by; :meth:`dequantize` gives ``W`` itself (the rows divided by ``s``), so every path that
    dequantizes reads the right kernel."""

    input_scale: Any = None

    def __post_init__(self) -> None:
        super().__post_init__()
        s = self.input_scale
        want = (*self.shape[: self.stacked], self.shape[self.stacked])
        concrete = isinstance(s, (jax.Array, np.ndarray)) and not isinstance(s, jax.core.Tracer)
        if concrete and tuple(s.shape) != want:
            raise ValueError(
                f"`input_scale` must have shape {want} (one per input row) for a kernel "
                f"of shape {self.shape}. Received: input_scale of shape {tuple(s.shape)}"
            )

    def dequantize(self, dtype: Any = None) -> jax.Array:
        dtype = self.original_dtype if dtype is None else dtype
        real = super().dequantize(jnp.float32)
        s = jnp.asarray(self.input_scale, jnp.float32)
        s = s.reshape(*s.shape, *([1] * (len(self.shape) - self.stacked - 1)))
        return (real / s).astype(dtype)

    def scaled_kernel(self) -> QuantizedArray:
        """The stored ``Q(diag(s) W)`` as a plain :class:`~jmp_policy.QuantizedArray`
        (what the weight-only matmul multiplies the inputs divided by ``s`` with)."""
        return QuantizedArray(
            self.values, self.scale, self.mode, self.block_size, self.shape,
            self.original_dtype, self.stacked,
        )  # fmt: skip

    @property
    def nbytes(self) -> int:
        """Bytes stored: values, scales and the input scale."""
        return super().nbytes + int(self.input_scale.size) * 4
