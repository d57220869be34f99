"""Zero overhead of `jmp_policy.linen.apply` under a single `mixed_bfloat16` policy.

A small Flax transformer's `value_and_grad`, compiled three ways:

* `jp.linen.apply`: `jmp_policy.linen.apply(model, "mixed_bfloat16")`;
* by hand: `jax.tree.map(lambda p: p.astype(bfloat16), params)` and the input cast by hand;
* Flax's own `dtype=jnp.bfloat16` on every layer (float32 parameters);
* float32 throughout (what mixed precision is measured against; on a GPU, the speed-up);
* with `--float8`, every projection under `"float8_current_from_mixed_bfloat16"` (the rest
  `mixed_bfloat16`): what float8 gives a GPT-2-small-size model on a GPU;
* `jp.linen.apply` with a map (a float32 head) and `NORM_FLOAT32`, a new wrapper per trace:
  its trace time against Flax's own `dtype=` model (the body is traced once, #21).

For each: the activations kept for the backward pass (the residuals of `jax.vjp` that grow
with the batch, read from the traced step: the same on any device, where XLA's CPU temp
bytes keep 16-bit arithmetic in float32), the compiled temp bytes (residuals and scratch),
output bytes, the number of `convert` ops in the optimized HLO, the step time (median of
runs interleaved in one process) and the trace time of `value_and_grad` (`jax.make_jaxpr`,
median of interleaved runs; for `jp.linen.apply` both a fresh wrapper, which learns the
model's modules on its first trace, and a wrapper that has run before), with ratios to the
hand-cast version.

Run: `python benchmarks/linen_overhead_bench.py [--layers 12 --dim 256 --batch 16 --seq 128]`
(the trace-time target, #21: the map row within 1.2x Flax's own `dtype=` model at 12 layers).
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
import warnings
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

import jmp_policy as jp


class Block(nn.Module):
    dim: int
    heads: int
    dtype: Any = None

    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm(dtype=self.dtype, name="norm1")(x)
        h = nn.MultiHeadDotProductAttention(self.heads, dtype=self.dtype, name="attention")(h, h)
        x = x + h
        h = nn.LayerNorm(dtype=self.dtype, name="norm2")(x)
        h = nn.Dense(4 * self.dim, dtype=self.dtype, name="mlp_in")(h)
        h = nn.Dense(self.dim, dtype=self.dtype, name="mlp_out")(nn.gelu(h))
        return x + h


class Transformer(nn.Module):
    layers: int
    dim: int
    heads: int
    dtype: Any = None

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(self.dim, dtype=self.dtype, name="embed")(x)
        for i in range(self.layers):
            x = Block(self.dim, self.heads, self.dtype, name=f"layers_{i}")(x)
        x = nn.LayerNorm(dtype=self.dtype, name="final_norm")(x)
        return nn.Dense(self.dim, dtype=self.dtype, name="head")(x)


MAP_ROW = "jp.linen.apply (map, NORM_FLOAT32)"
FLAX_ROW = "flax dtype=bfloat16"
FLOAT8 = "float8_current_from_mixed_bfloat16"
FLOAT8_ROW = "float8 projections (current)"


def _loss(y: jax.Array) -> jax.Array:
    return jnp.mean(jnp.square(y.astype(jnp.float32)))


def saved_bytes(fn: Any, *args: Any) -> int:
    """Bytes of the residuals ``jax.vjp(fn, *args)`` keeps for the backward pass (the
    arguments themselves aside), read from the traced function: the same on any device."""

    def residuals(*args: Any) -> list[Any]:
        _, backward = jax.vjp(fn, *args)  # a pytree whose leaves are the residuals
        inputs = {id(a) for a in jax.tree.leaves(args)}
        return [r for r in jax.tree.leaves(backward) if id(r) not in inputs]

    return sum(r.size * r.dtype.itemsize for r in jax.eval_shape(residuals, *args))


def activation_bytes(fn: Any, params: Any, x: jax.Array) -> int:
    """The residuals that grow with the batch (activations, not parameter copies)."""
    return saved_bytes(fn, params, jnp.concatenate([x, x])) - saved_bytes(fn, params, x)


def make_variants(
    args: argparse.Namespace, fresh: bool = False, grad: bool = True
) -> tuple[dict[str, Any], Any, jax.Array]:
    model = Transformer(args.layers, args.dim, args.heads)
    flax_model = Transformer(args.layers, args.dim, args.heads, dtype=jnp.bfloat16)
    x = jax.random.normal(jax.random.key(0), (args.batch, args.seq, args.dim), jnp.float32)
    params = jax.jit(model.init)(jax.random.key(1), x)["params"]
    ours = jp.linen.apply(model, "mixed_bfloat16")

    def jmp_policy_apply(p, x):
        # `fresh`: a new wrapper per trace, which has learnt nothing of the model yet.
        wrapper = jp.linen.apply(model, "mixed_bfloat16") if fresh else ours
        return _loss(wrapper({"params": p}, x))

    def by_hand(p, x):
        p = jax.tree.map(lambda a: a.astype(jnp.bfloat16), p)
        return _loss(model.apply({"params": p}, x.astype(jnp.bfloat16)))

    policy_map = jp.DTypePolicyMap("mixed_bfloat16", {"head": "float32"})

    def jmp_policy_map(p, x):
        # A new wrapper per trace (its first, the costliest): a map, a float32 head and
        # float32 norms (`NORM_FLOAT32`), which the wrapper learns of while it traces.
        wrapper = jp.linen.apply(model, policy_map, type_policies=jp.linen.NORM_FLOAT32)
        return _loss(wrapper({"params": p}, x))

    def flax_dtype(p, x):
        return _loss(flax_model.apply({"params": p}, x))

    def float32(p, x):
        return _loss(model.apply({"params": p}, x))

    variants = {
        "by hand (tree.map astype)": by_hand,
        "jp.linen.apply": jmp_policy_apply,
        FLAX_ROW: flax_dtype,
        "float32 (no policy)": float32,
        MAP_ROW: jmp_policy_map,
    }
    if getattr(args, "float8", False):
        # Every projection (attention's query/key/value/out, the MLP's two) in float8,
        # current scaling (no state to carry), the rest mixed_bfloat16.
        float8_map = jp.DTypePolicyMap(
            "mixed_bfloat16",
            {r"layers_\d+/(attention/(query|key|value|out)|mlp_in|mlp_out)": FLOAT8},
        )
        float8_apply = jp.linen.apply(model, float8_map)

        def float8_projections(p, x):
            return _loss(float8_apply({"params": p}, x))

        variants[FLOAT8_ROW] = float8_projections
    if not grad:
        return variants, params, x
    return {k: jax.value_and_grad(f) for k, f in variants.items()}, params, x


def measure(args: argparse.Namespace, traced_only: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """A row per variant; those named in ``traced_only`` are only traced (their trace times
    alone: no compile, memory, convert count or step time)."""
    variants, params, x = make_variants(args)
    losses = make_variants(args, grad=False)[0]
    only = getattr(args, "only", None)
    if only:  # these variants alone, in this order (the first is the base of the ratios)
        variants = {name: variants[name] for name in only}
    rows = []
    compiled = {}
    for name, fn in variants.items():
        if name in traced_only:
            rows.append({"name": name, "times": []})
            continue
        start = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            c = jax.jit(fn).lower(params, x).compile()
        if only:  # a GPU's compiles are slow: say how far it got
            print(f"compiled {name} in {time.perf_counter() - start:.1f} s", flush=True)
        for w in caught:
            if "float8" in str(w.message):
                print(f"warning ({name}): {str(w.message)[:160]}...")
        compiled[name] = c
        memory = c.memory_analysis()
        rows.append(
            {
                "name": name,
                "temp": memory.temp_size_in_bytes,
                "activations": activation_bytes(losses[name], params, x),
                "output": memory.output_size_in_bytes,
                "converts": len(re.findall(r"\bconvert\(", c.as_text())),
                "times": [],
            }
        )
    for c in compiled.values():  # warm up
        jax.block_until_ready(c(params, x))
    timed = [row for row in rows if row["name"] in compiled]
    for _ in range(args.repeats):  # interleaved, so load changes hit every variant alike
        for row, c in zip(timed, compiled.values(), strict=True):
            start = time.perf_counter()
            jax.block_until_ready(c(params, x))
            row["times"].append(time.perf_counter() - start)
    if getattr(args, "no_traces", False):
        for row in rows:
            row["traces"] = [float("nan")]
        return rows
    fresh_variants = make_variants(args, fresh=True)[0]
    tracers = [(row, variants[row["name"]]) for row in rows]
    first = {**rows[1], "name": "jp.linen.apply (first trace)", "times": rows[1]["times"]}
    rows.insert(2, first)
    tracers.insert(2, (first, fresh_variants["jp.linen.apply"]))
    for row, _ in tracers:
        row["traces"] = []
    for _ in range(args.repeats):
        for row, fn in tracers:
            start = time.perf_counter()
            # A new function object per trace: JAX caches traces by function.
            jax.make_jaxpr(lambda p, x, fn=fn: fn(p, x))(params, x)
            row["traces"].append(time.perf_counter() - start)
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    base = rows[0]
    base_time = statistics.median(base["times"])
    base_trace = statistics.median(base["traces"])
    header = [
        "variant",
        "temp MB",
        "x hand",
        "output MB",
        "x hand",
        "converts",
        "x hand",
        "step ms",
        "x hand",
        "trace ms",
        "x hand",
    ]
    table = [header]
    for row in rows:
        t = statistics.median(row["times"])
        table.append(
            [
                row["name"],
                f"{row['temp'] / 1e6:.1f}",
                f"{row['temp'] / base['temp']:.3f}",
                f"{row['output'] / 1e6:.2f}",
                f"{row['output'] / base['output']:.3f}",
                str(row["converts"]),
                f"{row['converts'] / max(base['converts'], 1):.3f}",
                f"{t * 1e3:.1f}",
                f"{t / base_time:.3f}",
                f"{statistics.median(row['traces']) * 1e3:.1f}",
                f"{statistics.median(row['traces']) / base_trace:.3f}",
            ]
        )
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    return "\n".join(
        "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in table
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument(
        "--float8",
        action="store_true",
        help=f"add a row with every projection under {FLOAT8!r} (a GPU measure)",
    )
    parser.add_argument(
        "--only",
        type=lambda s: s.split(","),
        default=None,
        help="comma-separated variant names, in order; the first is the base of the ratios "
        f"(its 'x hand' columns; e.g. {FLAX_ROW!r},jp.linen.apply); implies --no-traces",
    )
    parser.add_argument(
        "--no-traces", action="store_true", help="skip the trace times (host work, not a GPU's)"
    )
    args = parser.parse_args()
    args.no_traces = args.no_traces or bool(args.only)
    print(
        f"Transformer value_and_grad, {args.layers} layers, d={args.dim}, "
        f"batch {args.batch}x{args.seq}, mixed_bfloat16, {jax.devices()[0].platform}, "
        f"{args.repeats} interleaved runs (median)"
    )
    rows = measure(args)
    if args.only:
        print(f"'x hand' columns: over {args.only[0]!r}")
    print(format_table(rows))
    by_name = {r["name"]: r for r in rows}
    if args.no_traces or MAP_ROW not in by_name or FLAX_ROW not in by_name:
        return
    ratio = statistics.median(by_name[MAP_ROW]["traces"]) / statistics.median(
        by_name[FLAX_ROW]["traces"]
    )
    print(f"trace time, {MAP_ROW} (first trace) / {FLAX_ROW}: {ratio:.2f}x")


if __name__ == "__main__":
    main()
