"""Choosing one format per layer under a budget: a multiple-choice knapsack.

Each layer offers options ``(cost, score)`` (bytes of its kernel, estimated loss increase);
exactly one option per layer is chosen. Two problems: the least total score with total
cost at most a bound, and the least total cost with total score at most a bound.

The exact method keeps, layer by layer, the Pareto frontier of the partial sums (cost
ascending, score strictly descending); it is exact for any costs and scores, and small
while the frontier stays small (few layers, or costs sharing few distinct sums). Past
``max_frontier`` points it gives way to the Lagrangian method: bisection on the
multiplier ``lam`` of ``score + lam * cost``, each layer choosing its own best option,
then a greedy repair spending what the bound leaves on the upgrades that buy the most
score per byte. Ties break on the option's order, so the choice is deterministic.
"""

from __future__ import annotations

from collections.abc import Sequence

Options = Sequence[tuple[float, float]]  # one layer's (cost, score) per option

MAX_FRONTIER = 200_000


def cheapest(layers: Sequence[Options], by: int) -> float:
    """The least total of component ``by`` (0 cost, 1 score) any choice reaches."""
    return sum(min(o[by] for o in options) for options in layers)


def choose(
    layers: Sequence[Options],
    bound: float,
    *,
    minimize: str = "score",
    max_frontier: int = MAX_FRONTIER,
) -> tuple[list[int], str]:
    """One option index per layer, and the method used (``"exact"`` or ``"lagrangian"``).

    ``minimize="score"``: least total score with total cost <= ``bound``;
    ``minimize="cost"``: least total cost with total score <= ``bound``.
    The caller checks feasibility (:func:`cheapest`) first.
    """
    if minimize not in ("score", "cost"):
        raise ValueError(f"`minimize` must be 'score' or 'cost'. Received: {minimize!r}")
    # Internally: minimize component `obj` subject to component `con` <= bound.
    con, obj = (0, 1) if minimize == "score" else (1, 0)
    picks = _exact(layers, bound, con, obj, max_frontier)
    if picks is not None:
        return picks, "exact"
    return _lagrangian(layers, bound, con, obj), "lagrangian"


def _exact(
    layers: Sequence[Options], bound: float, con: int, obj: int, max_frontier: int
) -> list[int] | None:
    # frontier: list of (con_sum, obj_sum, back) with back = (previous index, option)
    frontiers: list[list[tuple[float, float, int, int]]] = []
    current: list[tuple[float, float, int, int]] = [(0.0, 0.0, -1, -1)]
    for options in layers:
        merged = sorted(
            (
                (point[0] + option[con], point[1] + option[obj], i, j)
                for i, point in enumerate(current)
                for j, option in enumerate(options)
                if point[0] + option[con] <= bound * (1 + 1e-12) + 1e-12
            ),
            key=lambda p: (p[0], p[1], p[3], p[2]),
        )
        pruned: list[tuple[float, float, int, int]] = []
        for p in merged:
            if not pruned or p[1] < pruned[-1][1]:
                pruned.append(p)
        if len(pruned) > max_frontier or not pruned:
            return None
        frontiers.append(pruned)
        current = pruned
    best = min(range(len(current)), key=lambda k: (current[k][1], current[k][0]))
    picks: list[int] = []
    for frontier in reversed(frontiers):
        _, _, back, option = frontier[best]
        picks.append(option)
        best = back
    return picks[::-1]


def _best(options: Options, lam: float, con: int, obj: int) -> int:
    return min(range(len(options)), key=lambda j: (options[j][obj] + lam * options[j][con], j))


def _least(options: Options, con: int, obj: int) -> int:
    return min(range(len(options)), key=lambda j: (options[j][con], options[j][obj]))


def _lagrangian(layers: Sequence[Options], bound: float, con: int, obj: int) -> list[int]:
    def picks_at(lam: float) -> list[int]:
        return [_best(options, lam, con, obj) for options in layers]

    def total(picks: list[int], k: int) -> float:
        return sum(options[j][k] for options, j in zip(layers, picks, strict=True))

    lo, hi = 0.0, 1.0
    while total(picks_at(hi), con) > bound and hi < 1e30:
        hi *= 4.0
    if total(picks_at(lo), con) <= bound:
        picks = picks_at(lo)
    else:
        for _ in range(100):
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if total(picks_at(mid), con) <= bound else (mid, hi)
        picks = picks_at(hi)
    if total(picks, con) > bound:  # even the largest multiplier: the least `con` per layer
        picks = [_least(options, con, obj) for options in layers]
    # Greedy repair: spend the slack on the upgrades with the best gain per unit spent.
    while True:
        slack = bound - total(picks, con)
        best_move, best_ratio = None, 0.0
        for i, options in enumerate(layers):
            here = options[picks[i]]
            for j, option in enumerate(options):
                spend, gain = option[con] - here[con], here[obj] - option[obj]
                if gain <= 0 or spend > slack:
                    continue
                ratio = float("inf") if spend <= 0 else gain / spend
                if best_move is None or ratio > best_ratio:
                    best_move, best_ratio = (i, j), ratio
        if best_move is None:
            return picks
        picks[best_move[0]] = best_move[1]
