"""float8 scaling (delayed or current) for explicit float8 matmuls, and its state.

The recipe of Transformer Engine, Keras and Flax: a matmul's two operands (the layer's
input and kernel) are quantized to ``float8_e4m3fn`` in the forward pass and the gradient
reaching its output to ``float8_e5m2`` in the backward pass, and each of the three matmuls
is a ``dot_general`` of two float8 operands (:mod:`jmp_policy._src.quantization.float8_matmul`), which
XLA runs as a native float8 GEMM on GPUs that have one (H100 and later). This module holds
the scaling: how a tensor's scale is computed (delayed, from a history kept as state, or
current, from the tensor's own amax) and the state it keeps.

**State.** Each of the three tensors has a float32 ``scale`` (shape ``()``, a multiplier
applied before the cast: ``fp8 = cast(clip(x * scale))`` and ``x ≈ fp8 / scale``) and a
float32 ``amax_history`` of shape ``(amax_history_length,)`` holding the amaxes of the
last ``amax_history_length`` steps, laid out as Flax, Keras and Transformer Engine lay it
out (a step rolls it by -1 and writes its amax at index 0), so their states read alike. One call's
state is a dict with Flax's and Keras's names: ``input_scale``, ``input_amax_history``,
``kernel_scale``, ``kernel_amax_history``, ``output_grad_scale``,
``output_grad_amax_history`` (:func:`init_state`).

**Delayed scaling** (:func:`update`): a step quantizes with the scale computed from the
history *before* its own amax is recorded; then its amax is pushed into the history and
the new scale is ``fp8_max / max(history)``, kept unchanged when that maximum is zero. A
non-finite amax (an overflowing step under dynamic loss scaling) is not recorded and
leaves the state as it was, so one bad step does not freeze a scale for a whole history.
The one exception, documented: while the history holds nothing yet (``max == 0``, the
first step), the step is scaled by its own amax (``fp8_max / amax``) instead of the
initial scale of 1, so inputs far from 1 in magnitude do not flush to zero (or saturate)
on the first step. The state stored after the step is the same either way.

**Values.** Quantization saturates at the float8 maximum (448 for e4m3, 57344 for e5m2),
as Transformer Engine does, but a non-finite value stays non-finite (``inf`` and ``nan``
are not clipped to a finite number), so a dynamic loss scale still sees an overflow.
The arithmetic runs in the tensor's own dtype (the compute dtype): nothing is upcast.
In float16 a scale above ``2**15`` is applied as ``2**15`` (float16 holds no larger
power of two); that loses nothing float16 itself could represent.

**New state as a gradient.** The float8 matmul's "gradient" with respect to the state
is the new state (Flax's ``_overwrite_with_gradient`` convention): ``jax.grad`` of a loss
with respect to the variables returns the updated state where the state was, and the
optimizer must replace, not update, it. Under ``jit`` a forward pass without ``grad``
computes no new state.

The explicit float8 matmul that layers run is :mod:`jmp_policy._src.quantization.float8_matmul`.
Nothing here imports Flax: :mod:`jmp_policy._src.quantization.matmuls` picks the layers that run it,
and the glue keeps the state where its framework does (Linen: in the collection of
:mod:`jmp_policy._src.state_collections`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jmp_policy._src.dtypes import MAX_AMAX_HISTORY
from jmp_policy._src.int_arguments import check_int

SCALINGS = ("delayed", "current")


def scaling_of(mode: str, scaling: Any) -> str:
    """A float8 policy's scaling: ``scaling`` checked against ``mode`` (``None``: as
    ``mode`` says; ``"delayed"`` with ``"float8_current"`` is a contradiction)."""
    if scaling is not None and (not isinstance(scaling, str) or scaling not in SCALINGS):
        raise ValueError(f"`scaling` must be one of {SCALINGS}. Received: scaling={scaling!r}")
    if mode == "float8_current" and scaling == "delayed":
        raise ValueError(
            "`scaling='delayed'` contradicts mode 'float8_current' (current scaling): pass "
            f"mode='float8' for delayed scaling. Received: mode={mode!r}, scaling={scaling!r}"
        )
    return "current" if mode == "float8_current" else scaling or "delayed"


E4M3 = np.dtype(jnp.float8_e4m3fn)
E5M2 = np.dtype(jnp.float8_e5m2)
TENSORS = ("input", "kernel", "output_grad")


def max_value(dtype: Any) -> float:
    """The largest finite value of a float8 ``dtype`` (448 for e4m3fn, 57344 for e5m2)."""
    return float(jnp.finfo(dtype).max)


def init_state(amax_history_length: int) -> dict[str, jax.Array]:
    """One call's float8 state: scales 1, empty (zero) histories, all float32.

    Examples:
        >>> from jmp_policy._src.quantization import float8
        >>> state = float8.init_state(4)
        >>> sorted(state)[:2]
        ['input_amax_history', 'input_scale']
        >>> state["input_scale"], state["input_amax_history"]
        (Array(1., dtype=float32), Array([0., 0., 0., 0.], dtype=float32))
    """
    length = check_int(amax_history_length, "amax_history_length", 1, MAX_AMAX_HISTORY)
    state: dict[str, jax.Array] = {}
    for tensor in TENSORS:
        state[f"{tensor}_scale"] = jnp.ones((), jnp.float32)
        state[f"{tensor}_amax_history"] = jnp.zeros((length,), jnp.float32)
    return state


def amax(x: jax.Array) -> jax.Array:
    """``max(|x|)`` as a float32 scalar (computed in ``x``'s dtype, then converted)."""
    return jnp.max(jnp.abs(x)).astype(jnp.float32)


def update(
    scale: jax.Array, history: jax.Array, new_amax: jax.Array, dtype: Any
) -> tuple[jax.Array, jax.Array]:
    """The state after a step whose amax is ``new_amax`` (see the module docstring).

    Returns:
        ``(new_scale, new_history)``: the history rolled by -1 with ``new_amax`` written
        at index 0 (the oldest amax is the one dropped) and ``fp8_max / max(new_history)``; both unchanged when
        ``new_amax`` is not finite; the scale unchanged when the new maximum is zero.

    Examples:
        >>> import jax.numpy as jnp
        >>> from jmp_policy._src.quantization import float8
        >>> scale, history = float8.update(
        ...     jnp.float32(1.0), jnp.zeros(2, jnp.float32), jnp.float32(2.0), float8.E4M3)
        >>> float(scale), history.tolist()
        (224.0, [2.0, 0.0])
        >>> scale, history = float8.update(scale, history, jnp.float32(jnp.inf), float8.E4M3)
        >>> float(scale), history.tolist()   # not recorded
        (224.0, [2.0, 0.0])
    """
    finite = jnp.isfinite(new_amax)
    pushed = jnp.roll(history, -1).at[0].set(new_amax)
    new_history = jnp.where(finite, pushed, history)
    top = jnp.max(new_history)
    fp8_max = jnp.float32(max_value(dtype))
    new_scale = jnp.where(top > 0, fp8_max / jnp.where(top > 0, top, 1.0), scale)
    return new_scale.astype(jnp.float32), new_history.astype(jnp.float32)


def step_scale(
    scale: jax.Array, history: jax.Array, current_amax: jax.Array, dtype: Any
) -> jax.Array:
    """The scale a step quantizes with: ``scale``, or, while ``history`` is empty, the
    step's own ``fp8_max / amax`` (when that amax is finite and above zero); 1 for a
    scale that is zero or not finite (a state zeroed by a layer left out of a step).

    Examples:
        >>> import jax.numpy as jnp
        >>> from jmp_policy._src.quantization import float8
        >>> zeros = jnp.zeros(4, jnp.float32)
        >>> float(float8.step_scale(jnp.float32(7.0), zeros, jnp.float32(2.0), float8.E4M3))
        224.0
        >>> float(float8.step_scale(jnp.float32(0.0), zeros, jnp.float32(0.0), float8.E4M3))
        1.0
    """
    fp8_max = jnp.float32(max_value(dtype))
    usable = jnp.isfinite(current_amax) & (current_amax > 0)
    own = fp8_max / jnp.where(usable, current_amax, 1.0)
    empty = jnp.max(history) <= 0
    # A scale that is not a positive finite number never came from `update`: a state that
    # got a zero "gradient" (its layer did not run in the differentiated function) reads
    # as a fresh one (scale 1), never as a division by zero.
    scale = jnp.where(jnp.isfinite(scale) & (scale > 0), scale, 1.0)
    return jnp.where(empty & usable, own, scale)


def scale_limit(compute: Any) -> float:
    """The largest power of two the compute dtype holds (2**15 for float16)."""
    return float(2.0 ** np.floor(np.log2(float(jnp.finfo(compute).max))))
