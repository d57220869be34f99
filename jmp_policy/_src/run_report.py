"""What a resolved model run tells the user: warnings and explain rows.

Nothing silent: when a run quietly turned the user's request off (modules' own ``dtype``
overriding the policy for most of the model, map keys that choose nothing) the wrappers
warn once; ``explain`` lists what every module and variable resolved to, and why.
"""

from __future__ import annotations

import difflib
import weakref
from typing import Any

import jax
import numpy as np

from jmp_policy._src import numerics, quantization
from jmp_policy._src.explain import ExplainRow, with_leaf
from jmp_policy._src.policy_map import DTypePolicyMap, leaf_path, parent_path
from jmp_policy._src.resolution import Resolver
from jmp_policy._src.user_warnings import warn

# What has been said about each map: {id(map): {(model, unused keys)}}, so a typo warns once
# per map and model whatever the number of wrappers (`init`, then a jitted `apply`) that
# run it. An entry goes when its map does.
_SAID: dict[int, set[tuple[str, frozenset[str]]]] = {}


def _first_time(policy_map: DTypePolicyMap, model: str, keys: list[str]) -> bool:
    said = _SAID.get(id(policy_map))
    if said is None:
        said = _SAID[id(policy_map)] = set()
        weakref.finalize(policy_map, _SAID.pop, id(policy_map), None)
    entry = (model, frozenset(keys))
    if entry in said:
        return False
    said.add(entry)
    return True


def closest_paths(keys: list[str], paths: list[str]) -> str:
    """``'haed' (closest module paths: 'head')`` for each key that has near paths."""
    parts = []
    for key in keys:
        near = difflib.get_close_matches(key, paths, n=3, cutoff=0.5)
        if near:
            parts.append(f"{key!r} (closest module paths: {', '.join(map(repr, near))})")
        else:
            parts.append(repr(key))
    return "; ".join(parts)


def compute_modules(
    resolver: Resolver, params: Any = None, matmul_classes: tuple[type, ...] = ()
) -> set[str]:
    """The module paths that carry the model's compute: those that hold a kernel in
    ``params`` (a floating variable with at least two axes longer than 1 that is not an
    embedding table, or a quantized kernel), and those of ``matmul_classes`` (attention,
    whose own call multiplies queries and keys)."""
    found: set[str] = set()
    if params is not None:
        flat = jax.tree_util.tree_flatten_with_path(params, is_leaf=quantization.is_quantized)[0]
        for key_path, leaf in flat:
            path = leaf_path(key_path)
            name = path.rpartition("/")[2].lower()
            if quantization.is_quantized(leaf) or (
                numerics.is_float_leaf(leaf)
                and sum(d > 1 for d in np.shape(leaf)) >= 2
                and "embed" not in name
            ):
                found.add(parent_path(path) or "")
    if matmul_classes:
        for path, info in resolver.infos.items():
            if info.cls is not None and issubclass(info.cls, matmul_classes):
                found.add(path)
    return found


def warn_once(
    resolver: Resolver,
    model: str,
    warned: set[str],
    compute: set[str] | None = None,
) -> None:
    """Warns (once per wrapper: ``warned`` holds what it has said; a map's typos once per map
    and model, whichever wrappers run it) when a run quietly turned the user's request off.

    Two cases: modules' own ``dtype`` attributes overriding the policy for most of the
    modules that carry the compute (``compute``, from :func:`compute_modules`; all modules
    when it is empty or ``None``; the way out: ``module_dtype="override"``), and keys of
    the map that chose no module or variable (typos, most likely; ``unused_keys`` lists
    them).
    """
    overridden = resolver.overridden()
    carriers = [p for p in resolver.infos if p in compute] if compute else []
    if carriers:
        counted = [p for p in overridden if p in compute]  # type: ignore[operator]
        total = len(carriers)
        what = " that carry its matmuls and convolutions (they hold kernels or run attention)"
    else:
        counted, total, what = overridden, len(resolver.infos), ""
    if counted and 2 * len(counted) > total and "dtype" not in warned:
        warned.add("dtype")
        asked = sorted({resolver.module(p).chosen_policy.compute_dtype.name for p in counted})
        own = sorted({str(resolver.module(p).own_dtype) for p in counted})
        warn(
            f"{len(counted)} of {total} modules of {model}{what} set their own `dtype` "
            f"({', '.join(own)}), which wins over the policy's compute dtype "
            f"({', '.join(asked)}): the policy does not reach them. Pass "
            '`module_dtype="override"` to let the policy win everywhere, or leave the '
            "modules' `dtype` unset. Under \"override\" a Linen module's `setup` sees the "
            "policy's dtype too, so what it derives from it (Hugging Face's "
            "`attention_softmax_in_fp32`) is as in a model built in that dtype; an NNX "
            "module keeps what its `__init__` derived from the dtype it was built with.",
        )
    if "keys" not in warned and resolver.unused_keys():
        warned.add("keys")
        unused_keys_note(resolver, model)


def unused_keys_note(resolver: Resolver, model: str) -> str:
    """The map's keys that chose nothing in this run, each with the closest module paths
    (``"keys that resolve nothing: 'haed' (closest module paths: 'head')"``; ``""`` when
    every key chose something); warns once per map, model and keys (``apply``, ``init`` and
    ``explain`` together)."""
    unused = resolver.unused_keys()
    if not unused:
        return ""
    closest = closest_paths(unused, [p for p in resolver.infos if p])
    policy_map = resolver.policy_or_map
    if not isinstance(policy_map, DTypePolicyMap) or _first_time(policy_map, model, unused):
        warn(
            f"Keys of the DTypePolicyMap resolve no module or variable of {model}: "
            f"{unused}. Check them for typos: {closest}. "
            "`DTypePolicyMap.unused_keys(params)` lists them for a parameter tree.",
        )
    return f"\nkeys that resolve nothing: {closest}"


def resolved_rows(resolver: Resolver, params: Any, is_leaf: Any = None) -> list[ExplainRow]:
    """The rows of one resolved model run (the Linen and NNX ``explain``).

    One row per module the run knows, in the order it met them, and one per variable that a
    key of the map names itself; each parameter counted in its module's row (or its own).
    """
    rows: dict[str, ExplainRow] = {}

    def row(path: str) -> ExplainRow:
        if path not in rows:
            r = resolver.module(path)
            info = resolver.infos.get(path)
            cls = info.cls if info is not None else None
            own = "" if r.own_dtype is None else np.dtype(r.own_dtype).name
            name = "" if cls is None else cls.__name__
            rows[path] = ExplainRow(path, name, r.chosen_policy.name, r.source, own)
        return rows[path]

    for path in resolver.infos:
        row(path)
    for key_path, leaf in jax.tree_util.tree_flatten_with_path(params, is_leaf=is_leaf)[0]:
        path = leaf_path(key_path)
        policy, named = resolver.variable(path)
        if named:
            rows.setdefault(path, ExplainRow(path, "", policy.name, "key (variable)"))
            rows[path] = with_leaf(rows[path], leaf, policy.compute_dtype)
        else:
            module = parent_path(path) or ""
            rows[module] = with_leaf(row(module), leaf, policy.compute_dtype)
    return list(rows.values())


def float8_not_run(
    resolver: Resolver, rows: list[ExplainRow], params: Any, forms: dict[str, str]
) -> None:
    """Adds to ``forms`` (explain's matmul lines) what runs in each module that holds a
    weight (a parameter of rank >= 2) under a float8 policy yet ran no float8 matmul: an
    embedding's lookup and its ``attend`` (a tied head), a layer with a ``dot_general`` of
    its own. Its row names the float8 policy; this line says it ran in the compute dtype."""
    weights = {
        parent_path(leaf_path(kp)) or ""
        for kp, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
        if np.ndim(leaf) >= 2
    }
    for row in rows:
        if row.path not in weights or row.path in forms:
            continue
        policy = resolver.module(row.path).chosen_policy
        if getattr(getattr(policy, "scheme", None), "state_kind", None) != "float8":
            continue
        compute = np.dtype(policy.compute_dtype).name
        forms[row.path] = f"{compute}, not float8: " + (
            "its lookup and `attend` (a tied head) stay in the compute dtype"
            if row.module_class in ("Embed", "Embedding")
            else "no float8 matmul ran (float8 covers Dense, DenseGeneral and Einsum kernels)"
        )
