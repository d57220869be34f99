"""Large maps of every accepted key shape (#46): build time and first lookup.

For each key shape, a map of N keys (20,000 by default) is built, then one path is looked
up on the cold map; a target of the issue is a build under 2 s and a first lookup under
1 s for every shape. Then a 100,000-key map is read back from its config
(``deserialize``), its time given as a ratio to building the same map (target: 2x).

Shapes: a literal prefix (``encoder/layers_{i}/mlp_\\d+``), an alternation, a leading
wildcard (``.*/layers_{i}/mlp``: no literal prefix), a Cyrillic class
(``[\\u0430-\\u044f]+/layers_{i}``), a backreference (``(a)\\1/layers_{i}``).

Run: python benchmarks/map_key_shapes_bench.py [--quick]  (--quick: 2,000 keys, 10,000
for the config)
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jmp_policy as jp

SHAPES = {
    "literal prefix": ("encoder/layers_{i}/mlp_\\d+", "encoder/layers_7/mlp_3"),
    "alternation": ("encoder/layers_{i}/(mlp|attn)_\\d+", "encoder/layers_7/attn_3"),
    "leading wildcard": (".*/layers_{i}/mlp", "decoder/layers_7/mlp"),
    "cyrillic class": ("[\u0430-\u044f]+/layers_{i}", "\u0441\u043b\u043e\u0439/layers_7"),
    "backreference": ("(a)\\1/layers_{i}", "aa/layers_7"),
}


def measure(template: str, path: str, n: int) -> tuple[float, float, str]:
    keys = {template.format(i=i): "bfloat16" for i in range(n)}
    start = time.perf_counter()
    m = jp.DTypePolicyMap("float32", keys)
    built = time.perf_counter() - start
    start = time.perf_counter()
    policy = m[path]
    return built, time.perf_counter() - start, policy.name


def main() -> None:
    quick = "--quick" in sys.argv
    n = 2_000 if quick else 20_000
    print(f"map key shapes: {n:,} keys, build and first lookup (seconds)")
    print(f"  {'shape':20s}  {'build':>8s}  {'first lookup':>12s}  policy")
    for name, (template, path) in SHAPES.items():
        built, looked, policy = measure(template, path, n)
        print(f"  {name:20s}  {built:8.3f}  {looked:12.4f}  {policy}")
    big = 10_000 if quick else 100_000
    keys = {
        (f"blocks_{i}/mlp" if i % 2 else f"blocks_{i}/attention/.*"): "bfloat16" for i in range(big)
    }
    start = time.perf_counter()
    m = jp.DTypePolicyMap("float32", keys)
    built = time.perf_counter() - start
    config = jp.serialize(m)
    start = time.perf_counter()
    back = jp.deserialize(config)
    read = time.perf_counter() - start
    assert back == m
    print(f"  {big:,}-key map: build {built:.3f} s, deserialize {read:.3f} s ({read / built:.2f}x)")


if __name__ == "__main__":
    main()
