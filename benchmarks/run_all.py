"""Every benchmark in benchmarks/, run in one process and reported in one table.

Each row says what is measured, on what (ours) and against what, both values with their
units, and their ratio (ours / against: below 1, ours is smaller or faster). Rows are
measured side by side in this run (interleaved repeats, medians), so a noisy machine moves
both sides alike; bytes and op counts come from XLA's compiled programs or the traced step
and do not depend on the machine's load. Timings on a CPU are labelled ``CPU``: XLA's CPU
backend upcasts 16-bit arithmetic, so 16-bit steps are not faster there.

* linen (``linen_overhead_bench``): a small Flax transformer's ``value_and_grad`` under
  ``"mixed_bfloat16"``, ``jp.linen.apply`` against casting parameters and inputs by hand
  (XLA's temp memory, convert ops, step and trace time: zero overhead is a ratio of 1),
  then ``mixed_bfloat16`` against float32: the activations kept for the backward pass
  (the residuals of ``jax.vjp`` that grow with the batch, read from the traced step: the
  same on any device) and the step time;
* loss scale (``loss_scaling_bench``'s tree): one adam update wrapped in
  ``jp.loss_scaling`` against plain adam, a jmp-style hand-written loop and
  ``optax.apply_if_finite(adam)``: bytes XLA's kernels read and write, and time;
* policy map (``policy_map_bench``): 200 regular-expression keys on a cold map, against
  Keras's ``DTypePolicyMap`` (the peer the README names; its column stays empty when Keras
  is not installed): 1,000 module lookups each, and our whole tree (the 1,000 modules and
  their 20,000 variables) against Keras's 1,000 module lookups;
* quantization: stored parameter bytes of int8 and int4 weights against float32 (an
  MLP), and how far the quantized MLP's output is from float32's (relative norm);
* float8 (``float8_bench``): a training step (``value_and_grad``, adam, the float8 state
  split off) of an MLP stack with its Dense layers under ``"float8_from_mixed_bfloat16"``
  against ``"mixed_bfloat16"`` and float32: step time, XLA's temp memory, the converts to
  float8 (3 per Dense: input, kernel and output gradient), the dots on float8
  operands (the form XLA's GPU GemmRewriter makes native float8 GEMMs of; on a GPU also
  how many it made), and the final training loss over the first after a few hundred steps
  (``final / first loss``: how much of it training removed) next to bf16's, from the same
  start. A CPU has no float8 units: there only the loss and the counts mean something.

After each benchmark's rows a line starting ``=>`` says what they found, in words.

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
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

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


class Row(NamedTuple):
    """One line of the table: ``what`` measured on ``ours`` and on ``against``."""

    what: str
    ours: str
    value: float
    against: str
    against_value: float | None  # None: not measured in this run
    unit: str  # "bytes", "s", "count" or "share"
    ratio: bool = True  # False where a ratio would mislead (of two values near 0)


Section = tuple[str, list[Row]]  # a heading in plain words, its rows


def _timed(what: str) -> str:
    """A timing row's label: CPU timings say so (16-bit runs upcast there)."""
    return f"{what}, CPU" if jax.default_backend() == "cpu" else what


def _scaled(value: float, units: tuple[tuple[float, str], ...]) -> str:
    for scale, unit in units:
        if abs(value) >= scale or scale == units[-1][0]:
            v = value / scale
            digits = 0 if abs(v) >= 100 else 1 if abs(v) >= 10 else 2
            return f"{v:.{digits}f} {unit}"
    raise AssertionError("unreachable")  # pragma: no cover


def format_value(value: float | None, unit: str) -> str:
    """``1.5e6, "bytes"`` -> ``"1.50 MB"``; seconds in s or ms; counts as integers."""
    if value is None:
        return "-"
    if unit == "bytes":
        if abs(value) < 1e3:
            return f"{value:.0f} B"
        return _scaled(value, ((1e9, "GB"), (1e6, "MB"), (1e3, "KB"), (1, "B")))
    if unit == "s":
        return _scaled(value, ((1, "s"), (1e-3, "ms")))
    if unit == "count":
        return f"{value:,.0f}"
    if unit == "share":
        return f"{value:.2%}"
    return f"{value:.4g}"


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}" + ("" if n == 1 else "s")


def linen_rows(quick: bool) -> Section:
    sizes = dict(layers=1, dim=64, heads=2, batch=2, seq=16, repeats=2)
    if not quick:
        sizes = dict(layers=4, dim=256, heads=4, batch=16, seq=128, repeats=10)
    # The map and Flax's dtype= rows give trace times only: they are not compiled.
    traced_only = (linen_overhead_bench.MAP_ROW, linen_overhead_bench.FLAX_ROW)
    rows = linen_overhead_bench.measure(argparse.Namespace(**sizes), traced_only)
    by_name = {r["name"]: r for r in rows}
    ours, hand = by_name["jp.linen.apply"], by_name["by hand (tree.map astype)"]
    f32 = by_name["float32 (no policy)"]
    med = statistics.median
    heading = (
        f"linen: a Flax transformer ({_count(sizes['layers'], 'layer')}, d={sizes['dim']}, batch "
        f"{sizes['batch']}x{sizes['seq']}), value_and_grad under mixed_bfloat16"
    )
    apply, by_hand = "jp.linen.apply", "cast by hand"
    return heading, [
        Row("XLA temp memory", apply, ours["temp"], by_hand, hand["temp"], "bytes"),
        Row("convert ops", apply, ours["converts"], by_hand, hand["converts"], "count"),
        Row("step time", apply, med(ours["times"]), by_hand, med(hand["times"]), "s"),
        Row("trace time", apply, med(ours["traces"]), by_hand, med(hand["traces"]), "s"),
        Row(
            "first trace, float32 norms",
            "a map, new wrapper",
            med(by_name[linen_overhead_bench.MAP_ROW]["traces"]),
            "Flax dtype=bf16",
            med(by_name[linen_overhead_bench.FLAX_ROW]["traces"]),
            "s",
        ),
        Row(
            "activations kept for backward",
            "mixed_bfloat16",
            ours["activations"],
            "float32",
            f32["activations"],
            "bytes",
        ),
        Row(
            _timed("step time"),
            "mixed_bfloat16",
            med(ours["times"]),
            "float32",
            med(f32["times"]),
            "s",
        ),
    ]


def float8_rows(quick: bool) -> Section:
    """float8 Dense layers against bf16 and float32 in a training step (float8_bench)."""
    args = float8_bench.parse_args(["--quick"] if quick else [])
    with warnings.catch_warnings():
        # Its small sizes trip the "float8 will not pay at this size" warning on purpose.
        warnings.filterwarnings("ignore", message="The float8 layer")
        results = float8_bench.measure(args, ("float8", "bf16", "float32"), forward=False)
    f8, bf16, f32 = results["float8"], results["bf16"], results["float32"]
    med = statistics.median
    ours = "float8 Dense"
    denses = 2 * args.layers
    heading = (
        f"float8: a training step of {_count(args.layers, 'MLP block')} (Dense {args.width}->"
        f"{args.hidden}->{args.width}, {args.tokens} tokens), adam, one start for all"
    )
    rows = [
        Row(_timed("step time"), ours, med(f8["times"]), "mixed_bfloat16", med(bf16["times"]), "s"),
        Row(_timed("step time"), ours, med(f8["times"]), "float32", med(f32["times"]), "s"),
        Row("XLA temp memory", ours, f8["temp"], "mixed_bfloat16", bf16["temp"], "bytes"),
        # Counted in the program jax lowers (the library's): compiled, XLA's CPU backend adds
        # the converts back from float8 its emulated dots need and may repeat a convert in
        # each fusion that reads it (jax 0.10.2: 24 here at --quick, 0.12.0.1: 40).
        Row(
            "converts to float8 (traced)",
            ours,
            f8["f8_traced"],
            f"3 per Dense x {denses}",
            3 * denses,
            "count",
        ),
        Row(
            "dots on float8 operands",
            ours,
            f8["fp8_form"][0],
            "all dots",
            f8["fp8_form"][1],
            "count",
        ),
        # The final loss over the first, from the same start: both near 0, so no ratio.
        Row(
            f"final / first loss, {args.steps} steps",
            ours,
            f8["losses"][-1] / f8["losses"][0],
            "mixed_bfloat16",
            bf16["losses"][-1] / bf16["losses"][0],
            "share",
            ratio=False,
        ),
    ]
    if jax.devices()[0].platform == "gpu":
        rows.append(
            Row("native float8 GEMMs", ours, f8["fp8_gemms"], "all GEMMs", f8["gemms"], "count")
        )
    return heading, rows


def quantization_rows(quick: bool) -> Section:
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

    rows = []
    for mode, name in (("int8", "int8"), ("int4/32", "int4 (blocks of 32)")):
        policy_map = jp.DTypePolicyMap("float32", {".*": f"{mode}_from_float32"})
        quantized = policy_map.quantize(params)
        out = jp.linen.apply(mlp, "float32")({"params": quantized}, x)
        error = float(jnp.linalg.norm(out - reference) / jnp.linalg.norm(reference))
        rows.append(
            Row("parameter bytes", name, nbytes(quantized), "float32", nbytes(params), "bytes")
        )
        rows.append(
            Row("output error vs float32's", name, error, "float32", 0.0, "share", ratio=False)
        )
    heading = f"quantization: an MLP of 3 Dense layers ({width} wide), weights quantized"
    return heading, rows


def _bytes(exe: Any) -> float:
    cost = exe.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return float(cost["bytes accessed"])


def loss_scaling_rows(quick: bool) -> Section:
    params = loss_scaling_bench.make_tree(int(2e5 if quick else 20e6))
    size = sum(p.size for p in jax.tree.leaves(params))  # at least one 1024-wide layer
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
    rows = []
    for ref in ("plain adam", "jmp-style by hand", "apply_if_finite"):
        rows.append(
            Row(
                "bytes read and written",
                ours,
                _bytes(compiled[ours]),
                ref,
                _bytes(compiled[ref]),
                "bytes",
            )
        )
        rows.append(Row(_timed("update time"), ours, med[ours], ref, med[ref], "s"))
    heading = f"loss scale: one adam update of {size:,} float32 parameters, finite gradients"
    return heading, rows


def policy_map_rows(quick: bool) -> Section:
    reps = 2 if quick else 7
    tree, keys = policy_map_bench.make_tree(), policy_map_bench.make_keys()
    keras = None
    with contextlib.suppress(ImportError):
        import keras
    ours_tree, ours_lookups, theirs = [], [], []
    for _ in range(reps):
        ours_tree.append(policy_map_bench.time_ours(tree, keys))
        ours_lookups.append(policy_map_bench.time_ours_module_lookups(keys))
        if keras is not None:
            theirs.append(policy_map_bench.time_keras(keys))
    med = statistics.median
    keras_time = med(theirs) if theirs else None
    heading = f"policy map: {policy_map_bench.KEYS} regex keys, a cold map"
    if keras is None:
        heading += " (Keras not installed: `pip install keras` fills its column)"
    ours = "jp.DTypePolicyMap"
    return heading, [
        Row("1,000 module lookups", ours, med(ours_lookups), "Keras's map", keras_time, "s"),
        Row(
            "whole tree (20,000 variables)",
            ours,
            med(ours_tree),
            "Keras, modules only",
            keras_time,
            "s",
        ),
    ]


HEADER = ("what", "ours", "value", "against", "value", "ratio")


def _ratio_of(rows: list[Row], what: str, against: str) -> float:
    row = next(r for r in rows if r.what.startswith(what) and r.against == against)
    return row.value / row.against_value if row.against_value else float("nan")


def findings(sections: list[Section], quick: bool) -> dict[str, str]:
    """A line per benchmark: what its rows found, in words (timings only at full sizes)."""
    rows = {heading.partition(":")[0]: section for heading, section in sections}
    out = {}
    linen = rows["linen"]
    line = (
        f"jp.linen.apply compiles to what casting by hand does (converts "
        f"{_ratio_of(linen, 'convert ops', 'cast by hand'):.3f}x, temp memory "
        f"{_ratio_of(linen, 'XLA temp memory', 'cast by hand'):.3f}x); mixed_bfloat16 keeps "
        f"{_ratio_of(linen, 'activations kept', 'float32'):.2f}x float32's activations"
    )
    if not quick:
        line += f"; step time {_ratio_of(linen, 'step time', 'cast by hand'):.3f}x by hand's"
    out["linen"] = line
    scale = rows["loss scale"]
    out["loss scale"] = (
        f"the wrapper moves {_ratio_of(scale, 'bytes', 'plain adam'):.2f}x plain adam's bytes "
        f"(the extra finiteness read any skipping wrapper pays), "
        f"{_ratio_of(scale, 'bytes', 'jmp-style by hand'):.2f}x a jmp-style loop's and "
        f"{_ratio_of(scale, 'bytes', 'apply_if_finite'):.2f}x apply_if_finite's"
    )
    policy_map = rows["policy map"]
    whole = policy_map[1]
    out["policy map"] = f"our whole tree resolves in {format_value(whole.value, 's')}" + (
        f", {whole.value / whole.against_value:.2f}x Keras's time for its modules alone"
        if whole.against_value
        else " (Keras not installed: no comparison)"
    )
    quant = rows["quantization"]
    parts = []
    for r in quant:
        if r.what == "parameter bytes":
            error = next(e for e in quant if e.ours == r.ours and e.what.startswith("output"))
            parts.append(
                f"{r.ours} stores {r.value / r.against_value:.2f}x float32's bytes at "
                f"{error.value:.2%} output error"
            )
    out["quantization"] = "; ".join(parts)
    f8 = rows["float8"]
    dots = next(r for r in f8 if r.what == "dots on float8 operands")
    loss = next(r for r in f8 if r.what.startswith("final / first loss"))
    out["float8"] = (
        f"{dots.value:.0f} of {dots.against_value:.0f} dots run on float8 operands; training "
        f"leaves {loss.value:.2%} of the first loss (bf16: {loss.against_value:.2%})"
    )
    return out


def format_table(sections: list[Section], found: dict[str, str] | None = None) -> str:
    """One table, a heading line per benchmark; ratio = ours' value / against's; after each
    benchmark's rows, its line of ``found`` (``=> ...``) where given."""
    found = found or {}
    cells: list[tuple[str, ...] | str] = [HEADER]
    for heading, rows in sections:
        cells.append(heading)
        if heading.partition(":")[0] in found:
            rows = [*rows, found[heading.partition(":")[0]]]  # type: ignore[list-item]
        for r in rows:
            if isinstance(r, str):
                cells.append(_wrap("=> " + r))
                continue
            ratio = "-"
            if r.ratio and r.against_value:  # neither None nor 0
                ratio = f"{r.value / r.against_value:.3f}x"
            cells.append(
                (
                    r.what,
                    r.ours,
                    format_value(r.value, r.unit),
                    r.against,
                    format_value(r.against_value, r.unit),
                    ratio,
                )
            )
    table = [c for c in cells if isinstance(c, tuple)]
    widths = [max(len(c[i]) for c in table) for i in range(len(HEADER))]
    right = {2, 4, 5}  # the numbers
    lines = []
    for c in cells:
        if isinstance(c, str):
            lines.append(c)
            continue
        line = _INDENT + "  ".join(
            c[i].rjust(widths[i]) if i in right else c[i].ljust(widths[i])
            for i in range(len(HEADER))
        )
        lines.append(line.rstrip())
        if c is HEADER:
            lines.append(_INDENT + "-" * (len(line) - len(_INDENT)))
    return "\n".join(lines)


_INDENT = "  "


def _wrap(text: str, width: int = 100) -> str:
    """``text`` in lines of at most ``width`` columns, continuations indented by three."""
    lines, line = [], ""
    for word in text.split(" "):
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = "   " + word
        else:
            line = f"{line} {word}" if line else word
    return "\n".join([*lines, line])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="Full sizes take about 3 minutes on 2 CPU cores; --quick about 1 minute, at "
        "sizes too small to time (its timings measure fixed costs, not the library).",
    )
    parser.add_argument(
        "--quick", action="store_true", help="small sizes, few repeats (about 1 minute)"
    )
    args = parser.parse_args(argv)
    device = jax.devices()[0]
    print(
        f"jax {jax.__version__} on {device.device_kind} ({os.cpu_count()} cores), "
        f"{'quick' if args.quick else 'full'} sizes; ratio = ours / against (< 1: ours less)"
    )
    sections = [linen_rows(args.quick), loss_scaling_rows(args.quick)]
    sections += [policy_map_rows(args.quick), quantization_rows(args.quick)]
    sections.append(float8_rows(args.quick))
    print(format_table(sections, findings(sections, args.quick)))
    if args.quick:
        print(
            "Quick sizes are too small to time: their time ratios are fixed costs, not the "
            "library's;\nbytes, counts and errors hold."
        )
    if device.platform == "cpu":
        print("No speed-up on a CPU: XLA's CPU backend upcasts 16-bit arithmetic to float32.")


if __name__ == "__main__":
    main()
