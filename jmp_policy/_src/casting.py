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

T = TypeVar("T")


def should_cast(x: Any, dtype: np.dtype) -> bool:
    """Whether the casting rule casts ``x`` to ``dtype``."""
    return isinstance(x, (jax.Array, np.ndarray)) and x.dtype != dtype and dt.is_floating(x.dtype)


def cast_leaf(x: Any, dtype: np.dtype) -> Any:
    """Casts one leaf by the casting rule (``astype`` keeps a sharded array's sharding)."""
    return x.astype(dtype) if should_cast(x, dtype) else x


def cast_tree(tree: T, dtype: np.dtype) -> T:
    """Casts every leaf of ``tree`` by the casting rule."""
    return jax.tree.map(lambda x: cast_leaf(x, dtype), tree)
