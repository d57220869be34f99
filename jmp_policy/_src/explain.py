"""Explain tables: one row per module (or variable) and the policy it runs under.

Every ``explain`` (``DTypePolicyMap.explain``, the Linen and NNX glue's) builds
:class:`ExplainRow` values and renders them with :func:`format_rows`, so all tables read
alike and fit 100 columns: dtypes in short form (``f32→bf16``), bytes in binary units
(``4.0M``), columns that are empty in every row dropped, long sources listed under the
table, long paths grouped under their parent path, long cells shortened with ``…``.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Iterable
from typing import Any, NamedTuple

import numpy as np

from jmp_policy._src import dtypes as dt
from jmp_policy._src import quantization

WIDTH = 100
SEP = "  "
INDENT = "  "
# Display columns: ExplainRow's stored and compute dtypes share one ("f32→bf16").
_HEADERS = ("path", "class", "policy", "source", "own", "dtype", "bytes", "c.bytes")
# Under a table with byte columns: what they count.
UNITS = "bytes: as stored; c.bytes: as the compute reads them (K = 1024, M = 1024 K)"
_PATH, _CLASS, _POLICY, _SOURCE, _OWN, _DTYPE = range(6)
_FIRST_NUMERIC = 6
# Narrowest widths the elastic columns are shortened to (with "…") when space runs out.
_MIN_WIDTH = {_PATH: 16, _CLASS: 8, _POLICY: 14, _OWN: 4, _DTYPE: 8}
# The class column keeps this much while the others shrink: Flax's longest common class
# name, "MultiHeadDotProductAttention", stays whole; below it only if nothing else fits.
# Paths shrink further first (to 10): a long path is grouped under its parent, not cut.
_CLASS_WIDTH = len("MultiHeadDotProductAttention")
_KEEP_CLASS = {**_MIN_WIDTH, _PATH: 10, _CLASS: _CLASS_WIDTH}
_SOURCE_WIDTH = 16  # longer sources become references "[n]" listed under the table
_MIN_FORM_WIDTH = 40  # narrower, and the matmul forms go on lines below their paths


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

    A floating leaf computes in ``compute_dtype``; other leaves keep their dtype; a
    ``QuantizedArray`` is stored as its mode (``int8``, ``int4``: values and scales) and
    computes in ``compute_dtype``. Leaves
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
    if isinstance(leaf, quantization.QuantizedArray):
        target = np.dtype(compute_dtype)
        return row._replace(
            stored=_add_name(row.stored, leaf.mode),
            compute=_add_name(row.compute, target.name),
            nbytes=row.nbytes + leaf.nbytes,
            compute_nbytes=row.compute_nbytes + leaf.size * target.itemsize,
        )
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
            return f"{value:.1f}{unit}" if value < 10 else f"{value:.0f}{unit}"
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


def _dtype_cell(row: ExplainRow) -> str:
    stored, compute = short_dtype(row.stored), short_dtype(row.compute)
    return stored if stored == compute or not compute else f"{stored}→{compute}"


def _fill(naturals: dict[int, int], available: int) -> dict[int, int]:
    """Widths for the elastic columns: all natural if they fit, else each capped at one
    common level (never below its minimum), the widest level that fits; the class column
    keeps up to ``_CLASS_WIDTH`` until the others are at their minimums."""
    if sum(naturals.values()) <= available:
        return dict(naturals)
    for minimum in (_KEEP_CLASS, _MIN_WIDTH):
        level = max(naturals.values())
        while level > 0:
            widths = {c: min(n, max(minimum[c], level)) for c, n in naturals.items()}
            if sum(widths.values()) <= available:
                return widths
            level -= 1
    return {c: min(n, _MIN_WIDTH[c]) for c, n in naturals.items()}


def format_rows(rows: Iterable[ExplainRow]) -> str:
    """Renders explain rows as a table no wider than 100 columns, with a total line.

    Columns: ``path``, ``class``, ``policy``, ``source``, ``own`` (the module's own
    dtype), ``dtype`` (stored dtypes, then ``→`` and the compute dtypes when they differ:
    ``f32→bf16``), ``bytes`` and ``c.bytes`` (bytes stored and in compute, 1K = 1024, said
    in a line under the table). A
    column empty in every row is dropped (the byte columns and the total line when no row
    has leaves); a row without leaves leaves its byte cells blank. When the table would
    be wider than 100 columns, a source longer than 16 characters becomes a reference
    ``[n]`` spelled out under the table; paths too long for their column are grouped under a line holding their
    parent path (``encoder/layers_0/attention/``), each row then showing its last segment
    indented; and the path, policy, own and dtype columns are shortened with ``…``, widest
    first, only as far as needed, before the class column goes below 28 characters (Flax's
    ``MultiHeadDotProductAttention`` stays whole).

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
        path         class  policy          source      dtype     bytes  c.bytes
        <root>       Model  mixed_bfloat16  default
        encoder/mlp  Dense  mixed_bfloat16  default     f32→bf16   4.0M     2.0M
        head         Dense  float32         key 'head'  f32        2.0K     2.0K
        total                                                      4.0M     2.0M
        bytes: as stored; c.bytes: as the compute reads them (K = 1024, M = 1024 K)
    """
    rows = list(rows)
    cells = [_cells(r) for r in rows]
    keep = [_PATH] + [c for c in range(1, len(_HEADERS)) if any(row[c] for row in cells)]
    shown = cells
    if _FIRST_NUMERIC in keep:
        total = ["total"] + [""] * (len(_HEADERS) - 3)
        total += [_human_bytes(sum(r.nbytes for r in rows))]
        total += [_human_bytes(sum(r.compute_nbytes for r in rows))]
        shown = [*cells, total]
    legend = _legend(cells, shown, keep)
    widths = _widths(shown, keep)
    lines = [_line(list(_HEADERS), _HEADERS[_PATH], keep, widths)]
    group = None
    for row in shown:
        path = row[_PATH]
        if len(path) > widths[_PATH] and "/" in path:
            head, _, tail = path.rpartition("/")
            if head != group:
                lines.append(_ellipsize(head + "/", WIDTH))
                group = head
            path = INDENT + tail
        else:
            group = None
        lines.append(_line(row, path, keep, widths))
    for source, ref in legend.items():
        lines.append(_ellipsize(f"{ref} {source}", WIDTH))
    if _FIRST_NUMERIC in keep:
        lines.append(UNITS)
    return "\n".join(lines)


def _cells(r: ExplainRow) -> list[str]:
    """A row's display cells, one per header (byte cells blank for a row without leaves)."""
    leafy = bool(r.stored)
    return [
        r.path or "<root>",
        r.module_class,
        r.policy,
        r.source,
        short_dtype(r.own_dtype),
        _dtype_cell(r),
        _human_bytes(r.nbytes) if leafy else "",
        _human_bytes(r.compute_nbytes) if leafy else "",
    ]


def _natural(shown: list[list[str]], c: int) -> int:
    return max([len(_HEADERS[c])] + [len(row[c]) for row in shown])


def _legend(cells: list[list[str]], shown: list[list[str]], keep: list[int]) -> dict[str, str]:
    """When the table at natural widths is too wide, long sources become references
    ``[n]`` (in ``cells``, in place): ``{source: reference}``."""
    legend: dict[str, str] = {}
    natural = sum(_natural(shown, c) for c in keep) + len(SEP) * (len(keep) - 1)
    if natural > WIDTH and _SOURCE in keep:
        for row in cells:
            if len(row[_SOURCE]) > _SOURCE_WIDTH:
                row[_SOURCE] = legend.setdefault(row[_SOURCE], f"[{len(legend) + 1}]")
    return legend


def _widths(shown: list[list[str]], keep: list[int]) -> dict[int, int]:
    """The columns' widths: natural where the table fits, else the elastic columns
    shrunk (:func:`_fill`), with room for grouped paths' last segments."""
    widths = {c: _natural(shown, c) for c in keep}
    elastic = {c: widths[c] for c in _MIN_WIDTH if c in keep}
    fixed = sum(widths[c] for c in keep if c not in elastic) + len(SEP) * (len(keep) - 1)
    widths.update(_fill(elastic, WIDTH - fixed))
    if widths[_PATH] < elastic[_PATH]:  # some paths go under their parent path
        tails = [
            len(INDENT) + len(p.rpartition("/")[2]) if len(p) > widths[_PATH] else len(p)
            for p in (row[_PATH] for row in shown)
        ]
        elastic[_PATH] = max([len(_HEADERS[_PATH]), *tails])
        widths.update(_fill(elastic, WIDTH - fixed))
    return widths


def _line(row: list[str], path: str, keep: list[int], widths: dict[int, int]) -> str:
    out = []
    for c in keep:
        cell = _ellipsize(path if c == _PATH else row[c], widths[c])
        out.append(cell.rjust(widths[c]) if c >= _FIRST_NUMERIC else cell.ljust(widths[c]))
    return SEP.join(out).rstrip()


def format_matmuls(forms: dict[str, str]) -> str:
    """The matmul each quantized or float8 layer runs, as lines under an explain table
    (``""`` when none ran): ``path  form``, one per layer, in the order they ran. A form
    too long for the line is wrapped, never cut, its lines aligned under its first; paths
    too long to leave a form room put the forms on lines of their own.

    Examples:
        >>> from jmp_policy._src.explain import format_matmuls
        >>> print(format_matmuls({"up": "int8 weights: weight-only, scale after"}))
        <BLANKLINE>
        matmuls:
          up  int8 weights: weight-only, scale after
    """
    if not forms:
        return ""
    width = max(len(path or "<root>") for path in forms)
    column = len(INDENT) + width + len(SEP)
    own_line = WIDTH - column < _MIN_FORM_WIDTH
    lines = ["", "matmuls:"]
    for path, form in forms.items():
        name = path or "<root>"
        if own_line:
            lines.append(f"{INDENT}{name}")
            lines += textwrap.wrap(
                form,
                WIDTH,
                initial_indent=INDENT * 3,
                subsequent_indent=INDENT * 3,
                break_long_words=False,
            )
            continue
        wrapped = textwrap.wrap(form, WIDTH - column, break_long_words=False) or [""]
        lines.append(f"{INDENT}{name.ljust(width)}{SEP}{wrapped[0]}")
        lines += [" " * column + more for more in wrapped[1:]]
    return "\n".join(lines)
