"""Biases stay float whatever their rank: an attention projection's ``[heads, head_dim]``
bias and a ``DenseGeneral``'s multi-axis bias are added to a matmul's output, never read by
one, so ``quantize``, ``map.quantize``, ``calibrate`` and a searched map leave them as they
are (Linen and NNX); their kernels are quantized."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jmp_policy as jp
from jmp_policy._src.tree_paths import leaf_path

D, HEADS = 64, 4
X = jax.random.normal(jax.random.key(1), (2, 8, D))


class LinenModel(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = x + nn.MultiHeadDotProductAttention(num_heads=HEADS, qkv_features=D, name="attn")(x, x)
        h = nn.DenseGeneral((HEADS, D // HEADS), name="split")(x)  # bias [4, 16]
        return nn.DenseGeneral(D, axis=(-2, -1), name="merge")(h)


class NnxModel(nnx.Module):
    def __init__(self, rngs):
        self.attn = nnx.MultiHeadAttention(
            num_heads=HEADS, in_features=D, qkv_features=D, decode=False, rngs=rngs
        )
        self.split = nnx.LinearGeneral(D, (HEADS, D // HEADS), rngs=rngs)
        self.merge = nnx.LinearGeneral((HEADS, D // HEADS), D, axis=(-2, -1), rngs=rngs)

    def __call__(self, x):
        return self.merge(self.split(x + self.attn(x)))


def _is_q(x):
    return isinstance(x, jp.QuantizedArray)


def _leaves(tree):
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_q)[0]
    return {leaf_path(kp): leaf for kp, leaf in flat}


def _assert_biases_float_kernels_quantized(before, after):
    before, after = _leaves(before), _leaves(after)
    biases = [p for p in before if p.endswith("bias")]
    kernels = [p for p in before if p.endswith("kernel")]
    assert len(biases) == len(kernels) == 6  # query, key, value, out, split, merge
    assert [p for p in biases if np.ndim(before[p]) >= 2] == [
        p for p in biases if "out" not in p and "merge" not in p
    ]  # the multi-axis ones are there: [heads, head_dim]
    for p in biases:
        assert not _is_q(after[p]), p
        assert after[p].dtype == jnp.float32, p
        np.testing.assert_array_equal(after[p], before[p])
    for p in kernels:
        assert _is_q(after[p]), p


def _linen():
    model = LinenModel()
    return model, model.init(jax.random.key(0), X)


@pytest.mark.parametrize("mode", ["int8", "int4/16", "int4"])
def test_linen_quantize_leaves_multi_axis_biases_float(mode, maybe_jit):
    model, variables = _linen()
    policy = jp.DTypePolicyMap("float32", {".*": f"{mode}_from_float32"})
    q = jp.linen.quantize(model, policy, variables, X)
    _assert_biases_float_kernels_quantized(variables["params"], q["params"])
    out = maybe_jit(jp.linen.apply(model, policy))(q, X)
    assert out.dtype == jnp.float32 and out.shape == X.shape
    ref = model.apply(
        {
            "params": jax.tree.map(
                lambda a: a.dequantize() if _is_q(a) else a, q["params"], is_leaf=_is_q
            )
        },
        X,
    )
    np.testing.assert_allclose(out, ref, rtol=2e-4, atol=2e-4)


def test_map_quantize_leaves_multi_axis_biases_float(maybe_jit):
    _, variables = _linen()
    policy = jp.DTypePolicyMap(
        "float32",
        {
            "attn/.*": "int8_from_float32",
            "s.*": "int4/16_from_float32",
            "m.*": "int4/16_from_float32",
        },
    )
    q = maybe_jit(lambda p: policy.quantize(p, stacked_axes=0))(variables["params"])
    _assert_biases_float_kernels_quantized(variables["params"], q)
    # The one-policy form too.
    q1 = jp.QuantizedDTypePolicy("int8", "float32").quantize(variables["params"], stacked_axes=0)
    _assert_biases_float_kernels_quantized(variables["params"], q1)


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_linen_calibrate_leaves_multi_axis_biases_float(method):
    model, variables = _linen()
    policy = jp.DTypePolicyMap("float32", {".*": f"{method}/4/16_from_float32"})
    q = jp.linen.calibrate(model, policy, variables, [X])
    _assert_biases_float_kernels_quantized(variables["params"], q["params"])
    eager = jp.linen.apply(model, policy)(q, X)
    np.testing.assert_allclose(
        jax.jit(jp.linen.apply(model, policy))(q, X), eager, rtol=1e-5, atol=1e-5
    )


def _loss(out, batch):
    return jnp.mean((out - batch) ** 2)


def test_linen_searched_map_leaves_multi_axis_biases_float():
    model, variables = _linen()
    result = jp.linen.search_map(
        model, variables, [X], _loss, budget={"effective_bits": 9},
        candidates=("int8_from_float32",), base="float32",
    )  # fmt: skip
    assert {row.choice for row in result.table} == {"int8_from_float32"}
    q = jp.linen.quantize(model, result.policy_map, variables, X)
    _assert_biases_float_kernels_quantized(variables["params"], q["params"])


def _nnx_params(model):
    return nnx.state(model, nnx.Param)


@pytest.mark.parametrize("mode", ["int8", "int4/16"])
def test_nnx_quantize_leaves_multi_axis_biases_float(mode, maybe_jit):
    model = NnxModel(nnx.Rngs(0))
    policy = jp.DTypePolicyMap("float32", {".*": f"{mode}_from_float32"})
    q = jp.nnx.quantize(model, policy)
    _assert_biases_float_kernels_quantized(_nnx_params(model), _nnx_params(q))
    run = jp.nnx.apply(q, policy)
    out = maybe_jit(lambda x: run(x))(X)
    assert out.dtype == jnp.float32 and out.shape == X.shape


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_nnx_calibrate_leaves_multi_axis_biases_float(method):
    model = NnxModel(nnx.Rngs(0))
    policy = jp.DTypePolicyMap("float32", {".*": f"{method}/4/16_from_float32"})
    q = jp.nnx.calibrate(model, policy, [X])
    _assert_biases_float_kernels_quantized(_nnx_params(model), _nnx_params(q))


def test_nnx_searched_map_leaves_multi_axis_biases_float():
    model = NnxModel(nnx.Rngs(0))
    result = jp.nnx.search_map(
        model, [X], _loss, budget={"effective_bits": 9},
        candidates=("int8_from_float32",), base="float32",
    )  # fmt: skip
    assert {row.choice for row in result.table} == {"int8_from_float32"}
    q = jp.nnx.quantize(model, result.policy_map)
    _assert_biases_float_kernels_quantized(_nnx_params(model), _nnx_params(q))
