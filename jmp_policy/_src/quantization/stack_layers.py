"""A stacked ``QuantizedArray`` kernel read one layer at a time, inside its stack's loop.

A layer stack (``nn.scan``, ``nnx.scan``, vmapped layers) hands each layer a slice of its
stacked kernel ``[*depth, in, out]``. A stacked :class:`~jmp_policy.QuantizedArray` is
handed to the loop as its data arrays, which the loop slices like any stacked parameter:
the integer values (as the kernel itself), the scales, the zero points where there are
some and an AWQ kernel's input scale
(as leaves beside it, named by :func:`leaf_name`). The body rebuilds its own layer's
kernel from its slices (:func:`layer_of`) and runs the matmul an unstacked layer runs, so
the only weight bytes the loop reads are the quantized ones.

Nothing here knows Flax.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from jmp_policy._src.quantization.awq import InputScaledArray
from jmp_policy._src.quantization.quantized_array import QuantizedArray
from jmp_policy._src.quantization.quantized_tree import make

# Beside a kernel ``kernel``: ``kernel`` + this + the field (a name no Flax layer makes).
_SEPARATOR = ":jmp_policy_"


def leaf_name(kernel_name: str, field: str) -> str:
    """The name of the leaf beside ``kernel_name`` that holds its ``field`` (``"scale"``,
    ``"zero_point"``, ``"input_scale"``)."""
    return f"{kernel_name}{_SEPARATOR}{field}"


def is_extra_leaf(name: str) -> bool:
    """Whether the parameter ``name`` (its last path part) is a leaf :func:`leaf_name` made."""
    return _SEPARATOR in name


def servable(q: Any) -> bool:
    """Whether the stacked kernel ``q`` can be read a layer at a time (a stacked
    ``QuantizedArray``; the packed int4 layout of earlier versions has no stacked form)."""
    return isinstance(q, QuantizedArray) and q.stacked > 0 and not q.packed


def _stacked_leaves(q: QuantizedArray) -> dict[str, Any]:
    """The data of ``q`` beside its values, stacked axes leading: ``{field: array}``."""
    leaves = {"scale": q.scale}
    if q.zero_point is not None:
        leaves["zero_point"] = q.zero_point
    if isinstance(q, InputScaledArray):
        leaves["input_scale"] = q.input_scale
    return leaves


def extra_leaves(q: QuantizedArray) -> dict[str, Any]:
    """The data of ``q`` beside its values, ``{field: stacked array}``, with its stacked
    axes where the loop slices them: where the values have theirs (``q.stacked_at``)."""
    k, at = q.stacked, q.stacked_at
    leaves = _stacked_leaves(q)
    if not at:
        return leaves
    return {f: jnp.moveaxis(x, range(k), range(at, at + k)) for f, x in leaves.items()}


def can_stack_at(q: QuantizedArray, at: int) -> bool:
    """Whether the leading-stacked ``q``'s scales have the axes to carry its stacked ones
    at ``at`` (int8's per-channel scale ``[depth, n]`` has one axis after them: at most 1)."""
    return all(x.ndim >= at + q.stacked for x in _stacked_leaves(q).values())


def layer_shape(q: QuantizedArray) -> tuple[int, ...]:
    """The shape of one layer's kernel (``q``'s shape without its stacked axes)."""
    k, at = q.stacked, q.stacked_at
    return tuple(q.shape[:at]) + tuple(q.shape[at + k :])


def layer_of(q: QuantizedArray, values: Any, leaves: dict[str, Any]) -> QuantizedArray:
    """One layer of the stacked kernel ``q``, from its slices: ``values`` and the
    :func:`extra_leaves` (by field) as the loop body sees them.

    Raises:
        ValueError: a slice is not one layer's (the loop sliced other axes than the
            leading stacked ones).
    """
    k = q.stacked
    want = {"values": (values, layer_shape(q))}
    for field, stacked in _stacked_leaves(q).items():
        want[field] = (leaves.get(field), tuple(stacked.shape[k:]))
    for field, (got, shape) in want.items():
        if tuple(getattr(got, "shape", ())) != shape:
            raise ValueError(
                f"A layer of the stacked quantized kernel {q!r} saw its {field} as shape "
                f"{tuple(getattr(got, 'shape', ()))}, not one layer's {shape}: the stack "
                f"must slice its parameters along axis {q.stacked_at} (`variable_axes="
                f'{{"params": {q.stacked_at}}}`), as the kernel was quantized.'
            )
    fields = (values, leaves["scale"], q.mode, q.block_size, layer_shape(q), q.original_dtype)
    zero = leaves.get("zero_point") if q.zero_point is not None else None
    if isinstance(q, InputScaledArray):
        return make(
            InputScaledArray, *fields, 0, input_scale=leaves["input_scale"], zero_point=zero
        )
    return make(QuantizedArray, *fields, 0, zero_point=zero)
