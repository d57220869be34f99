"""Zero-point weights (``"int4/<block>/asym"``, ``"int8/asym"``) on the Pallas serving route
(#49): the kernel multiplies the integer values and scales, and the zero points' term
``Σ_b sum(x_b) z_b s_b`` is taken from its float32 result. Run in Pallas's interpreter on
the CPU against the reference ``x @ dequantize(W)``, on ragged shapes, 1/7/16/64 rows, with
and without jit; ``explain`` names the form."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_policy as jp
from jmp_policy._src.quantization import serving_kernels
from jmp_policy._src.quantization.kernel_matmul import PALLAS_FORM, quantized_kernel_dot_general

DIMS = (((1,), (0,)), ((), ()))
K, N = 200, 46  # not multiples of the tiles; blocks of 64 and 128 leave a short last block


@pytest.fixture
def pallas_route():
    with serving_kernels.interpreted(), serving_kernels.using("pallas"):
        yield


@pytest.mark.parametrize("use_jit", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 16, 64])
@pytest.mark.parametrize("mode", ["int4/128/asym", "int4/64/asym", "int4/-1/asym", "int8/asym"])
def test_zero_point_weights_run_the_kernel_and_match_the_reference(
    pallas_route, mode, rows, use_jit
):
    w = jax.random.normal(jax.random.key(0), (K, N), jnp.float32) + 0.3  # skewed groups
    q = jp.get(f"{mode}_from_float32").quantize(w)
    assert q.zero_point is not None and bool(jnp.any(q.zero_point != 0))
    x = jax.random.normal(jax.random.key(1), (rows, K), jnp.float32)
    forms = []
    dot = quantized_kernel_dot_general(q, record=forms.append)
    run = lambda a: dot(a, jnp.zeros((K, N)), DIMS)  # noqa: E731
    y = (jax.jit(run) if use_jit else run)(x)
    assert forms[-1] == f"{PALLAS_FORM}, zero point folded"
    ref = np.asarray(jnp.dot(x, q.dequantize(jnp.float32), precision="highest"))
    assert y.shape == (rows, N) and y.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-5, atol=2e-5 * np.abs(ref).max())


@pytest.mark.parametrize("use_jit", [False, True])
def test_a_bfloat16_layer_and_explain_name_the_kernel_with_its_zero_point(pallas_route, use_jit):
    model = nn.Dense(N)
    x = jax.random.normal(jax.random.key(1), (3, 5, K), jnp.float32)  # 15 rows
    variables = model.init(jax.random.key(0), x)
    q = jp.get("int4/64/asym_from_float32").quantize(variables)
    policy = "int4/64/asym_from_mixed_bfloat16"
    pallas = jp.linen.apply(model, policy, serving_kernel="pallas")
    xla = jp.linen.apply(model, policy, serving_kernel="xla")
    run = jax.jit if use_jit else (lambda f: f)
    y, ref = run(pallas)(q, x), run(xla)(q, x)
    assert y.dtype == ref.dtype == jnp.bfloat16 and y.shape == (3, 5, N)
    np.testing.assert_allclose(
        np.asarray(y, np.float32), np.asarray(ref, np.float32), rtol=0.02, atol=0.05
    )
    table = jp.linen.explain(model, policy, q, x, serving_kernel="pallas")
    assert f"int4/64 with zero points weights: {PALLAS_FORM}, zero point folded" in table
    table = jp.linen.explain(model, policy, q, x, serving_kernel="xla")
    assert PALLAS_FORM not in table and "zero point folded" in table
