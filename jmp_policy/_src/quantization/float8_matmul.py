"""The explicit float8 matmul: two float8 operands per ``dot_general``, scales on the result.

A layer's input and kernel are quantized to e4m3 and the gradient reaching its output to
e5m2 (:mod:`jmp_policy._src.quantization.float8` holds the scaling and its state); each of the three
matmuls (the forward and both gradients) is a ``dot_general`` of two float8 operands, the
form XLA's GEMM rewriter turns into one native float8 GEMM on GPUs that have one (H100 and
later). The state's "gradient" is its new value (Flax's ``_overwrite_with_gradient``
convention).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jmp_policy._src.quantization import float8
from jmp_policy._src.quantization.float8 import E4M3, E5M2


def _quantize(x: jax.Array, scale: jax.Array, dtype: Any) -> tuple[jax.Array, jax.Array]:
    """``x`` to float8 ``dtype`` with ``scale`` (saturating, non-finite kept), and that scale
    as it was applied (in ``x``'s dtype), in float32."""
    compute = x.dtype
    scale = jnp.minimum(scale.astype(jnp.float32), float8.scale_limit(compute)).astype(compute)
    fp8_max = jnp.asarray(float8.max_value(dtype), compute)
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
    current = float8.amax(a)
    if state is None:
        return float8.step_scale(
            jnp.float32(1.0), jnp.zeros((1,), jnp.float32), current, dtype
        ), None
    scale, history = state[f"{name}_scale"], state[f"{name}_amax_history"]
    return float8.step_scale(scale, history, current, dtype), float8.update(
        scale, history, current, dtype
    )


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
        >>> from jmp_policy._src.quantization import float8_matmul
        >>> x, w = jnp.full((2, 3), 0.1), jnp.full((3, 4), 0.5)
        >>> dims = (((1,), (0,)), ((), ()))
        >>> y = float8_matmul.matmul(x, w, dims, None)   # current scaling
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
        >>> from jmp_policy._src.quantization import float8, float8_matmul
        >>> state = float8.init_state(8)
        >>> x, w = jnp.full((2, 3), 0.1), jnp.full((3, 4), 0.5)
        >>> y = float8_matmul.dot_general(state)(x, w, (((1,), (0,)), ((), ())))
        >>> y.shape, bool(jnp.allclose(y, x @ w, rtol=0.1))
        ((2, 4), True)
        >>> new_state = jax.grad(
        ...     lambda s: float8_matmul.dot_general(s)(x, w, (((1,), (0,)), ((), ()))).sum())(state)
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
