"""Where a layer created stacked keeps its stacked axes, read from its kernel's shape against
one layer's own: a framework that names a stack's axis at the call (NNX's ``nnx.vmap(...,
out_axes=1)``, ``nnx.scan(in_axes=(nnx.Carry, 1))``), not in the layer, tells it so."""

from __future__ import annotations

from collections.abc import Mapping


def _fitting(shape: tuple[int, ...], own: tuple[int, ...]) -> list[int]:
    """The axes from which removing the stacked axes leaves the layer's own shape."""
    n = len(shape) - len(own)
    return [a for a in range(len(own) + 1) if shape[:a] + shape[a + n :] == own] or [0]


def stack_axes(
    kernels: Mapping[str, tuple[tuple[int, ...], tuple[int, ...]]],
) -> dict[str, int | None]:
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
