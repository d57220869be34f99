"""Quantized KV caches under ``jp.linen.apply``/``init`` (issue #50): Flax's unmodified
``MultiHeadDotProductAttention(decode=True)`` keeps its ``cached_key``/``cached_value``
quantized, decoding under Python loops, ``lax.scan`` and ``lax.while_loop``, with and
without ``jit``, close to the bfloat16 cache's outputs."""

from __future__ import annotations

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_policy as jp

B, T, F, HEADS, HEAD_DIM = 2, 8, 32, 2, 128
JIT = pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])


class Decoder(nn.Module):
    decode: bool = True

    @nn.compact
    def __call__(self, x):
        for i in range(2):
            x = x + nn.MultiHeadDotProductAttention(
                num_heads=HEADS, qkv_features=HEADS * HEAD_DIM, decode=self.decode, name=f"attn_{i}"
            )(nn.LayerNorm(name=f"norm_{i}")(x))
        return nn.Dense(4, name="head")(x)


MODEL = Decoder()
TOKENS = jax.random.normal(jax.random.key(1), (B, T, F))
PARAMS = Decoder(decode=False).init(jax.random.key(0), TOKENS)["params"]


def _cache(kv_cache, policy="mixed_bfloat16"):
    return jp.linen.init(MODEL, policy, kv_cache=kv_cache)(jax.random.key(0), TOKENS)["cache"]


def _stepper(kv_cache, policy="mixed_bfloat16"):
    fn = jp.linen.apply(MODEL, policy, kv_cache=kv_cache)

    def step(cache, token):
        out, state = fn({"params": PARAMS, "cache": cache}, token, mutable=["cache"])
        return state["cache"], out

    return step


def _decode_loop(kv_cache, jit):
    step = _stepper(kv_cache)
    step = jax.jit(step) if jit else step
    cache, outs, caches = _cache(kv_cache), [], []
    for t in range(T):
        cache, out = step(cache, TOKENS[:, t : t + 1])
        outs.append(out)
        caches.append(cache)
    return jnp.concatenate(outs, axis=1), caches


def _rel(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize(
    ("kv_cache", "stored", "scale_shape"),
    [("int8", jnp.int8, (B, T, HEADS, 1)), ("fp8", jnp.float8_e4m3fn, (B, T, 1, 1))],
)
def test_init_creates_the_caches_in_the_stored_format(kv_cache, stored, scale_shape):
    cache = _cache(kv_cache)
    for layer in ("attn_0", "attn_1"):
        for name in ("cached_key", "cached_value"):
            stored_cache = cache[layer][name]
            assert isinstance(stored_cache, jp.QuantizedKVCache)
            assert stored_cache.values.dtype == stored
            assert stored_cache.values.shape == (B, T, HEADS, HEAD_DIM)
            assert stored_cache.scale.shape == scale_shape
            assert stored_cache.dtype == "bfloat16"
        assert cache[layer]["cache_index"].dtype == jnp.int32


@pytest.mark.parametrize("kv_cache", ["int8", "float8_e4m3fn"])
def test_cache_bytes_at_most_053_of_the_bfloat16_cache(kv_cache):
    def nbytes(tree):
        return sum(x.nbytes for x in jax.tree.leaves(tree))

    bf16 = _cache(None)
    quantized = _cache(kv_cache)
    for layer in ("attn_0", "attn_1"):
        for name in ("cached_key", "cached_value"):
            ratio = nbytes(quantized[layer][name]) / nbytes(bf16[layer][name])
            assert ratio <= 0.53


@JIT
@pytest.mark.parametrize(("kv_cache", "tolerance"), [("int8", 0.01), ("fp8", 0.04)])
def test_python_loop_decoding_is_close_to_the_bfloat16_cache(jit, kv_cache, tolerance):
    reference, _ = _decode_loop(None, jit)
    outs, caches = _decode_loop(kv_cache, jit)
    assert outs.shape == reference.shape
    assert 0 < _rel(outs, reference) < tolerance
    # a token's stored values and scales never change after its step
    final = caches[-1]["attn_1"]["cached_value"]
    for t, cache in enumerate(caches):
        earlier = cache["attn_1"]["cached_value"]
        np.testing.assert_array_equal(
            np.asarray(final.values[:, : t + 1]), np.asarray(earlier.values[:, : t + 1])
        )
        np.testing.assert_array_equal(
            np.asarray(final.scale[:, : t + 1]), np.asarray(earlier.scale[:, : t + 1])
        )
    assert int(caches[-1]["attn_0"]["cache_index"]) == T


@JIT
@pytest.mark.parametrize("loop", ["scan", "while_loop"])
def test_decoding_under_lax_loops_matches_the_python_loop(jit, loop):
    step = _stepper("int8")
    tokens = jnp.swapaxes(TOKENS, 0, 1)[:, :, None]  # [T, B, 1, F]

    def decode(cache):
        if loop == "scan":
            return jax.lax.scan(step, cache, tokens)
        outs = jnp.zeros((T, B, 1, 4), jnp.float32)

        def body(carry):
            t, cache, outs = carry
            cache, out = step(cache, tokens[t])
            return t + 1, cache, outs.at[t].set(out.astype(outs.dtype))

        _, cache, outs = jax.lax.while_loop(lambda c: c[0] < T, body, (0, cache, outs))
        return cache, outs

    decode = jax.jit(decode) if jit else decode
    cache, outs = decode(_cache("int8"))
    expected, caches = _decode_loop("int8", jit=True)
    np.testing.assert_allclose(
        np.asarray(jnp.swapaxes(outs[:, :, 0], 0, 1), np.float32),
        np.asarray(expected, np.float32),
        rtol=2e-2,
        atol=2e-2,
    )
    assert isinstance(cache["attn_0"]["cached_key"], jp.QuantizedKVCache)
    np.testing.assert_array_equal(
        np.asarray(cache["attn_0"]["cached_key"].values),
        np.asarray(caches[-1]["attn_0"]["cached_key"].values),
    )


def test_a_map_chooses_the_format_per_attention_module():
    cache = _cache({"attn_0": "int8", "attn_1": None})
    assert cache["attn_0"]["cached_key"].values.dtype == jnp.int8
    assert cache["attn_1"]["cached_key"].dtype == jnp.bfloat16  # stored as written
    cache = _cache({r"attn_\d": "fp8"})
    assert cache["attn_1"]["cached_value"].format == "float8_e4m3fn"
    step = jax.jit(_stepper({"attn_0": "int8", "attn_1": None}))
    cache, _ = step(_cache({"attn_0": "int8", "attn_1": None}), TOKENS[:, :1])
    assert cache["attn_0"]["cached_key"].values.dtype == jnp.int8
    assert cache["attn_1"]["cached_key"].dtype == jnp.bfloat16


def test_a_float_cache_is_quantized_on_its_first_step():
    cache, _ = jax.jit(_stepper("int8"))(_cache(None), TOKENS[:, :1])
    assert cache["attn_0"]["cached_key"].values.dtype == jnp.int8


def test_a_cache_stored_in_another_format_is_an_error_naming_the_way_out():
    with pytest.raises(ValueError, match=r"attn_0/cached_key is stored as int8.*asks for "):
        _stepper("fp8")(_cache("int8"), TOKENS[:, :1])


def test_a_request_that_matches_no_cache_warns_once():
    model = Decoder(decode=False)
    fn = jp.linen.apply(model, "mixed_bfloat16", kv_cache="int8")
    with pytest.warns(
        UserWarning, match=r"kv_cache='int8' matched no attention cache.*decode=True"
    ):
        fn({"params": PARAMS}, TOKENS)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fn({"params": PARAMS}, TOKENS)  # once per wrapper
    with pytest.warns(UserWarning, match=r"matched no attention cache"):
        jp.linen.init(MODEL, "float32", kv_cache={"decoder/attn": "int8"})(
            jax.random.key(0), TOKENS
        )


def test_a_cache_replaced_whole_warns_that_it_was_quantized_again():
    class Whole(nn.Module):
        @nn.compact
        def __call__(self, x):
            cache = self.variable("cache", "cached_key", jnp.zeros, (B, T, HEADS, 4), x.dtype)
            cache.value = cache.value + 1.0  # not a dynamic_update_slice
            return cache.value.sum()

    model = Whole()
    init = jp.linen.init(model, "float32", kv_cache="int8")
    cache = init(jax.random.key(0), TOKENS)["cache"]
    fn = jp.linen.apply(model, "float32", kv_cache="int8")
    with pytest.warns(UserWarning, match=r"replaced whole.*quantized them again"):
        fn({"cache": cache}, TOKENS, mutable=["cache"])


def test_without_kv_cache_the_cache_is_flaxs_own():
    cache = _cache(None)
    assert cache["attn_0"]["cached_key"].dtype == jnp.bfloat16


def test_explain_lists_each_cache_with_its_format_and_bytes():
    kv_cache = {"attn_0": "int8", "attn_1": "fp8"}
    variables = jax.eval_shape(
        lambda: jp.linen.init(MODEL, "mixed_bfloat16", kv_cache={"attn_0": "int8"})(
            jax.random.key(0), TOKENS
        )
    )
    text = jp.linen.explain(
        MODEL, "mixed_bfloat16", variables, TOKENS[:, :1], kv_cache=kv_cache, mutable=["cache"]
    )
    lines = {line.split()[0]: line.split() for line in text.splitlines() if "cached_" in line}
    assert lines["attn_0/cached_key"][1:5] == ["int8", "per", "token", "and"]
    assert lines["attn_1/cached_value"][1:4] == ["float8_e4m3fn", "per", "token"]  # as it will be
    assert lines["attn_0/cached_key"][-2:] == ["4.1K", "8.0K"]
    assert "KV caches: bytes as stored, scales included (0.512x" in text
    plain = jp.linen.explain(
        MODEL, "mixed_bfloat16", _float_variables(), TOKENS[:, :1], mutable=["cache"]
    )
    assert "attn_0/cached_key    bfloat16" in plain


def _float_variables():
    return jax.eval_shape(lambda: jp.linen.init(MODEL, "mixed_bfloat16")(jax.random.key(0), TOKENS))
