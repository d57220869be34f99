"""Quantized kernels reach their layers' matmuls (issue #19): no float copy of a whole
kernel, int8 x int8 in cuBLAS's layout, outputs as dequantize-then-dot, explain's forms."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from flax_examples.measure import equations

import jmp_policy as jp
from jmp_policy._src.quantization import quantized_array as quantization


def _normal(shape, seed):
    """Standard normal float32 values, drawn by NumPy: `jax.random.normal` compiles once per
    shape, seconds each on CPU, for values that nothing here depends on."""
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32))


X_SMALL = _normal((4, 64), 1)  # 4 rows: weight-only
X_LARGE = _normal((256, 64), 2)  # 256 rows: int8 x int8


class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(128, name="up")(x))
        h = nn.relu(nn.DenseGeneral((2, 64), name="split")(h))
        h = nn.Einsum((2, 64, 64), "bhi,hio->bo", name="merge")(h)
        return nn.Dense(16, name="head")(h)


class NnxMLP(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(64, 128, rngs=rngs)
        self.split = nnx.LinearGeneral(128, (2, 64), rngs=rngs)
        self.merge = nnx.Einsum("bhi,hio->bo", (2, 64, 64), (64,), rngs=rngs)
        self.head = nnx.Linear(64, 16, rngs=rngs)

    def __call__(self, x):
        h = nnx.relu(self.split(nnx.relu(self.up(x))))
        return self.head(self.merge(h))


MODES = ["int8", "int4", "int4/32"]
KERNELS = {"up": (64, 128), "split": (128, 2, 64), "merge": (2, 64, 64), "head": (64, 16)}


def _dequantized(tree):
    return jax.tree.map(
        lambda a: a.dequantize() if quantization.is_quantized(a) else a,
        tree,
        is_leaf=quantization.is_quantized,
    )


def _kernel_dequantizations(jaxpr, shapes):
    """Multiplies on as many elements as a whole kernel (in any layout, blocks too): what
    dequantizing a kernel takes. No activation here has a kernel's size."""
    sizes = {int(np.prod(s)) for s in shapes}
    return [
        e
        for e in equations(jaxpr, "mul")
        if any(int(np.prod(getattr(v.aval, "shape", ()))) in sizes for v in e.invars)
    ]


def _linen(mode, policy="mixed_bfloat16"):
    model = LinenMLP()
    variables = model.init(jax.random.key(0), X_SMALL)
    kernels = jp.get(f"{mode}_from_float32")  # "split" and "merge": DenseGeneral, not stacks
    quantized = {"params": kernels.quantize(variables["params"], stacked_axes=0)}
    return model, quantized, jp.linen.apply(model, policy)


def _nnx(mode):
    model = NnxMLP(nnx.Rngs(0))
    reference = NnxMLP(nnx.Rngs(0))
    state = jp.get(f"{mode}_from_float32").quantize(nnx.state(model, nnx.Param), stacked_axes=0)
    nnx.update(model, state)
    nnx.update(reference, _dequantized(state))
    return model, reference


@pytest.mark.parametrize("mode", MODES)
def test_linen_apply_reads_no_float_copy_of_a_quantized_kernel(mode):
    model, quantized, fn = _linen(mode)
    jaxpr = jax.make_jaxpr(fn)(quantized, X_SMALL).jaxpr
    shapes = {s for name, s in KERNELS.items() if not (mode == "int4/32" and name == "split")}
    assert _kernel_dequantizations(jaxpr, shapes) == []
    ref = jp.linen.apply(model, "mixed_bfloat16")(
        {"params": _dequantized(quantized["params"])}, X_SMALL
    )
    for run in (fn, jax.jit(fn)):
        out = run(quantized, X_SMALL)
        assert out.dtype == jnp.bfloat16
        err = np.abs(np.asarray(out, np.float32) - np.asarray(ref, np.float32)).max()
        assert err <= 0.02 * np.abs(np.asarray(ref, np.float32)).max(), err


@pytest.mark.parametrize("mode", MODES)
def test_nnx_apply_reads_no_float_copy_of_a_quantized_kernel(mode):
    model, reference = _nnx(mode)
    fn = lambda m, x: jp.nnx.apply(m, "mixed_bfloat16")(x)  # noqa: E731
    jaxpr = jax.make_jaxpr(lambda x: fn(model, x))(X_SMALL).jaxpr
    shapes = {s for name, s in KERNELS.items() if not (mode == "int4/32" and name == "split")}
    assert _kernel_dequantizations(jaxpr, shapes) == []
    ref = fn(reference, X_SMALL)
    for run in (fn, nnx.jit(fn)):
        out = run(model, X_SMALL)
        err = np.abs(np.asarray(out, np.float32) - np.asarray(ref, np.float32)).max()
        assert err <= 0.02 * np.abs(np.asarray(ref, np.float32)).max(), err


def _int8_dots(jaxpr):
    return [
        e
        for e in equations(jaxpr, "dot_general")
        if [str(v.aval.dtype) for v in e.invars] == ["int8", "int8"]
    ]


def test_int8_policy_with_int8_weights_runs_int8_gemms_in_cublas_layout():
    """At 256 rows: int8 x int8 -> int32, the last dimension of both contracted."""
    model, quantized, fn = _linen("int8", "int8_from_mixed_bfloat16")
    jaxpr = jax.make_jaxpr(fn)(quantized, X_LARGE).jaxpr
    dots = _int8_dots(jaxpr)
    assert len(dots) == 4
    for e in dots:
        (lc, rc), _ = e.params["dimension_numbers"]
        lhs, rhs = (v.aval for v in e.invars)
        assert e.params["preferred_element_type"] == jnp.int32
        assert tuple(lc) == tuple(range(lhs.ndim - len(lc), lhs.ndim))
        assert tuple(rc) == tuple(range(rhs.ndim - len(rc), rhs.ndim))
    ref = jp.linen.apply(model, "mixed_bfloat16")(
        {"params": _dequantized(quantized["params"])}, X_LARGE
    )
    out = jax.jit(fn)(quantized, X_LARGE)
    rel = np.linalg.norm(np.asarray(out, np.float32) - np.asarray(ref, np.float32))
    assert rel / np.linalg.norm(np.asarray(ref, np.float32)) < 0.03
    # At 4 rows the matmuls are bound by weight bytes: weight-only, no int8 GEMM.
    assert _int8_dots(jax.make_jaxpr(fn)(quantized, X_SMALL).jaxpr) == []


def test_explain_shows_each_layers_form():
    model, quantized, _ = _linen("int8")
    small = jp.linen.explain(model, "int8_from_mixed_bfloat16", quantized, X_SMALL)
    large = jp.linen.explain(model, "int8_from_mixed_bfloat16", quantized, X_LARGE)
    assert "matmuls:\n  up     int8 weights: weight-only, scale after" in small
    assert "  up     int8 weights: int8 x int8" in large
    _, blocks, _ = _linen("int4/32")
    table = jp.linen.explain(model, "mixed_bfloat16", blocks, X_SMALL)
    assert "  up     int4/32 weights: int4 blocks" in table
    assert "  split  int4/32 weights: dequantized" in table  # a layout no fast form covers
    nnx_model, _ = _nnx("int4")
    assert "  up     int4 weights: weight-only, scale after" in jp.nnx.explain(
        nnx_model, "mixed_bfloat16", X_SMALL
    )


@pytest.mark.parametrize("lead", [(1,), (1, 1)], ids=["one row", "one row of one"])
def test_int4_blocks_multiply_a_single_row_as_two(lead, maybe_jit):
    """XLA's GPU compiler turns a one-row batched GEMM into a multiply and a reduction that
    writes a float32 array of the kernel's size (issue #28, seen by compiling for an H100);
    a zero row added keeps the GEMM. The result is the single row's."""
    model = nn.Dense(128, use_bias=False)
    x = _normal((*lead, 64), 4)
    params = model.init(jax.random.key(0), x)["params"]
    quantized = {"params": jp.get("int4/32_from_float32").quantize(params)}
    fn = jp.linen.apply(model, "mixed_bfloat16")
    dots = equations(jax.make_jaxpr(fn)(quantized, x).jaxpr, "dot_general")
    # The blocks' GEMM on two rows (rows, blocks, size), then the sum over blocks times
    # their scales (blocks, features): no dot on a single row.
    assert [tuple(e.invars[0].aval.shape) for e in dots] == [(2, 2, 32), (2, 128)]
    out = maybe_jit(fn)(quantized, x)
    assert out.shape == (*lead, 128) and out.dtype == jnp.bfloat16
    # The same row among others: the same values (rows of a GEMM are independent).
    others = _normal((3, 64), 5)
    stacked = fn(quantized, jnp.concatenate([x.reshape(1, 64), others]))
    np.testing.assert_allclose(
        np.asarray(out, np.float32).reshape(128), np.asarray(stacked[0], np.float32), rtol=1e-2
    )
    ref = x.reshape(1, 64) @ _dequantized(quantized["params"])["kernel"]
    err = np.abs(np.asarray(out, np.float32).reshape(1, 128) - np.asarray(ref)).max()
    assert err <= 0.02 * np.abs(np.asarray(ref)).max(), err


def test_cast_to_compute_still_dequantizes_a_whole_tree():
    _, quantized, _ = _linen("int8")
    cast = jp.get("int8_from_mixed_bfloat16").cast_to_compute(quantized["params"])
    assert cast["up"]["kernel"].dtype == jnp.bfloat16
    assert cast["up"]["kernel"].shape == KERNELS["up"]


def test_int4_is_stored_as_int4_at_an_eighth_of_float32():
    _, quantized, _ = _linen("int4")
    q = quantized["params"]["up"]["kernel"]
    assert q.values.dtype == jnp.int4 and q.values.shape == KERNELS["up"]
    assert q.nbytes / (64 * 128 * 4) <= 0.16


@pytest.mark.parametrize(
    ("mode", "policy", "bound"),
    [("int4", "float32", 1e-5), ("int8", "float32", 1e-5), ("int8", "int8_from_float32", 0.2)],
)
def test_gradients_flow_past_frozen_quantized_kernels(mode, policy, bound):
    """Training biases (or adapters) over a frozen quantized base: the input and bias
    gradients are the float ones (exactly for weight-only; int8 x int8 within what its
    activation quantization moves them, the bound the QAT tests use); kernels get float0."""
    model, quantized, fn = _linen(mode, policy)
    dequantized = {"params": _dequantized(quantized["params"])}
    reference = jp.linen.apply(model, "float32")
    c = _normal((16,), 3)

    def loss(apply, variables, x):
        return jnp.sum(apply(variables, x).astype(jnp.float32) * c)

    def rel(a, b):
        return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))

    gx = jax.jit(jax.grad(lambda x: loss(fn, quantized, x)))(X_LARGE)
    assert rel(gx, jax.grad(lambda x: loss(reference, dequantized, x))(X_LARGE)) < bound
    grads = jax.grad(lambda v: loss(fn, v, X_LARGE), allow_int=True)(quantized)
    kernel = grads["params"]["up"]["kernel"]
    assert isinstance(kernel, jp.QuantizedArray)
    assert kernel.values.dtype == jax.dtypes.float0
    ref = jax.grad(lambda v: loss(reference, v, X_LARGE))(dequantized)
    assert rel(grads["params"]["up"]["bias"], ref["params"]["up"]["bias"]) < bound


@pytest.mark.parametrize("jit", [False, True])
def test_int4_blocks_are_dequantized_into_one_gemm_from_64_rows(jit):
    """int4 kernels in blocks: a matmul per block below 64 rows, the kernel dequantized to
    the compute dtype and one GEMM from 64 (the crossover measured on an H200); both equal
    the dequantized kernel's product."""
    from jmp_policy._src.quantization import kernel_matmul

    assert kernel_matmul.INT4_BLOCKS_MAX_ROWS == 64
    w = jax.random.normal(jax.random.key(0), (256, 64)) / 16
    q = jp.get("int4/128_from_float32").quantize(w)
    ref_w = q.dequantize(jnp.float32)
    for rows, form in ((63, "int4 blocks"), (64, "dequantized, one GEMM")):
        forms = []
        dot = kernel_matmul.quantized_kernel_dot_general(q, record=forms.append)
        x = jax.random.normal(jax.random.key(rows), (rows, 256)).astype(jnp.bfloat16)
        run = jax.jit(dot, static_argnums=2) if jit else dot
        dims = (((1,), (0,)), ((), ()))
        y = run(x, jnp.zeros((256, 64), jnp.bfloat16), dims)
        assert forms == [form]
        assert y.dtype == jnp.bfloat16
        want = np.asarray(x, np.float32) @ np.asarray(ref_w)
        err = np.abs(np.asarray(y, np.float32) - want).max() / np.abs(want).max()
        assert err < 2e-2, (rows, err)
        jaxpr = jax.make_jaxpr(dot, static_argnums=2)(x, jnp.zeros((256, 64), jnp.bfloat16), dims)
        kernels = [e.outvars[0].aval for e in jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"]
        # one GEMM, or a dot batched over the 2 blocks (then the scaled sum over blocks)
        assert kernels[0].shape == ((64, 64) if rows == 64 else (2, 63, 64))
        assert len(kernels) == (1 if rows == 64 else 2)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("shape", [(1, 256), (1, 1, 256), (256,), (3, 256)])
@pytest.mark.parametrize("name", ["int8_from_float32", "int4_from_float32"])
def test_weight_only_one_row_runs_as_two_rows_of_the_compute_dtype(jit, shape, name):
    """One row with a float32 result made XLA's GPU compiler convert both operands to
    float32 (an f32 GEMM, compiled for an H100): the weight-only form multiplies a single
    row as two (a zero row added, then dropped). The result is the one row's, any shape."""
    from jmp_policy._src.quantization import kernel_matmul

    w = jax.random.normal(jax.random.key(0), (256, 64)) / 16
    q = jp.get(name).quantize(w)
    x = jax.random.normal(jax.random.key(1), shape).astype(jnp.bfloat16)
    dims = (((len(shape) - 1,), (0,)), ((), ()))
    forms = []
    dot = kernel_matmul.quantized_kernel_dot_general(q, record=forms.append)
    run = jax.jit(dot, static_argnums=2) if jit else dot
    y = run(x, jnp.zeros((256, 64), jnp.bfloat16), dims)
    assert forms == ["weight-only, scale after"]
    assert y.shape == (*shape[:-1], 64) and y.dtype == jnp.bfloat16
    want = np.asarray(x, np.float32) @ np.asarray(q.dequantize(jnp.float32))
    assert np.abs(np.asarray(y, np.float32) - want).max() < 2e-2 * np.abs(want).max()
    jaxpr = jax.make_jaxpr(dot, static_argnums=2)(x, jnp.zeros((256, 64), jnp.bfloat16), dims)
    (lhs,) = [e.invars[0].aval for e in jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"]
    padded = len(shape) > 1 and int(np.prod(shape[:-1])) == 1
    assert lhs.shape == ((2, *shape[1:]) if padded else shape)
    assert lhs.dtype == jnp.bfloat16
