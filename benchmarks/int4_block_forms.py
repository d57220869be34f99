"""int4 weights in blocks of 128 rows: which JAX form serves them fastest (a GPU measure).

``--layers`` Dense layers of ``--dim`` x ``--dim`` (no bias), the weights int4 in blocks of
128 rows along the contracted axis (``"int4/128_from_float32"``), bf16 activations at batch
1, 16 and 256, jitted, side by side in one run against bf16 weights:

* ``library``: what ``jp.linen.apply`` runs today (``_int4_blocks``: one matmul per block,
  batched over blocks, float32 partial results, then their sum times the scales);
* ``bf16 partials``: the same with bf16 partial results (half the intermediate bytes);
* ``dequant bf16``: the kernel dequantized in bf16 (``convert(int4) * scale``), then one
  bf16 matmul (the form XLA may fuse into the GEMM's operand);
* ``dequant bf16 + flag``: the same compiled with XLA's experimental
  ``xla_gpu_experimental_enable_subchannel_dequantisation_fusion`` (per compile);
* ``per channel``: int4 with one scale per output channel (scale after the matmul), for
  reference: the fastest int4 form, with a larger error;
* ``int8 w``, ``int8 x int8``, ``int8 x int8 [out,in]``: int8 weights per output channel,
  weight-only (the library's form), and both operands int8 (the activations quantized per
  row, an s8 x s8 -> s32 GEMM) with the kernel stored ``[in, out]`` as the library stores
  it, or transposed ``[out, in]`` (the layout of the H100 form measured at 1.40x bf16 at
  256 rows in docs/h100_forms.md): does the stored layout decide the int8 GEMM's speed?
* ``int8 w, reduce (1 row)``, ``int4 w, reduce (1 row)``: one row only, written as a
  multiply and a sum over the contracted axis instead of a matmul. Compiled for an H100
  this is one reduction fusion reading the s8/s4 weights (no GEMM, no float copy), a form
  bound by the weight bytes alone; from two rows XLA writes a float32 copy of the kernel
  first, so these run at batch 1 only.

For each: the median time of ``--repeats`` interleaved runs, its ratio to bf16, and the
output error against the float32 dequantized weights. On a CPU the times mean nothing.

Run: ``JAX_PLATFORMS=cuda python benchmarks/int4_block_forms.py --dim 8192``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jmp_policy as jp
from jmp_policy._src.quantization import kernel_matmul

FLAG = "xla_gpu_experimental_enable_subchannel_dequantisation_fusion"


def _dequant_bf16(x: jax.Array, q: Any) -> jax.Array:
    rows, n = q.shape
    blocks = q.scale.shape[0]
    w = q.values.astype(jnp.bfloat16).reshape(blocks, rows // blocks, n)
    w = (w * q.scale.astype(jnp.bfloat16)[:, None, :]).reshape(rows, n)
    return x @ w


def _bf16_partials(x: jax.Array, q: Any) -> jax.Array:
    rows, n = q.shape
    blocks = q.scale.shape[0]
    xb = x.reshape(x.shape[0], blocks, rows // blocks)
    wb = q.values.reshape(blocks, rows // blocks, n).astype(x.dtype)
    part = jax.lax.dot_general(xb, wb, (((2,), (1,)), ((1,), (0,))))  # (blocks, m, n), bf16
    return jnp.einsum("bmn,bn->mn", part.astype(jnp.float32), q.scale).astype(x.dtype)


def _library(x: jax.Array, q: Any) -> jax.Array:
    return kernel_matmul._int4_blocks(x, q, np.dtype(jnp.bfloat16))


def _per_channel(x: jax.Array, q: Any) -> jax.Array:
    y = jnp.dot(x, q.values.astype(x.dtype), preferred_element_type=jnp.float32)
    return (y * q.scale.reshape(-1)).astype(x.dtype)


def _int8_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    scale = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1, keepdims=True) / 127.0
    scale = jnp.where(scale == 0, 1.0, scale)
    q = jnp.clip(jnp.round(x.astype(jnp.float32) / scale), -127, 127).astype(jnp.int8)
    return q, scale


def _int8_in_out(x: jax.Array, w: tuple[jax.Array, jax.Array]) -> jax.Array:
    values, scale = w  # values [in, out] int8, scale [out]
    q, sx = _int8_rows(x)
    y = jnp.dot(q, values, preferred_element_type=jnp.int32)
    return (y.astype(jnp.float32) * sx * scale).astype(x.dtype)


def _int8_out_in(x: jax.Array, w: tuple[jax.Array, jax.Array]) -> jax.Array:
    values, scale = w  # values [out, in] int8, scale [out]
    q, sx = _int8_rows(x)
    y = jax.lax.dot_general(q, values, (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32)
    return (y.astype(jnp.float32) * sx * scale).astype(x.dtype)


def _int8_weight_only(x: jax.Array, w: tuple[jax.Array, jax.Array]) -> jax.Array:
    values, scale = w
    y = jnp.dot(x, values.astype(x.dtype), preferred_element_type=jnp.float32)
    return (y * scale).astype(x.dtype)


def _reduce_one_row(x: jax.Array, w: tuple[jax.Array, jax.Array]) -> jax.Array:
    values, scale = w  # values [in, out] int8 or int4, scale [out]
    y = jnp.sum(x.astype(jnp.float32)[:, :, None] * values.astype(jnp.float32)[None], axis=1)
    return (y * scale).astype(x.dtype)


def _stack(layer: Any) -> Any:
    def run(x: jax.Array, ws: list[Any]) -> jax.Array:
        for w in ws:
            x = layer(x, w)
        return x

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 256])
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    keys = jax.random.split(jax.random.key(0), args.layers)
    f32 = [jax.random.normal(k, (args.dim, args.dim)) / np.sqrt(args.dim) for k in keys]
    blocked = [jp.get("int4/128_from_float32").quantize(w) for w in f32]
    channel = [jp.get("int4_from_float32").quantize(w) for w in f32]
    reference = [q.dequantize(jnp.float32) for q in blocked]
    bf16 = [w.astype(jnp.bfloat16) for w in f32]
    int8 = [jp.get("int8_from_float32").quantize(w) for w in f32]
    int8_in_out = [(q.values, q.scale.reshape(-1)) for q in int8]
    int8_out_in = [(q.values.T.copy(), q.scale.reshape(-1)) for q in int8]
    int4_in_out = [(q.values, q.scale.reshape(-1)) for q in channel]
    forms: dict[str, tuple[Any, Any, dict[str, Any]]] = {
        "bf16": (_stack(lambda x, w: x @ w), bf16, {}),
        "library": (_stack(_library), blocked, {}),
        "bf16 partials": (_stack(_bf16_partials), blocked, {}),
        "dequant bf16": (_stack(_dequant_bf16), blocked, {}),
        "dequant bf16 + flag": (_stack(_dequant_bf16), blocked, {FLAG: True}),
        "per channel": (_stack(_per_channel), channel, {}),
        "int8 w": (_stack(_int8_weight_only), int8_in_out, {}),
        "int8 x int8": (_stack(_int8_in_out), int8_in_out, {}),
        "int8 x int8 [out,in]": (_stack(_int8_out_in), int8_out_in, {}),
        "int8 w, reduce (1 row)": (_stack(_reduce_one_row), int8_in_out, {}),
        "int4 w, reduce (1 row)": (_stack(_reduce_one_row), int4_in_out, {}),
    }
    print(
        f"jax {jax.__version__} on {jax.devices()[0].device_kind}; {args.layers} layers of "
        f"{args.dim}x{args.dim}, int4 blocks of 128; median of {args.repeats} runs"
    )
    print(f"{'batch':>5}  {'form':<22} {'time us':>9} {'bf16/this':>9} {'rel err':>8}")
    for batch in args.batches:
        x = jax.random.normal(jax.random.key(batch), (batch, args.dim)).astype(jnp.bfloat16)
        ref = np.asarray(_stack(lambda x, w: x @ w)(x.astype(jnp.float32), reference))
        runs = {}
        for name, (fn, ws, options) in forms.items():
            if name.endswith("(1 row)") and batch != 1:
                continue
            try:
                runs[name] = (jax.jit(fn).lower(x, ws).compile(compiler_options=options), ws)
            except Exception as e:  # an option this jaxlib does not know
                print(f"{batch:5d}  {name:<22} failed to compile: {type(e).__name__}: {e}"[:160])
        errors = {
            n: float(np.abs(np.asarray(c(x, ws), np.float32) - ref).max() / np.abs(ref).max())
            for n, (c, ws) in runs.items()
        }
        times: dict[str, list[float]] = {n: [] for n in runs}
        for c, ws in runs.values():
            jax.block_until_ready(c(x, ws))
        for _ in range(args.repeats):
            for name, (c, ws) in runs.items():
                start = time.perf_counter()
                jax.block_until_ready(c(x, ws))
                times[name].append(time.perf_counter() - start)
        base = statistics.median(times["bf16"])
        for name in runs:
            t = statistics.median(times[name])
            print(f"{batch:5d}  {name:<22} {t * 1e6:9.1f} {base / t:9.3f} {errors[name]:8.4f}")


if __name__ == "__main__":
    main()
