"""The ``serving_kernel`` option (issue #48): which weight-only matmul a quantized layer
runs. On a CPU the Pallas kernel is never chosen; under ``serving_kernels.interpreted()``
the route runs as on a GPU, the kernel in Pallas's interpreter, and is checked against
XLA's form of the same weights, in Linen and NNX, with and without ``jit``."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jmp_policy as jp
from jmp_policy._src.quantization import matmuls, serving_kernels
from jmp_policy._src.quantization.kernel_matmul import PALLAS_FORM

D_IN, D_OUT = 72, 34  # not multiples of the kernel's tiles
X = jax.random.normal(jax.random.key(1), (3, D_IN), jnp.float32)


class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(D_OUT, name="down")(nn.relu(nn.Dense(D_IN, name="up")(x)))


def _quantized(stored):
    model = Mlp()
    variables = model.init(jax.random.key(0), X)
    return model, jp.get(stored).quantize(variables)


@pytest.fixture
def gpu_route():
    with serving_kernels.interpreted():
        yield


def test_bad_serving_kernel_values_are_value_errors_naming_the_argument():
    with pytest.raises(
        ValueError, match=r"`serving_kernel` must be 'auto'.*serving_kernel='triton'"
    ):
        jp.linen.apply(Mlp(), "float32", serving_kernel="triton")
    with pytest.raises(ValueError, match=r"Received: serving_kernel=None"):
        jp.nnx.apply(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), "float32", serving_kernel=None)


@pytest.mark.parametrize("choice", ["auto", "pallas", "xla"])
def test_on_a_cpu_every_choice_runs_xlas_form(choice):
    model, q = _quantized("int8_from_float32")
    table = jp.linen.explain(model, "int8_from_float32", q, X, serving_kernel=choice)
    assert "  up    int8 weights: weight-only, scale after" in table
    assert "  down  int8 weights: weight-only, scale after" in table
    assert PALLAS_FORM not in table


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize(
    ("stored", "label"),
    [
        ("int8_from_float32", "int8"),
        ("int4_from_float32", "int4"),
        ("int4/32_from_float32", "int4/32"),
    ],
)
def test_pallas_runs_the_kernel_on_the_gpu_route_and_matches_xlas_form(
    gpu_route, stored, label, jit
):
    model, q = _quantized(stored)
    policy = stored.replace("float32", "mixed_bfloat16")
    pallas = jp.linen.apply(model, policy, serving_kernel="pallas")
    xla = jp.linen.apply(model, policy, serving_kernel="xla")
    run = jax.jit if jit else (lambda f: f)
    y, ref = run(pallas)(q, X), run(xla)(q, X)
    assert y.dtype == ref.dtype == jnp.bfloat16 and y.shape == (3, D_OUT)
    np.testing.assert_allclose(
        np.asarray(y, np.float32), np.asarray(ref, np.float32), rtol=0.02, atol=0.02
    )
    table = jp.linen.explain(model, policy, q, X, serving_kernel="pallas")
    assert f"{label} weights: {PALLAS_FORM}" in table
    assert PALLAS_FORM not in jp.linen.explain(model, policy, q, X, serving_kernel="xla")


def test_auto_keeps_xlas_form_until_a_gpu_kind_is_measured(gpu_route, monkeypatch):
    model, q = _quantized("int8_from_float32")
    assert serving_kernels.PALLAS_MAX_ROWS == {}  # measured on an H100: XLA's form faster
    assert PALLAS_FORM not in jp.linen.explain(model, "int8_from_float32", q, X)
    monkeypatch.setitem(serving_kernels.PALLAS_MAX_ROWS, "interpreted", 2)
    assert PALLAS_FORM not in jp.linen.explain(model, "int8_from_float32", q, X)  # 3 rows
    monkeypatch.setitem(serving_kernels.PALLAS_MAX_ROWS, "interpreted", 16)
    assert PALLAS_FORM in jp.linen.explain(model, "int8_from_float32", q, X)


def test_more_than_64_rows_and_int8_compute_from_128_keep_xlas_forms(gpu_route):
    model, q = _quantized("int8_from_float32")
    x = jnp.ones((65, D_IN))
    table = jp.linen.explain(model, "int8_from_float32", q, x, serving_kernel="pallas")
    assert "weight-only, scale after" in table and PALLAS_FORM not in table
    x = jnp.ones((128, D_IN))
    table = jp.linen.explain(model, "int8_from_mixed_bfloat16", q, x, serving_kernel="pallas")
    assert "int8 weights: int8 x int8" in table


def test_an_odd_number_of_int4_outputs_keeps_xlas_form(gpu_route):
    model = nn.Dense(33)
    q = jp.get("int4_from_float32").quantize(model.init(jax.random.key(0), X))
    table = jp.linen.explain(model, "int4_from_float32", q, X, serving_kernel="pallas")
    assert "int4 weights: weight-only, scale after" in table


@pytest.mark.parametrize("jit", [False, True])
def test_nnx_layers_of_a_batch_of_sequences_run_the_kernel(gpu_route, jit):
    """A [batch, seq, in] input: its 2 x 3 rows reach the kernel as one [6, in] matrix."""
    layer = nnx.Linear(D_IN, D_OUT, rngs=nnx.Rngs(0))
    q = jp.nnx.quantize(layer, "int4/32_from_float32")
    xs = X[None].repeat(2, 0)
    fn = lambda m, x, k: jp.nnx.apply(m, "int4/32_from_mixed_bfloat16", serving_kernel=k)(x)  # noqa: E731
    run = nnx.jit(fn, static_argnums=2) if jit else fn
    y, ref = run(q, xs, "pallas"), run(q, xs, "xla")
    assert y.shape == (2, 3, D_OUT) and y.dtype == jnp.bfloat16
    np.testing.assert_allclose(
        np.asarray(y, np.float32), np.asarray(ref, np.float32), rtol=0.02, atol=0.02
    )
    table = jp.nnx.explain(q, "int4/32_from_mixed_bfloat16", xs, serving_kernel="pallas")
    assert f"int4/32 weights: {PALLAS_FORM}" in table


def test_target_gpu_is_none_on_a_cpu():
    assert serving_kernels.target_gpu() is None
    assert serving_kernels.pallas_rows() == 0


@pytest.mark.parametrize("choice", ["pallas", "xla"])
def test_int4_blocks_with_a_short_last_block_match_the_dequantized_weights(gpu_route, choice):
    """72 input rows in blocks of 32 (32, 32, 8): both forms read block ``i`` as rows
    ``32 i`` to ``32 i + 31`` (XLA's form once cut 3 blocks of 24)."""
    model, q = _quantized("int4/32_from_float32")
    deq = jax.tree.map(
        lambda a: a.dequantize() if isinstance(a, jp.QuantizedArray) else a,
        q,
        is_leaf=lambda a: isinstance(a, jp.QuantizedArray),
    )
    ref = model.apply(deq, X)
    y = jp.linen.apply(model, "int4/32_from_float32", serving_kernel=choice)(q, X)
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("jit", [False, True])
def test_gptq_and_awq_kernels_run_the_kernel_awq_dividing_the_inputs_first(gpu_route, jit):
    model = Mlp()
    variables = model.init(jax.random.key(0), X)
    policy = jp.DTypePolicyMap(
        "float32", {"up": "awq/4/32_from_float32", "down": "gptq/4/32_from_float32"}
    )
    calib = jax.random.normal(jax.random.key(2), (64, D_IN), jnp.float32)
    q = jp.linen.calibrate(model, policy, variables, [calib])
    run = jax.jit if jit else (lambda f: f)
    y = run(jp.linen.apply(model, policy, serving_kernel="pallas"))(q, X)
    ref = run(jp.linen.apply(model, policy, serving_kernel="xla"))(q, X)
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=1e-5, atol=1e-5)
    table = jp.linen.explain(model, policy, q, X, serving_kernel="pallas")
    assert table.count(PALLAS_FORM) == 2, table


def test_compile_for_serving_compiles_the_kernel_of_the_function_it_is_given(gpu_route):
    model, q = _quantized("int4/32_from_float32")
    serve = jp.linen.apply(model, "int4/32_from_mixed_bfloat16", serving_kernel="pallas")
    x = X.astype(jnp.bfloat16)
    with matmuls.recording() as forms:
        compiled, placed = jp.compile_for_serving(serve, q, x)
    assert forms == {
        "up": f"int4/32 weights: {PALLAS_FORM}",
        "down": f"int4/32 weights: {PALLAS_FORM}",
    }
    y = compiled(placed, x)
    xla = jp.linen.apply(model, "int4/32_from_mixed_bfloat16", serving_kernel="xla")
    ref = jax.jit(xla)(q, x)
    assert y.dtype == ref.dtype == jnp.bfloat16
    np.testing.assert_allclose(
        np.asarray(y, np.float32), np.asarray(ref, np.float32), rtol=0.02, atol=0.02
    )


@pytest.mark.parametrize("kind", ["NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA H200"])
def test_auto_runs_xlas_form_on_the_measured_h100(monkeypatch, kind):
    """On an H100 (2026-11-27, docs/benchmarks.md) XLA's weight-only GEMM was faster than
    the kernel at 1-16 rows for int8, int4 and int4/128: "auto" keeps it there (and on an
    H200, its chip); "pallas" still takes the kernel up to 64 rows."""
    monkeypatch.setattr(serving_kernels, "target_gpu", lambda: kind)
    assert serving_kernels.pallas_rows() == 0
    with serving_kernels.using("pallas"):
        assert serving_kernels.pallas_rows() == 64
    with serving_kernels.using("xla"):
        assert serving_kernels.pallas_rows() == 0
