"""Decoding with a bfloat16 KV cache and float32 QK-norms (issue #8, "float32 islands").

`NORM_FLOAT32` computes norms in float32 and hands back the caller's compute dtype, so a key
normalised in float32 still fits a bfloat16 cache and q·kᵀ stays bfloat16. Shown on an
lm1b-style Linen decoder (lm1b's embedding, position cache index and MLP; Flax's attention with
`normalize_qk=True` and `decode=True`) and on a Gemma-style NNX decoder (QK-norm, RoPE, a
left-aligned cache dict), decoding token by token against a teacher-forced float32 reference.
Tolerance: logits within 3% relative L2 error of float32.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax_examples import gemma_nnx
from flax_examples import lm1b_models as lm
from flax_examples.measure import (
    BF16,
    RTOL_BF16,
    VOCAB,
    B,
    count,
    dot_dtypes,
    lm1b_config,
    rel_err,
    tokens,
)

import jmp_policy as jp

# --------------------------------------------------------------------------- Linen decoding


class QKNormBlock(nn.Module):
    """lm1b's EncoderDecoder1DBlock with Flax's QK-norm (`normalize_qk=True`) turned on."""

    config: lm.TransformerConfig

    @nn.compact
    def __call__(self, inputs, decoder_mask=None):
        cfg = self.config
        x = nn.LayerNorm(dtype=cfg.dtype)(inputs)
        x = nn.MultiHeadDotProductAttention(
            num_heads=cfg.num_heads,
            dtype=cfg.dtype,
            qkv_features=cfg.qkv_dim,
            use_bias=False,
            broadcast_dropout=False,
            deterministic=True,
            decode=cfg.decode,
            normalize_qk=True,
        )(x, mask=decoder_mask)
        x = x + inputs
        z = nn.LayerNorm(dtype=cfg.dtype)(x)
        return x + lm.MlpBlock(config=cfg)(z)


class QKNormLM(nn.Module):
    """lm1b's TransformerLM (its embedding, AddPositionEmbs with a decode cache index, MlpBlock)
    with QK-norm attention blocks."""

    config: lm.TransformerConfig

    @nn.compact
    def __call__(self, inputs):
        cfg = self.config
        mask = None
        if not cfg.decode:
            mask = nn.combine_masks(
                nn.make_attention_mask(inputs > 0, inputs > 0), nn.make_causal_mask(inputs)
            )
        y = inputs.astype("int32")
        if not cfg.decode:
            y = lm.shift_inputs(y)
        y = nn.Embed(cfg.vocab_size, cfg.emb_dim, embedding_init=nn.initializers.normal(1.0))(y)
        y = lm.AddPositionEmbs(config=cfg, decode=cfg.decode, name="posembed_output")(y)
        for i in range(cfg.num_layers):
            y = QKNormBlock(cfg, name=f"block_{i}")(y, mask)
        y = nn.LayerNorm(dtype=cfg.dtype, name="final_norm")(y)
        return nn.Dense(cfg.vocab_size, dtype=cfg.dtype, name="logitdense")(y)


def test_linen_decoder_with_bfloat16_cache_and_float32_qk_norms_decodes_several_tokens():
    cfg = lm1b_config(num_layers=1, dtype=None)
    model, decoder = QKNormLM(cfg), QKNormLM(cfg.replace(decode=True))
    seq = tokens()
    params = model.init(jax.random.key(0), seq)["params"]
    logits32 = jax.jit(model.apply)({"params": params}, seq)  # teacher-forced float32 reference
    policy, norms = "mixed_bfloat16", jp.linen.NORM_FLOAT32

    init = jax.jit(jp.linen.init(decoder, policy, type_policies=norms))
    cache = init(jax.random.key(0), seq)["cache"]
    cache_leaves = jax.tree_util.tree_leaves_with_path(cache)
    kv = [leaf for path, leaf in cache_leaves if "cached_" in jax.tree_util.keystr(path)]
    assert len(kv) == 2 and {np.dtype(leaf.dtype) for leaf in kv} == {BF16}

    cache_dtypes = jax.tree.map(lambda a: a.dtype, cache)
    fn = jp.linen.apply(decoder, policy, type_policies=norms)
    step = jax.jit(lambda variables, tok: fn(variables, tok, mutable=["cache"]))
    tok, decoded = jnp.zeros((B, 1), jnp.int32), []  # lm1b's decoding starts from token 0
    for t in range(4):
        logits, mutated = step({"params": params, "cache": cache}, tok)
        cache = mutated["cache"]
        assert jax.tree.map(lambda a: a.dtype, cache) == cache_dtypes
        decoded.append(logits[:, 0])
        tok = seq[:, t : t + 1]  # teacher forcing, so the float32 reference applies
    kv = [
        leaf for path, leaf in jax.tree_util.tree_leaves_with_path(cache) if "cached_" in str(path)
    ]
    assert {np.dtype(leaf.dtype) for leaf in kv} == {BF16}
    assert int(jax.tree.leaves(cache["posembed_output"])[0]) == 4
    decoded = jnp.stack(decoded, axis=1)
    assert np.isfinite(np.asarray(decoded, np.float32)).all()
    assert rel_err(decoded, logits32[:, :4]) < RTOL_BF16
    # q·kᵀ and every other matmul stay bfloat16: the float32 norms hand back bfloat16
    dots = dot_dtypes(fn, {"params": params, "cache": cache}, tok, mutable=["cache"])
    assert count(dots) == {"bfloat16": 9}  # q, k, v, out, q·kᵀ, p·v, 2 MLP, logits


# --------------------------------------------------------------------------- NNX decoding


def gemma_decode(step, seq, cache):
    """Decodes token by token with Gemma's left-aligned cache, fed `seq` (teacher forcing)."""
    steps, out = seq.shape[1], []
    for t in range(steps):
        pos = jnp.full((B, 1), t)
        mask = jnp.broadcast_to(jnp.arange(steps) <= t, (B, 1, steps))
        logits, cache = step(seq[:, t : t + 1], pos, cache, mask)
        out.append(logits[:, 0])
    return jnp.stack(out, axis=1), cache


def test_nnx_gemma_decoder_with_bfloat16_cache_and_float32_qk_norms():
    model = gemma_nnx.Transformer(vocab_size=VOCAB, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)

    @jax.jit
    def step32(state, *args):
        return nnx.merge(graphdef, state)(*args)

    @jax.jit
    def step(state, *args):  # the wrapper called inside jit, as a decoding loop does
        m = nnx.merge(graphdef, state)
        return jp.nnx.apply(m, "mixed_bfloat16", type_policies=jp.nnx.NORM_FLOAT32)(*args)

    seq = tokens((B, 4))
    logits32, _ = gemma_decode(
        functools.partial(step32, state), seq, model.init_cache(4, B, jnp.float32)
    )
    logits, cache = gemma_decode(
        functools.partial(step, state), seq, model.init_cache(4, B, jnp.bfloat16)
    )

    for layer in cache.values():
        assert layer["k"].dtype == BF16 and layer["v"].dtype == BF16
        assert layer["end_index"].tolist() == [4, 4]
    assert np.isfinite(np.asarray(logits, np.float32)).all()
    assert rel_err(logits, logits32) < RTOL_BF16


def test_nnx_gemma_every_matmul_bfloat16_with_float32_qk_norms():
    model = gemma_nnx.Transformer(vocab_size=VOCAB, rngs=nnx.Rngs(0))
    cache = model.init_cache(4, B, dtype=jnp.bfloat16)
    mask = jnp.ones((B, 1, 4), bool)
    graphdef, state = nnx.split(model)

    def step(state, tok, pos, cache):
        m = nnx.merge(graphdef, state)
        fn = jp.nnx.apply(m, "mixed_bfloat16", type_policies=jp.nnx.NORM_FLOAT32)
        return fn(tok, pos, cache, mask)

    dots = dot_dtypes(step, state, tokens((B, 1)), jnp.zeros((B, 1), jnp.int32), cache)
    # per layer: qkv, q·kᵀ, p·v, output, gate, up, down; then the tied-embedding logits
    assert count(dots) == {"bfloat16": 2 * 7 + 1}
