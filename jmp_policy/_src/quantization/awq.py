"""AWQ (Lin et al., 2023): int4 weights with a per-input-channel scale ``s`` chosen so that
the channels that see large activations are rounded more finely.

The kernel's input rows are multiplied by ``s`` before round-to-nearest and the layer's
inputs divided by ``s`` in the matmul: ``y = (x / s) @ Q(diag(s) W)``, equal to ``x @ W`` up
to rounding. ``s = m^alpha`` for ``m`` the mean input magnitude per channel (the paper's
statistic; Keras uses the max), normalised so that ``max(s) · min(s) = 1``; ``alpha`` is the
best of ``num_grid_points + 1`` values in ``[0, 1]`` (Keras's grid) by the layer's output
error on the calibration inputs, ``‖XW - XŴ‖² = tr((W - Ŵ)ᵀ XᵀX (W - Ŵ))``, computed from
their Gram matrix. ``alpha = 0`` is round-to-nearest, so the search never does worse than it on
the calibration inputs. With ``clip_search`` each group's int4 scale is then clipped as
AWQ's ``auto_clip`` does (:mod:`~jmp_policy._src.quantization.clipping`, by the group's share
of the output error of the scaled layer). A kernel contracted over several leading axes
(attention's output projection ``[heads, head_dim, out]``) is searched as its 2-D kernel,
with one ``s`` per input (shape ``[heads, head_dim]``). Nothing here knows Flax.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jmp_policy._src.int_arguments import check_int
from jmp_policy._src.quantization import asymmetric_grid, clipping, symmetric_grid
from jmp_policy._src.quantization.asymmetric_grid import check_symmetric
from jmp_policy._src.quantization.gptq import (
    check_bits_and_group,
    check_in_axes,
    check_kernel,
)
from jmp_policy._src.quantization.quantized_array import QuantizedArray, quantize
from jmp_policy._src.quantization.quantized_array_checks import stack_to_front
from jmp_policy._src.quantization.quantized_tree import make, register
from jmp_policy._src.quantization.zero_point import quantize_asymmetric

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


@functools.partial(jax.jit, static_argnames=("mode", "group", "num_grid_points", "clip", "sym"))
def _search(
    w: jax.Array,
    mean_abs: jax.Array,
    gram: jax.Array,
    *,
    mode: str,
    group: int | None,
    num_grid_points: int,
    clip: bool = False,
    sym: bool = True,
) -> tuple[jax.Array, ...]:
    """One kernel ``w`` (float32, ``[in, ...]``): the best ``s``, the integer values
    (float32), scales and zero points (zeros when ``sym``) of ``diag(s) w`` (clipped when
    ``clip``; on the asymmetric grid unless ``sym``), and every candidate's output error."""

    def rtn(x: jax.Array) -> QuantizedArray:
        return quantize(x, mode, group) if sym else quantize_asymmetric(x, group)

    def loss(alpha: jax.Array) -> jax.Array:
        s = candidate_scales(mean_abs, alpha)
        q = rtn(_rows_times(w, s))
        return output_error(w, _rows_times(q.dequantize(jnp.float32), 1.0 / s), gram)

    alphas = jnp.arange(num_grid_points + 1, dtype=jnp.float32) / num_grid_points
    losses = jax.lax.map(loss, alphas)
    best = jnp.argmin(jnp.where(jnp.isnan(losses), jnp.inf, losses))  # first minimum
    s = candidate_scales(mean_abs, alphas[best])
    scaled = _rows_times(w, s)
    if not clip:
        q = rtn(scaled)
        zero = q.zero_point
        zero = jnp.zeros(q.scale.shape, jnp.float32) if zero is None else zero
        return s, q.values.astype(jnp.float32), q.scale, zero.astype(jnp.float32), losses
    # AWQ's auto_clip: each group's clip by its share of the output error of the scaled
    # layer, whose inputs are x / s (Gram matrix XᵀX / (s sᵀ)).
    rows, rest = w.shape[0], tuple(w.shape[1:])
    sgrid = symmetric_grid.of(mode)  # int4's full range, as round-to-nearest's
    size = rows if group in (None, -1) else int(group)  # type: ignore[arg-type]
    gram_s = gram / s[:, None] / s[None, :]
    if not sym:
        values, scales, zeros = asymmetric_grid.quantize_groups(
            scaled.reshape(rows, -1), rest, size, gram_s
        )
        return s, values.reshape(w.shape), scales, zeros, losses
    values, scales = clipping.quantize_groups(scaled.reshape(rows, -1), rest, sgrid, size, gram_s)
    if mode == "int8":
        scales = scales.reshape(-1)
    return s, values.reshape(w.shape), scales, jnp.zeros(scales.shape), losses


def awq_quantize(
    kernel: Any,
    mean_abs: Any,
    gram: Any,
    *,
    weight_bits: int = 4,
    group_size: int = 128,
    num_grid_points: int = DEFAULT_NUM_GRID_POINTS,
    stacked: int = 0,
    in_axes: int = 1,
    clip_search: bool = False,
    symmetric: bool = True,
) -> InputScaledArray:
    """AWQ-quantizes ``kernel``: ``Q(diag(s) W)`` with the searched input scale ``s``.

    Args:
        kernel: a floating kernel ``[in, ..., out]`` (``[*depth, in, ..., out]`` stacked).
        mean_abs: the mean magnitude of each input channel over the calibration inputs,
            ``[in]`` (``[*depth, in]``); with ``in_axes`` > 1, ``in`` is the product of the
            input axes (flattened in order).
        gram: ``XᵀX`` of the calibration inputs, ``[in, in]`` (``[*depth, in, in]``).
        weight_bits: 4 (``jnp.int4``) or 8 (``jnp.int8``, per channel only).
        group_size: int4's rows per scale (``-1``: per channel).
        num_grid_points: the exponent grid is ``0, 1/n, ..., 1`` for ``n`` this.
        stacked: leading axes of ``kernel`` that stack layers, each searched on its own.
        in_axes: the kernel's leading axes (after ``stacked``) that the layer contracts
            with its inputs (2 for attention's output projection ``[heads, head_dim,
            out]``); ``s`` then has their shape.
        clip_search: after the scale search, choose each group's int4 scale by AWQ's
            ``auto_clip`` (:func:`~jmp_policy._src.quantization.clipping.search_scale` by
            the group's output error on the calibration inputs) instead of abs-max.
        symmetric: ``False``: the scaled kernel on the asymmetric grid (a zero point per
            group, all 16 codes; AutoAWQ's default), searched and clipped on it.

    Returns:
        An :class:`InputScaledArray`: the scaled kernel in round-to-nearest's storage and
        ``input_scale`` ``s`` (float32, ``[*depth, *in_shape]``), the scale the matmul
        divides the layer's inputs by; its ``dequantize()`` is ``W``'s estimate. Works
        under ``jit``.

    Raises:
        ValueError: unsupported ``weight_bits``/``group_size``, ``num_grid_points``/
            ``in_axes``/``stacked`` out of range, or shapes that disagree.
        TypeError: ``kernel`` is not a floating array, or ``num_grid_points``/``in_axes``/
            ``stacked`` no integer.
    """
    group = check_bits_and_group(weight_bits, group_size, "AWQ")
    sym = check_symmetric(symmetric, weight_bits)
    num_grid_points = check_int(num_grid_points, "num_grid_points", 1)
    shape = check_kernel(kernel, stacked)
    in_axes = check_in_axes(in_axes, shape, stacked)
    lead, ins = shape[:stacked], shape[stacked : stacked + in_axes]
    rows, rest = math.prod(ins), shape[stacked + in_axes :]
    mean_abs, gram = jnp.asarray(mean_abs), jnp.asarray(gram)
    for name, x, want in (
        ("mean_abs", mean_abs, (*lead, rows)),
        ("gram", gram, (*lead, rows, rows)),
    ):
        if tuple(x.shape) != want:
            raise ValueError(
                f"`{name}` must have shape {want} for a kernel of shape {shape} "
                f"(stacked={stacked}, in_axes={in_axes}). Received: {name} of shape "
                f"{tuple(x.shape)}"
            )
    mode = "int4" if weight_bits == 4 else "int8"
    block = group if weight_bits == 4 else None
    inner = math.prod(ins[1:])  # rows of the 2-D kernel per row of the stored kernel
    flat_block = block * inner if block is not None and block > 0 else block
    search = functools.partial(
        _search, mode=mode, group=flat_block, num_grid_points=num_grid_points,
        clip=bool(clip_search), sym=sym,
    )  # fmt: skip
    for _ in range(stacked):
        search = jax.vmap(search)
    w32 = jnp.asarray(kernel).astype(jnp.float32).reshape(*lead, rows, *rest)
    s, values, scales, zeros, _ = search(
        w32, mean_abs.astype(jnp.float32), gram.astype(jnp.float32)
    )
    dtype = jnp.int4 if weight_bits == 4 else jnp.int8
    extra = {} if sym else {"zero_point": zeros.astype(jnp.int8)}
    return make(
        InputScaledArray, values.reshape(shape).astype(dtype), scales, mode, block, shape,
        np.dtype(kernel.dtype), stacked, input_scale=s.reshape(*lead, *ins), **extra,
    )  # fmt: skip


@register(("values", "scale", "zero_point", "input_scale"), optional=("zero_point",))
@dataclasses.dataclass(frozen=True, eq=False)
class InputScaledArray(QuantizedArray):
    """An AWQ kernel: a :class:`~jmp_policy.QuantizedArray` of ``diag(s) W`` (with its zero
    points on the asymmetric grid) and ``s``,
    ``input_scale`` (float32, ``[*depth, *in_shape]``: the kernel's leading input axes, one
    for a Dense kernel, two for attention's output projection), which the matmul divides
    the layer's inputs by; :meth:`dequantize` gives ``W`` itself (divided by ``s``), so
    every path that dequantizes reads the right kernel."""

    reads_as_stored: ClassVar[bool] = False

    input_scale: Any = None

    def _validate(self, *, nan_scale: bool) -> None:
        super()._validate(nan_scale=nan_scale)
        s = self.input_scale
        k = self.stacked
        # The stacked axes lead the input scale whatever `stacked_at` is.
        shape = stack_to_front(self.shape, k, self.stacked_at)
        concrete = isinstance(s, (jax.Array, np.ndarray)) and not isinstance(s, jax.core.Tracer)
        if concrete and not (k + 1 <= s.ndim < len(shape) and tuple(s.shape) == shape[: s.ndim]):
            raise ValueError(
                f"`input_scale` must have shape {shape[: k + 1]} (one per input row; a "
                f"layer contracting several kernel axes: a longer prefix of the kernel's "
                f"shape, at most {shape[:-1]}) for a kernel of shape {self.shape}. "
                f"Received: input_scale of shape {tuple(s.shape)}"
            )

    def dequantize(self, dtype: Any = None) -> jax.Array:
        if self.stacked_at:
            return super().dequantize(dtype)  # dequantizes front(), then moves its axes
        dtype = self.original_dtype if dtype is None else dtype
        real = super().dequantize(jnp.float32)
        s = jnp.asarray(self.input_scale, jnp.float32)
        s = s.reshape(*s.shape, *([1] * (len(self.shape) - s.ndim)))
        return (real / s).astype(dtype)

    def scaled_kernel(self) -> QuantizedArray:
        """The stored ``Q(diag(s) W)`` as a plain :class:`~jmp_policy.QuantizedArray`, its
        zero points kept (what the weight-only matmul multiplies the inputs divided by ``s``
        with)."""
        return make(
            QuantizedArray, self.values, self.scale, self.mode, self.block_size, self.shape,
            self.original_dtype, self.stacked, stacked_at=self.stacked_at,
            zero_point=self.zero_point,
        )  # fmt: skip

    @property
    def nbytes(self) -> int:
        """Bytes stored: values, scales and the input scale."""
        return super().nbytes + int(self.input_scale.size) * 4
