"""Gemma 3 (270M) as a Flax Linen model, its weights and tokenizer read from a GGUF file.

A pretrained model for ``pretrained_int4_bench.py``: the attention and MLP projections are
``nn.Dense`` layers (kernels ``[in, out]``), so the library's calibration sees each one as
it sees any Flax model's. The architecture is Gemma 3's: RMSNorm before and after the
attention and the MLP, RMSNorm on queries and keys, grouped-query attention, RoPE (base
1,000,000 on every sixth layer, which attends globally, and 10,000 on the others, which
attend within a sliding window), a GeGLU MLP (tanh-approximate gelu), the embedding scaled
by ``sqrt(d)`` and tied to the output. GGUF files store each norm's weight with Gemma's
``+1`` already added, and each matrix as ``[out, in]``; ``params`` transposes them.

Reading a GGUF file needs ``gguf``; the tokenizer, ``sentencepiece`` and ``protobuf``
(``pip install -e ".[bench]"``). Checked against a NumPy forward pass written apart from
this one (the same loss on the same 255 tokens, 3.178 nats), and point by point against
Hugging Face's ``modeling_gemma3.py``, llama.cpp's gemma3 graph and converter, and
google-deepmind/gemma's ``Gemma3_270M``: the global layers, both RoPE bases and their
halves-rotated form, the ``1/sqrt(head_dim)`` scale, the norms' ``+1`` stored in the file,
the window's ``<``, no soft-capping, gelu on the gate. For the 270M model only: the 4B,
12B and 27B files need RoPE scaling, and 27B another attention scale, which this port
does not have.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

GLOBAL_EVERY = 6  # layers 5, 11, 17 attend globally (Gemma 3's five local to one global)
LOCAL_ROPE_BASE = 10_000.0
BOS = 2


@dataclasses.dataclass(frozen=True)
class Config:
    layers: int
    d: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp: int
    vocab: int
    eps: float
    rope_base: float
    window: int


def read(path: str) -> tuple[Config, dict, object]:
    """``(config, params, tokenizer)`` from the GGUF file at ``path`` (weights in float32)."""
    import gguf  # the benchmark's extra, not the library's
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(path)

    def field(key):
        return reader.fields[key].contents()

    weights = {t.name: dequantize(t.data, t.tensor_type).astype(np.float32) for t in reader.tensors}
    arch = field("general.architecture")
    config = Config(
        layers=int(field(f"{arch}.block_count")),
        d=int(field(f"{arch}.embedding_length")),
        heads=int(field(f"{arch}.attention.head_count")),
        kv_heads=int(field(f"{arch}.attention.head_count_kv")),
        head_dim=int(field(f"{arch}.attention.key_length")),
        mlp=int(field(f"{arch}.feed_forward_length")),
        vocab=int(weights["token_embd.weight"].shape[0]),
        eps=float(field(f"{arch}.attention.layer_norm_rms_epsilon")),
        rope_base=float(field(f"{arch}.rope.freq_base")),
        window=int(field(f"{arch}.attention.sliding_window")),
    )
    return config, _params(config, weights), _tokenizer(reader)


def _params(config: Config, w: dict) -> dict:
    def kernel(name):
        return {"kernel": np.ascontiguousarray(w[name + ".weight"].T)}

    def norm(name):
        return {"scale": w[name + ".weight"]}

    params = {
        "embed": {"embedding": w["token_embd.weight"]},
        "final_norm": norm("output_norm"),
    }
    for i in range(config.layers):
        b = f"blk.{i}."
        params[f"layers_{i}"] = {
            "attn": {
                "q": kernel(b + "attn_q"),
                "k": kernel(b + "attn_k"),
                "v": kernel(b + "attn_v"),
                "o": kernel(b + "attn_output"),
                "q_norm": norm(b + "attn_q_norm"),
                "k_norm": norm(b + "attn_k_norm"),
            },
            "attn_norm": norm(b + "attn_norm"),
            "post_attn_norm": norm(b + "post_attention_norm"),
            "mlp_norm": norm(b + "ffn_norm"),
            "post_mlp_norm": norm(b + "post_ffw_norm"),
            "mlp": {
                "gate": kernel(b + "ffn_gate"),
                "up": kernel(b + "ffn_up"),
                "down": kernel(b + "ffn_down"),
            },
        }
    return params


def _tokenizer(reader):
    """A SentencePiece BPE model rebuilt from the GGUF file's vocabulary and scores."""
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as pb

    def field(key):
        return reader.fields[key].contents()

    model = pb.ModelProto()
    unk = field("tokenizer.ggml.unknown_token_id")
    pieces = zip(field("tokenizer.ggml.tokens"), field("tokenizer.ggml.scores"),
                 field("tokenizer.ggml.token_type"), strict=True)  # fmt: skip
    for i, (token, score, kind) in enumerate(pieces):
        piece = model.pieces.add()
        piece.piece, piece.score, piece.type = token, float(score), 2 if i == unk else int(kind)
    model.trainer_spec.model_type = pb.TrainerSpec.BPE
    model.trainer_spec.byte_fallback = True
    model.trainer_spec.unk_id, model.trainer_spec.bos_id = unk, BOS
    model.trainer_spec.eos_id, model.trainer_spec.pad_id = 1, 0
    model.normalizer_spec.name = "identity"
    model.normalizer_spec.add_dummy_prefix = False
    model.normalizer_spec.remove_extra_whitespaces = False
    model.normalizer_spec.escape_whitespaces = True
    return spm.SentencePieceProcessor(model_proto=model.SerializeToString())


class RMSNorm(nn.Module):
    eps: float

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],))
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + self.eps)
        return (y * scale).astype(x.dtype)


def _rope(x, base, positions=None):
    """Rotary embedding on ``[batch, time, heads, head_dim]``, halves rotated (as Gemma), at
    ``positions`` ``[time]`` (default ``0 .. time-1``)."""
    t, half = x.shape[1], x.shape[-1] // 2
    inv = base ** (-jnp.arange(0, 2 * half, 2, dtype=jnp.float32) / (2 * half))
    if positions is None:
        positions = jnp.arange(t, dtype=jnp.float32)
    angle = positions.astype(jnp.float32)[:, None] * inv[None]
    cos, sin = jnp.cos(angle)[None, :, None], jnp.sin(angle)[None, :, None]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


class Attention(nn.Module):
    """With ``decode``, a ``cache`` collection as Flax's ``MultiHeadDotProductAttention(
    decode=True)`` keeps it: ``init`` on ``[batch, length]`` inputs creates ``cached_key`` and
    ``cached_value`` ``[batch, length, kv_heads, head_dim]`` (keys normed and rotated) and
    ``cache_index``; each later call takes the next tokens, rotates them at their positions,
    writes them with ``lax.dynamic_update_slice`` at ``cache_index`` and attends over the
    cache, masked by position (causal; within the window on local layers)."""

    config: Config
    is_global: bool
    decode: bool = False

    @nn.compact
    def __call__(self, x):
        c = self.config
        b, t, _ = x.shape
        q = nn.Dense(c.heads * c.head_dim, use_bias=False, name="q")(x)
        k = nn.Dense(c.kv_heads * c.head_dim, use_bias=False, name="k")(x)
        v = nn.Dense(c.kv_heads * c.head_dim, use_bias=False, name="v")(x)
        q = RMSNorm(c.eps, name="q_norm")(q.reshape(b, t, c.heads, c.head_dim))
        k = RMSNorm(c.eps, name="k_norm")(k.reshape(b, t, c.kv_heads, c.head_dim))
        v = v.reshape(b, t, c.kv_heads, c.head_dim)
        base = c.rope_base if self.is_global else LOCAL_ROPE_BASE
        if self.decode and self.has_variable("cache", "cached_key"):
            return nn.Dense(c.d, use_bias=False, name="o")(self._cached(q, k, v, base))
        q, k = _rope(q, base), _rope(k, base)
        if self.decode:  # init: the cache sized by the input, the call run as the forward
            self.variable("cache", "cached_key", jnp.zeros, k.shape, k.dtype)
            self.variable("cache", "cached_value", jnp.zeros, v.shape, v.dtype)
            self.variable("cache", "cache_index", lambda: jnp.array(0, jnp.int32))
        k, v = (jnp.repeat(a, c.heads // c.kv_heads, axis=2) for a in (k, v))
        scores = jnp.einsum("bthd,bshd->bhts", q, k).astype(jnp.float32) / np.sqrt(c.head_dim)
        i = jnp.arange(t)
        mask = i[:, None] >= i[None]
        if not self.is_global:
            mask &= i[:, None] - i[None] < c.window
        weights = jax.nn.softmax(jnp.where(mask, scores, -1e30), -1).astype(v.dtype)
        out = jnp.einsum("bhts,bshd->bthd", weights, v).reshape(b, t, c.heads * c.head_dim)
        return nn.Dense(c.d, use_bias=False, name="o")(out)

    def _cached(self, q, k, v, base):
        """The decode step: ``q``, ``k``, ``v`` ``[batch, time, heads, head_dim]`` of the
        tokens at ``cache_index ..``; the attention's output ``[batch, time, heads * head_dim]``."""
        c = self.config
        b, t = q.shape[:2]
        cached_key = self.variable("cache", "cached_key", jnp.zeros, k.shape, k.dtype)
        cached_value = self.variable("cache", "cached_value", jnp.zeros, v.shape, v.dtype)
        index = self.variable("cache", "cache_index", lambda: jnp.array(0, jnp.int32))
        i = index.value
        positions = i + jnp.arange(t)
        q, k = _rope(q, base, positions), _rope(k, base, positions)
        # The read passed straight to dynamic_update_slice, as Flax's attention does.
        key, value = cached_key.value, cached_value.value
        key = jax.lax.dynamic_update_slice(key, k.astype(key.dtype), (0, i, 0, 0))
        value = jax.lax.dynamic_update_slice(value, v.astype(value.dtype), (0, i, 0, 0))
        cached_key.value, cached_value.value = key, value
        index.value = i + t
        key, value = (jnp.repeat(a, c.heads // c.kv_heads, axis=2) for a in (key, value))
        scores = jnp.einsum("bthd,bshd->bhts", q, key.astype(q.dtype)).astype(jnp.float32)
        scores = scores / np.sqrt(c.head_dim)
        j = jnp.arange(key.shape[1])
        mask = positions[:, None] >= j[None]
        if not self.is_global:
            mask &= positions[:, None] - j[None] < c.window
        weights = jax.nn.softmax(jnp.where(mask, scores, -1e30), -1).astype(q.dtype)
        out = jnp.einsum("bhts,bshd->bthd", weights, value.astype(q.dtype))
        return out.reshape(b, t, c.heads * c.head_dim)


class MLP(nn.Module):
    config: Config

    @nn.compact
    def __call__(self, x):
        c = self.config
        gate = nn.gelu(nn.Dense(c.mlp, use_bias=False, name="gate")(x), approximate=True)
        return nn.Dense(c.d, use_bias=False, name="down")(
            gate * nn.Dense(c.mlp, use_bias=False, name="up")(x)
        )


class Block(nn.Module):
    config: Config
    is_global: bool
    decode: bool = False

    @nn.compact
    def __call__(self, x):
        eps = self.config.eps
        h = Attention(self.config, self.is_global, self.decode, name="attn")(
            RMSNorm(eps, name="attn_norm")(x)
        )
        x = x + RMSNorm(eps, name="post_attn_norm")(h)
        h = MLP(self.config, name="mlp")(RMSNorm(eps, name="mlp_norm")(x))
        return x + RMSNorm(eps, name="post_mlp_norm")(h)


class Gemma3(nn.Module):
    """Token ids ``[batch, time]`` (starting with ``BOS``) to logits ``[batch, time, vocab]``.

    With ``decode``, the attention caches its keys and values (see :class:`Attention`):
    ``init`` on ``[batch, length]`` ids sizes the caches, each ``apply(..., mutable=["cache"])``
    then takes the next tokens (one a step) at their positions."""

    config: Config
    decode: bool = False

    @nn.compact
    def __call__(self, ids):
        c = self.config
        embed = nn.Embed(c.vocab, c.d, name="embed")
        x = embed(ids) * jnp.float32(np.sqrt(c.d))
        for i in range(c.layers):
            x = Block(c, (i + 1) % GLOBAL_EVERY == 0, self.decode, name=f"layers_{i}")(x)
        return embed.attend(RMSNorm(c.eps, name="final_norm")(x))
