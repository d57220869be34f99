"""Every benchmark in benchmarks/, run in one process and reported in one table of ratios.

Each row is measured side by side in this run (interleaved repeats, medians), so a noisy
machine moves both sides alike; bytes and op counts come from XLA's compiled programs and
do not depend on the machine's load.

* zero overhead (``linen_overhead_bench``): ``jp.linen.apply(model, "mixed_bfloat16")``
  against casting parameters and inputs by hand, on a small Flax transformer's
  ``value_and_grad``: activation bytes, convert ops, step time; and against float32, the
  activations kept for the backward pass (the residuals of ``jax.vjp`` that grow with the
  batch, read from the traced step: the same on any device) and the step time (labelled
  ``CPU`` on a CPU, where XLA upcasts 16-bit arithmetic);
* loss scaling (``loss_scaling_bench``'s tree): ``jp.loss_scaling(adam)`` against plain adam,
  a jmp-style hand-written loop and ``optax.apply_if_finite(adam)``: bytes accessed and
  update time;
* float8 (``float8_bench``): a training step (``value_and_grad``, adam, the float8 state
  split off) of an MLP stack with its Dense layers under ``"float8_from_mixed_bfloat16"``
  against ``"mixed_bfloat16"`` and float32: step time, temp bytes, float8 converts (6 per
  Dense: input, kernel and output gradient, each to and from float8), the share of dots in
  the form XLA's GPU GemmRewriter makes native float8 GEMMs of (and on a GPU the share it
  did), and the loss after a few hundred steps (its distance to bf16's, over the first
  loss). A CPU has no float8 units: there only the loss and the counts mean something;
* quantization: stored parameter bytes and output error of int8 and int4 weights
  against float32 (an MLP);
* policy maps (``policy_map_bench``): resolving a whole tree with 200 regex keys, against
  Keras's ``DTypePolicyMap`` doing the module lookups (when Keras is installed; not in
  ``--quick``, where the whole tree is compared with our module lookups alone).

Run: ``python benchmarks/run_all.py`` (``--quick``: small sizes, few repeats; CI runs it).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

import jmp_policy as jp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import float8_bench
import linen_overhead_bench
import loss_scaling_bench

_platforms = os.environ.get("JAX_PLATFORMS")
import policy_map_bench  # noqa: E402  (it defaults JAX_PLATFORMS to cpu for itself alone)

if _platforms is None:
    os.environ.pop("JAX_PLATFORMS", None)

Row = tuple[str, str, str, str, float]  # benchmark, what, ours, reference, ratio


def _timed(what: str) -> str:
    """A timing row's label: CPU timings say so (16-bit runs upcast there)."""
    return f"{what}, CPU" if jax.default_backend() == "cpu" else what


def linen_rows(quick: bool) -> list[Row]:
    sizes = dict(layers=1, dim=64, heads=2, batch=2, seq=16, repeats=2)
    if not quick:
        sizes = dict(layers=4, dim=256, heads=4, batch=16, seq=128, repeats=10)
    rows = linen_overhead_bench.measure(argparse.Namespace(**sizes))
    by_name = {r["name"]: r for r in rows}
    ours, hand = by_name["jp.linen.apply"], by_name["by hand (tree.map astype)"]
    f32 = by_name["float32 (no policy)"]
    med = statistics.median
    shape = f"{sizes['layers']}x d={sizes['dim']}"
    return [
        (
            "linen",
            f"activation bytes, {shape}",
            "jp.linen.apply",
            "by hand",
            ours["temp"] / hand["temp"],
        ),
        (
            "linen",
            "convert ops",
            "jp.linen.apply",
            "by hand",
            ours["converts"] / max(hand["converts"], 1),
        ),
        (
            "linen",
            "step time",
            "jp.linen.apply",
            "by hand",
            med(ours["times"]) / med(hand["times"]),
        ),
        (
            "linen",
            "trace time",
            "jp.linen.apply",
            "by hand",
            med(ours["traces"]) / med(hand["traces"]),
        ),
        (
            "linen",
            "trace time, first",
            "map+NORM_FLOAT32",
            "flax dtype=",
            med(by_name[linen_overhead_bench.MAP_ROW]["traces"])
            / med(by_name[linen_overhead_bench.FLAX_ROW]["traces"]),
        ),
        (
            "linen",
            "activations kept for backward",
            "mixed_bfloat16",
            "float32",
            ours["activations"] / f32["activations"],
        ),
        (
            "linen",
            _timed("step time"),
            "mixed_bfloat16",
            "float32",
            med(ours["times"]) / med(f32["times"]),
        ),
    ]


def float8_rows(quick: bool) -> list[Row]:
    """float8 Dense layers against bf16 and float32 in a training step (float8_bench)."""
    args = float8_bench.parse_args(["--quick"] if quick else [])
    results = float8_bench.measure(args)
    f8, bf16, f32 = results["float8"], results["bf16"], results["float32"]
    med = statistics.median
    ours = "float8 Dense"
    denses = 2 * args.layers
    rows: list[Row] = [
        (
            "float8",
            _timed("step time"),
            ours,
            "mixed_bfloat16",
            med(f8["times"]) / med(bf16["times"]),
        ),
        ("float8", _timed("step time"), ours, "float32", med(f8["times"]) / med(f32["times"])),
        ("float8", "step temp bytes", ours, "mixed_bfloat16", f8["temp"] / bf16["temp"]),
        (
            "float8",
            "float8 converts",
            ours,
            f"6 per Dense x {denses}",
            f8["f8_converts"] / (6 * denses),
        ),
        (
            "float8",
            "dots in fp8 GEMM form",
            ours,
            "all dots",
            f8["fp8_form"][0] / f8["fp8_form"][1],
        ),
        (
            "float8",
            f"loss after {args.steps} steps, - bf16's",
            ours,
            "first loss",
            abs(f8["losses"][-1] - bf16["losses"][-1]) / bf16["losses"][0],
        ),
    ]
    if jax.devices()[0].platform == "gpu":
        rows.append(
            ("float8", "native fp8 GEMMs", ours, "all GEMMs", f8["fp8_gemms"] / f8["gemms"])
        )
    return rows


def quantization_rows(quick: bool) -> list[Row]:
    """Stored bytes and output error of int8 / int4 weights against float32 (an MLP)."""
    import flax.linen as nn

    width = 64 if quick else 512
    mlp = nn.Sequential([nn.Dense(width), nn.relu, nn.Dense(width), nn.relu, nn.Dense(width)])
    x = jax.random.normal(jax.random.key(0), (8, width))
    params = mlp.init(jax.random.key(1), x)["params"]
    reference = mlp.apply({"params": params}, x)

    def nbytes(tree: Any) -> int:
        leaves = jax.tree.leaves(tree, is_leaf=lambda v: isinstance(v, jp.QuantizedArray))
        return sum(int(v.nbytes) for v in leaves)

    rows: list[Row] = []
    for mode in ("int8", "int4/32"):
        policy_map = jp.DTypePolicyMap("float32", {".*": f"{mode}_from_float32"})
        quantized = policy_map.quantize(params)
        out = jp.linen.apply(mlp, "float32")({"params": quantized}, x)
        error = float(jnp.linalg.norm(out - reference) / jnp.linalg.norm(reference))
        rows.append(
            (
                "quantization",
                f"parameter bytes, {mode}",
                mode,
                "float32",
                nbytes(quantized) / nbytes(params),
            )
        )
        rows.append(("quantization", f"output rel. error, {mode}", mode, "float32", error))
    return rows


def _bytes(exe: Any) -> float:
    cost = exe.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return float(cost["bytes accessed"])


def loss_scaling_rows(quick: bool) -> list[Row]:
    params = loss_scaling_bench.make_tree(int(2e5 if quick else 20e6))
    reps = 3 if quick else 30
    scale = jp.DynamicLossScale(2.0**15)
    grads = jax.tree.map(lambda x: x * 1e-3, params)
    scaled = scale.scale(grads)
    adam = optax.adam(1e-3)
    wrapped = jp.loss_scaling(adam, scale)
    guarded = optax.apply_if_finite(adam, max_consecutive_errors=5)

    def jmp_style(g: Any, state: Any, p: Any) -> Any:
        inner, loss_scale = state
        g = loss_scale.unscale(g)
        finite = jp.all_finite(g)
        updates, new_inner = adam.update(g, inner, p)
        updates = jp.select_tree(finite, updates, jax.tree.map(jnp.zeros_like, updates))
        return updates, (jp.select_tree(finite, new_inner, inner), loss_scale.adjust(finite))

    variants: dict[str, tuple[Callable[..., Any], Any, Any]] = {
        "plain adam": (adam.update, grads, adam.init(params)),
        "jp.loss_scaling": (wrapped.update, scaled, wrapped.init(params)),
        "jmp-style by hand": (jmp_style, scaled, (adam.init(params), scale)),
        "apply_if_finite": (guarded.update, grads, guarded.init(params)),
    }
    compiled = {k: jax.jit(f).lower(g, s, params).compile() for k, (f, g, s) in variants.items()}
    times: dict[str, list[float]] = {k: [] for k in variants}
    for i in range(reps + 1):
        for name, (_, g, state) in variants.items():
            start = time.perf_counter()
            jax.block_until_ready(compiled[name](g, state, params))
            if i:  # the first round warms up
                times[name].append(time.perf_counter() - start)
    med = {k: statistics.median(v) for k, v in times.items()}
    ours = "jp.loss_scaling"
    rows: list[Row] = []
    for ref in ("plain adam", "jmp-style by hand", "apply_if_finite"):
        rows.append(
            (
                "loss scale",
                "adam update, bytes accessed",
                ours,
                ref,
                _bytes(compiled[ours]) / _bytes(compiled[ref]),
            )
        )
        rows.append(("loss scale", "adam update, time", ours, ref, med[ours] / med[ref]))
    return rows


def policy_map_rows(quick: bool) -> list[Row]:
    reps = 2 if quick else 7
    tree, keys = policy_map_bench.make_tree(), policy_map_bench.make_keys()
    keras = None
    if not quick:  # importing Keras alone takes seconds
        with contextlib.suppress(ImportError):
            import keras
    ours_tree, ours_lookups, theirs = [], [], []
    for _ in range(reps):
        ours_tree.append(policy_map_bench.time_ours(tree, keys))
        ours_lookups.append(policy_map_bench.time_ours_module_lookups(keys))
        if keras is not None:
            theirs.append(policy_map_bench.time_keras(keys))
    med = statistics.median
    if keras is None:
        return [
            (
                "policy map",
                "whole tree vs 1,000 lookups",
                "tree",
                "lookups",
                med(ours_tree) / med(ours_lookups),
            )
        ]
    return [
        (
            "policy map",
            "1,000 modules + 20,000 leaves",
            "whole tree",
            "Keras lookups",
            med(ours_tree) / med(theirs),
        ),
        (
            "policy map",
            "1,000 module lookups",
            "DTypePolicyMap",
            "Keras",
            med(ours_lookups) / med(theirs),
        ),
    ]


def format_table(rows: list[Row]) -> str:
    header = ("benchmark", "what", "ours", "against", "ratio")
    cells = [header] + [(b, w, o, r, f"{x:.3f}x") for b, w, o, r, x in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(5)]
    lines = [
        "  ".join(
            c[i].ljust(widths[i]) if i < 4 else c[i].rjust(widths[i]) for i in range(5)
        ).rstrip()
        for c in cells
    ]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, few repeats")
    args = parser.parse_args(argv)
    device = jax.devices()[0]
    print(
        f"jax {jax.__version__} on {device.device_kind} ({os.cpu_count()} cores), "
        f"{'quick' if args.quick else 'full'} sizes; ratio = ours / against (< 1: ours less)"
    )
    rows = linen_rows(args.quick) + loss_scaling_rows(args.quick)
    rows += policy_map_rows(args.quick) + quantization_rows(args.quick) + float8_rows(args.quick)
    print(format_table(rows))
    if device.platform == "cpu":
        print("No speed-up on a CPU: XLA's CPU backend upcasts 16-bit arithmetic to float32.")


if __name__ == "__main__":
    main()
