"""Where a stacked layer keeps its stacked axes in a stored parameter, read from shapes:
the stored shape against the one a layer sees (or holds), and the axes the stack's scans
put them at where the framework tells them (Linen's ``nn.scan`` ``variable_axes``); a
framework that names a stack's axis at the call (NNX's ``nnx.vmap(..., out_axes=1)``,
``nnx.scan(in_axes=(nnx.Carry, 1))``), not in the layer, is told it from the shapes of a
layer and its siblings."""

from __future__ import annotations

import re
from collections.abc import Mapping

from jmp_policy._src import user_warnings

Shapes = Mapping[str, tuple[tuple[int, ...], tuple[int, ...]]]


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


def _fitting(shape: tuple[int, ...], own: tuple[int, ...]) -> list[int]:
    """The axes from which removing the stacked axes leaves the layer's own shape."""
    return axes_that_fit(shape, own, len(shape) - len(own)) or [0]


def stack_axes(kernels: Shapes) -> dict[str, int | None]:
    """Layer path -> where the stacked axes start in the kernel of each stacked layer
    (``kernels``: path -> ``(kernel shape, one layer's kernel shape)``): the axis that fits
    it and the layers made beside it (one ``vmap`` stacks siblings on one axis), leading
    first; ``None`` when still more than one fits and not the leading one (as many heads as
    layers), which the shapes cannot tell."""
    fits = {path: _fitting(shape, own) for path, (shape, own) in kernels.items()}
    common: dict[str, set[int]] = {}
    for path, axes in fits.items():
        parent = path.rpartition("/")[0]
        common[parent] = common.get(parent, set(axes)) & set(axes) or common.get(parent, set())
    found: dict[str, int | None] = {}
    for path, axes in fits.items():
        shared = sorted(common[path.rpartition("/")[0]] & set(axes)) or axes
        found[path] = 0 if 0 in shared else shared[0] if len(shared) == 1 else None
    return found


def quantize_axes(kernels: Shapes, hint: str) -> dict[str, tuple[int, int]]:
    """``DTypePolicyMap.quantize``'s ``stacked_axes`` for the leaves of each stacked layer
    (``kernels`` as :func:`stack_axes` takes them): ``(n, axis)`` by the layer's path;
    a layer whose axis the shapes cannot tell is left whole (quantized as one kernel, run
    dequantized ahead of its stack) with a warning saying how to stack it (``hint``)."""
    found = {}
    for path, at in stack_axes(kernels).items():
        shape, own = kernels[path]
        if at is None:
            user_warnings.warn(
                f"quantize: the stacked layer {path!r} (kernel {shape}) could hold its layers "
                "on more than one axis (as many heads as layers, not on axis 0); its kernel "
                "is quantized as one kernel (its layers share their scales) and runs "
                f"dequantized ahead of its stack. Stack the layers on axis 0 ({hint}) to "
                "quantize them per layer."
            )
            continue
        found[re.escape(f"{path}/" if path else "") + "[^/]+"] = (len(shape) - len(own), at)
    return found
