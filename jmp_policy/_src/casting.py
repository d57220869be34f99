"""Casting pytrees: the one rule every policy, map and wrapper uses.

A leaf is cast iff it is a JAX or NumPy array whose dtype is floating (float8 types
included). Integer, bool and complex arrays, Python scalars, ``None``, strings and other
objects come back untouched; NumPy arrays stay NumPy arrays; a leaf already in the target
dtype comes back as the same object. This is jmp's rule.
"""

from __future__ import annotations

from typing import Any, TypeVar

import jax
import numpy as np

from jmp_policy._src import dtypes as dt
from jmp_policy._src import quantization
from jmp_policy._src.tree_paths import check_depth

T = TypeVar("T")


def should_cast(x: Any, dtype: np.dtype) -> bool:
    """Whether the casting rule casts ``x`` to ``dtype``."""
    return isinstance(x, (jax.Array, np.ndarray)) and x.dtype != dtype and dt.is_floating(x.dtype)


def cast_leaf(x: Any, dtype: np.dtype) -> Any:
    """Casts one leaf by the casting rule (``astype`` keeps a sharded array's sharding)."""
    return x.astype(dtype) if should_cast(x, dtype) else x


def cast_tree(tree: T, dtype: np.dtype) -> T:
    """Casts every leaf of ``tree`` by the casting rule (QuantizedArrays kept whole)."""
    check_depth(tree)
    return jax.tree.map(lambda x: cast_leaf(x, dtype), tree, is_leaf=quantization.is_quantized)


def compute_leaf(x: Any, dtype: np.dtype) -> Any:
    """One leaf to a compute dtype: a QuantizedArray dequantized, others by the rule."""
    if quantization.is_quantized(x):
        return x.dequantize(dtype)
    return cast_leaf(x, dtype)


def compute_tree(tree: T, dtype: np.dtype) -> T:
    """Every leaf of ``tree`` to a compute dtype (:func:`compute_leaf`)."""
    check_depth(tree)
    return jax.tree.map(lambda x: compute_leaf(x, dtype), tree, is_leaf=quantization.is_quantized)


def half_dtype() -> np.dtype:
    """jmp's ``half_dtype``: here always bfloat16, whatever the device.

    jmp returns float16 off TPU, which makes one program mean different things on
    different machines; ask for float16 by name when you want it.

    Examples:
        >>> import jmp_policy as jp
        >>> jp.half_dtype()
        dtype(bfloat16)
    """
    return dt.canonicalize_dtype("bfloat16")


def cast_to_half(tree: T) -> T:
    """jmp's ``cast_to_half``: every floating array leaf to :func:`half_dtype` (bfloat16).

    Examples:
        >>> import jax.numpy as jnp
        >>> import jmp_policy as jp
        >>> jp.cast_to_half({"w": jnp.ones(2), "step": jnp.array(1)})["w"].dtype
        dtype(bfloat16)
    """
    return cast_tree(tree, half_dtype())


def cast_to_full(tree: T) -> T:
    """jmp's ``cast_to_full``: every floating array leaf to float32.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jmp_policy as jp
        >>> jp.cast_to_full({"w": jnp.ones(2, jnp.bfloat16)})["w"].dtype
        dtype('float32')
    """
    return cast_tree(tree, dt.canonicalize_dtype("float32"))
