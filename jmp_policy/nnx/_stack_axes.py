"""Where an NNX layer created stacked (``nnx.vmap`` of its constructor) keeps its stacked
axes: NNX names the axis at the call (``nnx.vmap(..., out_axes=1)``, ``nnx.scan(in_axes=
(nnx.Carry, 1))``), not in the module, so it is read from the kernels' shapes against each
layer's own."""

from __future__ import annotations

from typing import Any

from flax import nnx

from jmp_policy.nnx._modules import path_of
from jmp_policy.nnx._quantization import stacked


def _axes_that_fit(module: Any) -> list[int]:
    """The axes of a stacked layer's kernel from which removing its stacked axes leaves the
    layer's own kernel shape (``nnx.vmap`` with ``out_axes=1`` puts them on axis 1)."""
    n = len(stacked(module))
    kernel = module.kernel
    shape = tuple((kernel.get_value() if isinstance(kernel, nnx.Variable) else kernel).shape)
    if isinstance(module, nnx.Linear):
        own: tuple[int, ...] = (module.in_features, module.out_features)
    elif isinstance(module, nnx.LinearGeneral):
        batch = tuple(dict(module.batch_axis).values())
        own = (*batch, *module.in_features, *module.out_features)
    else:  # nnx.Einsum, nnx.Conv
        own = tuple(getattr(module, "kernel_shape", shape[n:]))
    return [a for a in range(len(own) + 1) if shape[:a] + shape[a + n :] == own] or [0]


def stack_axes(model: Any) -> dict[str, int | None]:
    """Module path -> where the stacked axes of each layer created stacked start in its
    kernel: the axis that fits it and the layers made beside it (one ``nnx.vmap`` stacks
    siblings on one axis), leading first; ``None`` when still more than one fits and not
    the leading one (as many heads as layers), which the kernels cannot tell."""
    fits: dict[str, list[int]] = {}
    for parts, module in nnx.iter_modules(model):
        if stacked(module):
            fits[path_of(parts)] = _axes_that_fit(module)
    common: dict[str, set[int]] = {}
    for path, axes in fits.items():
        parent = path.rpartition("/")[0]
        common[parent] = common.get(parent, set(axes)) & set(axes) or common.get(parent, set())
    found: dict[str, int | None] = {}
    for path, axes in fits.items():
        shared = sorted(common[path.rpartition("/")[0]] & set(axes)) or axes
        found[path] = 0 if 0 in shared else shared[0] if len(shared) == 1 else None
    return found


def ambiguous_stack(path: str, module: Any) -> str:
    """The warning for a stacked layer whose stacked axis :func:`stack_axis` cannot tell."""
    shape = tuple(module.kernel.get_value().shape)
    return (
        f"quantize: the stacked layer {path!r} (kernel {shape}) could hold its layers on "
        "more than one axis (as many heads as layers, not on axis 0); its kernel is "
        "quantized as one kernel (its layers share their scales) and runs dequantized "
        "ahead of its stack. Stack the layers on axis 0 (`nnx.vmap(..., out_axes=0)`) to "
        "quantize them per layer."
    )
