"""Tune the Pallas weight-only kernel's tiles on a GPU, timed beside bf16 and XLA's form.

For each ``--dims`` (a square ``dim x dim`` kernel), ``--rows`` and weight format (int8 per
channel, int4 per channel, int4 in blocks of 128), one jitted program per variant runs
``--layers`` distinct kernels in a chain, ``--loops`` times over (a ``fori_loop``, so a
call is long enough to time without the dispatch), with:

* ``bf16``: ``x @ w`` with the kernel stored in bfloat16 (the reference);
* ``xla``: the library's weight-only matmul with ``serving_kernel="xla"`` (XLA's form);
* ``pallas <tiles>``: the library's Pallas kernel with those :class:`Tiles`.

Each row: the median time per matmul over ``--repeats`` interleaved calls, its ratio to
bf16's (``bf16/this``, above 1 is faster), the weight bandwidth it reached (the stored
weight bytes over the time) and the relative error against a float32 matmul of the same
quantized weights. The tiles tried are :data:`CANDIDATES` at the first dim; at the others,
the default and the best of the first dim. The table ends with the best tiles per shape.
A step stops starting new variants after ``--budget`` seconds (what it has still prints).

Run on a GPU: ``JAX_PLATFORMS=cuda python benchmarks/pallas_tune.py``; ``--quick`` runs
the same code at tiny sizes in Pallas's interpreter (for tests on CPUs: times mean nothing).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from contextlib import nullcontext
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jmp_policy as jp
from jmp_policy._src.quantization import kernel_matmul, pallas_matmul, serving_kernels
from jmp_policy._src.quantization.pallas_matmul import Tiles

FORMATS = {
    "int8": "int8_from_float32",
    "int4": "int4_from_float32",
    "int4/128": "int4/128_from_float32",
}
CANDIDATES = (
    Tiles(),
    Tiles(out=64),
    Tiles(out=256),
    Tiles(step=256),
    Tiles(step=64),
    Tiles(programs=132),
    Tiles(programs=528),
    Tiles(warps=8),
    Tiles(stages=4),
    Tiles(out=64, programs=528),
    Tiles(out=256, step=64),
    Tiles(out=64, programs=528, fma_rows=4),
    Tiles(out=64, programs=528, mask_weights=False),
    Tiles(out=64, programs=528, fma_rows=4, mask_weights=False),
)
DIMS = (((1,), (0,)), ((), ()))


def label(t: Tiles) -> str:
    extra = "".join(f" {k}{v}" for k, v in (("w", t.warps), ("s", t.stages)) if v)
    extra += f" x{t.partials:g}" if t.partials != Tiles().partials else ""
    extra += f" fma{t.fma_rows}" if t.fma_rows else ""
    extra += " nomask" if not t.mask_weights else ""
    return f"pallas o{t.out} k{t.step} p{t.programs}{extra}"


def program(kind: str, loops: int, tiles: Tiles | None, interpret: bool) -> Any:
    """The jitted chain ``x -> x @ w_0 -> ... -> x @ w_{L-1}``, ``loops`` times."""

    def one(x: jax.Array, w: Any) -> jax.Array:
        if kind == "bf16":
            return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)
        if kind == "xla":
            rhs = jax.ShapeDtypeStruct(w.shape, x.dtype)
            return kernel_matmul.quantized_kernel_dot_general(w)(x, rhs, DIMS)
        block = None if w.block_size in (None, -1) else w.block_size
        return pallas_matmul.weight_only_matmul(
            x, w.values, w.scale, block, x.dtype, interpret=interpret, tiles=tiles
        )

    def chain(x: jax.Array, weights: list[Any]) -> jax.Array:
        def body(_: Any, y: jax.Array) -> jax.Array:
            for w in weights:
                y = one(y, w)
            return y

        return jax.lax.fori_loop(0, loops, body, x)

    return jax.jit(chain)


def error(kind: str, tiles: Tiles | None, x: jax.Array, w: Any, interpret: bool) -> float:
    """Relative error of one matmul against float32 on the same (dequantized) weights."""
    f = program(kind, 1, tiles, interpret)
    ctx = serving_kernels.using("xla") if kind == "xla" else nullcontext()
    with ctx:
        y = np.asarray(f(x, [w]), np.float32)
    dense = w.astype(jnp.float32) if kind == "bf16" else w.dequantize(jnp.float32)
    ref = np.asarray(x, np.float32) @ np.asarray(dense)
    return float(np.linalg.norm(y - ref) / np.linalg.norm(ref))


def measure_shape(args: argparse.Namespace, dim: int, rows: int, fmt: str,
                  tiles_list: list[Tiles], deadline: float) -> list[dict[str, Any]]:  # fmt: skip
    key = jax.random.key(dim)
    ws = [
        jax.random.normal(jax.random.fold_in(key, i), (dim, dim), jnp.float32) / np.sqrt(dim)
        for i in range(args.layers)
    ]
    q = [jp.get(FORMATS[fmt]).quantize(w) for w in ws]
    weights = {"bf16": [w.astype(jnp.bfloat16) for w in ws], "xla": q}
    x = jax.random.normal(jax.random.key(rows), (rows, dim)).astype(jnp.bfloat16)
    interpret = args.quick
    runs: dict[str, tuple[Any, list[Any], float]] = {}
    for name, kind, tiles in [("bf16", "bf16", None), ("xla", "xla", None)] + [
        (label(t), "pallas", t) for t in tiles_list
    ]:
        if time.monotonic() > deadline and name not in ("bf16", "xla"):
            print(f"  budget spent: {name} not run", flush=True)
            continue
        w = weights.get(kind, q)
        f = program(kind, args.loops, tiles, interpret)
        with serving_kernels.using("xla") if kind == "xla" else nullcontext():
            compiled = f.lower(x, w).compile()
        # The error of the kernel's tiles (XLA's own forms are checked by the test suite).
        err = error(kind, tiles, x, w[0], interpret) if kind == "pallas" else float("nan")
        jax.block_until_ready(compiled(x, w))
        runs[name] = (compiled, w, err)
    times: dict[str, list[float]] = {n: [] for n in runs}
    for _ in range(args.repeats):
        for name, (compiled, w, _) in runs.items():
            start = time.perf_counter()
            jax.block_until_ready(compiled(x, w))
            times[name].append(time.perf_counter() - start)
    per = args.loops * args.layers
    base = statistics.median(times["bf16"]) / per
    out = []
    for name, (_, w, err) in runs.items():
        t = statistics.median(times[name]) / per
        nbytes = stored_bytes(w[0])
        row = {"dim": dim, "rows": rows, "format": fmt, "variant": name, "us": t * 1e6,
               "speedup": base / t, "gbps": nbytes / t / 1e9, "error": err}  # fmt: skip
        print("  " + format_row(row), flush=True)
        out.append(row)
    return out


def stored_bytes(w: Any) -> float:
    """The bytes a kernel occupies on a device: int4 two values per byte (``nbytes`` of a
    ``jnp.int4`` array counts one byte per value: the first H100 logs' int4 GB/s are 2x)."""
    leaves = jax.tree.leaves(w)
    return sum(x.size * (0.5 if x.dtype == jnp.int4 else x.dtype.itemsize) for x in leaves)


def format_row(r: dict[str, Any]) -> str:
    return (
        f"{r['dim']:>5} {r['rows']:>3} {r['format']:<8} {r['variant']:<30} {r['us']:9.2f} us "
        f"{r['speedup']:6.3f}x {r['gbps']:8.1f} GB/s err {r['error']:.2e}"
    )


def best_by_shape(rows: list[dict[str, Any]]) -> dict[tuple[int, int, str], dict[str, Any]]:
    best: dict[tuple[int, int, str], dict[str, Any]] = {}
    for r in rows:
        k = (r["dim"], r["rows"], r["format"])
        if r["variant"].startswith("pallas") and (k not in best or r["us"] < best[k]["us"]):
            best[k] = r
    return best


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, interpreted (CI)")
    parser.add_argument("--dims", type=int, nargs="+", default=[8192, 4096])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--loops", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--budget", type=float, default=1e9, help="seconds to start variants")
    parser.add_argument("--json", help="write every row and the best tiles per shape here")
    parser.add_argument(
        "--tiles", nargs="+", type=json.loads,
        help="the tiles to try at the first dim, JSON objects of Tiles' fields (default: CANDIDATES)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.quick:
        args.dims, args.rows, args.layers, args.loops, args.repeats = [256], [1, 16], 2, 1, 2
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    deadline = time.monotonic() + args.budget
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; {time.strftime('%Y-%m-%d')}")
    results: list[dict[str, Any]] = []
    for i, dim in enumerate(args.dims):
        for rows in args.rows:
            for fmt in args.formats:
                if i == 0:
                    cands = list(CANDIDATES[:3] if args.quick else CANDIDATES)
                    if args.tiles:
                        cands = [Tiles(**t) for t in args.tiles]
                    if fmt == "int4/128":  # the step is the block size
                        cands = [t for t in cands if t.step == Tiles().step]
                else:
                    won = best_by_shape(results).get((args.dims[0], rows, fmt))
                    cands = [pallas_matmul.TILES] + (
                        [won["tiles"]] if won and won["tiles"] != pallas_matmul.TILES else []
                    )
                found = measure_shape(args, dim, rows, fmt, cands, deadline)
                for r in found:
                    r["tiles"] = next((t for t in cands if label(t) == r["variant"]), None)
                results += found
    print("\nbest tiles per shape (bf16/this; bandwidth):")
    for (dim, rows, fmt), r in sorted(best_by_shape(results).items()):
        xla = next(x for x in results if (x["dim"], x["rows"], x["format"], x["variant"])
                   == (dim, rows, fmt, "xla"))  # fmt: skip
        print(f"  {format_row(r)}   xla {xla['speedup']:.3f}x")
    if args.json:
        with open(args.json, "w") as f:
            rows = [{**r, "tiles": dataclasses.asdict(r["tiles"]) if r["tiles"] else None}
                    for r in results]  # fmt: skip
            json.dump({"jax": jax.__version__, "device": jax.devices()[0].device_kind,
                       "date": time.strftime("%Y-%m-%d"), "rows": rows}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
