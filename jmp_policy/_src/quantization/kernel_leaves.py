"""Which leaves of a parameter tree are kernels, and quantizing them per layer along
the stacked axes of a layer stack (leading, or where an ``nn.scan``'s ``variable_axes``
put them).

A kernel is a floating leaf of rank >= 2 (after its stacked axes) that is no bias: a bias
is added to a matmul's output, never read by one, so it stays float whatever its rank.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jmp_policy._src import user_warnings
from jmp_policy._src.quantization.quantized_array import (
    QuantizedArray,
    is_quantizable,
    is_quantized,
)
from jmp_policy._src.quantization.stacked_axes import stack_of, warn_maybe_stacked
from jmp_policy._src.tree_paths import leaf_path


def is_bias(path: str) -> bool:
    """Whether the parameter at ``path`` is a layer's bias (its name is ``bias`` or ends in
    ``bias``, as Flax, NNX, Equinox and Hugging Face name them): added to a matmul's output,
    never read by one, so it stays float whatever its rank (an attention projection's
    ``[heads, head_dim]`` bias)."""
    return path.rpartition("/")[2].lower().endswith("bias")


def quantizable_layers(x: Any, stacked: int, path: str = "") -> bool:
    """A quantizable array whose layers (after ``stacked`` leading axes) have rank >= 2
    and that is no bias (:func:`is_bias`): a stacked bias ``[depth, n]`` and a
    ``DenseGeneral``'s ``[heads, head_dim]`` bias stay float."""
    return is_quantizable(x) and x.ndim - stacked >= 2 and not is_bias(path)


def quantize_stacked(quantize_one: Any, x: Any, k: int, at: int, path: str = "") -> Any:
    """``quantize_one(x, k)`` (a scheme's ``quantize``) for ``x`` whose ``k`` stacked axes
    start at axis ``at``: each layer quantized on its own, the values left in ``x``'s
    layout (the one its stack's loop slices), the scales stacked leading. Where the scales
    cannot carry the stacked axes at ``at`` for the loop (int8's ``[depth, n]`` past axis
    1), the kernel is quantized whole with a warning: its layers then share their scales
    and it runs dequantized ahead of the stack."""
    if not at or not k:
        return quantize_one(x, k)
    q = quantize_one(jnp.moveaxis(x, range(at, at + k), range(k)), k)
    if not isinstance(q, QuantizedArray):
        return q
    scales = [q.scale, getattr(q, "input_scale", q.scale)]
    if any(s.ndim < at + k for s in scales):
        user_warnings.warn(
            f"quantize: the kernel {path!r} of shape {tuple(x.shape)} stacks its layers on "
            f"axis {at}, where its {q.mode} scales have no axis to carry them through the "
            "stack's loop; it is quantized as one kernel (its layers share their scales) and "
            "runs dequantized ahead of the stack. Stack the parameters on axis 0 or 1 "
            '(`variable_axes={"params": 0}`) to quantize it per layer.'
        )
        return quantize_one(x, 0)
    return q.stacked_to(at)


def quantize_tree(tree: Any, quantize_one: Any, stacked_axes: Any = None) -> Any:
    """Every quantizable leaf of ``tree`` as ``quantize_one(leaf, stacked)`` (a scheme's
    ``quantize``), with the stacked axes that ``stacked_axes`` gives its path (see
    :func:`quantize_stacked`); others (and QuantizedArrays) kept."""
    stacked_of = stack_of(stacked_axes)
    done: list[tuple[str, tuple[int, ...]]] = []

    def leaf(key_path: Any, x: Any) -> Any:
        path = leaf_path(key_path)
        k, at = stacked_of(path)
        if not quantizable_layers(x, k, path):
            return x
        done.append((path, tuple(x.shape)))
        return quantize_stacked(quantize_one, x, k, at, path)

    result = jax.tree_util.tree_map_with_path(leaf, tree, is_leaf=is_quantized)
    warn_maybe_stacked(stacked_axes, done)
    return result
