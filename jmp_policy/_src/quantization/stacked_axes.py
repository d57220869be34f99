"""``stacked_axes``: how many leading axes of a kernel stack layers (an ``nn.scan``,
``nnx.scan`` or vmapped layer stack, ``[depth, in, out]``), given per leaf path."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from jmp_policy._src import user_warnings
from jmp_policy._src.path_patterns import compile_pattern


def stacked_axes_of(stacked_axes: Any) -> Callable[[str], int]:
    """``stacked_axes`` as a function of a leaf's path: its number of stacked axes (see
    :func:`stack_of`)."""
    of = stack_of(stacked_axes)
    return lambda path: of(path)[0]


def stack_of(stacked_axes: Any) -> Callable[[str], tuple[int, int]]:
    """``stacked_axes`` (``None``, an int, or a mapping from path regex to an int or a pair
    ``(n, axis)``, the first key that fully matches a leaf's path wins) as a function of a
    leaf's path: ``(n, axis)``, its ``n`` stacked axes starting at ``axis`` (``0`` for an
    int: leading axes; ``1`` for an ``nn.scan(..., variable_axes={"params": 1})`` stack).

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

    def pair(n: Any, where: str) -> tuple[int, int]:
        if isinstance(n, tuple) and len(n) == 2:
            return count(n[0], where), count(n[1], where)
        return count(n, where), 0

    if stacked_axes is None:
        return lambda path: (0, 0)
    if isinstance(stacked_axes, (int, np.integer)) and not isinstance(stacked_axes, bool):
        n = count(stacked_axes, f"stacked_axes={stacked_axes!r}")
        return lambda path: (n, 0)
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
        rules.append((pattern, pair(n, f"{n!r} for {key!r} in stacked_axes={stacked_axes!r}")))

    def of(path: str) -> tuple[int, int]:
        for pattern, n in rules:
            if pattern.fullmatch(path):
                return n
        return (0, 0)

    return of


def warn_maybe_stacked(stacked_axes: Any, done: list[tuple[str, tuple[int, ...]]]) -> None:
    """Once per ``quantize`` call on a plain tree given no ``stacked_axes``: the kernels of
    rank >= 3 it quantized whole (of ``done``: each path and shape) might be layer stacks."""
    found = [(path, shape) for path, shape in done if len(shape) >= 3]
    if stacked_axes is not None or not found:
        return
    path, shape = found[0]
    others = f" (and {len(found) - 1} more kernel(s) of rank >= 3)" if len(found) > 1 else ""
    user_warnings.warn(
        f"quantize: the kernel {path!r} of shape {shape}{others} was quantized as one kernel "
        "(one scale per last-axis channel over all its other axes). If its first axis stacks "
        "layers (an `nn.scan`, `nnx.scan` or vmapped model's tree), the layers share their "
        f"scales: pass `stacked_axes=` (such as {{{re.escape(path)!r}: 1}}), or quantize the "
        "model with `jmp_policy.linen.quantize` / `jmp_policy.nnx.quantize`, which find the "
        "stacked axes. `stacked_axes=0` says there are none (a `DenseGeneral` or convolution "
        "kernel) and silences this warning."
    )
