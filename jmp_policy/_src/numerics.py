"""Tree numerics: which leaves are floating, finiteness, selection and scaling of whole pytrees.

The numerical building blocks of loss scaling (scaling, finiteness, selection), and the
floating-leaf test that diagnostics and the run report use; float8 scaling has its own
arithmetic (optax keeps its own ``numerics.py`` the same way). Everything here works on
plain pytrees, under ``jit`` with no host synchronisation, and leaves non-floating leaves
(integers, bools, ``None``, other objects) alone.
"""

from __future__ import annotations

import functools
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jmp_policy._src.tree_paths import check_depth

T = TypeVar("T")


def is_float_leaf(x: Any) -> bool:
    """True for Python floats/complex and arrays (or shape structs) of an inexact dtype."""
    if isinstance(x, (float, complex)):
        return True
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        return False
    return bool(jnp.issubdtype(dtype, jnp.inexact))


def scaling_dtype(dtype: Any) -> np.dtype:
    """The dtype a leaf is scaled in: float32, or the leaf's own dtype when that is wider."""
    dtype = np.dtype(dtype)
    if dtype.itemsize > 4 or jnp.issubdtype(dtype, jnp.complexfloating):
        return dtype
    return np.dtype(np.float32)


def scale_tree(tree: T, scale: ArrayLike) -> T:
    """Multiplies every floating leaf by ``scale`` in float32 (or wider); 16-bit leaves come
    back float32, so a scaled loss cannot overflow its own dtype."""
    scale = jnp.asarray(scale, jnp.float32)

    def scale_leaf(x: Any) -> Any:
        if not is_float_leaf(x):
            return x
        x = jnp.asarray(x)
        dtype = scaling_dtype(x.dtype)
        return x.astype(dtype) * scale.astype(dtype)

    return jax.tree.map(scale_leaf, tree)


def unscale_tree(tree: T, scale: ArrayLike) -> T:
    """Divides every floating leaf by ``scale``, computing in float32 (or wider) and returning
    each leaf in its own dtype: one scalar division, then a multiply per element."""
    inverse = 1.0 / jnp.asarray(scale, jnp.float32)

    def unscale_leaf(x: Any) -> Any:
        if not is_float_leaf(x):
            return x
        x = jnp.asarray(x)
        dtype = scaling_dtype(x.dtype)
        return (x.astype(dtype) * inverse.astype(dtype)).astype(x.dtype)

    return jax.tree.map(unscale_leaf, tree)


def scalar_bool(pred: Any, argument: str) -> jax.Array:
    """``pred`` as a scalar bool array; ``TypeError``/``ValueError`` naming ``argument``."""
    shape = np.shape(pred)
    dtype = getattr(pred, "dtype", None)
    if dtype is None and isinstance(pred, bool):
        dtype = np.dtype(bool)
    if dtype is None or np.dtype(dtype) != np.bool_:
        raise TypeError(
            f"`{argument}` must be a scalar bool array (such as the result of `all_finite`). "
            f"Received: {argument}={pred!r}"
        )
    if shape != ():
        raise ValueError(
            f"`{argument}` must be a scalar bool array, not of shape {shape}. Received: "
            f"{argument}={pred!r}"
        )
    return jnp.asarray(pred)


def all_finite(tree: Any) -> jax.Array:
    """Whether every floating (and complex) leaf of ``tree`` is free of inf and NaN.

    Other leaves (integers, bools, ``None``, objects) are ignored, so a tree with no floating
    leaf gives ``True``. Computed with ``isfinite``, which keeps its meaning under fast-math
    compilation (``XLA_FLAGS=--xla_cpu_enable_fast_math=true`` folds identities such as
    ``x - x == 0``, with which a NaN would pass). One read of every leaf; XLA fuses any
    elementwise producer (an unscaling) into the reduction. Under ``jit`` with sharded
    arrays the reduction is global (XLA adds the cross-device step); inside
    ``shard_map``/``pmap`` it sees only the local shard: combine it across devices yourself
    (``lax.pmin``), or let :func:`jmp_policy.loss_scaling` do it with ``axis_name``.

    Args:
        tree: any pytree.

    Returns:
        A scalar bool array. Nothing waits for the device.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jmp_policy as jp
        >>> jp.all_finite({"a": jnp.ones(3), "step": 3})
        Array(True, dtype=bool)
        >>> jp.all_finite([jnp.ones(3), jnp.array([1.0, jnp.nan])])
        Array(False, dtype=bool)
    """
    check_depth(tree)
    result = jnp.array(True)
    for x in jax.tree.leaves(tree):
        if is_float_leaf(x):
            result = result & jnp.all(jnp.isfinite(jnp.asarray(x)))
    return result


def select_tree(pred: jax.Array, on_true: T, on_false: T) -> T:
    """Picks ``on_true`` or ``on_false`` leaf by leaf, with no host synchronisation.

    Works under ``jit`` (it compiles to elementwise selects that XLA fuses into their
    producers) and with sharded arrays (each leaf keeps its sharding).

    Args:
        pred: a scalar bool array.
        on_true: a pytree.
        on_false: a pytree of the same structure.

    Returns:
        ``on_true`` where ``pred`` holds, else ``on_false``.

    Raises:
        TypeError: ``pred`` is not a bool array.
        ValueError: ``pred`` is not a scalar, or the two trees differ in structure.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jmp_policy as jp
        >>> jp.select_tree(jnp.array(False), {"a": jnp.ones(2)}, {"a": jnp.zeros(2)})
        {'a': Array([0., 0.], dtype=float32)}
    """
    pred = scalar_bool(pred, "pred")
    check_depth(on_true, "on_true")
    check_depth(on_false, "on_false")
    true_def = jax.tree.structure(on_true)
    false_def = jax.tree.structure(on_false)
    if true_def != false_def:  # type: ignore[operator]
        raise ValueError(
            f"`on_true` and `on_false` must have the same tree structure. Received: "
            f"{true_def} and {false_def}"
        )
    return jax.tree.map(functools.partial(jnp.where, pred), on_true, on_false)
