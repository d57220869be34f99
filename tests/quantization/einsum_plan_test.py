"""Einsums with the kernel on either side (issue #31): ``einsum_plan.plan`` and the
quantized and float8 einsums of Gemma-style layouts in Linen and NNX, compared with the
dequantized model."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jmp_policy as jp
from jmp_policy._src.quantization import quantized_array as quantization
from jmp_policy._src.quantization.einsum_plan import plan

# (subscripts, kernel shape, input shape): the kernel first in jnp.einsum's dot_general
# for the first (its leading free axes C, K lead the output), second for the others.
LAYOUTS = [
    ("BTD,CKDH->CBTKH", (2, 2, 64, 16), (2, 6, 64)),
    ("BTD,NDH->BTNH", (4, 64, 16), (2, 6, 64)),
    ("BTNH,NHD->BTD", (4, 16, 64), (2, 6, 4, 16)),
    ("...D,DF->...F", (64, 32), (2, 6, 64)),
]
MODES = ["int8", "int4", "int4/32"]


@pytest.mark.parametrize(("subscripts", "kernel", "x"), LAYOUTS)
def test_plan_is_jnp_einsum_with_the_kernel_on_the_right(subscripts, kernel, x):
    a = jax.random.normal(jax.random.key(0), x)
    w = jax.random.normal(jax.random.key(1), kernel)
    steps = plan(subscripts, a.shape, w.shape)
    assert steps is not None
    y = jax.lax.dot_general(a, w, steps.dims)
    y = y if steps.perm is None else jnp.transpose(y, steps.perm)
    np.testing.assert_allclose(y, jnp.einsum(subscripts, a, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("subscripts", "x", "w"),
    [
        ("ii,ij->j", (2, 2), (2, 3)),  # a trace
        ("ij,jk", (2, 3), (3, 4)),  # implicit output
        ("ij,jk,kl->il", (2, 3), (3, 4)),  # three operands
        ("ij,jk->i", (2, 3), (3, 4)),  # k summed in the kernel alone
        ("bij,bjk->bik", (1, 2, 3), (4, 3, 5)),  # a size-1 batch broadcast
        ("ij,...jk->ik", (2, 3), (3, 4)),  # an ellipsis in the kernel
        ("ij,jk->ik", (2, 3, 1), (3, 4)),  # ranks that do not fit the subscripts
    ],
)
def test_plan_leaves_other_subscripts_to_jnp_einsum(subscripts, x, w):
    assert plan(subscripts, x, w) is None


def _dequantized(tree):
    return jax.tree.map(
        lambda a: a.dequantize() if quantization.is_quantized(a) else a,
        tree,
        is_leaf=quantization.is_quantized,
    )


class LinenEinsum(nn.Module):
    subscripts: str
    kernel: tuple

    @nn.compact
    def __call__(self, x):
        return nn.Einsum(self.kernel, self.subscripts, use_bias=False, name="kv")(x)


class NnxEinsum(nnx.Module):
    def __init__(self, subscripts, kernel, rngs):
        self.kv = nnx.Einsum(subscripts, kernel, rngs=rngs)

    def __call__(self, x):
        return self.kv(x)


def _close(out, ref, rtol):
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert out.shape == ref.shape
    np.testing.assert_allclose(out, ref, rtol=rtol, atol=rtol * np.abs(ref).max())


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("subscripts", "kernel", "x_shape"), LAYOUTS[:3])
def test_linen_quantized_einsum_equals_the_dequantized_model(subscripts, kernel, x_shape, mode):
    model = LinenEinsum(subscripts, kernel)
    x = jax.random.normal(jax.random.key(2), x_shape)
    variables = model.init(jax.random.key(0), x)
    policy_map = jp.DTypePolicyMap("float32", {"kv": f"{mode}_from_float32"})
    quantized = {"params": policy_map.quantize(variables["params"], stacked_axes=0)}
    assert isinstance(quantized["params"]["kv"]["kernel"], jp.QuantizedArray)
    ref = model.apply({"params": _dequantized(quantized["params"])}, x)
    fn = jp.linen.apply(model, "float32")  # weight-only: the same sums, reordered
    for run in (fn, jax.jit(fn)):
        _close(run(quantized, x), ref, 1e-5)
    assert jp.linen.apply(model, "mixed_bfloat16")(quantized, x).dtype == jnp.bfloat16
    if mode == "int8":  # an int8 policy: weight-only at 12 rows
        out = jp.linen.apply(model, policy_map)(quantized, x)
        _close(out, ref, 0.05)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("subscripts", "kernel", "x_shape"), LAYOUTS[:3])
def test_nnx_quantized_einsum_equals_the_dequantized_model(subscripts, kernel, x_shape, mode):
    x = jax.random.normal(jax.random.key(2), x_shape)
    policy_map = jp.DTypePolicyMap("float32", {"kv": f"{mode}_from_float32"})
    model = jp.nnx.quantize(NnxEinsum(subscripts, kernel, nnx.Rngs(0)), policy_map)
    assert isinstance(model.kv.kernel.get_value(), jp.QuantizedArray)
    reference = nnx.clone(model)
    nnx.update(reference, _dequantized(nnx.state(reference, nnx.Param)))
    ref = reference(x)
    fn = lambda m, x: jp.nnx.apply(m, "float32")(x)  # noqa: E731
    for run in (fn, nnx.jit(fn)):
        _close(run(model, x), ref, 1e-5)
    out = jp.nnx.apply(model, policy_map)(x)
    _close(out, ref, 0.05 if mode == "int8" else 1e-5)


def test_issue_example_kv_einsum_int8_from_mixed_bfloat16():
    class M(nnx.Module):
        def __init__(self, r):
            self.kv = nnx.Einsum("BTD,CKDH->CBTKH", (2, 2, 128, 16), rngs=r)

        def __call__(self, x):
            return self.kv(x)

    x = jax.random.normal(jax.random.key(2), (2, 6, 128))
    policy_map = jp.DTypePolicyMap("mixed_bfloat16", {"kv": "int8_from_mixed_bfloat16"})
    model = jp.nnx.quantize(M(nnx.Rngs(0)), policy_map)
    out = jp.nnx.apply(model, policy_map)(x)
    assert out.shape == (2, 2, 6, 2, 16) and out.dtype == jnp.bfloat16
    reference = nnx.clone(model)
    nnx.update(reference, _dequantized(nnx.state(reference, nnx.Param)))
    _close(out, reference(x), 0.02)
    table = jp.nnx.explain(model, policy_map, x)
    assert "matmuls:\n  kv  int8 weights: weight-only, scale after" in table


@pytest.mark.filterwarnings("ignore:The float8 layer 'kv' runs a 12x64x64 matmul")
def test_float8_delayed_einsum_with_the_kernel_first_keeps_each_operands_history():
    x = jax.random.normal(jax.random.key(2), (2, 6, 64))
    policy = jp.QuantizedFloat8DTypePolicy("float8", "float32", amax_history_length=4)
    model = jp.nnx.init_float8(NnxEinsum("BTD,CKDH->CBTKH", (2, 2, 64, 16), nnx.Rngs(0)), policy)
    wrt = nnx.DiffState(0, nnx.Any(nnx.Param, jp.nnx.Float8State))
    loss = lambda m, x: jp.nnx.apply(m, policy)(x).sum()  # noqa: E731
    grads = nnx.grad(loss, argnums=wrt)(model, x)
    _, state = jp.nnx.split_gradients(grads)
    new = state["kv"]["float8"].get_value()
    kernel = model.kv.kernel.get_value()
    np.testing.assert_allclose(new["input_amax_history"][0], jnp.abs(x).max(), rtol=1e-6)
    np.testing.assert_allclose(new["kernel_amax_history"][0], jnp.abs(kernel).max(), rtol=1e-6)
