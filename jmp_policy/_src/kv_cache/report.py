"""What ``explain`` says of a model's attention caches: per cache variable, its format,
scale layout, shape and bytes, stored and as the float cache it replaces."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any, NamedTuple

import jax
import numpy as np

from jmp_policy._src.kv_cache.cache import QuantizedKVCache
from jmp_policy._src.kv_cache.formats import FORMATS, KVCacheFormat, KVCacheSpec


class CacheRow(NamedTuple):
    path: str  # the variable's path, "attn/cached_key"
    format: str  # "int8", "float8_e4m3fn", or the float dtype it is stored in
    layout: str  # "per token and head", "per token", "" (a float cache)
    shape: tuple[int, ...]
    nbytes: int  # stored, scales included
    float_bytes: int  # as a cache of the dtype the model writes


def _size(shape: Any) -> int:
    return int(np.prod(shape, dtype=np.int64))


def _quantized_bytes(shape: tuple[int, ...], fmt: KVCacheFormat) -> int:
    scales = _size(shape[: len(shape) - fmt.scale_axes])
    return _size(shape) * fmt.dtype.itemsize + scales * 4


def cache_rows(
    caches: Any, spec: KVCacheSpec | None, names: Collection[str] = ()
) -> list[CacheRow]:
    """One row per quantized cache in ``caches`` (a ``"cache"`` collection), per float leaf
    named in ``names`` (stored quantized where ``spec`` says, shown as it will be), and per
    float leaf of another name that a key of ``spec`` names by its whole path."""
    rows = []
    flat = jax.tree_util.tree_flatten_with_path(
        caches, is_leaf=lambda x: isinstance(x, QuantizedKVCache)
    )[0]
    for key_path, leaf in flat:
        path = "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in key_path)
        module, _, name = path.rpartition("/")
        shape = tuple(getattr(leaf, "shape", ()))
        if isinstance(leaf, QuantizedKVCache):
            stored = FORMATS[leaf.format]
            float_bytes = _size(shape) * np.dtype(leaf.dtype).itemsize
            rows.append(CacheRow(path, stored.name, stored.layout, shape, leaf.nbytes, float_bytes))
            continue
        if not hasattr(leaf, "dtype"):
            continue
        if name in names:  # Flax's cache names: by their module's path, or the default
            fmt = None if spec is None else spec.resolve(module)
        else:  # any other variable: only where a key names its whole path
            fmt = None if spec is None else spec.resolve_variable(path)
            if fmt is None:
                continue
        float_bytes = _size(shape) * np.dtype(leaf.dtype).itemsize
        if fmt is None:
            row = CacheRow(path, np.dtype(leaf.dtype).name, "", shape, float_bytes, float_bytes)
        else:
            row = CacheRow(
                path, fmt.name, fmt.layout, shape, _quantized_bytes(shape, fmt), float_bytes
            )
        rows.append(row)
    return rows


def _bytes(n: int) -> str:
    value = float(n)
    for unit in ("", "K", "M", "G"):
        if value < 1024 or unit == "G":
            return str(n) if not unit else f"{value:.1f}{unit}"
        value /= 1024
    return str(n)  # pragma: no cover


def format_caches(rows: list[CacheRow]) -> str:
    """The rows as a table (``""`` when there are none), with the total and its ratio."""
    if not rows:
        return ""
    header = ("cache", "format", "scales", "shape", "bytes", "f.bytes")
    cells = [header] + [
        (r.path, r.format, r.layout, str(r.shape), _bytes(r.nbytes), _bytes(r.float_bytes))
        for r in rows
    ]
    stored, floats = sum(r.nbytes for r in rows), sum(r.float_bytes for r in rows)
    cells.append(("total", "", "", "", _bytes(stored), _bytes(floats)))
    widths = [max(len(row[c]) for row in cells) for c in range(len(header))]
    lines = [
        "  ".join(
            cell.rjust(w) if c >= 4 else cell.ljust(w)
            for c, (cell, w) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in cells
    ]
    ratio = stored / floats if floats else 1.0
    legend = (
        f"KV caches: bytes as stored, scales included ({ratio:.3f}x of f.bytes: the cache "
        "in the dtype the model writes)"
    )
    return "\n" + "\n".join(lines) + "\n" + legend
