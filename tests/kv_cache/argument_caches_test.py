"""Quantized KV caches passed as arguments (issue #50): the Gemma library's pattern, an
attention that takes its layer's cache dict (``k``, ``v``, ``end_index``) as an argument,
writes the new tokens with ``lax.dynamic_update_slice`` and returns the new dict (written
here from that pattern). A key of ``kv_cache`` naming the argument's path quantizes it in
Linen, NNX and Equinox alike."""

from __future__ import annotations

import itertools

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jmp_policy as jp

B, T, HEADS, HEAD_DIM, LAYERS = 2, 6, 2, 64, 2
WIDTH = HEADS * HEAD_DIM
KEYS = {r"layer_\d+/cache/k": "int8", r"layer_\d+/cache/v": "int8"}


def _attend(q, cache, k, v, t):
    """The Gemma library's cache step: write at ``end_index``, attend over the cache."""
    at = cache["end_index"][0]
    k = jax.lax.dynamic_update_slice(cache["k"], k.astype(cache["k"].dtype), (0, at, 0, 0))
    v = jax.lax.dynamic_update_slice(cache["v"], v.astype(cache["v"].dtype), (0, at, 0, 0))
    logits = jnp.einsum("BTNH,BSNH->BTNS", q, k) / HEAD_DIM**0.5
    logits = jnp.where(jnp.arange(T) < at + t, logits, -1e9)
    mixed = jnp.einsum("BTNS,BSNH->BTNH", jax.nn.softmax(logits), v)
    return {"k": k, "v": v, "end_index": cache["end_index"] + t}, mixed


class LinenAttention(nn.Module):
    @nn.compact
    def __call__(self, x, cache):
        q, k, v = (nn.DenseGeneral((HEADS, HEAD_DIM), name=n)(x) for n in ("q", "k", "v"))
        new, mixed = _attend(q, cache, k, v, x.shape[1])
        return new, nn.DenseGeneral(WIDTH, axis=(-2, -1), name="o")(mixed)


class LinenModel(nn.Module):
    @nn.compact
    def __call__(self, x, cache):
        new = {}
        for i in range(LAYERS):
            name = f"layer_{i}"
            new[name], y = LinenAttention(name=name)(x, cache[name])
            x = x + y
        return x, new


def _layers(model, x, cache):
    """The Gemma library's loop: each layer takes its cache and returns the new one."""
    new = {}
    for name in ("layer_0", "layer_1"):
        new[name], y = getattr(model, name)(x, cache[name])
        x = x + y
    return x, new


class EqxAttention(eqx.Module):
    q: eqx.nn.Linear
    k: eqx.nn.Linear
    v: eqx.nn.Linear
    o: eqx.nn.Linear

    def __init__(self, key):
        keys = jax.random.split(key, 4)
        self.q, self.k, self.v, self.o = (eqx.nn.Linear(WIDTH, WIDTH, key=k) for k in keys)

    def __call__(self, x, cache):  # x: [B, t, WIDTH]
        def heads(layer):
            return jax.vmap(jax.vmap(layer))(x).reshape(*x.shape[:2], HEADS, HEAD_DIM)

        new, mixed = _attend(heads(self.q), cache, heads(self.k), heads(self.v), x.shape[1])
        return new, jax.vmap(jax.vmap(self.o))(mixed.reshape(x.shape))


class EqxModel(eqx.Module):
    layer_0: EqxAttention
    layer_1: EqxAttention

    def __init__(self, key):
        k0, k1 = jax.random.split(key)
        self.layer_0, self.layer_1 = EqxAttention(k0), EqxAttention(k1)

    def __call__(self, x, cache):
        return _layers(self, x, cache)


class NnxAttention(nnx.Module):
    def __init__(self, rngs):
        self.q, self.k, self.v = (
            nnx.LinearGeneral(WIDTH, (HEADS, HEAD_DIM), rngs=rngs) for _ in range(3)
        )
        self.o = nnx.LinearGeneral((HEADS, HEAD_DIM), WIDTH, axis=(-2, -1), rngs=rngs)

    def __call__(self, x, cache):
        new, mixed = _attend(self.q(x), cache, self.k(x), self.v(x), x.shape[1])
        return new, self.o(mixed)


class NnxModel(nnx.Module):
    def __init__(self, rngs):
        self.layer_0, self.layer_1 = NnxAttention(rngs), NnxAttention(rngs)

    def __call__(self, x, cache):
        return _layers(self, x, cache)


TOKENS = jax.random.normal(jax.random.key(1), (B, T, WIDTH))


def _empty_cache(dtype=jnp.float32):
    layer = {
        "k": jnp.zeros((B, T, HEADS, HEAD_DIM), dtype),
        "v": jnp.zeros((B, T, HEADS, HEAD_DIM), dtype),
        "end_index": jnp.zeros((B,), jnp.int32),
    }
    return {f"layer_{i}": dict(layer) for i in range(LAYERS)}


def _linen(kv_cache, policy="float32"):
    model = LinenModel()
    params = model.init(jax.random.key(0), TOKENS[:, :1], _empty_cache())
    fn = jp.linen.apply(model, policy, kv_cache=kv_cache)
    return lambda x, cache: fn(params, x, cache)


def _equinox(kv_cache, policy="float32"):
    model = EqxModel(jax.random.key(0))
    return jp.equinox.apply(model, policy, kv_cache=kv_cache)


def _nnx(kv_cache, policy="float32"):
    model = NnxModel(nnx.Rngs(0))
    return jp.nnx.apply(model, policy, kv_cache=kv_cache)


FRAMEWORKS = {"linen": _linen, "equinox": _equinox, "nnx": _nnx}


def _decode(step, jit, prefill=2):
    """Prefill ``prefill`` tokens, then one token a step; the outputs and each step's cache."""
    step = jax.jit(step) if jit else step
    out, cache = step(TOKENS[:, :prefill], _empty_cache())
    outs, caches = [out], [cache]
    for t in range(prefill, T):
        out, cache = step(TOKENS[:, t : t + 1], cache)
        outs.append(out)
        caches.append(cache)
    return jnp.concatenate(outs, axis=1), caches


@pytest.mark.parametrize("framework", sorted(FRAMEWORKS))
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_an_argument_cache_named_by_path_is_stored_int8_and_decodes_close(framework, jit):
    reference, _ = _decode(FRAMEWORKS[framework](None), jit)
    out, caches = _decode(FRAMEWORKS[framework](KEYS), jit)
    for cache in caches:
        for name in ("layer_0", "layer_1"):
            for kv in ("k", "v"):
                stored = cache[name][kv]
                assert isinstance(stored, jp.QuantizedKVCache)
                assert stored.values.dtype == jnp.int8
                assert stored.scale.shape == (B, T, HEADS, 1)
                assert stored.dtype == "float32"
            assert cache[name]["end_index"].dtype == jnp.int32
    np.testing.assert_array_equal(caches[-1]["layer_1"]["end_index"], [T, T])
    assert out.dtype == reference.dtype == jnp.float32
    rel = float(jnp.linalg.norm(out - reference) / jnp.linalg.norm(reference))
    assert 0 < rel < 0.02, rel


@pytest.mark.parametrize("framework", sorted(FRAMEWORKS))
def test_a_token_once_stored_never_changes(framework):
    _, caches = _decode(FRAMEWORKS[framework](KEYS), jit=True)
    for step, (before, after) in enumerate(itertools.pairwise(caches)):
        written = 2 + step  # tokens written before the later step
        for kv in ("k", "v"):
            old, new = before["layer_0"][kv], after["layer_0"][kv]
            np.testing.assert_array_equal(new.values[:, :written], old.values[:, :written])
            np.testing.assert_array_equal(new.scale[:, :written], old.scale[:, :written])
        assert bool(jnp.any(after["layer_0"]["k"].values[:, written] != 0))


def test_a_scan_decoding_loop_carries_the_stored_cache():
    step = FRAMEWORKS["linen"](KEYS)
    _, cache = step(TOKENS[:, :2], _empty_cache())

    def body(cache, token):
        out, cache = step(token[:, None], cache)
        return cache, out[:, 0]

    final, outs = jax.jit(lambda c: jax.lax.scan(body, c, jnp.swapaxes(TOKENS[:, 2:], 0, 1)))(cache)
    looped, _ = _decode(step, jit=True)
    np.testing.assert_allclose(jnp.swapaxes(outs, 0, 1), looped[:, 2:], rtol=1e-5, atol=1e-5)
    assert isinstance(final["layer_1"]["v"], jp.QuantizedKVCache)
    np.testing.assert_array_equal(final["layer_1"]["end_index"], [T, T])


def test_float8_argument_caches_read_in_the_modules_compute_dtype():
    # A cache is an input like any other: the float32 policy's module reads the bfloat16
    # cache cast to float32, and the stored cache reads back in that dtype.
    step = FRAMEWORKS["linen"]({r"layer_\d+/cache/[kv]": "fp8"})
    _, cache = step(TOKENS[:, :2], _empty_cache(jnp.bfloat16))
    stored = cache["layer_0"]["k"]
    assert stored.values.dtype == jnp.float8_e4m3fn
    assert stored.scale.shape == (B, T, 1, 1)
    assert stored.dtype == "float32"
    assert stored.dequantize().dtype == jnp.float32


@pytest.mark.parametrize("framework", sorted(FRAMEWORKS))
def test_a_bfloat16_cache_under_a_bfloat16_policy_is_stored_int8(framework):
    step = FRAMEWORKS[framework](KEYS, "mixed_bfloat16")
    _, cache = step(TOKENS[:, :2], _empty_cache(jnp.bfloat16))
    stored = cache["layer_1"]["v"]
    assert isinstance(stored, jp.QuantizedKVCache)
    assert stored.values.dtype == jnp.int8
    assert stored.dtype == "bfloat16"
    assert stored.dequantize().dtype == jnp.bfloat16


def test_a_key_that_names_no_argument_warns_once_and_leaves_the_cache_float():
    step = FRAMEWORKS["linen"]({r"layer_\d+/cache/keys": "int8"})
    with pytest.warns(UserWarning, match=r"matched no attention cache"):
        _, cache = step(TOKENS[:, :2], _empty_cache())
    assert cache["layer_0"]["k"].dtype == jnp.float32


def test_a_stored_cache_of_another_format_is_a_clear_error():
    _, cache = FRAMEWORKS["linen"](KEYS)(TOKENS[:, :2], _empty_cache())
    step = FRAMEWORKS["linen"]({r"layer_\d+/cache/[kv]": "fp8"})
    with pytest.raises(ValueError, match=r"layer_0/cache/k is stored as int8.*asks for"):
        step(TOKENS[:, 2:3], cache)


@pytest.mark.parametrize("framework", sorted(FRAMEWORKS))
def test_explain_lists_the_argument_caches_with_format_and_bytes(framework):
    x, cache = TOKENS[:, :1], _empty_cache()
    if framework == "linen":
        model = LinenModel()
        params = model.init(jax.random.key(0), x, cache)
        text = jp.linen.explain(model, "float32", params, x, cache, kv_cache=KEYS)
    elif framework == "nnx":
        text = jp.nnx.explain(NnxModel(nnx.Rngs(0)), "float32", x, cache, kv_cache=KEYS)
    else:
        text = jp.equinox.explain(EqxModel(jax.random.key(0)), "float32", x, cache, kv_cache=KEYS)
    lines = {line.split()[0]: line for line in text.splitlines() if "/cache/" in line}
    assert sorted(lines) == [f"layer_{i}/cache/{kv}" for i in range(LAYERS) for kv in "kv"]
    # [2, 6, 2, 64] int8 values + [2, 6, 2, 1] float32 scales: 1,536 + 96 bytes; float32 6 K.
    assert lines["layer_0/cache/k"].split()[1:5] == ["int8", "per", "token", "and"]
    assert lines["layer_0/cache/k"].split()[-2:] == ["1.6K", "6.0K"]
    assert "KV caches: bytes as stored, scales included (0.266x" in text
