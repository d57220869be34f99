"""Explain tables: one row per module (or variable) and the policy it runs under.

Every ``explain`` (``DTypePolicyMap.explain``, the Linen and NNX glue's) builds
:class:`ExplainRow` values and renders them with :func:`format_rows`, so all tables read
alike and fit 100 columns: dtypes in short form (``f32``, ``bf16``), bytes in binary units
(``4.0M``), columns that are empty in every row dropped, long cells shortened with ``…`` and
long paths wrapped at ``/``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from typing import Any, NamedTuple

import numpy as np

from jmp_policy._src import dtypes as dt

WIDTH = 100
_SEP = "  "
_MIN_PATH = 16
_HEADERS = ("path", "class", "policy", "source", "own", "stored", "compute", "bytes", "c.bytes")
_NUMERIC = 2  # the last two columns are right-aligned numbers
# (column, cap) in the order columns give up width when a table is too wide.
_SHRINK = (
    *((3, 24), (1, 16), (2, 18), (3, 16), (5, 10), (6, 10), (1, 10)),
    *((2, 12), (3, 10), (4, 6), (5, 8), (6, 8), (1, 8), (2, 10)),
)


class ExplainRow(NamedTuple):
    """One row of an explain table.

    Attributes:
        path: the module path (``""`` for the root, shown as ``<root>``), or a variable's
            path when a key names the variable itself.
        module_class: the module's class name (``""`` when unknown).
        policy: the policy's name.
        source: why this policy: ``"key '<key>'"``, ``"type <Class>"``, ``"default"``...
        own_dtype: the module's own ``dtype`` attribute, when it sets one (``""`` if not).
        stored: the stored dtypes of its leaves, comma-separated (``"float32,int32"``).
        compute: the dtypes of its leaves in compute, comma-separated.
        nbytes: the bytes of its leaves as stored.
        compute_nbytes: the bytes of its leaves in compute.

    Examples:
        >>> from jmp_policy._src.explain import ExplainRow
        >>> ExplainRow("encoder/mlp", policy="mixed_bfloat16", source="default")
        ExplainRow(path='encoder/mlp', module_class='', policy='mixed_bfloat16', source='default', own_dtype='', stored='', compute='', nbytes=0, compute_nbytes=0)
    """

    path: str
    module_class: str = ""
    policy: str = ""
    source: str = ""
    own_dtype: str = ""
    stored: str = ""
    compute: str = ""
    nbytes: int = 0
    compute_nbytes: int = 0


def _add_name(names: str, name: str) -> str:
    found = set(names.split(",")) if names else set()
    found.add(name)
    return ",".join(sorted(found))


def with_leaf(row: ExplainRow, leaf: Any, compute_dtype: Any) -> ExplainRow:
    """``row`` with one more leaf counted: its dtype, its dtype in compute, its bytes.

    A floating leaf computes in ``compute_dtype``; other leaves keep their dtype. Leaves
    without ``dtype`` and ``shape`` (Python scalars, strings, ``None``) are not counted;
    ``jax.ShapeDtypeStruct`` leaves are.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from jmp_policy._src.explain import ExplainRow, with_leaf
        >>> row = with_leaf(ExplainRow("mlp"), jnp.ones((4, 4)), jnp.bfloat16)
        >>> row = with_leaf(row, jax.ShapeDtypeStruct((2,), jnp.int32), jnp.bfloat16)
        >>> row.stored, row.compute, row.nbytes, row.compute_nbytes
        ('float32,int32', 'bfloat16,int32', 72, 40)
    """
    if not hasattr(leaf, "dtype") or not hasattr(leaf, "shape"):
        return row
    stored = np.dtype(leaf.dtype)
    target = np.dtype(compute_dtype) if dt.is_floating(stored) else stored
    size = math.prod(leaf.shape)
    return row._replace(
        stored=_add_name(row.stored, stored.name),
        compute=_add_name(row.compute, target.name),
        nbytes=row.nbytes + size * stored.itemsize,
        compute_nbytes=row.compute_nbytes + size * target.itemsize,
    )


_SHORT = (("bfloat", "bf"), ("float", "f"), ("uint", "u"), ("int", "i"), ("complex", "c"))


def short_dtype(name: str) -> str:
    """``"float32"`` -> ``"f32"``, ``"bfloat16"`` -> ``"bf16"``, ``"int8"`` -> ``"i8"``;
    comma-separated lists element-wise; other names as given."""
    out = []
    for part in name.split(","):
        for long, short in _SHORT:
            if part.startswith(long) and part[len(long) : len(long) + 1].isdigit():
                part = short + part[len(long) :]
                break
        out.append(part)
    return ",".join(out)


def _human_bytes(n: int) -> str:
    value = float(n)
    for unit in ("", "K", "M", "G", "T"):
        if value < 1024 or unit == "T":
            if not unit:
                return str(n)
            return f"{value:.1f}{unit}" if value < 100 else f"{value:.0f}{unit}"
        value /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


def _ellipsize(text: str, width: int) -> str:
    if len(text) <= width:
        return text
    if width <= 1:
        return "…"[:width]
    head = (width - 1) // 2 + (width - 1) % 2
    tail = width - 1 - head
    return text[:head] + "…" + (text[-tail:] if tail else "")


def _wrap_path(path: str, width: int) -> list[str]:
    """``path`` in lines of at most ``width``, broken after ``/``; continuations indented."""
    if len(path) <= width:
        return [path]
    parts = re.findall(r"[^/]*/|[^/]+$", path)
    lines: list[str] = []
    current = ""
    for part in parts:
        indent = "  " if lines else ""
        if current and len(indent) + len(current) + len(part) > width:
            lines.append(indent + current)
            current = ""
            indent = "  "
        current += part
    lines.append(("  " if lines else "") + current)
    return [_ellipsize(line, width) if len(line) > width else line for line in lines]


def format_rows(rows: Iterable[ExplainRow]) -> str:
    """Renders explain rows as a table no wider than 100 columns, with a total line.

    Columns: ``path``, ``class``, ``policy``, ``source``, ``own`` (the module's own
    dtype), ``stored`` and ``compute`` (dtypes, short forms), ``bytes`` and ``c.bytes``
    (bytes stored and in compute, 1K = 1024). A column empty in every row is dropped
    (the byte columns when no row has leaves); a row without leaves leaves its byte cells
    blank. When the table is too wide, ``source``, ``class``, ``policy`` and the dtype
    columns are shortened with ``…`` and paths longer than their column are wrapped after
    a ``/`` (the row's cells on the last line). The total line sums the bytes.

    Args:
        rows: the rows, in the order to show them.

    Returns:
        The table, lines joined with ``"\\n"`` (no trailing newline).

    Examples:
        >>> from jmp_policy._src.explain import ExplainRow, format_rows
        >>> print(format_rows([
        ...     ExplainRow("", "Model", "mixed_bfloat16", "default"),
        ...     ExplainRow("encoder/mlp", "Dense", "mixed_bfloat16", "default", "",
        ...                "float32", "bfloat16", 4 * 1024 * 1024, 2 * 1024 * 1024),
        ...     ExplainRow("head", "Dense", "float32", "key 'head'", "", "float32",
        ...                "float32", 2048, 2048),
        ... ]))
        path         class  policy          source      stored  compute  bytes  c.bytes
        <root>       Model  mixed_bfloat16  default
        encoder/mlp  Dense  mixed_bfloat16  default     f32     bf16      4.0M     2.0M
        head         Dense  float32         key 'head'  f32     f32       2.0K     2.0K
        total                                                             4.0M     2.0M
    """
    rows = list(rows)
    has_leaves = [bool(r.stored) for r in rows]
    cells = []
    for r, leafy in zip(rows, has_leaves, strict=True):
        cells.append(
            [
                r.path or "<root>",
                r.module_class,
                r.policy,
                r.source,
                short_dtype(r.own_dtype),
                short_dtype(r.stored),
                short_dtype(r.compute),
                _human_bytes(r.nbytes) if leafy else "",
                _human_bytes(r.compute_nbytes) if leafy else "",
            ]
        )
    keep = [0] + [c for c in range(1, len(_HEADERS)) if any(row[c] for row in cells)]
    widths = {c: max([len(_HEADERS[c])] + [len(row[c]) for row in cells]) for c in keep}
    total_line = None
    if 7 in keep:
        total_line = ["total"] + [""] * (len(_HEADERS) - 3)
        total_line += [_human_bytes(sum(r.nbytes for r in rows))]
        total_line += [_human_bytes(sum(r.compute_nbytes for r in rows))]
        for c in (7, 8):
            widths[c] = max(widths[c], len(total_line[c]))

    def others() -> int:
        return sum(widths[c] for c in keep if c) + len(_SEP) * (len(keep) - 1)

    for column, cap in _SHRINK:
        if others() + _MIN_PATH <= WIDTH:
            break
        if column in widths:
            widths[column] = min(widths[column], max(cap, len(_HEADERS[column])))
    widths[0] = min(widths[0], max(_MIN_PATH, WIDTH - others()))
    first_numeric = len(_HEADERS) - _NUMERIC

    def line(row: list[str]) -> list[str]:
        path_lines = _wrap_path(row[0], widths[0])
        out = []
        for c in keep:
            cell = path_lines[-1] if c == 0 else _ellipsize(row[c], widths[c])
            out.append(cell.rjust(widths[c]) if c >= first_numeric else cell.ljust(widths[c]))
        return [*path_lines[:-1], _SEP.join(out).rstrip()]

    lines = line(list(_HEADERS))
    for row in cells:
        lines += line(row)
    if total_line is not None:
        lines += line(total_line)
    return "\n".join(lines)
