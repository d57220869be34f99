"""Searched policy maps against uniform int4 and the naive map, on a trained small LM.

The model and task are ``lm_task.py``'s (a 4-block Linen LM trained on a structured
synthetic task). ``jp.linen.search_map`` (candidates int8 and int4/128, bf16 always
allowed) is run at three budgets of effective bits per kernel parameter and at the naive
map's bytes; each map's held-out loss is measured with quantized kernels. The naive map
keeps the head and the first and last blocks in bf16 and puts the rest in int4
(embeddings are never quantized). Then each layer alone is put in int4 and the held-out
loss change measured: the Spearman rank correlation between that and the layer's int4
score says whether the score ranks layers as the loss does. A plot of held-out loss
against kernel bytes is written to ``search_bench.png`` (beside this file; ``--quick``:
a temporary folder).

Run: python benchmarks/search_bench.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lm_task
import numpy as np

import jmp_policy as jp

INT8, INT4, BF16 = "int8_from_mixed_bfloat16", "int4/128_from_mixed_bfloat16", "mixed_bfloat16"


def _rank(x):
    order = np.argsort(x, kind="stable")
    ranks = np.empty(len(x))
    ranks[order] = np.arange(len(x))
    return ranks


def spearman(a, b):
    return float(np.corrcoef(_rank(np.asarray(a)), _rank(np.asarray(b)))[0, 1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="short training, fewer batches, 4 layers alone in int4"
    )
    args = parser.parse_args()
    quick = args.quick
    start = time.perf_counter()
    model = lm_task.model()
    params = lm_task.train(lm_task.QUICK_STEPS if quick else lm_task.STEPS)
    variables = {"params": params}
    calib = lm_task.calibration_batches(2 if quick else 4)
    held = lm_task.held_out_batches(2 if quick else lm_task.HELD_OUT)  # the same for every map

    def losses_of(policy_map):
        stored = variables
        if any(getattr(p, "scheme", None) is not None for p in policy_map.values()):
            # No layer stacks in this model: the map quantizes each kernel as it stands
            # (what jp.linen.quantize does here, without tracing the model for stacks).
            stored = {"params": policy_map.quantize(params, stacked_axes=0)}
        return lm_task.held_out_losses(jp.linen.apply(model, policy_map), stored, held)

    def loss_of(policy_map):
        return float(losses_of(policy_map).mean())

    def run(budget):
        return jp.linen.search_map(
            model, variables, calib, lm_task.loss_fn, candidates=[INT8, INT4], budget=budget
        )

    first = run({"effective_bits": 16})
    layers = [row.path for row in first.table]
    params_n = sum(row.params for row in first.table)
    bytes_of = {row.path: row.bytes for row in first.table}
    base_losses = losses_of(jp.DTypePolicyMap(BF16))
    base_loss = float(base_losses.mean())

    def named(choices, label):
        entries = {p: c for p, c in choices.items() if c != BF16}
        b = sum(bytes_of[p][c] for p, c in choices.items())
        return label, b, loss_of(jp.DTypePolicyMap(BF16, entries))

    rows = [named({p: INT4 for p in layers}, "uniform int4")]
    naive_bf16 = ("head", "blocks_0/", f"blocks_{lm_task.LAYERS - 1}/")
    naive = {p: BF16 if p.startswith(naive_bf16) else INT4 for p in layers}
    rows.append(named(naive, "naive (head, first+last block bf16)"))
    rows.append(named({p: INT8 for p in layers}, "uniform int8"))
    budgets = [4.5, 5.0, 6.0]
    naive_bits = 8 * rows[1][1] / params_n
    searched = []
    for bits in [*budgets, naive_bits]:
        result = first.at({"effective_bits": bits})  # the same scores, chosen again
        label = f"searched at {bits:.3g} bits" + (" (naive's bytes)" if bits == naive_bits else "")
        searched.append((label, result.weight_bytes, loss_of(result.policy_map)))
    # Each layer alone in int4: measured loss change against its int4 score (quick: four
    # layers of different kinds, each a compile of the model).
    quick_alone = ("blocks_0/attn/query", "blocks_0/attn/out", "blocks_0/mlp/up", "head")
    alone = layers if not quick else [p for p in layers if p.startswith(quick_alone)]
    scores = {row.path: row.scores[INT4] for row in first.table}
    paired = [
        lm_task.paired_difference(losses_of(jp.DTypePolicyMap(BF16, {p: INT4})), base_losses)
        for p in alone
    ]
    measured = [d for d, _ in paired]
    rho = spearman([scores[p] for p in alone], measured)

    print(
        f"LM: {lm_task.LAYERS} blocks, d={lm_task.D}; {len(layers)} layers, {params_n:,} kernel params"
    )
    print(f"held-out loss, bf16 kernels: {base_loss:.4f} ({2 * params_n:,} bytes)")
    print(f"{'map':44} {'bytes':>10} {'bits':>6} {'held-out loss':>14}")
    for label, b, loss in [*rows, *searched]:
        print(f"{label:44} {b:>10,} {8 * b / params_n:>6.3f} {loss:>14.4f}")
    print(f"Spearman(score, measured loss change), {len(alone)} layers alone in int4: {rho:.3f}")
    print(
        f"  loss changes {min(measured):+.5f} to {max(measured):+.5f} nats; standard error of "
        f"each (paired over {len(held)} held-out batches) median {np.median([e for _, e in paired]):.5f}"
    )
    print(f"took {time.perf_counter() - start:.1f} s")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.scatter([2 * params_n], [base_loss], label="bf16", marker="s")
    for (label, b, loss), marker in zip(rows, "ovD", strict=True):
        ax.scatter([b], [loss], label=label, marker=marker)
    ax.plot([b for _, b, _ in searched], [x for _, _, x in searched], "k.-", label="searched")
    ax.set_xlabel("kernel bytes")
    ax.set_ylabel("held-out loss")
    ax.legend(fontsize=7)
    folder = tempfile.mkdtemp() if quick else os.path.dirname(os.path.abspath(__file__))
    path = os.path.join(folder, "search_bench.png")
    fig.savefig(path, dpi=100, bbox_inches="tight")
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
