"""Cold resolution of a DTypePolicyMap, side by side with Keras's DTypePolicyMap.

A tree of 1,000 modules (20,000 leaves) and a map of 200 regular-expression keys. Ours
resolves the whole tree (every module and every variable path) from a cold map, also with
one variable pattern added, and answers ``match_variable`` for every variable path; Keras
resolves the 1,000 module paths. Keras is optional (`pip install keras`); without it only
our figures print.

Run: python benchmarks/policy_map_bench.py
"""

from __future__ import annotations

import os
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


if __name__ == "__main__":
    main()
