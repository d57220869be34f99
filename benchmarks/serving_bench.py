"""Serving with quantized weights: 8 Dense layers, bf16 weights against int8 and int4.

A stack of ``--layers`` Dense layers of ``--dim`` x ``--dim`` (no bias), run forward under
``jp.linen.apply`` at batch 1, 16, 64 and 256, jitted, twelve ways, side by side in one run:

* ``bf16``: the weights stored in bfloat16, ``"mixed_bfloat16"`` (the reference);
* ``int8 w``: ``map.quantize`` int8 weights (per output channel) under
  ``"mixed_bfloat16"``: the quantized kernel reaches each Dense, which runs
  ``(x @ convert(w8)) * scale``;
* ``int4 w``: int4 weights per channel, stored as ``jnp.int4``, the same form;
* ``int8 x int8``: int8 weights under ``"int8_from_mixed_bfloat16"``: activations
  quantized per row, ``int8 x int8 -> int32`` GEMMs from 128 rows on (below, the
  weight-only form);
* ``int4/128``: int4 weights with one scale per 128 input rows (the storage GPTQ's
  ``"gptq/4/128"`` calibration writes too: a GPTQ kernel serves exactly as this row);
* ``awq/4/128``: the same int4/128 storage with AWQ's per-input-channel scale, which the
  matmul divides the activations by (the scale here is random and positive: how
  calibration chose it does not change the serving cost);
* ``int4 w, XLA layout`` and ``int8 x int8, XLA layout``: the same as ``int4 w`` and
  ``int8 x int8``, compiled by ``jp.compile_for_serving``, which lets XLA choose the
  weights' device layout (for an H100 it stores these kernels ``[out, in]``, so the GEMM
  needs no transpose of them);
* ``int8 w, pallas``, ``int4 w, pallas``, ``int4/128, pallas`` and ``awq/4/128, pallas``:
  the same weights with ``serving_kernel="pallas"``: on a GPU, up to 64 rows, the library's
  Pallas kernel (at more rows XLA's form, as the row without it). Off a GPU these rows are
  skipped, except under ``--quick``, where the kernel runs in Pallas's interpreter (its
  forms and errors only: an interpreter's time means nothing).

For each: the median time over ``--repeats`` interleaved runs and its ratio to bf16, the
weight bytes read per token (all layers' stored weight bytes over the batch), the form
``explain`` reports for the first layer, and the largest relative error of the output
against bf16 weights. A CPU has no fast int8/int4 paths and upcasts bf16: there only the
bytes, the forms and the errors mean something; time it on a GPU:
``JAX_PLATFORMS=cuda python benchmarks/serving_bench.py --dim 4096`` and ``--dim 8192``.

Run: ``python benchmarks/serving_bench.py [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from contextlib import nullcontext
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import jmp_policy as jp
from jmp_policy._src.quantization import matmuls, pallas_matmul, serving_kernels
from jmp_policy._src.quantization.awq import InputScaledArray


class Stack(nn.Module):
    dim: int
    layers: int

    @nn.compact
    def __call__(self, x):
        for i in range(self.layers):
            x = nn.Dense(self.dim, use_bias=False, name=f"layer_{i}")(x)
        return x


def awq_storage(params: Any) -> Any:
    """AWQ's storage: int4/128 values of ``diag(s) W`` and ``s``, a random positive input
    scale (one per input row)."""

    def awq(w: jax.Array) -> InputScaledArray:
        s = jax.random.uniform(jax.random.key(w.shape[0]), w.shape[:1], jnp.float32, 0.5, 2.0)
        q = jp.get("int4/128_from_float32").quantize(w * s[:, None])
        return InputScaledArray(
            q.values, q.scale, q.mode, q.block_size, q.shape, q.original_dtype, q.stacked, s
        )

    return jax.tree.map(awq, params)


XLA_LAYOUT = ", XLA layout"  # a variant compiled by jp.compile_for_serving
PALLAS = ", pallas"  # a variant run with serving_kernel="pallas"


def variants(params: Any) -> dict[str, tuple[Any, str]]:
    """name -> (params, policy); a name ending in :data:`XLA_LAYOUT` is compiled by
    ``jp.compile_for_serving``, one ending in :data:`PALLAS` runs the Pallas kernel."""
    bf16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
    int8 = jp.get("int8_from_float32").quantize(params)
    int4 = jp.get("int4_from_float32").quantize(params)
    int4_128 = jp.get("int4/128_from_float32").quantize(params)
    awq = awq_storage(params)
    return {
        "bf16": (bf16, "mixed_bfloat16"),
        "int8 w": (int8, "mixed_bfloat16"),
        "int4 w": (int4, "mixed_bfloat16"),
        "int8 x int8": (int8, "int8_from_mixed_bfloat16"),
        "int4/128": (int4_128, "mixed_bfloat16"),
        "awq/4/128": (awq, "awq/4/128_from_mixed_bfloat16"),
        "int4 w" + XLA_LAYOUT: (int4, "mixed_bfloat16"),
        "int8 x int8" + XLA_LAYOUT: (int8, "int8_from_mixed_bfloat16"),
        "int8 w" + PALLAS: (int8, "mixed_bfloat16"),
        "int4 w" + PALLAS: (int4, "mixed_bfloat16"),
        "int4/128" + PALLAS: (int4_128, "mixed_bfloat16"),
        "awq/4/128" + PALLAS: (awq, "awq/4/128_from_mixed_bfloat16"),
    }


def weight_bytes(params: Any) -> int:
    leaves = jax.tree.leaves(params, is_leaf=jp.QuantizedArray.__instancecheck__)
    return sum(int(leaf.nbytes) for leaf in leaves)


def looped(serve: Any, loops: int) -> Any:
    """``serve`` run ``loops`` times in one program, each output the next input (so a
    call's time is the device's, not the host's dispatch: ``--loops``). Returns
    ``(first pass's output, last pass's output)``: the error column is the first pass's,
    which does not compound over the passes as the last's would."""

    def run(variables: Any, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        first = serve(variables, x)
        last = jax.lax.fori_loop(
            1, loops, lambda _, y: serve(variables, y).astype(y.dtype), first.astype(x.dtype)
        )
        return first, last

    return run


def on_gpu() -> bool:
    return jax.devices()[0].platform == "gpu"


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    model = Stack(args.dim, args.layers)
    interpret = not on_gpu()  # the Pallas rows: in the interpreter (--quick) or skipped
    x0 = jnp.ones((1, args.dim), jnp.float32)
    params = model.init(jax.random.key(0), x0)["params"]
    rows = []
    for batch in args.batches:
        x = jax.random.normal(jax.random.key(batch), (batch, args.dim)).astype(jnp.bfloat16)
        runs, info = {}, {}
        for name, (p, policy) in variants(params).items():
            pallas = name.endswith(PALLAS)
            if pallas and interpret and not args.quick:
                continue
            serve = jp.linen.apply(model, policy, serving_kernel="pallas" if pallas else "auto")
            serve = looped(serve, args.loops)
            fn = jax.jit(serve)
            variables = {"params": p}
            with serving_kernels.interpreted() if pallas and interpret else nullcontext():
                with matmuls.recording() as forms:
                    fn.lower(variables, x)
                if name.endswith(XLA_LAYOUT):
                    compiled, variables = jp.compile_for_serving(serve, variables, x)
                else:
                    compiled = fn.lower(variables, x).compile()
            if os.environ.get("BENCH_HLO_DIR"):  # the optimized program, to read its GEMMs
                slug = name.replace(" ", "_").replace("/", "_")
                path = os.path.join(os.environ["BENCH_HLO_DIR"], f"serve_{batch}_{slug}.hlo")
                with open(path, "w") as f:
                    f.write(compiled.as_text())
            runs[name] = (compiled, variables)
            info[name] = (forms.get("layer_0", "as written"), weight_bytes(p))
        outs = {n: np.asarray(c(v, x)[0], np.float32) for n, (c, v) in runs.items()}
        times: dict[str, list[float]] = {n: [] for n in runs}
        for _ in range(args.repeats):
            for name, (compiled, v) in runs.items():
                start = time.perf_counter()
                jax.block_until_ready(compiled(v, x))
                times[name].append(time.perf_counter() - start)
        times = {n: [t / args.loops for t in ts] for n, ts in times.items()}
        base = statistics.median(times["bf16"])
        scale = np.abs(outs["bf16"]).max()
        for name in runs:
            t = statistics.median(times[name])
            rows.append(
                {
                    "batch": batch,
                    "variant": name,
                    "us": t * 1e6,
                    "speedup": base / t,
                    "bytes_per_token": info[name][1] / batch,
                    "error": float(np.abs(outs[name] - outs["bf16"]).max() / scale),
                    "form": info[name][0],
                }
            )
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    header = ["batch", "variant", "time us", "bf16/this", "weight B/token", "rel err", "form"]
    table = [header] + [
        [
            str(r["batch"]),
            r["variant"],
            f"{r['us']:.1f}",
            f"{r['speedup']:.3f}",
            f"{r['bytes_per_token']:.3g}",
            f"{r['error']:.4f}",
            r["form"],
        ]
        for r in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    return "\n".join(
        "  ".join(
            c.ljust(w) if i in (1, 6) else c.rjust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in table
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (CI)")
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument(
        "--loops", type=int, default=1,
        help="forward passes per call, in one program (times are per pass)",
    )  # fmt: skip
    parser.add_argument(
        "--tiles", help="the Pallas kernel's tiles: a JSON object of Tiles' fields (default: TILES)"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.dim, args.layers, args.repeats = 256, 2, 3  # 256: two int4 blocks of 128
        args.batches = [1, 16, 256]
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.tiles:
        pallas_matmul.TILES = pallas_matmul.Tiles(**json.loads(args.tiles))
    print(
        f"{args.layers} Dense layers {args.dim}x{args.dim}, {args.loops} pass(es) per call, "
        f"median of {args.repeats} "
        f"interleaved runs; jax {jax.__version__} on {jax.devices()[0].device_kind}; "
        f"{time.strftime('%Y-%m-%d')}; kernel tiles {pallas_matmul.TILES}"
    )
    if jax.devices()[0].platform == "cpu":
        print(
            "CPU timings: XLA's CPU backend has no fast int8/int4 GEMMs and upcasts bf16, "
            "so only the bytes, forms and errors carry over to a GPU."
        )
        print(
            "The Pallas rows run the kernel in Pallas's interpreter (--quick) or are skipped: "
            "time them on a GPU."
        )
    print(format_table(measure(args)))


if __name__ == "__main__":
    main()
