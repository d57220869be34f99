"""What a pytree holds, in bytes per dtype: parameters and optimizer states side by side."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


def _leaf_bytes(leaf: Any) -> tuple[str, int] | None:
    """``(dtype name, bytes)`` of an array leaf (a PRNG key as its raw data), else None."""
    dtype = getattr(leaf, "dtype", None)
    shape = getattr(leaf, "shape", None)
    if dtype is None or shape is None:
        return None
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        leaf = jax.random.key_data(leaf)
        dtype, shape = leaf.dtype, leaf.shape
    dtype = np.dtype(dtype)
    return dtype.name, int(np.prod(shape, dtype=np.int64)) * dtype.itemsize


def tree_bytes(tree: Any) -> dict[str, int]:
    """The bytes of a pytree's arrays, per dtype name, largest first.

    Counts what the arrays hold (``size * itemsize``; ``jnp.int4`` counts a byte per value,
    as NumPy reports it), whatever their sharding: the global array's bytes. Leaves that are
    not arrays (Python numbers, ``None``) are skipped; PRNG keys count as their raw data.
    Works on concrete arrays and on ``jax.ShapeDtypeStruct`` trees (``jax.eval_shape``),
    so an optimizer's state can be sized without creating it.

    Args:
        tree: any pytree (parameters, an optax state, ``(params, opt_state)``).

    Returns:
        A dict from dtype name to bytes; ``sum(...values())`` is the total.

    Examples:
        >>> import jax.numpy as jnp
        >>> import optax
        >>> import jmp_policy as jp
        >>> params = {"w": jnp.ones((256, 256), jnp.bfloat16)}
        >>> opt = jp.stochastic_rounding(optax.adam(1e-3), key=0, moment_dtype="bfloat16")
        >>> jp.tree_bytes((params, opt.init(params)))
        {'bfloat16': 393216, 'uint32': 8, 'int32': 4}
    """
    totals: dict[str, int] = {}
    for leaf in jax.tree.leaves(tree):
        found = _leaf_bytes(leaf)
        if found is not None:
            totals[found[0]] = totals.get(found[0], 0) + found[1]
    return dict(sorted(totals.items(), key=lambda kv: (-kv[1], kv[0])))
