"""Explain tables: the policy every module path runs under, why, and its bytes.

Shared by the Linen and NNX integrations' ``explain`` (the rows come from one resolved
run, :class:`~jmp_policy._src.resolution.Resolver`).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jmp_policy._src import dtypes as dt
from jmp_policy._src.policy_map import format_table, leaf_path, parent_path
from jmp_policy._src.resolution import Resolver


def _nbytes(leaf: Any, dtype: Any) -> int:
    return int(np.prod(leaf.shape, dtype=np.int64)) * np.dtype(dtype).itemsize


def table(resolver: Resolver, params: Any) -> str:
    """The explain table of a resolved run (shared with the NNX glue)."""
    rows: dict[str, list[Any]] = {}

    def row(path: str) -> list[Any]:
        if path not in rows:
            r = resolver.module(path)
            cls = resolver.infos[path].cls if path in resolver.infos else None
            rows[path] = [cls, r.resolved, r.source, r.own_dtype, set(), set(), 0, 0]
        return rows[path]

    for path in resolver.infos:
        row(path)
    for key_path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        path = leaf_path(key_path)
        policy, own_key = resolver.variable(path)
        if own_key:
            r = rows.setdefault(path, [None, policy, "key (variable)", None, set(), set(), 0, 0])
        else:
            r = row(parent_path(path) or "")
        if not hasattr(leaf, "dtype") or not hasattr(leaf, "shape"):
            continue
        stored = np.dtype(leaf.dtype)
        target = policy.compute_dtype if dt.is_floating(stored) else stored
        r[4].add(dt.short_name(stored))
        r[5].add(dt.short_name(np.dtype(target)))
        r[6] += _nbytes(leaf, stored)
        r[7] += _nbytes(leaf, target)

    header = ["path", "class", "policy", "source", "own", "stored", "compute", "bytes"]
    header += ["compute bytes"]
    lines = [header]
    for path, (cls, policy, source, own, stored_set, compute_set, nbytes, cbytes) in rows.items():
        has_params = bool(stored_set)
        lines.append(
            [
                path or "<root>",
                "" if cls is None else cls.__name__,
                policy.name,
                source,
                "" if own is None else dt.short_name(own),
                ",".join(sorted(stored_set)),
                ",".join(sorted(compute_set)),
                str(nbytes) if has_params else "",
                str(cbytes) if has_params else "",
            ]
        )
    total = sum(r[6] for r in rows.values())
    total_compute = sum(r[7] for r in rows.values())
    lines.append(["total", "", "", "", "", "", "", str(total), str(total_compute)])
    return format_table(lines, numeric_columns=2)
