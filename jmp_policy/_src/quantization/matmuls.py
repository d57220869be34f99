"""Which matmul a layer runs: the glue's entry point, and the pieces formats build it from.

A layer (a Flax ``Dense``/``DenseGeneral``/``Einsum``, an NNX ``Linear``/``LinearGeneral``/
``Einsum``, with Flax's own matmul) hands its matmul to :func:`pick`, which returns the
replacement ``dot_general`` (or ``einsum``) for its policy, its state and its kernel, or
``None`` when the layer runs as written. The policy's scheme chooses
(:meth:`jmp_policy._src.schemes.Scheme.matmul`: explicit float8 GEMMs, int8 compute, a
``QuantizedArray`` kernel read whole); under a float policy a ``QuantizedArray`` kernel
that reaches its layer is read whole (:func:`stored_kernel`).

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

from jmp_policy._src import user_warnings
from jmp_policy._src.quantization import einsum_plan, kernel_matmul, quantized_matmul
from jmp_policy._src.quantization import quantized_array as quantization

JNP_EINSUM = quantized_matmul.JNP_EINSUM

# Below this many rows, contracted or output features, a float8 GEMM is not expected to
# beat bf16 once its quantization passes are paid. Measured on one H200 (jax 0.11.2,
# 2026-11-26; `benchmarks/float8_bench.py --tokens 8192 --sweep 1024,2048`: 2 MLP blocks,
# hidden 4x width, adam): the float8 step took 1.08x (delayed) and 0.97x (current) bf16's
# time at width 1024, 0.87x and 0.84x at width 2048.
FLOAT8_MIN_DIM = 2048

# TPU generations (device kinds) whose matmul has no float8 mode: the TPU compiler's cost
# model puts an e4m3 x e4m3 matmul at bf16's cycles or more (its operands go through a bf16
# pass), int8 x int8 at 0.50x (v5e, v5p) and 0.76x (v6e). Read from programs compiled without
# a TPU (`benchmarks/tpu_forms.py`, jax 0.12.0.1, libtpu 0.0.50.1, 2026-11-27); nothing timed.
TPU_WITHOUT_FLOAT8 = ("TPU v4", "TPU v5 lite", "TPU v5", "TPU v6 lite")

# path -> form, for the model run being explained (None: nobody is recording).
_FORMS: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar(
    "jmp_policy_matmul_forms", default=None
)
_WARNED: set[tuple[int, int, int]] = set()
_WARNED_AHEAD: set[tuple[str, tuple[int, ...], str]] = set()
_WARNED_TPU: set[str] = set()


@contextlib.contextmanager
def recording() -> Iterator[dict[str, str]]:
    """Collects ``{module path: the matmul it ran}`` for the runs inside (``explain``)."""
    forms: dict[str, str] = {}
    token = _FORMS.set(forms)
    try:
        yield forms
    finally:
        _FORMS.reset(token)


def record(path: str, form: str) -> None:
    """Records the form of ``path``'s matmul for the ``explain`` in progress, if any."""
    forms = _FORMS.get()
    if forms is not None:
        forms[path] = form


def storage_label(kernel: Any) -> str:
    """A ``QuantizedArray`` kernel named by its storage (``"int8"``, ``"int4"`` per channel,
    ``"int4/128"``): how the built-in formats, and a float policy, word its weights."""
    block = kernel.block_size
    label = str(kernel.mode) if block in (None, -1) else f"int4/{block}"
    return f"{label} with zero points" if kernel.zero_point is not None else label


def _label(scheme: Any, kernel: Any) -> str:
    """The weights' words for ``explain``: the scheme's (:meth:`Scheme.describe
    <jmp_policy._src.schemes.Scheme.describe>`), or the storage's under a float policy."""
    return storage_label(kernel) if scheme is None else str(scheme.describe(kernel))


def own_matmul_in_stack(path: str, kernel: Any, scheme: Any) -> None:
    """A layer with a matmul of its own (none the glue routes) whose stored kernel is a
    stack's (``kernel.stacked``): it runs from the dequantized copy, which
    :func:`dequantized_ahead` records and warns of. Both glues call this for such layers."""
    if getattr(kernel, "stacked", 0):
        dequantized_ahead(path, kernel, scheme)


def dequantized_ahead(path: str, kernel: Any, scheme: Any) -> bool:
    """Whether a layer runs as written because its ``QuantizedArray`` kernel was
    dequantized ahead of it (a scanned stack's layer sees a slice; ``kernel``: that stored
    kernel, ``None`` when there is none). Weights that came in quantized are served, never
    trained: a matmul in the compute dtype, never the int8 rule of float kernels (no
    activation rounding). ``scheme``: the layer's policy's (``None`` for a float policy),
    which words it; a scheme that does not read stored kernels (float8) keeps its matmul.
    Both glues ask this one function; a ``True`` is recorded for ``explain``."""
    if kernel is None or not (scheme is None or scheme.reads_stored_kernels):
        return False
    label = _label(scheme, kernel)
    record(path, f"{label} weights: dequantized ahead (a stack), compute-dtype matmul")
    key = (path, tuple(kernel.shape), label)
    if key not in _WARNED_AHEAD:  # once per layer and kernel: `explain` lists every one
        _WARNED_AHEAD.add(key)
        why = (
            "it was quantized as one kernel (`stacked=0`): quantize the stack per layer "
            "(`jp.linen.quantize` / `jp.nnx.quantize`, or `stacked_axes=`) so that each "
            "layer reads its own slice"
            if not getattr(kernel, "stacked", 0)
            else "a stacked layer reads its own slice of the quantized values only when it "
            "is a Dense, DenseGeneral or Einsum (NNX: Linear, LinearGeneral, Einsum) with "
            "Flax's own matmul, in a stack that slices its parameters along their leading "
            "axes (`nn.scan`/`nn.vmap` with `variable_axes={'params': 0}`, `nnx.scan`/"
            "`nnx.vmap` over `nnx.vmap`-made layers); otherwise unroll the stack, or give "
            "this layer a float policy"
        )
        user_warnings.warn(
            f"The {label} kernel {tuple(kernel.shape)} of the stacked layer "
            f"{path or '<root>'!r} is dequantized ahead of its stack: the layer runs from "
            "a compute-dtype copy of the whole stack's weights, not on its quantized "
            f"values ({why}). `explain` lists every such layer (this warning is given once)."
        )
    return True


_IN_STACK = "; per layer, in the stack's loop"


def in_stack(matmul: Callable[..., Any], path: str) -> Callable[..., Any]:
    """``matmul`` of a stacked layer reading its own slice of a stacked ``QuantizedArray``
    kernel (:mod:`jmp_policy._src.quantization.stack_layers`), its form recorded as such."""

    def run(*args: Any, **kwargs: Any) -> Any:
        result = matmul(*args, **kwargs)
        forms = _FORMS.get()
        if forms is not None and path in forms and not forms[path].endswith(_IN_STACK):
            forms[path] += _IN_STACK
        return result

    return run


def record_float8(path: str, m: int, k: int, n: int, scaling: str) -> None:
    """Records a float8 GEMM's form; warns once for a size below :data:`FLOAT8_MIN_DIM`."""
    small = min(m, k, n) < FLOAT8_MIN_DIM
    form = f"float8 ({scaling}), e4m3 x e4m3 GEMM {m}x{k}x{n}"
    if small:
        form += f"; below {FLOAT8_MIN_DIM}: bf16 may be faster"
        if not _WARNED:  # once per process: `explain` lists every such layer
            _WARNED.add((m, k, n))
            user_warnings.warn(
                f"The float8 layer {path or '<root>'!r} runs a {m}x{k}x{n} matmul: below "
                f"{FLOAT8_MIN_DIM} rows or features a float8 GEMM is not expected to be "
                "faster than bfloat16 once its quantization passes are paid (measured on an "
                "H200: a float8 MLP step took 1.08x bf16's time at width 1024 and 0.87x at "
                "2048). Give such layers a bfloat16 "
                "policy in the map unless you measured a gain; `explain` lists every such layer "
                "(this warning is given once).",
            )
    tpu = tpu_without_float8()
    if tpu:
        form += f"; {tpu} has no float8 matmul: bf16 may be faster"
        if not _WARNED_TPU:  # once per process
            _WARNED_TPU.add(tpu)
            user_warnings.warn(
                f"The float8 layer {path or '<root>'!r} runs on a {tpu}, whose matmul has no "
                "float8 mode: its float8 operands go through a bfloat16 pass (the TPU "
                "compiler's cost model puts a float8 matmul at bfloat16's cycles or more), "
                "so float8 is not expected to be faster than bfloat16 there and its "
                "quantization passes are paid on top. Give float8 layers a bfloat16 (or int8) "
                "policy on this TPU; `explain` lists every such layer (this warning is given "
                "once).",
            )
    if k % 16 or n % 16:
        form += "; dims not multiples of 16: XLA pads them"
    record(path, form)


def tpu_without_float8() -> str | None:
    """The device kind of the default backend's TPU when its matmul has no float8 mode
    (:data:`TPU_WITHOUT_FLOAT8`), else ``None``."""
    if jax.default_backend() != "tpu":
        return None
    kind = jax.devices()[0].device_kind
    return kind if kind in TPU_WITHOUT_FLOAT8 else None


def shapes(lhs: Any, rhs: Any, dims: Any) -> tuple[int, int, int]:
    """``(m, k, n)`` of a ``dot_general``: rows, contracted and output features."""
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


def of_kind(kind: str, dot_general: Callable[..., Any]) -> Callable[..., Any]:
    """``dot_general`` as the matmul of a layer of ``kind``: itself for ``"dot_general"``
    (Dense, DenseGeneral), the ``jnp.einsum`` that runs it (:func:`as_einsum`) for
    ``"einsum"``."""
    return as_einsum(lambda _: dot_general) if kind == "einsum" else dot_general


def as_einsum(dot_general_for: Callable[[Any], Callable[..., Any]]) -> Callable[..., Any]:
    """``jnp.einsum`` for ``(subscripts, input, kernel)`` whose contraction runs through
    ``dot_general_for(kernel)`` with the kernel on the right: a plain contraction as one
    ``dot_general`` (:mod:`jmp_policy._src.quantization.einsum_plan`), any other through
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


def stored_kernel(
    kind: str, path: str, kernel: Any, *, scheme: Any, int8_compute: bool
) -> Callable[..., Any]:
    """The matmul of a layer whose ``QuantizedArray`` ``kernel`` reaches it whole
    (:func:`jmp_policy._src.quantization.kernel_matmul.quantized_kernel_dot_general`), recorded
    in the words of ``scheme`` (the layer's format; ``None`` under a float policy)."""
    label = _label(scheme, kernel)

    def quantized_for(_: Any) -> Callable[..., Any]:
        def record_form(form: str) -> None:
            record(path, f"{label} weights: {form}")

        return kernel_matmul.quantized_kernel_dot_general(kernel, int8_compute, record_form)

    return as_einsum(quantized_for) if kind == "einsum" else quantized_for(None)


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
        state: the layer's state, for a scheme that keeps one (float8 delayed scaling).
        kernel: the layer's ``QuantizedArray`` kernel, when it reaches the layer whole.
    """
    scheme = policy.scheme
    if scheme is not None:
        return scheme.matmul(kind, path=path, state=state, kernel=kernel)  # type: ignore[no-any-return]
    if quantization.is_quantized(kernel):
        return stored_kernel(kind, path, kernel, scheme=None, int8_compute=False)
    return None
