"""The search's choice under a budget, and what it returns: the map and a table per layer.

The choice is a multiple-choice knapsack (:mod:`jmp_policy._src.map_choice`) over each
layer's options ``(name, bytes, score)``; the map's entries are compacted by
:mod:`._compaction`. :meth:`SearchResult.at` chooses again from the same scores.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from jmp_policy._src import map_choice
from jmp_policy._src.map_search._compaction import compact
from jmp_policy._src.policy_map import DTypePolicyMap
from jmp_policy._src.policy_names import get_policy

BUDGETS = ("effective_bits", "weight_bytes", "loss_increase")


class LayerRow(NamedTuple):
    """One layer (one path of the map) of a search's table.

    ``scores``/``bytes``: per candidate name (a candidate that cannot quantize the layer's
    kernel is absent); ``choice``: the chosen candidate; ``why``: the reason in words;
    ``unit``: ``"layer"``, or for a layer stack ``"per stack (scanned: N layers)"`` (one
    path, so one choice for all its layers) or ``"one kernel shared by N scan
    iterations"``; ``scored``: ``False`` where the search could not see the layer run
    (it keeps the base policy).
    """

    path: str
    params: int
    scores: dict[str, float]
    bytes: dict[str, int]
    choice: str
    why: str
    unit: str = "layer"
    scored: bool = True


class SearchResult(NamedTuple):
    """What a search returns: the map, the table per layer, and the totals.

    Unpacks as ``policy_map, table, ...``; ``str(result)`` is the table as text;
    :meth:`at` chooses again under another budget from the same scores.

    Examples:
        >>> import jmp_policy as jp
        >>> from jmp_policy._src.map_search import LayerRow
        >>> bf16 = "mixed_bfloat16"
        >>> rows = (LayerRow("up", 16384, {bf16: 0.0}, {bf16: 32768}, bf16, "kept"),)
        >>> result = jp.SearchResult(jp.DTypePolicyMap(bf16), rows, 32768, 16.0, 0.0, "")
        >>> policy_map, table, weight_bytes, *_ = result
        >>> weight_bytes, result.effective_bits
        (32768, 16.0)
    """

    policy_map: DTypePolicyMap
    table: tuple[LayerRow, ...]
    weight_bytes: int
    effective_bits: float
    loss_increase: float
    method: str

    def __str__(self) -> str:
        names = list(dict.fromkeys(n for row in self.table for n in row.scores))
        width = max([len("layer"), *(len(r.path) for r in self.table)])
        # Each column as wide as its policy's whole name (a cut name could be another's).
        widths = [max(len(n), 9) for n in names]
        head = f"{'layer':{width}}  " + "  ".join(
            f"{n:>{w}}" for n, w in zip(names, widths, strict=True)
        )
        lines = [head + "  choice"]
        for row in self.table:
            cells = [
                f"{row.scores[n]:>{w}.3g}" if n in row.scores else f"{'-':>{w}}"
                for n, w in zip(names, widths, strict=True)
            ]
            lines.append(f"{row.path:{width}}  " + "  ".join(cells) + f"  {row.choice}")
            lines.append(f"{'':{width}}  {row.why}")
        lines.append(
            f"total: {self.weight_bytes:,} bytes ({self.effective_bits:.3f} bits per "
            f"parameter), estimated loss increase {self.loss_increase:.4g} ({self.method})"
        )
        return "\n".join(lines)

    def at(self, budget: Mapping[str, float]) -> SearchResult:
        """The choice under another ``budget``, from this search's scores (no model runs).

        One search, then a sweep of budgets: ``result.at({"effective_bits": 5})`` is what
        ``search_map(..., budget={"effective_bits": 5})`` returns on the same arguments.

        Raises:
            TypeError, ValueError: ``budget`` is not one of the search's forms, or no
                choice meets it (the message names the cheapest possible).

        Examples:
            >>> import jmp_policy as jp
            >>> from jmp_policy._src.map_search import LayerRow, SearchResult
            >>> int4, bf16 = "int4/128_from_mixed_bfloat16", "mixed_bfloat16"
            >>> rows = tuple(LayerRow(path, 16384, {bf16: 0.0, int4: score},
            ...                       {bf16: 32768, int4: 8704}, bf16, "")
            ...              for path, score in [("up", 0.5), ("down", 0.1)])
            >>> result = SearchResult(jp.DTypePolicyMap(bf16), rows, 65536, 16.0, 0.0, "")
            >>> small = result.at({"effective_bits": 11})
            >>> [(row.path, row.choice) for row in small.table]
            [('up', 'mixed_bfloat16'), ('down', 'int4/128_from_mixed_bfloat16')]
            >>> small.weight_bytes
            41472
        """
        kind, value = check_budget(budget)
        layers = [
            ScoredLayer(
                r.path, r.params, [(n, r.bytes[n], r.scores[n]) for n in r.bytes], r.scored, r.unit
            )
            for r in self.table
        ]
        names = {n for row in self.table for n in row.bytes}
        policies = {n: get_policy(n) for n in sorted(names)}
        return choose(layers, policies, self.policy_map.default_policy.name, kind, value)


class ScoredLayer(NamedTuple):
    """A layer as the choice sees it: its options ``(name, bytes, score)``."""

    path: str
    params: int
    options: list[tuple[str, int, float]]
    scored: bool
    unit: str


def check_budget(budget: Any) -> tuple[str, float]:
    """``(kind, value)`` of a budget ``{"effective_bits": 4.5}`` (one key of BUDGETS)."""
    if not isinstance(budget, Mapping) or len(budget) != 1:
        raise TypeError(
            "`budget` must be a dict of one of "
            f"{list(BUDGETS)} to a positive number, such as {{'effective_bits': 4.5}}. "
            f"Received: budget={budget!r}"
        )
    ((kind, value),) = budget.items()
    if kind not in BUDGETS:
        raise ValueError(f"`budget` must name one of {list(BUDGETS)}. Received: budget={budget!r}")
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not 0 < value < float("inf")
    ):
        raise ValueError(
            f"`budget`'s {kind!r} must be a finite positive number. Received: budget={budget!r}"
        )
    return kind, float(value)


def choose(
    table: Sequence[ScoredLayer],
    policies: Mapping[str, Any],
    base: str,
    kind: str,
    value: float,
) -> SearchResult:
    """The choice among ``table``'s options under the budget ``{kind: value}``.

    Raises:
        ValueError: no choice meets the budget (the message names the least possible).
    """
    paths = [layer.path for layer in table]
    options = {layer.path: layer.options for layer in table}
    total_params = sum(layer.params for layer in table)
    picks, method = _picks(
        [[(float(b), s) for _, b, s in options[p]] for p in paths], kind, value, total_params
    )
    choices = {p: options[p][j][0] for p, j in zip(paths, picks, strict=True)}
    rows = tuple(
        LayerRow(
            path=layer.path,
            params=layer.params,
            scores={n: s for n, _, s in layer.options},
            bytes={n: b for n, b, _ in layer.options},
            choice=choices[layer.path],
            why=_why(layer.options, j, layer.scored, layer.unit),
            unit=layer.unit,
            scored=layer.scored,
        )
        for layer, j in zip(table, picks, strict=True)
    )
    entries = compact(choices, base)
    policy_map = DTypePolicyMap(base, {k: policies[n] for k, n in entries.items()})
    total_bytes = sum(options[p][j][1] for p, j in zip(paths, picks, strict=True))
    loss = sum(options[p][j][2] for p, j in zip(paths, picks, strict=True))
    return SearchResult(
        policy_map, rows, int(total_bytes), 8 * total_bytes / total_params, loss, method
    )


def _picks(
    layers: list[list[tuple[float, float]]], kind: str, value: float, total_params: int
) -> tuple[list[int], str]:
    """The knapsack's pick per layer (and its method) once the budget is known feasible."""
    least_bytes = map_choice.cheapest(layers, 0)
    if kind == "loss_increase":
        least_loss = map_choice.cheapest(layers, 1)
        if value < least_loss:
            raise ValueError(
                f"No choice of the candidates keeps the estimated loss increase within "
                f"`budget`={{'loss_increase': {value!r}}}: the least possible is "
                f"{least_loss:.6g}."
            )
        return map_choice.choose(layers, value, minimize="cost")
    bound = value if kind == "weight_bytes" else value * total_params / 8
    if bound < least_bytes:
        raise ValueError(
            f"No choice of the candidates fits `budget`={{{kind!r}: {value!r}}}: the "
            f"cheapest possible is {int(least_bytes):,} weight bytes "
            f"({8 * least_bytes / total_params:.4g} effective bits per parameter)."
        )
    return map_choice.choose(layers, bound, minimize="score")


def _why(options: list[tuple[str, int, float]], j: int, scored: bool, unit: str) -> str:
    if not scored:
        return (
            "not scored (called inside a transform the search cannot see into: one other "
            "than a scan, remat or vmap, or an nnx.remat/nnx.vmap function made before the "
            "search ran): base kept"
        )
    _, b, s = options[j]
    if unit.startswith("per stack"):
        unit += ", one entry of the map for all its layers"
    if len(options) == 1:
        why = "the only candidate that fits its kernel"
    elif b == min(o[1] for o in options):
        why = f"the cheapest candidate ({b:,} bytes)"
    else:
        cheaper = [o for o in options if o[1] < b]
        nxt = max(cheaper, key=lambda o: (o[1], -o[2]))
        why = (
            f"on the budget's frontier: {nxt[0]} would save {b - nxt[1]:,} bytes for "
            f"+{nxt[2] - s:.3g} estimated loss"
        )
    return why if unit == "layer" else f"{unit}; {why}"
