"""Quantized KV caches of a model's own cache variables (issue #50): the pattern of the
Hugging Face Flax models' attention (``cached_key``/``cached_value``/``cache_index`` in the
``"cache"`` collection, created by ``self.variable`` and written with
``lax.dynamic_update_slice`` at the index the model keeps), and a cache of another name
chosen by a key naming its whole path."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_policy as jp

B, T, HEADS, HEAD_DIM = 2, 6, 2, 64
WIDTH = HEADS * HEAD_DIM


class CachedAttention(nn.Module):
    """Causal self-attention that keeps its own cache, the way the Hugging Face Flax
    models' ``_concatenate_to_cache`` does (written here from that pattern)."""

    names: tuple[str, str] = ("cached_key", "cached_value")

    @nn.compact
    def __call__(self, x):  # x: [B, 1, WIDTH], one token a call
        q, k, v = (
            nn.Dense(WIDTH, name=n)(x).reshape(B, 1, HEADS, HEAD_DIM) for n in ("q", "k", "v")
        )
        initialized = self.has_variable("cache", self.names[0])
        shape = (B, T, HEADS, HEAD_DIM)
        keys = self.variable("cache", self.names[0], jnp.zeros, shape, k.dtype)
        values = self.variable("cache", self.names[1], jnp.zeros, shape, v.dtype)
        index = self.variable("cache", "cache_index", lambda: jnp.array(0, jnp.int32))
        at = index.value
        if initialized:  # at init the cache is only created
            keys.value = jax.lax.dynamic_update_slice(keys.value, k, (0, at, 0, 0))
            values.value = jax.lax.dynamic_update_slice(values.value, v, (0, at, 0, 0))
            index.value = at + 1
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, keys.value) / HEAD_DIM**0.5
        logits = jnp.where(jnp.arange(T) <= at, logits, -1e9)
        mixed = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits), values.value)
        return nn.Dense(WIDTH, name="out")(mixed.reshape(B, 1, WIDTH))


TOKENS = jax.random.normal(jax.random.key(1), (B, T, WIDTH))


def _decode(model, kv_cache, jit):
    variables = jp.linen.init(model, "mixed_bfloat16", kv_cache=kv_cache)(
        jax.random.key(0), TOKENS[:, :1]
    )
    fn = jp.linen.apply(model, "mixed_bfloat16", kv_cache=kv_cache)

    def step(cache, token):
        out, state = fn({"params": variables["params"], "cache": cache}, token, mutable=["cache"])
        return state["cache"], out

    step = jax.jit(step) if jit else step
    cache, outs, caches = variables["cache"], [], []
    for t in range(T):
        cache, out = step(cache, TOKENS[:, t : t + 1])
        outs.append(np.asarray(out, np.float32))
        caches.append(cache)
    return np.concatenate(outs, axis=1), caches


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize(
    ("names", "kv_cache"),
    [
        (("cached_key", "cached_value"), "int8"),  # Flax's names: a bare format finds them
        (("k_cache", "v_cache"), {".*_cache": "int8"}),  # own names: a key naming the path
    ],
)
def test_own_cache_variables_are_stored_int8_and_decode_close_to_bf16(names, kv_cache, jit):
    model = CachedAttention(names)
    reference, _ = _decode(model, None, jit)
    outs, caches = _decode(model, kv_cache, jit)
    assert 0 < np.abs(outs - reference).max() / np.abs(reference).max() < 0.03
    stored = caches[-1][names[0]]
    assert isinstance(stored, jp.QuantizedKVCache) and stored.values.dtype == jnp.int8
    assert caches[-1]["cache_index"].dtype == jnp.int32  # the index left as the model keeps it
    rows = [np.asarray(c[names[1]].values) for c in caches]
    for t in range(1, T):  # a token once written never changes
        np.testing.assert_array_equal(rows[t][:, :t], rows[t - 1][:, :t])


def test_explain_lists_own_cache_variables_a_key_names():
    model = CachedAttention(("k_cache", "v_cache"))
    kv_cache = {".*_cache": "int8"}
    variables = jp.linen.init(model, "mixed_bfloat16", kv_cache=kv_cache)(
        jax.random.key(0), TOKENS[:, :1]
    )
    table = jp.linen.explain(
        model, "mixed_bfloat16", variables, TOKENS[:, :1], kv_cache=kv_cache, mutable=["cache"]
    )
    caches = table.split("KV caches")[0].splitlines()
    rows = {line.split()[0]: line.split() for line in caches if line.strip()}
    assert rows["k_cache"][1] == "int8" and rows["v_cache"][1] == "int8"
    assert "cache_index" not in rows
