"""Cold resolution of a DTypePolicyMap, side by side with Keras's DTypePolicyMap.

A tree of 1,000 modules (20,000 leaves) and a map of 200 regular-expression keys. Ours
resolves the whole tree (every module and every variable path) from a cold map, also with
one variable pattern added, and answers ``match_variable`` for every variable path; Keras
resolves the 1,000 module paths. Keras is optional (`pip install keras`); without it only
our figures print.

Then how a map grows (issue 20): building a map of 1,000 / 5,000 / 20,000 keys (half exact
paths, half regular expressions), reading it back from its config (``deserialize``) and
resolving one path per key on a cold map, with each time's ratio to the 1,000-key one: a
linear cost gives ratios of 5 and 20 (building was quadratic: 20,000 keys took 209 s).

Then regular-expression keys at scale (issue 30): building a map of 1,000 / 20,000 /
100,000 keys ``encoder/layers_{i}/mlp_\\d+`` and, with an alternation,
``encoder/layers_{i}/(mlp|attn)_\\d+``, and its first lookup (keys are indexed by their
literal prefix, alternations included, and compiled for RE2 on their first match).

Run: python benchmarks/policy_map_bench.py [--quick]  (--quick: one repeat, 1,000 keys)
"""

from __future__ import annotations

import os
import re
import statistics
import time

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np

import jmp_policy as jp

BLOCKS, LAYERS, LEAVES, KEYS = 50, 20, 20, 200


def make_tree():
    leaf = np.zeros((1,), np.float32)
    return {
        f"block_{b}": {f"layer_{j}": {f"w_{k}": leaf for k in range(LEAVES)} for j in range(LAYERS)}
        for b in range(BLOCKS)
    }


def make_keys():
    rng = np.random.default_rng(0)
    pairs = rng.choice(BLOCKS * LAYERS, size=KEYS, replace=False)
    names = ["bfloat16", "float16", "mixed_bfloat16", "float32"]
    keys = {}
    for i, p in enumerate(sorted(pairs)):
        b, j = divmod(int(p), LAYERS)
        keys[f"block_{b}/layer_{j}(/.*)?"] = names[i % len(names)]
    return keys


def module_paths():
    return [f"block_{b}/layer_{j}" for b in range(BLOCKS) for j in range(LAYERS)]


def time_ours(tree, keys):
    m = jp.DTypePolicyMap("float32", keys)
    start = time.perf_counter()
    m.policy_tree(tree)
    for path in module_paths():
        m[path]
    return time.perf_counter() - start


def time_ours_variable_keys(tree, keys):
    """The whole tree with one more key, a variable pattern, so every module's variables
    are tried against it (the slow path of the variable rule)."""
    m = jp.DTypePolicyMap("float32", {**keys, ".*/w_1": "float32"})
    start = time.perf_counter()
    m.policy_tree(tree)
    return time.perf_counter() - start


def time_ours_match_variable(keys):
    """The Flax glue's per-variable question, ``match_variable``, on 20,000 paths."""
    m = jp.DTypePolicyMap("float32", keys)
    paths = [f"{p}/w_{k}" for p in module_paths() for k in range(LEAVES)]
    start = time.perf_counter()
    for path in paths:
        m.match_variable(path)
    return time.perf_counter() - start


def time_ours_module_lookups(keys):
    m = jp.DTypePolicyMap("float32", keys)
    start = time.perf_counter()
    for path in module_paths():
        m[path]
    return time.perf_counter() - start


def time_keras(keys):
    import keras

    m = keras.dtype_policies.DTypePolicyMap("float32")
    for k, v in keys.items():
        m[k] = v
    start = time.perf_counter()
    for path in module_paths():
        m[path]
    return time.perf_counter() - start


def main(reps: int = 7) -> None:
    tree, keys = make_tree(), make_keys()
    try:
        import keras  # noqa: F401

        have_keras = True
    except ImportError:
        have_keras = False
    rows: dict[str, list[float]] = {"ours: whole tree (1,000 modules + 20,000 leaves)": []}
    rows["ours: whole tree, plus a variable pattern '.*/w_1'"] = []
    rows["ours: 20,000 match_variable calls"] = []
    rows["ours: 1,000 module lookups"] = []
    if have_keras:
        rows["keras: 1,000 module lookups"] = []
    for _ in range(reps):  # interleaved, so machine noise hits every row alike
        rows["ours: whole tree (1,000 modules + 20,000 leaves)"].append(time_ours(tree, keys))
        rows["ours: whole tree, plus a variable pattern '.*/w_1'"].append(
            time_ours_variable_keys(tree, keys)
        )
        rows["ours: 20,000 match_variable calls"].append(time_ours_match_variable(keys))
        rows["ours: 1,000 module lookups"].append(time_ours_module_lookups(keys))
        if have_keras:
            rows["keras: 1,000 module lookups"].append(time_keras(keys))
    medians = {k: statistics.median(v) for k, v in rows.items()}
    base = medians.get("keras: 1,000 module lookups")
    print(f"{KEYS} regex keys, cold map, median of {reps}")
    print(f"{'what':52s} {'seconds':>9s} {'vs keras':>9s}")
    for name, t in medians.items():
        ratio = f"{t / base:9.3f}" if base else "        -"
        print(f"{name:52s} {t:9.4f} {ratio}")


SIZES = (1_000, 5_000, 20_000)


def make_many_keys(n: int) -> dict[str, str]:
    names = ["bfloat16", "mixed_bfloat16", "float32", "int8_from_mixed_bfloat16"]
    return {
        (f"blocks_{i}/mlp" if i % 2 else f"blocks_{i}/attention/.*"): names[i % len(names)]
        for i in range(n)
    }


def time_growth(n: int) -> tuple[float, float, float]:
    """Seconds to build a map of ``n`` keys, to deserialize its config, and to resolve one
    path per key on the deserialized (cold) map."""
    keys = make_many_keys(n)
    re.purge()  # `re` caches 512 compiled patterns: every size starts cold
    start = time.perf_counter()
    m = jp.DTypePolicyMap("float32", keys)
    built = time.perf_counter()
    config = jp.serialize(m)
    start_read = time.perf_counter()
    restored = jp.deserialize(config)
    read = time.perf_counter()
    for i in range(n):
        restored[f"blocks_{i}/attention/query" if i % 2 == 0 else f"blocks_{i}/mlp/dense"]
    looked_up = time.perf_counter()
    return built - start, read - start_read, looked_up - read


def main_growth(reps: int = 3) -> None:
    rows = {n: [time_growth(n) for _ in range(reps)] for n in SIZES}
    medians = {
        n: [statistics.median(r[i] for r in runs) for i in range(3)] for n, runs in rows.items()
    }
    base = medians[SIZES[0]]
    print(f"\nmap size growth, median of {reps} (ratio to {SIZES[0]:,} keys; linear = size ratio)")
    print(
        f"{'keys':>7s} {'build s':>9s} {'ratio':>6s} {'deserialize s':>14s} {'ratio':>6s} "
        f"{'lookups s':>10s} {'ratio':>6s}"
    )
    for n, (build, read, lookup) in medians.items():
        print(
            f"{n:7,d} {build:9.4f} {build / base[0]:6.1f} {read:14.4f} {read / base[1]:6.1f} "
            f"{lookup:10.4f} {lookup / base[2]:6.1f}"
        )


REGEX_SIZES = (1_000, 20_000, 100_000)


def time_regex_keys(n: int, alternation: bool) -> tuple[float, float]:
    """Seconds to build a map of ``n`` regular-expression keys, and to answer its first
    lookup."""
    middle = "(mlp|attn)" if alternation else "mlp"
    keys = {f"encoder/layers_{i}/{middle}_\\d+": "bfloat16" for i in range(n)}
    start = time.perf_counter()
    m = jp.DTypePolicyMap("float32", keys)
    built = time.perf_counter()
    m[f"encoder/layers_{n // 2}/mlp_3/kernel"]
    return built - start, time.perf_counter() - built


def main_regex_keys(sizes: tuple[int, ...] = REGEX_SIZES, reps: int = 3) -> None:
    print(f"\nregular-expression keys, median of {reps}")
    print(f"{'keys':>8s} {'alternation':>12s} {'build s':>9s} {'first lookup ms':>16s}")
    for n in sizes:
        for alternation in (False, True):
            runs = [time_regex_keys(n, alternation) for _ in range(reps)]
            build = statistics.median(r[0] for r in runs)
            lookup = statistics.median(r[1] for r in runs)
            print(
                f"{n:8,d} {'with |' if alternation else 'without':>12s} {build:9.3f} "
                f"{lookup * 1e3:16.2f}"
            )


if __name__ == "__main__":
    import sys

    if "--quick" in sys.argv[1:]:
        main(reps=1)
        main_regex_keys((1_000,), reps=1)
    else:
        main()
        main_growth()
        main_regex_keys()
