# Copyright 2024 The Flax Authors.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
#
# Written after github.com/google/flax, examples/gemma/{modules,layers,transformer,
# positional_embeddings}.py at commit 18f8f311c275d57f46d95e41b15aa97b454754c0. The original
# pulls jaxtyping, sharding configs, sow hooks and checkpoint loaders, so this is an
# equivalent, not a copy: the same Flax NNX constructs (`nnx.Einsum` for the fused QKV and
# output projections, `nnx.Linear` gated feed-forward, a QK-norm, RoPE, a left-aligned KV cache
# dict updated with `jax.lax.dynamic_update_slice`, `ScaledEmbed` whose `attend` gives the
# logits), with `apply_rope` copied as is. Trimmed: sharding, sow, dropout, GQA, sliding
# windows, soft caps, checkpoint loading. One change: the norms are `nnx.RMSNorm` (Flax's own
# class, which `jp.nnx.NORM_FLOAT32` names) instead of the example's `layers.RMSNorm`. The
# layers' `dtype` defaults to None (follow the inputs); Gemma's configs pass float32.
"""A small Gemma-style NNX decoder with QK-norm and a KV cache (test model)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

K_MASK = -2.3819763e38


def apply_rope(inputs, positions, head_dim, max_wavelength=10_000, scale_factor=1.0):
    """Applies RoPE (copied from examples/gemma/positional_embeddings.py)."""
    fraction = 2 * jnp.arange(0, head_dim // 2) / head_dim
    timescale = max_wavelength**fraction
    sinusoid_inp = positions[..., jnp.newaxis] / timescale[jnp.newaxis, jnp.newaxis, :]
    sinusoid_inp = sinusoid_inp[..., jnp.newaxis, :]
    sinusoid_inp /= scale_factor
    sin = jnp.sin(sinusoid_inp)
    cos = jnp.cos(sinusoid_inp)
    first_half, second_half = jnp.split(inputs, 2, axis=-1)
    first_part = first_half * cos - second_half * sin
    second_part = second_half * cos + first_half * sin
    out = jnp.concatenate([first_part, second_part], axis=-1)
    return out.astype(inputs.dtype)


class ScaledEmbed(nnx.Embed):
    def __call__(self, x):
        x = super().__call__(x)
        x *= jnp.sqrt(x.shape[-1]).astype(x.dtype)
        return x


class Attention(nnx.Module):
    def __init__(self, num_heads, features, head_dim, *, rngs, dtype: Any = None):
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.query_pre_attn_scalar = head_dim**-0.5
        self.qkv_einsum = nnx.Einsum(
            "BTD,SNDH->SBTNH", (3, num_heads, features, head_dim), dtype=dtype, rngs=rngs
        )
        self.attn_vec_einsum = nnx.Einsum(
            "BTNH,NHD->BTD", (num_heads, head_dim, features), dtype=dtype, rngs=rngs
        )
        self._query_norm = nnx.RMSNorm(head_dim, dtype=dtype, rngs=rngs)
        self._key_norm = nnx.RMSNorm(head_dim, dtype=dtype, rngs=rngs)

    def __call__(self, x, segment_pos, cache, attn_mask):
        seq_len = x.shape[1]
        query_proj, key_proj, value_proj = self.qkv_einsum(x)
        query_proj = self._query_norm(query_proj)
        key_proj = self._key_norm(key_proj)
        query_proj = apply_rope(query_proj, segment_pos, head_dim=self.head_dim)
        query_scaled = query_proj * self.query_pre_attn_scalar
        key_proj = apply_rope(key_proj, segment_pos, head_dim=self.head_dim)

        # Cache is left aligned.
        if cache is not None:
            end_index = cache["end_index"][0]
            slice_indices = (0, end_index % cache["v"].shape[1], 0, 0)
            value_proj = jax.lax.dynamic_update_slice(cache["v"], value_proj, slice_indices)
            key_proj = jax.lax.dynamic_update_slice(cache["k"], key_proj, slice_indices)

        logits = jnp.einsum("BTNH,BSNH->BTNS", query_scaled, key_proj)
        padded_logits = jnp.where(jnp.expand_dims(attn_mask, -2), logits, K_MASK)
        probs = jax.nn.softmax(padded_logits, axis=-1).astype(key_proj.dtype)
        encoded = jnp.einsum("BTNS,BSNH->BTNH", probs, value_proj)
        attn_output = self.attn_vec_einsum(encoded)

        if cache is not None:
            new_cache = {"v": value_proj, "k": key_proj, "end_index": cache["end_index"] + seq_len}
        else:
            new_cache = None
        return new_cache, attn_output

    def init_cache(self, cache_size, batch_size, dtype=jnp.float32):
        shape = (batch_size, cache_size, self.num_heads, self.head_dim)
        return {
            "v": jnp.zeros(shape, dtype=dtype),
            "k": jnp.zeros(shape, dtype=dtype),
            "end_index": jnp.zeros((batch_size,), dtype=jnp.int32),
        }


class FeedForward(nnx.Module):
    def __init__(self, features, hidden_dim, *, rngs, dtype: Any = None):
        kw = dict(use_bias=False, dtype=dtype, rngs=rngs)
        self.gate_proj = nnx.Linear(features, hidden_dim, **kw)
        self.up_proj = nnx.Linear(features, hidden_dim, **kw)
        self.down_proj = nnx.Linear(hidden_dim, features, **kw)

    def __call__(self, x):
        activations = nnx.gelu(self.gate_proj(x)) * self.up_proj(x)
        return self.down_proj(activations)


class Block(nnx.Module):
    def __init__(self, features, num_heads, head_dim, hidden_dim, *, rngs, dtype: Any = None):
        self.pre_attention_norm = nnx.RMSNorm(features, dtype=dtype, rngs=rngs)
        self.attn = Attention(num_heads, features, head_dim, rngs=rngs, dtype=dtype)
        self.pre_ffw_norm = nnx.RMSNorm(features, dtype=dtype, rngs=rngs)
        self.mlp = FeedForward(features, hidden_dim, rngs=rngs, dtype=dtype)

    def __call__(self, x, segment_pos, cache, attn_mask):
        inputs_normalized = self.pre_attention_norm(x)
        cache, attn_output = self.attn(inputs_normalized, segment_pos, cache, attn_mask)
        attn_output += x
        outputs = self.mlp(self.pre_ffw_norm(attn_output))
        return cache, outputs + attn_output


class Transformer(nnx.Module):
    def __init__(
        self,
        *,
        vocab_size=48,
        features=16,
        num_heads=2,
        head_dim=8,
        hidden_dim=32,
        num_layers=2,
        rngs,
        dtype: Any = None,
    ):
        self.embedder = ScaledEmbed(vocab_size, features, dtype=dtype, rngs=rngs)
        self.layers = nnx.List(
            [
                Block(features, num_heads, head_dim, hidden_dim, rngs=rngs, dtype=dtype)
                for _ in range(num_layers)
            ]
        )
        self.final_norm = nnx.RMSNorm(features, dtype=dtype, rngs=rngs)

    def __call__(self, last_tokens, positions, cache, attention_mask):
        x = self.embedder(last_tokens)
        new_cache = None if cache is None else {}
        for i, layer in enumerate(self.layers):
            layer_name = f"layer_{i}"
            layer_cache = None if cache is None else cache[layer_name]
            layer_cache, x = layer(x, positions, layer_cache, attention_mask)
            if cache is not None:
                new_cache[layer_name] = layer_cache
        x = self.final_norm(x)
        logits = self.embedder.attend(x)
        return logits, new_cache

    def init_cache(self, cache_size, batch_size, dtype=jnp.float32):
        return {
            f"layer_{i}": layer.attn.init_cache(cache_size, batch_size, dtype)
            for i, layer in enumerate(self.layers)
        }
