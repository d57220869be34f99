"""Quantized KV caches of layers stacked by ``nn.scan`` (issue #50): the ``"cache"``
collection scanned with the parameters (``variable_axes={"cache": 0}``), each layer's
cache a slice of one stacked ``QuantizedKVCache`` (values and scales with the layer axis
first), decoded token by token with and without ``jit``; ``explain`` counts the stack."""

from __future__ import annotations

import itertools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_policy as jp

B, T, WIDTH, LAYERS = 2, 8, 128, 3


class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        attn = nn.MultiHeadDotProductAttention(
            num_heads=2, qkv_features=WIDTH, decode=True, name="attn"
        )
        return x + attn(x, x), None


class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
        stack = nn.scan(
            Block,
            variable_axes={"params": 0, "cache": 0},
            split_rngs={"params": True},
            length=LAYERS,
        )
        x, _ = stack(name="blocks")(x, None)
        return x


MODEL = Model()
TOKENS = jax.random.normal(jax.random.key(1), (B, T, WIDTH))


def _decode(kv_cache, jit):
    variables = jp.linen.init(MODEL, "float32", kv_cache=kv_cache)(jax.random.key(0), TOKENS)
    fn = jp.linen.apply(MODEL, "float32", kv_cache=kv_cache)

    def step(cache, token):
        out, state = fn({"params": variables["params"], "cache": cache}, token, mutable=["cache"])
        return state["cache"], out

    step = jax.jit(step) if jit else step
    cache, outs, caches = variables["cache"], [], [variables["cache"]]
    for t in range(T):
        cache, out = step(cache, TOKENS[:, t : t + 1])
        outs.append(out)
        caches.append(cache)
    return jnp.concatenate(outs, 1), caches


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_scanned_stack_keeps_one_int8_cache_per_layer_and_decodes_close(jit):
    reference, _ = _decode(None, jit)
    out, caches = _decode("int8", jit)
    stored = caches[-1]["blocks"]["attn"]["cached_key"]
    assert isinstance(stored, jp.QuantizedKVCache)
    assert stored.values.dtype == jnp.int8
    assert stored.values.shape == (LAYERS, B, T, 2, 64)
    assert stored.scale.shape == (LAYERS, B, T, 2, 1)
    rel = float(jnp.linalg.norm(out - reference) / jnp.linalg.norm(reference))
    assert 0 < rel < 0.02, rel
    # Each layer's tokens are its own: the layers' stored keys differ.
    assert not np.array_equal(stored.values[0], stored.values[1])
    # A token once written never changes on a later step, in every layer.
    for t, (before, after) in enumerate(itertools.pairwise(caches[1:]), start=1):
        old, new = before["blocks"]["attn"]["cached_value"], after["blocks"]["attn"]["cached_value"]
        np.testing.assert_array_equal(new.values[:, :, :t], old.values[:, :, :t])
        np.testing.assert_array_equal(new.scale[:, :, :t], old.scale[:, :, :t])


def test_explain_counts_the_stacked_caches():
    variables = jp.linen.init(MODEL, "float32", kv_cache="int8")(jax.random.key(0), TOKENS)
    text = jp.linen.explain(
        MODEL, "float32", variables, TOKENS[:, :1], kv_cache="int8", mutable=["cache"]
    )
    line = next(x for x in text.splitlines() if x.startswith("blocks/attn/cached_key"))
    assert "int8" in line and "(3, 2, 8, 2, 64)" in line
    # 3*2*8*2*64 int8 values + 3*2*8*2 float32 scales = 6,528 bytes; float32: 24,576.
    assert line.split()[-2:] == ["6.4K", "24.0K"]
