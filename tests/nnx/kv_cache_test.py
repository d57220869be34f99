"""Quantized KV caches under ``jp.nnx.apply`` (issue #50): ``nnx.MultiHeadAttention`` with
``init_cache`` keeps its caches quantized in the model, decoding in Python loops (eager and
``nnx.jit``) and ``lax.scan``/``while_loop`` over the split state, close to the bf16 cache."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jmp_policy as jp

B, T, F = 2, 8, 32
TOKENS = jax.random.normal(jax.random.key(1), (B, T, F))


class Decoder(nnx.Module):
    def __init__(self, rngs):
        self.attn = nnx.MultiHeadAttention(
            num_heads=2, in_features=F, qkv_features=256, decode=True, rngs=rngs
        )
        self.head = nnx.Linear(F, 4, rngs=rngs)

    def __call__(self, x):
        return self.head(self.attn(x))


def _model(kv_cache=None):
    model = Decoder(nnx.Rngs(0))
    model.attn.init_cache((B, T, F), jnp.bfloat16)
    if kv_cache is not None:  # the caches stored quantized before any step
        jp.nnx.apply(model, "mixed_bfloat16", kv_cache=kv_cache, method=lambda m: None)()
    return model


def _rel(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _python_loop(kv_cache, jit):
    model = _model()

    def step(model, token):
        return jp.nnx.apply(model, "mixed_bfloat16", kv_cache=kv_cache)(token)

    step = nnx.jit(step) if jit else step
    outs, values = [], []
    for t in range(T):
        outs.append(step(model, TOKENS[:, t : t + 1]))
        cache = model.attn.cached_value.get_value()
        values.append(cache.values if kv_cache else cache)
    return jnp.concatenate(outs, axis=1), values, model


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize(("kv_cache", "tolerance"), [("int8", 0.01), ("fp8", 0.04)])
def test_python_loop_decoding_is_close_to_the_bfloat16_cache(jit, kv_cache, tolerance):
    reference, _, _ = _python_loop(None, jit)
    outs, values, model = _python_loop(kv_cache, jit)
    assert 0 < _rel(outs, reference) < tolerance
    cache = model.attn.cached_key.get_value()
    assert isinstance(cache, jp.QuantizedKVCache)
    assert cache.values.shape == (B, T, 2, 128) and cache.dtype == "bfloat16"
    assert int(model.attn.cache_index.get_value()) == T
    for t, earlier in enumerate(values):  # a token's stored values never change
        np.testing.assert_array_equal(
            np.asarray(values[-1][:, : t + 1]), np.asarray(earlier[:, : t + 1])
        )


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("loop", ["scan", "while_loop"])
def test_lax_loops_over_the_split_state_match_the_python_loop(jit, loop):
    graphdef, state = nnx.split(_model("int8"))
    tokens = jnp.swapaxes(TOKENS, 0, 1)[:, :, None]

    def step(state, token):
        model = nnx.merge(graphdef, state)
        out = jp.nnx.apply(model, "mixed_bfloat16", kv_cache="int8")(token)
        return nnx.state(model), out

    def decode(state):
        if loop == "scan":
            return jax.lax.scan(step, state, tokens)
        outs = jnp.zeros((T, B, 1, 4), jnp.bfloat16)

        def body(carry):
            t, state, outs = carry
            state, out = step(state, tokens[t])
            return t + 1, state, outs.at[t].set(out.astype(outs.dtype))

        _, state, outs = jax.lax.while_loop(lambda c: c[0] < T, body, (0, state, outs))
        return state, outs

    decode = jax.jit(decode) if jit else decode
    state, outs = decode(state)
    expected, _, model = _python_loop("int8", jit=True)
    np.testing.assert_allclose(
        np.asarray(jnp.swapaxes(outs[:, :, 0], 0, 1), np.float32),
        np.asarray(expected, np.float32),
        rtol=2e-2,
        atol=2e-2,
    )
    np.testing.assert_array_equal(
        np.asarray(nnx.merge(graphdef, state).attn.cached_key.get_value().values),
        np.asarray(model.attn.cached_key.get_value().values),
    )


def test_a_map_by_path_and_the_bytes():
    model = _model({"attn": "fp8"})
    cache = model.attn.cached_value.get_value()
    assert cache.values.dtype == jnp.float8_e4m3fn and cache.scale.shape == (B, T, 1, 1)
    assert cache.nbytes / (np.prod(cache.shape) * 2) <= 0.53
    with pytest.warns(UserWarning, match=r"kv_cache=\{'head': 'int8'\} matched no attention"):
        plain = _model({"head": "int8"})
    assert plain.attn.cached_value.get_value().dtype == jnp.bfloat16


def test_a_model_without_cache_warns_once():
    model = Decoder(nnx.Rngs(0))
    model.attn = nnx.MultiHeadAttention(
        num_heads=2, in_features=F, qkv_features=256, decode=False, rngs=nnx.Rngs(0)
    )
    fn = jp.nnx.apply(model, "mixed_bfloat16", kv_cache="int8")
    with pytest.warns(UserWarning, match=r"matched no attention cache.*init_cache"):
        fn(TOKENS)


def test_explain_lists_each_cache_with_its_format_and_bytes():
    text = jp.nnx.explain(_model("int8"), "mixed_bfloat16")
    rows = {line.split()[0]: line.split() for line in text.splitlines() if "cached_" in line}
    assert rows["attn/cached_key"][1] == "int8"
    assert rows["attn/cached_value"][-2:] == ["4.1K", "8.0K"]
    assert "KV caches: bytes as stored, scales included (0.516x" in text
    planned = jp.nnx.explain(_model(), "mixed_bfloat16", kv_cache="fp8")
    assert "attn/cached_key    float8_e4m3fn  per token" in planned  # as it will be stored
