"""Where a stacked layer keeps its stacked axes in a stored parameter, read from shapes:
the stored shape against the one a layer sees (or holds), and the axes the stack's scans
put them at where the framework tells them (Linen's ``nn.scan`` ``variable_axes``)."""

from __future__ import annotations

from collections.abc import Mapping


def axes_that_fit(stored: tuple[int, ...], own: tuple[int, ...], n: int) -> list[int]:
    """The axes from which removing ``n`` stacked axes of ``stored`` leaves ``own``."""
    return [a for a in range(len(own) + 1) if stored[:a] + stored[a + n :] == own]


def scan_positions(axes: list[int]) -> list[int]:
    """Where the stacked axes of nested scans (``axes``: each scan's axis, outermost
    first) lie in the stored parameter, outermost first."""
    positions: list[int] = []
    for axis in reversed(axes):  # innermost first: each outer scan inserts its axis
        positions = [p + 1 if p >= axis else p for p in positions] + [axis]
    return positions[::-1]


def stacked_axes(
    stored: Mapping[str, tuple[int, ...]],
    seen: Mapping[str, tuple[int, ...]],
    scans: Mapping[str, int],
) -> dict[str, tuple[int, int]]:
    """Parameter path -> ``(n, axis)``: its ``n`` stacked axes (``stored`` shape against
    the ``seen`` one), starting at ``axis``. The axes come from the ``scans`` around it
    (module path -> the axis it stacks parameters on); for other stacks (a ``vmap``) from
    shapes, leading axes first. A parameter whose scans put their axes apart (nested scans
    on different axes) has none."""
    found = {}
    for path, shape in stored.items():
        own = seen.get(path)
        if own is None or (n := len(shape) - len(own)) <= 0:
            continue
        around = [a for s, a in sorted(scans.items()) if path.startswith(f"{s}/" if s else "")]
        if len(around) == n:  # every stacked axis is a scan's: where the scans put them
            at = scan_positions(around)[0]
            if scan_positions(around) == list(range(at, at + n)) and (
                shape[:at] + shape[at + n :] == own
            ):
                found[path] = (n, at)
            continue
        if fits := axes_that_fit(shape, own, n):  # leading axes first
            found[path] = (n, fits[0])
    return found
