"""bfloat16 weights without float32 masters (#51): memory and loss against float32 masters.

Trains ``lm_task.py``'s LM (4 blocks, d=128, 867,328 parameters) from one initialisation on the
same batches with adam (the task's warmup-cosine schedule, peak 3e-3) in these setups:

- ``f32 masters``: float32 parameters and moments, bf16 compute (``"mixed_bfloat16"``);
- ``bf16 nearest``: bf16 parameters (``"bfloat16"``), adam in float32 from them, the update
  rounded to nearest by ``optax.apply_updates`` (the control: what stalls);
- ``bf16 + SR``: ``jp.stochastic_rounding(adam, key=0)``;
- ``bf16 + Kahan``: ``jp.kahan_summation(adam)``;
- the last two again with bf16 moments (``moment_dtype="bfloat16"``).

Prints, side by side as ratios to ``f32 masters``: parameter + optimizer-state bytes (read
from the arrays with ``jp.tree_bytes``), the held-out loss after training (48 held-out
batches, with the paired difference to ``f32 masters`` and its standard error), and the
training-loss curve (mean over windows of steps).

Run: ``python benchmarks/bf16_training_bench.py [--quick] [--steps N] [--only NAME ...]
[--save FILE]``; ``--report FILE ...`` prints the table of runs saved apart (setups run in
parallel processes).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax
import jax.numpy as jnp
import lm_task
import numpy as np
import optax

import jmp_policy as jp


def nearest(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """The control: ``inner`` in float32 from bf16 parameters (moments float32), its update
    left to ``optax.apply_updates``, which rounds the sum to nearest."""

    def up(tree: Any) -> Any:
        return jax.tree.map(lambda x: x.astype(jnp.float32), tree)

    def init(params: Any) -> Any:
        return inner.init(up(params))

    def update(grads: Any, state: Any, params: Any = None) -> Any:
        return inner.update(up(grads), state, up(params))

    return optax.GradientTransformation(init, update)


def setups(schedule: Any) -> dict[str, tuple[str, optax.GradientTransformation]]:
    """Name -> (policy, optimizer)."""
    adam = optax.adam(schedule)
    return {
        "f32 masters": ("mixed_bfloat16", adam),
        "bf16 nearest": ("bfloat16", nearest(adam)),
        "bf16 + SR": ("bfloat16", jp.stochastic_rounding(adam, key=0)),
        "bf16 + Kahan": ("bfloat16", jp.kahan_summation(adam)),
        "bf16 + SR, bf16 moments": (
            "bfloat16",
            jp.stochastic_rounding(adam, key=0, moment_dtype="bfloat16"),
        ),
        "bf16 + Kahan, bf16 moments": (
            "bfloat16",
            jp.kahan_summation(adam, moment_dtype="bfloat16"),
        ),
    }


NAMES = [
    "f32 masters",
    "bf16 nearest",
    "bf16 + SR",
    "bf16 + Kahan",
    "bf16 + SR, bf16 moments",
    "bf16 + Kahan, bf16 moments",
]


def train(
    policy: str, opt: optax.GradientTransformation, steps: int, log_every: int
) -> tuple[Any, Any, list[float], float]:
    """Params, optimizer state, mean training loss per window of ``log_every``, seconds."""
    net = lm_task.model()
    params = jax.jit(net.init)(jax.random.key(0), jnp.zeros((1, lm_task.SEQ), jnp.int32))
    params = jp.get(policy).cast_to_variable(params["params"])
    apply = jp.linen.apply(net, policy)
    state = opt.init(params)

    @jax.jit
    def step(params: Any, state: Any, tokens: Any) -> Any:
        loss, grads = jax.value_and_grad(
            lambda p: lm_task.loss_fn(apply({"params": p}, tokens), tokens)
        )(params)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    losses, curve = [], []
    start = time.perf_counter()
    for i in range(steps):
        params, state, loss = step(params, state, lm_task.sample(i, lm_task.TRAIN_BATCH))
        losses.append(loss)
        if (i + 1) % log_every == 0:
            curve.append(float(np.mean(jax.device_get(losses[-log_every:]))))
    return params, state, curve, time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="12 steps, 2 held-out batches")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--only", nargs="*", default=None, help="setups to run (by name)")
    parser.add_argument("--save", default=None, help="also write the results to this JSON file")
    parser.add_argument(
        "--report", nargs="*", default=None, help="print the table of saved JSON files, no run"
    )
    args = parser.parse_args(argv)
    if args.report:
        merged: dict[str, Any] = {}
        for path in args.report:
            with open(path) as f:
                merged.update(json.load(f))
        names = [n for n in NAMES if n in merged]
        results = {n: {**merged[n], "held": np.asarray(merged[n]["held"])} for n in names}
        report(results, merged[names[0]]["steps"], merged[names[0]]["log_every"])
        return
    steps = args.steps or (lm_task.QUICK_STEPS if args.quick else lm_task.STEPS)
    log_every = max(steps // 10, 1)
    held = lm_task.held_out_batches(2 if args.quick else lm_task.HELD_OUT)
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, lm_task.LEARNING_RATE, max(steps // 10, 1), steps
    )
    chosen = {k: v for k, v in setups(schedule).items() if not args.only or k in args.only}
    results: dict[str, dict[str, Any]] = {}
    for name, (policy, opt) in chosen.items():
        params, state, curve, seconds = train(policy, opt, steps, log_every)
        apply: Callable[..., Any] = jp.linen.apply(lm_task.model(), policy)
        results[name] = {
            "bytes": sum(jp.tree_bytes((params, state)).values()),
            "dtypes": jp.tree_bytes((params, state)),
            "held": lm_task.held_out_losses(apply, params, held),
            "curve": curve,
            "seconds": seconds,
            "steps": steps,
            "log_every": log_every,
        }
        print(f"trained {name!r}: {steps} steps in {seconds:.0f} s", flush=True)
    if args.save:
        with open(args.save, "w") as f:
            json.dump({n: {**r, "held": r["held"].tolist()} for n, r in results.items()}, f)
    report(results, steps, log_every)


def report(results: dict[str, dict[str, Any]], steps: int, log_every: int) -> None:
    base = results.get("f32 masters")
    print(f"\n{steps} steps of adam on lm_task's LM; ratios to 'f32 masters'")
    print(
        f"{'setup':28} {'params+state':>13} {'ratio':>7} {'held-out':>9} {'ratio':>7} "
        f"{'minus f32 masters':>19}"
    )
    for name, r in results.items():
        held = float(np.mean(r["held"]))
        if base is not None:
            diff, se = lm_task.paired_difference(r["held"], base["held"])
            b_ratio = f"{r['bytes'] / base['bytes']:.3f}x"
            l_ratio = f"{held / float(np.mean(base['held'])):.4f}x"
            d_text = f"{diff:+.4f} ± {se:.4f}"
        else:
            b_ratio = l_ratio = d_text = "-"
        print(
            f"{name:28} {r['bytes'] / 1e6:>10.2f} MB {b_ratio:>7} {held:>9.4f} {l_ratio:>7} "
            f"{d_text:>19}"
        )
    print("\nbytes by dtype:")
    for name, r in results.items():
        print(f"  {name:28} " + ", ".join(f"{k} {v / 1e6:.2f} MB" for k, v in r["dtypes"].items()))
    print(f"\ntraining loss, mean of each {log_every} steps (ratio to 'f32 masters'):")
    names = list(results)
    print(f"{'steps':>9} " + " ".join(f"{n[:22]:>22}" for n in names))
    for w in range(len(next(iter(results.values()))["curve"])):
        cells = []
        for n in names:
            v = results[n]["curve"][w]
            ratio = f" ({v / base['curve'][w]:.3f}x)" if base is not None else ""
            cells.append(f"{v:.4f}{ratio}")
        print(f"{(w + 1) * log_every:>9} " + " ".join(f"{c:>22}" for c in cells))


if __name__ == "__main__":
    main()
