"""The toy "int6" format of ``quantization/toy_format_test.py`` (defined outside the package,
one ``jp.register`` call) in Equinox: ``quantize``, ``apply`` and ``explain``, eager and jit.
Its scheme reads stored kernels dequantized, which the routed ``Linear`` does too."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from quantization.toy_format_test import Int6DTypePolicy, Int6Scheme, _reference

import jmp_policy as jp


@pytest.fixture
def int6():
    jp.register(Int6Scheme, Int6DTypePolicy)
    try:
        yield Int6Scheme
    finally:
        jp.unregister(Int6Scheme)


class MLP(eqx.Module):
    hidden: eqx.nn.Linear
    head: eqx.nn.Linear

    def __call__(self, x):
        return self.head(jax.nn.relu(self.hidden(x)))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_equinox_quantize_apply_and_explain(int6, jit):
    policy_map = jp.DTypePolicyMap("float32", {"hidden": "int6_from_float32"})
    k1, k2 = jax.random.split(jax.random.key(0))
    model = MLP(eqx.nn.Linear(16, 32, key=k1), eqx.nn.Linear(32, 4, key=k2))
    x = jax.random.normal(jax.random.key(1), (16,))
    reference = _reference(model.hidden.weight.T)  # the library's [in, out]
    quantized = jp.equinox.quantize(model, policy_map)
    kernel = quantized.hidden.weight
    assert isinstance(kernel, jp.QuantizedArray) and kernel.shape == (16, 32)
    np.testing.assert_allclose(kernel.dequantize(), reference, rtol=1e-6)

    run = jp.equinox.apply(quantized, policy_map)
    y = (jax.jit(run) if jit else run)(x)
    expected = eqx.tree_at(lambda m: m.hidden.weight, model, jnp.asarray(reference.T))
    np.testing.assert_allclose(y, expected(x), rtol=1e-5, atol=1e-5)

    table = jp.equinox.explain(quantized, policy_map, x)
    hidden_row = next(line for line in table.splitlines() if line.startswith("hidden "))
    assert "int6_from_float32" in hidden_row and "key 'hidden'" in hidden_row
