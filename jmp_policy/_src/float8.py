"""float8 with delayed scaling: quantize-dequantize around a matmul, and its state.

The recipe of Transformer Engine, Keras and Flax: a matmul's two operands (the layer's
input and kernel) are quantized to ``float8_e4m3fn`` in the forward pass and the gradient
reaching its output to ``float8_e5m2`` in the backward pass, each through a
quantize-dequantize (``dequant(quant(x))``) that XLA can fold into a native float8 matmul
on GPUs that have one (H100 and later); elsewhere it is exact emulation.

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

**New state as a gradient.** :func:`in_qdq` and :func:`out_qdq` are ``jax.custom_vjp``
functions whose "gradient" with respect to the state is the new state (Flax's
``_overwrite_with_gradient`` convention): ``jax.grad`` of a loss with respect to the
variables returns the updated state where the state was, and the optimizer must
replace, not update, it. Under ``jit`` a forward pass without ``grad`` computes no new
state.

Nothing here imports Flax: :mod:`jmp_policy._src.matmuls` picks the layers that run
:func:`dot_general`, and the glue keeps the state where its framework does (Linen: in the
collection of :mod:`jmp_policy._src.state_collections`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

E4M3 = np.dtype(jnp.float8_e4m3fn)
E5M2 = np.dtype(jnp.float8_e5m2)
TENSORS = ("input", "kernel", "output_grad")
STATE_KEYS = tuple(f"{t}_{k}" for t in TENSORS for k in ("scale", "amax_history"))


def max_value(dtype: Any) -> float:
    """The largest finite value of a float8 ``dtype`` (448 for e4m3fn, 57344 for e5m2)."""
    return float(jnp.finfo(dtype).max)


def init_state(amax_history_length: int) -> dict[str, jax.Array]:
    """One call's float8 state: scales 1, empty (zero) histories, all float32.

    Examples:
        >>> from jmp_policy._src import float8
        >>> state = float8.init_state(4)
        >>> sorted(state)[:2]
        ['input_amax_history', 'input_scale']
        >>> state["input_scale"], state["input_amax_history"]
        (Array(1., dtype=float32), Array([0., 0., 0., 0.], dtype=float32))
    """
    if isinstance(amax_history_length, bool) or not isinstance(amax_history_length, int):
        raise TypeError(
            "`amax_history_length` must be an integer. "
            f"Received: amax_history_length={amax_history_length!r}"
        )
    if amax_history_length < 1:
        raise ValueError(
            "`amax_history_length` must be at least 1. "
            f"Received: amax_history_length={amax_history_length!r}"
        )
    state: dict[str, jax.Array] = {}
    for tensor in TENSORS:
        state[f"{tensor}_scale"] = jnp.ones((), jnp.float32)
        state[f"{tensor}_amax_history"] = jnp.zeros((amax_history_length,), jnp.float32)
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
        >>> from jmp_policy._src import float8
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
        >>> from jmp_policy._src import float8
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


def _scale_limit(compute: Any) -> float:
    """The largest power of two the compute dtype holds (2**15 for float16)."""
    return float(2.0 ** np.floor(np.log2(float(jnp.finfo(compute).max))))


def qdq(x: jax.Array, scale: jax.Array, dtype: Any) -> jax.Array:
    """``x`` quantized to float8 ``dtype`` with ``scale`` and back, in ``x``'s dtype.

    Saturates finite values at the float8 maximum; ``inf`` and ``nan`` stay non-finite.
    The scale is applied in ``x``'s dtype; one larger than that dtype holds (float16: a
    tensor whose amax is below ``fp8_max / 2**15``) is applied as the largest power of two
    it holds, which loses nothing float16 itself could keep.

    Examples:
        >>> import jax.numpy as jnp
        >>> from jmp_policy._src import float8
        >>> x = jnp.array([1.0, 0.3, 1000.0, jnp.inf], jnp.float32)
        >>> float8.qdq(x, jnp.float32(1.0), float8.E4M3).tolist()
        [1.0, 0.3125, 448.0, nan]
        >>> tiny = jnp.array([1e-6, 3e-7], jnp.float16)   # scale 448 / 1e-6 > float16's max
        >>> float8.qdq(tiny, jnp.float32(4.48e8), float8.E4M3).tolist()
        [9.5367431640625e-07, 2.980232238769531e-07]
    """
    compute = x.dtype
    fp8_max = jnp.asarray(max_value(dtype), compute)
    scale = jnp.minimum(scale.astype(jnp.float32), _scale_limit(compute))
    scaled = x * scale.astype(compute)
    clipped = jnp.clip(scaled, -fp8_max, fp8_max)
    clipped = jnp.where(jnp.isfinite(scaled), clipped, scaled)
    return clipped.astype(dtype).astype(compute) * (1.0 / scale).astype(compute)


def _straight_through(x: jax.Array) -> Any:
    return x


@jax.custom_vjp
def in_qdq(x: jax.Array, scale: jax.Array, history: jax.Array) -> jax.Array:
    """``x`` through e4m3 with delayed scaling; its gradient passes straight through,
    the state's "gradient" is the new state (see the module docstring)."""
    return _in_fwd(x, scale, history)[0]


def _in_fwd(x: jax.Array, scale: jax.Array, history: jax.Array) -> Any:
    a = amax(x)
    y = qdq(x, step_scale(scale, history, a, E4M3), E4M3)
    return y, update(scale, history, a, E4M3)


def _in_bwd(res: Any, g: jax.Array) -> Any:
    new_scale, new_history = res
    return g, new_scale, new_history


in_qdq.defvjp(_in_fwd, _in_bwd)


@jax.custom_vjp
def out_qdq(y: jax.Array, scale: jax.Array, history: jax.Array) -> jax.Array:
    """``y`` as it is; the gradient reaching it goes through e5m2 with delayed scaling,
    and the state's "gradient" is the new state (see the module docstring)."""
    return y


def _out_fwd(y: jax.Array, scale: jax.Array, history: jax.Array) -> Any:
    return y, (scale, history)


def _out_bwd(res: Any, g: jax.Array) -> Any:
    scale, history = res
    a = amax(g)
    g_q = qdq(g, step_scale(scale, history, a, E5M2), E5M2)
    new_scale, new_history = update(scale, history, a, E5M2)
    return g_q, new_scale, new_history


out_qdq.defvjp(_out_fwd, _out_bwd)


# -- the explicit float8 matmul -------------------------------------------------------------


def _quantize(x: jax.Array, scale: jax.Array, dtype: Any) -> tuple[jax.Array, jax.Array]:
    """``x`` to float8 ``dtype`` with ``scale`` (saturating, non-finite kept), and that scale
    as it was applied (in ``x``'s dtype), in float32."""
    compute = x.dtype
    scale = jnp.minimum(scale.astype(jnp.float32), _scale_limit(compute)).astype(compute)
    fp8_max = jnp.asarray(max_value(dtype), compute)
    scaled = x * scale
    clipped = jnp.where(jnp.isfinite(scaled), jnp.clip(scaled, -fp8_max, fp8_max), scaled)
    return clipped.astype(dtype), scale.astype(jnp.float32)


def _gemm_dtype(out: np.dtype) -> np.dtype:
    """The dtype the float8 GEMM writes: bfloat16 when the result is bfloat16 (what the
    GEMM rewriter turns into one fp8 cuBLAS call, the scale folded in); float32 otherwise
    (float16 could overflow before the scales are undone)."""
    return out if out == np.dtype(jnp.bfloat16) else np.dtype(jnp.float32)


def _scaled_dot(
    a: jax.Array,
    b: jax.Array,
    dims: Any,
    scale: jax.Array,
    out: np.dtype,
    sharding: Any = None,
) -> jax.Array:
    """``dot_general(a, b) / scale`` (``scale``: the product of the operands' scales) in
    ``out``: divided in float32, or multiplied by ``1 / scale`` in bfloat16 when the GEMM
    writes bfloat16 (one rounding of the scalar, at most 2**-9 relative: far inside
    float8's own spacing). ``sharding``: the result's, under explicit sharding (a
    gradient's is its operand's, as JAX's own transpose of ``dot_general`` gives)."""
    gemm = _gemm_dtype(out)
    y = jax.lax.dot_general(a, b, dims, preferred_element_type=gemm, out_sharding=sharding)
    if gemm == np.dtype(jnp.float32):
        return (y / scale).astype(out)
    return (y * (1.0 / scale).astype(gemm)).astype(out)


def _mm_dims(batched: bool) -> tuple[Any, Any, Any]:
    """dot_general dims of ``x @ w``, ``g @ w.T`` and ``x.T @ g`` on ``(B?, M, K)`` by
    ``(B?, K, N)``: one contracting dimension per operand, the form XLA's GEMM rewriter
    turns into native float8 GEMMs."""
    if batched:
        b = ((0,), (0,))
        return (((2,), (1,)), b), (((2,), (2,)), b), (((1,), (1,)), b)
    none = ((), ())
    return (((1,), (0,)), none), (((1,), (1,)), none), (((0,), (0,)), none)


def _scales(state: Any, name: str, a: jax.Array, dtype: Any) -> tuple[jax.Array, Any]:
    """The scale one tensor is quantized with and its new ``(scale, history)`` (None under
    current scaling, ``state is None``: the tensor's own ``fp8_max / amax``)."""
    current = amax(a)
    if state is None:
        return step_scale(jnp.float32(1.0), jnp.zeros((1,), jnp.float32), current, dtype), None
    scale, history = state[f"{name}_scale"], state[f"{name}_amax_history"]
    return step_scale(scale, history, current, dtype), update(scale, history, current, dtype)


def _value(x: Any) -> Any:
    return x.value if hasattr(x, "perturbed") else x


def _perturbed(x: Any) -> bool:
    return bool(getattr(x, "perturbed", True))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _fp8_matmul(
    x: jax.Array, w: jax.Array, state: Any, batched: bool, out: np.dtype, grads: Any
) -> Any:
    x8, s_x = _quantize(x, _scales(state, "input", x, E4M3)[0], E4M3)
    w8, s_w = _quantize(w, _scales(state, "kernel", w, E4M3)[0], E4M3)
    return _scaled_dot(x8, w8, _mm_dims(batched)[0], s_x * s_w, out)


def _fp8_matmul_fwd(x: Any, w: Any, state: Any, batched: bool, out: np.dtype, grads: Any) -> Any:
    needs_dx, needs_dw = _perturbed(x), _perturbed(w)
    x, w = _value(x), _value(w)
    state = jax.tree.map(_value, state)
    x_scale, x_new = _scales(state, "input", x, E4M3)
    w_scale, w_new = _scales(state, "kernel", w, E4M3)
    x8, s_x = _quantize(x, x_scale, E4M3)
    w8, s_w = _quantize(w, w_scale, E4M3)
    y = _scaled_dot(x8, w8, _mm_dims(batched)[0], s_x * s_w, out)
    g_state = (
        None if state is None else (state["output_grad_scale"], state["output_grad_amax_history"])
    )
    # The float8 operands are what the backward keeps (half the bytes of bf16), each only
    # where the other operand's gradient is asked for.
    saved = (
        x8 if needs_dw else None,
        w8 if needs_dx else None,
        s_x,
        s_w,
    )
    return y, (saved, g_state, x_new, w_new)


def _fp8_matmul_bwd(batched: bool, out: np.dtype, grads: Any, res: Any, g: jax.Array) -> Any:
    (x8, w8, s_x, s_w), g_state, x_new, w_new = res
    (x_dtype, x_sharding), (w_dtype, w_sharding) = grads
    g_scale, g_new = _scales(
        None
        if g_state is None
        else {"output_grad_scale": g_state[0], "output_grad_amax_history": g_state[1]},
        "output_grad",
        g,
        E5M2,
    )
    g8, s_g = _quantize(g, g_scale, E5M2)
    _, dx_dims, dw_dims = _mm_dims(batched)
    dx = None if w8 is None else _scaled_dot(g8, w8, dx_dims, s_g * s_w, x_dtype, x_sharding)
    dw = None if x8 is None else _scaled_dot(x8, g8, dw_dims, s_x * s_g, w_dtype, w_sharding)
    if g_state is None:
        return dx, dw, None
    new_state = {
        "input_scale": x_new[0],
        "input_amax_history": x_new[1],
        "kernel_scale": w_new[0],
        "kernel_amax_history": w_new[1],
        "output_grad_scale": g_new[0],
        "output_grad_amax_history": g_new[1],
    }
    return dx, dw, new_state


_fp8_matmul.defvjp(_fp8_matmul_fwd, _fp8_matmul_bwd, symbolic_zeros=True)


def _explicit(x: jax.Array) -> Any:
    """``x``'s sharding on the current mesh when it has explicit axes (the sharding of
    ``x``'s gradient), else None."""
    mesh = jax.sharding.get_abstract_mesh()
    if not getattr(mesh, "_any_axis_explicit", False):
        return None
    spec = getattr(getattr(jax.typeof(x), "sharding", None), "spec", None)
    return jax.sharding.NamedSharding(mesh, spec if spec is not None else jax.P())


def _dims(dimension_numbers: Any) -> tuple[tuple[int, ...], ...]:
    (lc, rc), (lb, rb) = dimension_numbers
    return tuple(tuple(int(i) for i in d) for d in (lc, rc, lb, rb))


def matmul(
    x: jax.Array, w: jax.Array, dimension_numbers: Any, state: Any, out: Any = None
) -> jax.Array:
    """``jax.lax.dot_general(x, w, dimension_numbers)`` in float8: ``x`` (the layer's
    input) and ``w`` (its kernel) quantized to e4m3, the gradient reaching the result to
    e5m2, each matmul (forward and both gradients) a ``dot_general`` of two float8
    operands with the scales applied to its result.

    The operands are first laid out as ``(batch, M, K)`` and ``(batch, K, N)`` (several
    contracting axes become one: the form XLA's GEMM rewriter turns into native float8
    GEMMs on GPUs that have them, H100 and later), and the result is laid out back as
    ``dot_general``'s. ``state`` is one call's delayed-scaling state (:func:`init_state`),
    whose "gradient" is its new value, or ``None`` for current scaling (each tensor scaled
    by its own amax in the same step; no state). ``out`` is the result's dtype (``x``'s
    and ``w``'s result type when ``None``).

    Examples:
        >>> import jax
        >>> import jax.numpy as jnp
        >>> from jmp_policy._src import float8
        >>> x, w = jnp.full((2, 3), 0.1), jnp.full((3, 4), 0.5)
        >>> dims = (((1,), (0,)), ((), ()))
        >>> y = float8.matmul(x, w, dims, None)   # current scaling
        >>> y.shape, bool(jnp.allclose(y, x @ w, rtol=0.1))
        ((2, 4), True)
    """
    lc, rc, lb, rb = _dims(dimension_numbers)
    out = np.dtype(jnp.result_type(x, w) if out is None else out)
    lf = tuple(i for i in range(x.ndim) if i not in lc and i not in lb)
    rf = tuple(i for i in range(w.ndim) if i not in rc and i not in rb)

    def size(shape: tuple[int, ...], axes: tuple[int, ...]) -> int:
        return int(np.prod([shape[i] for i in axes], dtype=np.int64))

    batch = tuple(x.shape[i] for i in lb)
    m, k, n = size(x.shape, lf), size(x.shape, lc), size(w.shape, rf)
    lead = (size(x.shape, lb),) if lb else ()
    x3 = jnp.transpose(x, lb + lf + lc).reshape(*lead, m, k)
    w3 = jnp.transpose(w, rb + rc + rf).reshape(*lead, k, n)
    grads = ((np.dtype(x.dtype), _explicit(x3)), (np.dtype(w.dtype), _explicit(w3)))
    y = _fp8_matmul(x3, w3, state, bool(lb), out, grads)
    return y.reshape(*batch, *(x.shape[i] for i in lf), *(w.shape[i] for i in rf))


def dot_general(state: Any) -> Callable[..., jax.Array]:
    """A drop-in ``jax.lax.dot_general`` for ``(input, kernel)`` operands, through float8
    with the call's ``state`` (``None``: current scaling) — what a Flax ``Dense`` gets as
    its ``dot_general`` (see :func:`matmul`).

    Examples:
        >>> import jax
        >>> import jax.numpy as jnp
        >>> from jmp_policy._src import float8
        >>> state = float8.init_state(8)
        >>> x, w = jnp.full((2, 3), 0.1), jnp.full((3, 4), 0.5)
        >>> y = float8.dot_general(state)(x, w, (((1,), (0,)), ((), ())))
        >>> y.shape, bool(jnp.allclose(y, x @ w, rtol=0.1))
        ((2, 4), True)
        >>> new_state = jax.grad(
        ...     lambda s: float8.dot_general(s)(x, w, (((1,), (0,)), ((), ()))).sum())(state)
        >>> float(new_state["kernel_amax_history"][0]), float(new_state["kernel_scale"])
        (0.5, 896.0)
    """

    def fp8_dot_general(
        lhs: jax.Array,
        rhs: jax.Array,
        dimension_numbers: Any,
        precision: Any = None,
        preferred_element_type: Any = None,
        **kwargs: Any,
    ) -> jax.Array:
        lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
        out = jnp.result_type(lhs, rhs)
        if preferred_element_type is not None and np.dtype(preferred_element_type) != np.dtype(
            jnp.float32
        ):
            out = preferred_element_type  # jnp.einsum asks for float32 by default: keep ours
        return matmul(lhs, rhs, dimension_numbers, state, out)

    return fp8_dot_general


def is_delayed(policy: Any) -> bool:
    """Whether a float8 ``policy`` keeps delayed-scaling state (not current scaling)."""
    return getattr(policy, "scaling", "delayed") == "delayed"


def is_float8(policy: Any) -> bool:
    """Whether ``policy`` is a float8 policy (``quantization_mode == "float8"``)."""
    return getattr(policy, "quantization_mode", None) == "float8"
