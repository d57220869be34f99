"""Where a quantized KV cache's dequantization goes in the compiled decode step (issue #50).

One decode step of Flax's ``MultiHeadDotProductAttention(decode=True)`` (batch 1, 4096
cached tokens, 8 heads of 128) under ``jp.linen.apply(..., "bfloat16", kv_cache=...)`` is
compiled for the CPU, or for an H100 without a GPU (``h100_compile.py``: needs the CUDA PJRT
plugin on the path). The optimized HLO's top-level instructions are the buffers the step
materialises; for each cache format this prints how many are floating arrays at least as
large as one cache (a float copy of a cache would be one), which fusions read the stored
cache, and the bytes of the step's cache inputs (values and scales: what a step reads of
the cache, as every reader takes the stored arrays). Nothing runs and nothing is timed.

    JAX_PLATFORMS=cpu PYTHONPATH=.cuda-plugin/<jaxlib>:. python benchmarks/kv_cache_compile.py h100
"""

from __future__ import annotations

import json
import os
import re
import sys
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import flax.linen as nn
import jax
import jax.numpy as jnp

import jmp_policy as jp

B, LENGTH, HEADS, HEAD_DIM = 1, 4096, 8, 128
FEATURES = HEADS * HEAD_DIM
FORMATS = (None, "int8", "float8_e4m3fn")
_FLOATS = ("bf16", "f16", "f32", "f64")
_ITEMSIZE = {"bf16": 2, "f16": 2, "f32": 4, "f64": 8, "s8": 1, "u8": 1, "f8e4m3fn": 1, "s32": 4}
_ENTRY = re.compile(r"^ENTRY .*?\{\n(.*?)\n\}", re.S | re.M)
_LINE = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (\w+)\[([\d,]*)\]\S* (\S+?)\((.*)$")


class Attention(nn.Module):
    @nn.compact
    def __call__(self, x: Any) -> Any:
        return nn.MultiHeadDotProductAttention(
            num_heads=HEADS, qkv_features=FEATURES, decode=True, name="attn"
        )(x)


def decode_step(kv_cache: Any) -> tuple[Any, tuple[Any, Any]]:
    """The step and its abstract arguments (variables with a cache, one token)."""
    model = Attention()
    x = jnp.zeros((B, LENGTH, FEATURES), jnp.bfloat16)
    variables = jax.eval_shape(
        lambda: jp.linen.init(model, "bfloat16", kv_cache=kv_cache)(jax.random.key(0), x)
    )
    fn = jp.linen.apply(model, "bfloat16", kv_cache=kv_cache)

    def step(variables: Any, token: Any) -> Any:
        return fn(variables, token, mutable=["cache"])

    return step, (variables, jax.ShapeDtypeStruct((B, 1, FEATURES), jnp.bfloat16))


def compiled_hlo(kv_cache: Any, target: str) -> str:
    step, args = decode_step(kv_cache)
    if target == "h100":
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import h100_compile as hc

        return hc.compile_for_h100(step, hc.on_h100(args))
    return jax.jit(step).lower(*args).compile().as_text()  # type: ignore[no-any-return]


def summary(hlo: str) -> dict[str, Any]:
    """The entry computation's float buffers of at least one cache's size, and the
    top-level instructions that take the stored (8-bit) cache as an operand."""
    entry = _ENTRY.search(hlo)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO")
    cache_size = B * LENGTH * HEADS * HEAD_DIM
    types: dict[str, str] = {}
    large_floats, readers = [], []
    cache_bytes = 0  # the step's inputs holding the cache (values and scales)
    for line in entry.group(1).splitlines():
        m = _LINE.match(line)
        if m is None:
            continue
        name, dtype, dims, opcode, rest = m.groups()
        size = 1
        for d in filter(None, dims.split(",")):
            size *= int(d)
        types[name] = dtype
        if opcode == "parameter" and str(LENGTH) in dims.split(","):
            cache_bytes += size * _ITEMSIZE[dtype]
        if dtype in _FLOATS and size >= cache_size and opcode != "parameter":
            large_floats.append(f"{name}: {dtype}[{dims}] {opcode}")
        operands = re.findall(r"%([\w.\-]+)", rest.split(")", 1)[0])
        if (
            opcode in ("fusion", "dot", "custom-call")
            and dtype in _FLOATS
            and any(types.get(o) in ("s8", "f8e4m3fn") for o in operands)
        ):
            readers.append(f"{name}: {dtype}[{dims}]")
    return {
        "large_float_buffers": large_floats,
        "stored_cache_readers": readers,
        "cache_bytes_read": cache_bytes,
    }


def main(target: str) -> dict[str, Any]:
    return {str(f): summary(compiled_hlo(f, target)) for f in FORMATS}


if __name__ == "__main__":
    target = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    print(json.dumps(main(target), indent=1))
