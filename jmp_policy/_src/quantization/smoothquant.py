"""SmoothQuant (Xiao et al., 2023): int8 x int8 layers whose activation outliers are moved
into the weights by a per-input-channel smoothing scale.

For input channel ``j``, ``s_j = max|x_j|^alpha / max|W_j|^(1 - alpha)`` (``max|x_j|`` over
the calibration inputs, ``max|W_j|`` over the kernel's row ``j``; ``alpha`` 0.5 by default,
the paper's). The kernel's rows are multiplied by ``s`` before int8 round-to-nearest (one
scale per output channel) and the layer's inputs divided by ``s`` in the matmul, exactly as
AWQ's input scale is (:class:`~jmp_policy._src.quantization.awq.InputScaledArray`): ``y =
(x / s) @ Q(diag(s) W)``, equal to ``x @ W`` up to rounding, with ``x / s`` quantized per
row in the int8 x int8 GEMM. A channel never seen (``max|x_j| = 0``) or a zero row of the
kernel gets ``s_j = 1``. Nothing here knows Flax.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jmp_policy._src.dtypes import bounded_repr
from jmp_policy._src.quantization.awq import InputScaledArray
from jmp_policy._src.quantization.gptq import check_in_axes, check_kernel
from jmp_policy._src.quantization.quantized_array import quantize
from jmp_policy._src.quantization.quantized_tree import make

DEFAULT_ALPHA = 0.5


def check_alpha(alpha: Any, name: str = "alpha") -> float:
    """``alpha``, checked: a real number from 0 to 1 (bools refused); errors say ``name``."""
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float, np.integer, np.floating)):
        raise TypeError(
            f"`{name}` must be a number from 0 to 1 (SmoothQuant's migration strength). "
            f"Received: {name}={bounded_repr(alpha)} (of type {type(alpha).__name__})"
        )
    if not 0.0 <= float(alpha) <= 1.0:  # NaN fails too
        raise ValueError(
            f"`{name}` must be from 0 to 1 (0.5: the paper's default). Received: {name}={alpha!r}"
        )
    return float(alpha)


def smoothing_scale(abs_max: Any, w2: Any, alpha: float) -> jax.Array:
    """``s`` (``[in]``) for inputs whose ``max |x|`` per channel is ``abs_max`` and a 2-D
    kernel ``w2`` (``[in, M]``): ``abs_max^alpha / max|W_j|^(1 - alpha)``, 1 where either
    is 0 or the result is not finite, clipped to ``[1e-5, 1e5]``."""
    x = jnp.asarray(abs_max, jnp.float32)
    w = jnp.max(jnp.abs(jnp.asarray(w2, jnp.float32)), axis=-1)
    s = jnp.power(x, alpha) / jnp.power(w, 1.0 - alpha)
    ok = (x > 0) & (w > 0) & jnp.isfinite(s)
    return jnp.clip(jnp.where(ok, s, 1.0), 1e-5, 1e5)


def smoothquant_quantize(
    kernel: Any, abs_max: Any, *, alpha: float = DEFAULT_ALPHA, stacked: int = 0, in_axes: int = 1
) -> InputScaledArray:
    """SmoothQuant's int8 kernel: ``Q(diag(s) W)`` and the smoothing scale ``s``.

    Args:
        kernel: a floating kernel ``[in, ..., out]`` (``[*depth, in, ..., out]`` stacked).
        abs_max: ``max |x|`` of each input channel over the calibration inputs, ``[in]``
            (``[*depth, in]``); with ``in_axes`` > 1, ``in`` is the product of the input axes.
        alpha: the migration strength, from 0 (nothing moved: plain int8) to 1.
        stacked: leading axes of ``kernel`` that stack layers, each smoothed on its own.
        in_axes: the kernel's leading axes (after ``stacked``) the layer contracts.

    Returns:
        An :class:`~jmp_policy._src.quantization.awq.InputScaledArray` of mode ``"int8"``
        (a scale per output channel) whose ``input_scale`` is ``s`` (``[*depth,
        *in_shape]``); its ``dequantize()`` is ``W``'s estimate. Works under ``jit``.

    Raises:
        ValueError: ``alpha`` out of range, or shapes that disagree.
        TypeError: ``kernel`` is not a floating array, or ``alpha`` no number.
    """
    alpha = check_alpha(alpha)
    shape = check_kernel(kernel, stacked)
    in_axes = check_in_axes(in_axes, shape, stacked)
    lead, ins = shape[:stacked], shape[stacked : stacked + in_axes]
    rows = math.prod(ins)
    abs_max = jnp.asarray(abs_max)
    if tuple(abs_max.shape) != (*lead, rows):
        raise ValueError(
            f"`abs_max` must have shape {(*lead, rows)} for a kernel of shape {shape} "
            f"(stacked={stacked}, in_axes={in_axes}). Received: abs_max of shape "
            f"{tuple(abs_max.shape)}"
        )
    w2 = jnp.asarray(kernel).astype(jnp.float32).reshape(*lead, rows, -1)
    scale = lambda a, w: smoothing_scale(a, w, alpha)  # noqa: E731
    for _ in range(stacked):
        scale = jax.vmap(scale)
    s = scale(abs_max, w2)
    q = quantize((w2 * s[..., None]).reshape(shape), "int8", None, stacked)
    return make(
        InputScaledArray, q.values, q.scale, "int8", None, shape, np.dtype(kernel.dtype),
        stacked, s.reshape(*lead, *ins),
    )  # fmt: skip
