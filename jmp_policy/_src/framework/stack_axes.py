"""Where a layer created stacked keeps its stacked axes, read from its kernel's shape against
one layer's own: a framework that names a stack's axis at the call (NNX's ``nnx.vmap(...,
out_axes=1)``, ``nnx.scan(in_axes=(nnx.Carry, 1))``), not in the layer, tells it so."""

from __future__ import annotations

import re
from collections.abc import Mapping

from jmp_policy._src import user_warnings

Shapes = Mapping[str, tuple[tuple[int, ...], tuple[int, ...]]]


def _fitting(shape: tuple[int, ...], own: tuple[int, ...]) -> list[int]:
    """The axes from which removing the stacked axes leaves the layer's own shape."""
    n = len(shape) - len(own)
    return [a for a in range(len(own) + 1) if shape[:a] + shape[a + n :] == own] or [0]


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
