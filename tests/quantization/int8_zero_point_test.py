"""int8 with a zero point per output channel (``"int8/asym"``): values, dtypes, the folded
serving matmul, names, configs and round trips, with and without jit."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import serialization

import jmp_policy as jp
from jmp_policy._src.quantization.int_schemes import Int8Scheme
from jmp_policy._src.quantization.kernel_matmul import quantized_kernel_dot_general
from jmp_policy._src.quantization.zero_point import quantize_asymmetric

DIMS = (((1,), (0,)), ((), ()))


def _kernel(shape=(256, 48), shift=0.3, seed=0):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32) + shift


def test_values_use_all_256_codes_and_dequantize_within_half_a_step(maybe_jit):
    w = _kernel()
    q = maybe_jit(lambda k: jp.get("int8/asym_from_float32").quantize(k))(w)
    assert type(q) is jp.QuantizedArray and (q.mode, q.block_size) == ("int8", None)
    assert q.values.dtype == jnp.int8 and q.scale.dtype == jnp.float32
    assert q.zero_point.dtype == jnp.int8 and q.zero_point.shape == q.scale.shape == (48,)
    v = np.asarray(q.values).astype(int)
    assert v.min() == -128 and v.max() == 127
    low = np.minimum(np.asarray(w).min(axis=0), 0)
    high = np.maximum(np.asarray(w).max(axis=0), 0)
    np.testing.assert_allclose(q.scale, (high - low) / 255, rtol=1e-6)
    np.testing.assert_array_equal(
        q.zero_point, np.clip(np.round(-low / np.asarray(q.scale)) - 128, -128, 127)
    )
    assert np.all(np.abs(np.asarray(q.dequantize()) - np.asarray(w)) <= q.scale / 2 + 1e-6)
    assert q == quantize_asymmetric(w, None, mode="int8")


def test_zero_is_exact_and_a_skewed_channel_is_rounded_finer_than_symmetric():
    w = jnp.abs(_kernel(shift=0.0)).at[0, 0].set(0.0)
    asym = jp.get("int8/asym_from_float32").quantize(w)
    sym = jp.get("int8_from_float32").quantize(w)
    assert float(asym.dequantize()[0, 0]) == 0.0
    err_asym = float(jnp.mean(jnp.abs(asym.dequantize() - w)))
    err_sym = float(jnp.mean(jnp.abs(sym.dequantize() - w)))
    assert err_asym < 0.6 * err_sym  # all-positive channels: 256 codes on [0, max] vs 128


def test_bytes_stacked_empty_and_nonfinite():
    q = quantize_asymmetric(_kernel(), None, mode="int8")
    assert q.nbytes == 256 * 48 + 48 * 4 + 48
    w = _kernel((3, 20, 8))
    st = quantize_asymmetric(w, None, stacked=1, mode="int8")
    assert st.stacked == 1 and st.zero_point.shape == st.scale.shape == (3, 8)
    for i in range(3):
        one = quantize_asymmetric(w[i], None, mode="int8")
        np.testing.assert_array_equal(st.dequantize()[i], one.dequantize())
    empty = quantize_asymmetric(jnp.zeros((0, 4)), None, mode="int8")
    assert empty.dequantize().shape == (0, 4) and empty.zero_point.shape == (4,)
    d = np.asarray(quantize_asymmetric(_kernel((8, 4)).at[2, 1].set(jnp.nan), None, mode="int8")
                   .dequantize())  # fmt: skip
    assert np.isnan(d[:, 1]).all() and np.isfinite(np.delete(d, 1, axis=1)).all()
    with pytest.raises(ValueError, match="`block_size` must be None for int8"):
        quantize_asymmetric(_kernel(), 128, mode="int8")
    with pytest.raises(ValueError, match="`mode` must be"):
        quantize_asymmetric(_kernel(), None, mode="int6")


@pytest.mark.parametrize("use_jit", [False, True])
@pytest.mark.parametrize("rows", [1, 5, 200])
def test_matmul_folds_the_zero_point_weight_only(use_jit, rows):
    q = quantize_asymmetric(_kernel(), None, mode="int8")
    x = jax.random.normal(jax.random.key(1), (rows, 256), jnp.float32)
    forms = []
    dot = quantized_kernel_dot_general(q, int8_compute=True, record=forms.append)
    run = lambda a: dot(a, jnp.zeros((256, 48)), DIMS)  # noqa: E731
    y = (jax.jit(run) if use_jit else run)(x)
    if rows < 128:
        np.testing.assert_allclose(y, x @ q.dequantize(jnp.float32), rtol=2e-5, atol=2e-4)
        assert forms[-1] == "weight-only, scale after, zero point folded"
    else:  # Since #49 int8 x int8 reads zero-point weights too (was weight-only at every
        # row count): x quantized per row, the zero point folded in int32.
        xs = np.abs(np.asarray(x)).max(axis=1, keepdims=True) / 127
        xq = np.round(np.asarray(x) / xs) * xs
        np.testing.assert_allclose(y, xq @ q.dequantize(jnp.float32), rtol=2e-5, atol=2e-4)
        assert forms[-1] == "int8 x int8, zero point folded"


def test_policy_names_configs_and_round_trips():
    p = jp.get("int8/asym_from_mixed_bfloat16")
    assert type(p) is jp.QuantizedDTypePolicy and p.scheme == Int8Scheme(symmetric=False)
    assert (p.name, p.quantization_mode, p.block_size) == (
        "int8/asym_from_mixed_bfloat16", "int8", None,
    )  # fmt: skip
    assert p.get_config() == {"mode": "int8/asym", "source_name": "mixed_bfloat16"}
    assert jp.QuantizedDTypePolicy.from_config(p.get_config()) == p
    assert jp.deserialize(jp.serialize(p)) == p and jp.get(str(p)) == p
    assert p != jp.get("int8_from_mixed_bfloat16")
    assert jp.QuantizedDTypePolicy("int8/asym", "mixed_bfloat16") == p
    assert jp.get("int8_from_float32").get_config() == {"mode": "int8", "source_name": "float32"}
    with pytest.raises(ValueError, match="int8 takes no block size"):
        jp.get("int8/128_from_float32")
    with pytest.raises(ValueError, match="float16"):
        jp.get("int8/asym_from_mixed_float16")


def _same(a, b):
    """The same tree structure (zero points included) and bit-equal leaves."""
    return jax.tree.structure(a) == jax.tree.structure(b) and all(
        np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def test_a_tree_of_int8_zero_points_round_trips_and_serves(maybe_jit):
    import flax.linen as nn

    class Mlp(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(8, name="out")(nn.relu(nn.Dense(32, name="up")(x)))

    model, x = Mlp(), jax.random.normal(jax.random.key(2), (4, 16)) + 0.5
    policy = "int8/asym_from_float32"
    variables = model.init(jax.random.key(0), x)
    q = jp.linen.quantize(model, policy, variables, x)
    kernel = q["params"]["up"]["kernel"]
    assert kernel.zero_point.shape == (32,)
    assert _same(maybe_jit(lambda t: t)(q), q) and _same(jax.tree.map(lambda a: a, q), q)
    assert _same(serialization.from_bytes(q, serialization.to_bytes(q)), q)
    plain = {"k": {"values": kernel.values, "scale": kernel.scale, "zero_point": kernel.zero_point}}
    assert jp.rebuild_quantized(plain, jp.quantized_metadata({"k": kernel}))["k"] == kernel
    served = maybe_jit(jp.linen.apply(model, policy))(q, x)
    dense = jax.tree.map(
        lambda k: k.dequantize() if isinstance(k, jp.QuantizedArray) else k,
        q, is_leaf=lambda k: isinstance(k, jp.QuantizedArray),
    )  # fmt: skip
    np.testing.assert_allclose(served, model.apply(dense, x), rtol=1e-5, atol=1e-5)
    table = str(jp.linen.explain(model, policy, q, x))
    assert "int8 with zero points" in table and "zero point folded" in table


class _Stack(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(64, name="up")(x)
        return nn.Dense(32, use_bias=False, name="down")(nn.gelu(x))


@pytest.mark.parametrize("rows", [1, 128])  # the weight-only form, then int8 x int8
def test_compile_for_serving_folds_the_zero_point_into_int8_x_int8(rows):
    model = _Stack()
    x = (jax.random.normal(jax.random.key(1), (rows, 32)) + 0.5).astype(jnp.bfloat16)
    variables = jp.get("int8/asym_from_float32").quantize(model.init(jax.random.key(0), x))
    assert variables["params"]["up"]["kernel"].zero_point is not None
    policy = "int8/asym_from_mixed_bfloat16"
    serve = jp.linen.apply(model, policy)
    compiled, placed = jp.compile_for_serving(serve, variables, x)
    want = jax.jit(serve)(variables, x)
    got = compiled(placed, x)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    dense = jax.tree.map(
        lambda k: k.dequantize() if isinstance(k, jp.QuantizedArray) else k,
        variables,
        is_leaf=lambda k: isinstance(k, jp.QuantizedArray),
    )
    ref = np.asarray(model.apply(dense, x.astype(jnp.float32)))
    np.testing.assert_allclose(np.asarray(got, np.float32), ref, rtol=0.05, atol=0.05)
    form = "int8 x int8" if rows >= 128 else "weight-only, scale after"
    table = jp.linen.explain(model, policy, variables, x)
    assert f"up    int8 with zero points weights: {form}, zero point folded" in table, table
