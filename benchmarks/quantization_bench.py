"""Parameter bytes and output error of a small transformer: float32, bf16, int8, int4.

A 4-layer Flax Linen transformer LM (d=256, 4 heads, MLP 1024, vocab 1024). Each row
runs the same float32 weights under a policy map: every Dense/DenseGeneral kernel of the
blocks under the row's policy (``"blocks"``: attention and MLP), embeddings, norms and
the LM head left float32 (as a Keras or qwix user quantizes). ``bytes`` are the stored
parameters after ``map.quantize`` (int4 packed two per byte, scales included); ``rel
err`` is the relative L2 error of the logits against float32; ``top-1`` is how often
the argmax token agrees with float32's. The weights are Flax's random initialisation
(Gaussian, the hardest case for 4 bits); int4 rows quantize weights only, int8 rows run
int8 x int8 -> int32 matmuls too.

Run: python benchmarks/quantization_bench.py
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import flax.linen as nn
import jax
import numpy as np

import jmp_policy as jp

D, HEADS, MLP, VOCAB, LAYERS, BATCH, SEQ = 256, 4, 1024, 1024, 4, 8, 64


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm(name="norm1")(x)
        h = nn.MultiHeadDotProductAttention(HEADS, name="attn")(
            h, mask=nn.make_causal_mask(x[..., 0])
        )
        x = x + h
        h = nn.Dense(MLP, name="up")(nn.LayerNorm(name="norm2")(x))
        return x + nn.Dense(D, name="down")(nn.gelu(h))


class LM(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, D, name="embed")(tokens)
        for i in range(LAYERS):
            x = Block(name=f"block_{i}")(x)
        return nn.Dense(VOCAB, name="lm_head")(nn.LayerNorm(name="final_norm")(x))


def nbytes(tree):
    leaves = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, jp.QuantizedArray))
    return sum(int(x.nbytes) for x in leaves)


def main():
    model = LM()
    tokens = jax.random.randint(jax.random.key(0), (BATCH, SEQ), 0, VOCAB)
    params = jax.jit(model.init)(jax.random.key(1), tokens)["params"]
    ref = jax.jit(model.apply)({"params": params}, tokens)
    rows = [
        ("float32", "float32", None),
        ("bf16", "bfloat16", None),
        ("int8 (weights + int8 matmuls)", "int8_from_float32", "int8"),
        ("int4/128 (weights)", "int4/128_from_float32", "int4"),
        ("int4/-1 (weights)", "int4/-1_from_float32", "int4"),
    ]
    float_bytes = nbytes(params)
    print(f"LM: {LAYERS} layers, d={D}, MLP {MLP}, vocab {VOCAB}; logits of {BATCH}x{SEQ}")
    print(f"{'policy of the blocks':32} {'bytes':>10} {'of f32':>7} {'rel err':>9} {'top-1':>7}")
    for label, policy, mode in rows:
        policy_map = jp.DTypePolicyMap("float32", {r"block_\d+/.*": policy})
        stored = params
        if mode is not None:
            stored = policy_map.quantize(params, stacked_axes=0)  # DenseGeneral: no stacks
        else:
            stored = policy_map.cast_to_variable(params)  # bf16: stored in bfloat16
        out = jax.jit(jp.linen.apply(model, policy_map))({"params": stored}, tokens)
        out = np.asarray(out, np.float32)
        err = np.linalg.norm(out - np.asarray(ref)) / np.linalg.norm(np.asarray(ref))
        agree = np.mean(out.argmax(-1) == np.asarray(ref).argmax(-1))
        b = nbytes(stored)
        print(f"{label:32} {b:>10,} {b / float_bytes:>7.3f} {err:>9.4f} {agree:>7.3f}")


if __name__ == "__main__":
    main()
