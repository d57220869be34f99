"""Which matmul a layer runs: the one place that picks it, for the Linen and NNX glue.

A layer (a Flax ``Dense``/``DenseGeneral``/``Einsum``, an NNX ``Linear``/``LinearGeneral``/
``Einsum``, with Flax's own matmul) hands its matmul to :func:`pick`, which returns the
replacement ``dot_general`` (or ``einsum``) for its policy, its float8 state and its
kernel, or ``None`` when the layer runs as written:

* a float8 policy: :func:`jmp_policy._src.float8_matmul.dot_general` (explicit float8 GEMMs,
  delayed scaling with ``state``, current scaling without);
* a ``QuantizedArray`` kernel (int8 or int4 weights, any non-float8 policy):
  :func:`jmp_policy._src.kernel_matmul.quantized_kernel_dot_general`, which reads the
  quantized kernel itself (weight-only with the scale after the matmul, int4 blocks, or
  int8 x int8 under an int8 policy at enough rows);
* an int8 policy with a float kernel (quantization-aware training):
  :func:`jmp_policy._src.quantized_matmul.int8_dot_general`.

What each layer runs is recorded, at trace time, for ``explain`` (:func:`recording`), and
a float8 layer whose matmul is below the size where float8 pays warns once.

Nothing here knows Flax.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jmp_policy._src import (
    einsum_plan,
    float8,
    float8_matmul,
    kernel_matmul,
    quantization,
    quantized_matmul,
    run_report,
)

JNP_EINSUM = quantized_matmul.JNP_EINSUM

# Below this many rows, contracted or output features, a float8 GEMM is not expected to
# beat bf16 once its quantization passes are paid: float8 lost at width 768 and won at
# 8192 (the README's measurements), and this is the conservative middle.
FLOAT8_MIN_DIM = 4096

# path -> form, for the model run being explained (None: nobody is recording).
_FORMS: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar(
    "jmp_policy_matmul_forms", default=None
)
_WARNED: set[tuple[int, int, int]] = set()


@contextlib.contextmanager
def recording() -> Iterator[dict[str, str]]:
    """Collects ``{module path: the matmul it ran}`` for the runs inside (``explain``)."""
    forms: dict[str, str] = {}
    token = _FORMS.set(forms)
    try:
        yield forms
    finally:
        _FORMS.reset(token)


def _record(path: str, form: str) -> None:
    forms = _FORMS.get()
    if forms is not None:
        forms[path] = form


def dequantized_ahead(path: str, kernel: Any) -> None:
    """Records a layer whose ``QuantizedArray`` kernel was dequantized ahead of it (a
    scanned stack's layer sees a slice): the glue runs it as written, a matmul in the
    compute dtype, never the int8 rule of float kernels (no activation rounding)."""
    mode = kernel.mode if kernel.block_size in (None, -1) else f"int4/{kernel.block_size}"
    _record(path, f"{mode} weights: dequantized ahead (a stack), compute-dtype matmul")


def _float8_form(path: str, m: int, k: int, n: int, scaling: str) -> None:
    small = min(m, k, n) < FLOAT8_MIN_DIM
    form = f"float8 ({scaling}), e4m3 x e4m3 GEMM {m}x{k}x{n}"
    if small:
        form += f"; below {FLOAT8_MIN_DIM}: bf16 may be faster"
        if (m, k, n) not in _WARNED:
            _WARNED.add((m, k, n))
            run_report.warn(
                f"The float8 layer {path or '<root>'!r} runs a {m}x{k}x{n} matmul: below "
                f"{FLOAT8_MIN_DIM} rows or features a float8 GEMM is not expected to be "
                "faster than bfloat16 once its quantization passes are paid (on an H100, "
                "float8 lost at width 768 and won at 8192). Give such layers a bfloat16 "
                "policy in the map unless you measured a gain; `explain` lists them.",
            )
    if k % 16 or n % 16:
        form += "; dims not multiples of 16: XLA pads them"
    _record(path, form)


def _shapes(lhs: Any, rhs: Any, dims: Any) -> tuple[int, int, int]:
    (lc, rc), (lb, rb) = dims
    m = int(np.prod([d for i, d in enumerate(lhs.shape) if i not in lc and i not in lb]))
    k = int(np.prod([lhs.shape[i] for i in lc]))
    n = int(np.prod([d for i, d in enumerate(rhs.shape) if i not in rc and i not in rb]))
    return m, k, n


def kernel_on_the_right(fn: Callable[..., jax.Array], kernel: Any) -> Callable[..., jax.Array]:
    """``fn`` (a ``dot_general`` whose right operand is the kernel) for ``jnp.einsum``,
    which may hand the kernel over as the left operand: then the operands are swapped and
    the result laid out back as ``dot_general``'s (batch, left free, right free). Inside
    ``jnp.einsum``'s own ``jit`` the kernel is a new tracer: known by its shape then."""
    shape = np.shape(kernel)

    def dot_general(lhs: Any, rhs: Any, dimension_numbers: Any, *args: Any, **kw: Any) -> Any:
        left = lhs is kernel or (np.shape(lhs) == shape != np.shape(rhs))
        if not left or rhs is kernel:
            return fn(lhs, rhs, dimension_numbers, *args, **kw)
        (lc, rc), (lb, rb) = dimension_numbers
        y = fn(rhs, lhs, ((rc, lc), (rb, lb)), *args, **kw)
        n_b, n_in = len(lb), rhs.ndim - len(rc) - len(lb)
        n_k = y.ndim - n_b - n_in
        perm = (*range(n_b), *range(n_b + n_in, n_b + n_in + n_k), *range(n_b, n_b + n_in))
        return jnp.transpose(y, perm)

    return dot_general


def as_einsum(dot_general_for: Callable[[Any], Callable[..., Any]]) -> Callable[..., Any]:
    """``jnp.einsum`` for ``(subscripts, input, kernel)`` whose contraction runs through
    ``dot_general_for(kernel)`` with the kernel on the right: a plain contraction as one
    ``dot_general`` (:mod:`jmp_policy._src.einsum_plan`), any other through
    ``jnp.einsum``'s ``_dot_general`` (the route JAX's own AQT integration takes)."""

    def einsum(subscripts: str, lhs: Any, rhs: Any, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("out_sharding", 0) is None:
            kwargs.pop("out_sharding")
        kwargs.setdefault("preferred_element_type", jnp.result_type(lhs, rhs))
        steps = einsum_plan.plan(subscripts, np.shape(lhs), np.shape(rhs))
        if (
            steps is not None
            and not args
            and set(kwargs) <= {"precision", "preferred_element_type"}
        ):
            y = dot_general_for(rhs)(jnp.asarray(lhs), rhs, steps.dims, **kwargs)
            y = y if steps.perm is None else jnp.transpose(y, steps.perm)
            # jnp.einsum's result: the preferred type, else the operands' (Linen passes None).
            return y.astype(kwargs["preferred_element_type"] or jnp.result_type(lhs, rhs))
        inner = kernel_on_the_right(dot_general_for(rhs), rhs)
        return JNP_EINSUM(subscripts, lhs, rhs, *args, _dot_general=inner, **kwargs)

    return einsum


def pick(
    policy: Any,
    kind: str,
    path: str = "",
    state: Any = None,
    kernel: Any = None,
) -> Callable[..., Any] | None:
    """The matmul a layer runs (see the module docstring), or ``None`` (as written).

    Args:
        policy: the layer's policy.
        kind: ``"dot_general"`` (a drop-in ``jax.lax.dot_general``) or ``"einsum"`` (a
            drop-in ``jnp.einsum``).
        path: the layer's path, for ``explain`` and warnings.
        state: a float8 layer's delayed-scaling state (``None``: current scaling).
        kernel: the layer's ``QuantizedArray`` kernel, when it reaches the layer whole.
    """
    if float8.is_float8(policy):
        scaling = "delayed" if float8.is_delayed(policy) else "current"

        def fp8_for(kernel_arg: Any) -> Callable[..., Any]:
            inner = float8_matmul.dot_general(state)

            def dot_general(lhs: Any, rhs: Any, dims: Any, *args: Any, **kw: Any) -> Any:
                _float8_form(path, *_shapes(lhs, rhs, dims), scaling)
                return inner(lhs, rhs, dims, *args, **kw)

            return dot_general

        return as_einsum(fp8_for) if kind == "einsum" else fp8_for(None)
    if quantization.is_quantized(kernel):
        int8 = quantized_matmul.is_int8(policy)

        def quantized_for(_: Any) -> Callable[..., Any]:
            def record(form: str) -> None:
                mode = (
                    kernel.mode
                    if kernel.block_size in (None, -1)
                    else (f"int4/{kernel.block_size}")
                )
                _record(path, f"{mode} weights: {form}")

            return kernel_matmul.quantized_kernel_dot_general(kernel, int8, record)

        return as_einsum(quantized_for) if kind == "einsum" else quantized_for(None)
    if quantized_matmul.is_int8(policy):

        def qat(lhs: Any, rhs: Any, dims: Any, *args: Any, **kw: Any) -> Any:
            _record(path, "int8 x int8 (both quantized in the step), straight-through")
            return quantized_matmul.int8_dot_general(lhs, rhs, dims, *args, **kw)

        return as_einsum(lambda _: qat) if kind == "einsum" else qat
    return None
