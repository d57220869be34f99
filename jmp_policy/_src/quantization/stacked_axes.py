"""``stacked_axes``: how many leading axes of a kernel stack layers (an ``nn.scan``,
``nnx.scan`` or vmapped layer stack, ``[depth, in, out]``), given per leaf path."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from jmp_policy._src.path_patterns import compile_pattern


def stacked_axes_of(stacked_axes: Any) -> Callable[[str], int]:
    """``stacked_axes`` (``None``, an int, or a mapping from path regex to int, the first
    key that fully matches a leaf's path wins) as a function of a leaf's path.

    Raises:
        TypeError: ``stacked_axes`` is none of those, or a key is not a string.
        ValueError: a count is not a non-negative int, or a key is not a valid regex.
    """

    def count(n: Any, where: str) -> int:
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
            raise ValueError(
                "`stacked_axes` must give a non-negative int (the number of leading "
                f"stacked-layer axes of a kernel). Received: {where}"
            )
        return int(n)

    if stacked_axes is None:
        return lambda path: 0
    if isinstance(stacked_axes, (int, np.integer)) and not isinstance(stacked_axes, bool):
        n = count(stacked_axes, f"stacked_axes={stacked_axes!r}")
        return lambda path: n
    if not isinstance(stacked_axes, Mapping):
        raise TypeError(
            "`stacked_axes` must be None, an int, or a mapping from path regular expression "
            f"to int (such as {{'layers/.*': 1}}). Received: stacked_axes={stacked_axes!r}"
        )
    rules = []
    for key, n in stacked_axes.items():
        if not isinstance(key, str):
            raise TypeError(
                "The keys of `stacked_axes` must be path regular expressions (strings). "
                f"Received: key {key!r} in stacked_axes={stacked_axes!r}"
            )
        # Compiled as the map's keys are (bounded matching, errors naming the key).
        pattern = compile_pattern(key, "key {key} of `stacked_axes`")
        rules.append((pattern, count(n, f"{n!r} for {key!r} in stacked_axes={stacked_axes!r}")))

    def of(path: str) -> int:
        for pattern, n in rules:
            if pattern.fullmatch(path):
                return n
        return 0

    return of
