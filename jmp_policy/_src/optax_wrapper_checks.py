"""The checks of the optax wrappers' arguments, and :func:`~jmp_policy.loss_scaling`'s
float16 warning."""

from __future__ import annotations

import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jmp_policy._src.dtypes import DTYPE_NAMES, bounded_repr, did_you_mean, dtype_or_none
from jmp_policy._src.loss_scale import (
    DynamicLossScale,
    LossScale,
    NoOpLossScale,
    StaticLossScale,
)
from jmp_policy._src.user_warnings import user_stacklevel

LOSS_SCALE_TYPES = (NoOpLossScale, StaticLossScale, DynamicLossScale)
_LOSS_SCALE_STRINGS = ("dynamic", "auto", "none")


def resolve_loss_scale(loss_scale: Any) -> LossScale:
    """``loss_scaling``'s ``loss_scale`` argument as a loss-scale object."""
    if isinstance(loss_scale, LOSS_SCALE_TYPES):
        return loss_scale
    if isinstance(loss_scale, str):
        key = loss_scale.lower()
        if key == "dynamic":
            return DynamicLossScale()
        if key == "none":
            return NoOpLossScale()
        if key == "auto":
            from jmp_policy._src.global_state import dtype_policy

            if dtype_policy().compute_dtype == np.float16:
                return DynamicLossScale()
            return NoOpLossScale()
        raise ValueError(
            f"Unknown `loss_scale` {loss_scale!r}; expected one of "
            f"{', '.join(repr(s) for s in _LOSS_SCALE_STRINGS)}, a positive number (a static "
            f"scale) or a loss-scale object (NoOpLossScale, StaticLossScale, DynamicLossScale)."
        )
    if not isinstance(loss_scale, bool) and isinstance(
        loss_scale, (int, float, np.integer, np.floating)
    ):
        return StaticLossScale(loss_scale)  # validated there, quoting the value as given
    if (
        isinstance(loss_scale, (jax.Array, np.ndarray))
        and not isinstance(loss_scale, jax.core.Tracer)
        and loss_scale.shape == ()
        and (
            jnp.issubdtype(loss_scale.dtype, jnp.floating)
            or jnp.issubdtype(loss_scale.dtype, jnp.integer)
        )
    ):  # `jnp.float32(2**15)` is a jax array, not a NumPy scalar
        return StaticLossScale(float(loss_scale))
    raise TypeError(
        f"Invalid `loss_scale` argument. Expected 'dynamic', 'auto', 'none', a positive number "
        f"or a loss-scale object (NoOpLossScale, StaticLossScale, DynamicLossScale). Received: "
        f"loss_scale={loss_scale!r} (of type {type(loss_scale).__name__})"
    )


def check_axis_name(axis_name: Any) -> str | tuple[str, ...] | None:
    """``axis_name`` as ``psum`` takes it: ``None``, a name, or a tuple of names."""
    if axis_name is None or isinstance(axis_name, str):
        return axis_name
    if (
        isinstance(axis_name, (tuple, list))
        and axis_name
        and all(isinstance(name, str) for name in axis_name)
    ):
        return tuple(axis_name)
    raise TypeError(
        "`axis_name` must be None (plain `jit`), the name of a `shard_map`/`pmap` axis such as "
        "'batch', or a non-empty tuple of such names. Received: "
        f"axis_name={axis_name!r} (of type {type(axis_name).__name__})"
    )


def check_inner(inner: Any) -> None:
    """Raises unless ``inner`` is an optax transformation (with ``init`` and ``update``)."""
    if callable(getattr(inner, "init", None)) and callable(getattr(inner, "update", None)):
        return
    if isinstance(inner, str):
        hint = "; pass the transformation itself (`optax.adam(1e-3)`), not its name"
    elif callable(inner):
        name = getattr(inner, "__name__", "it")
        hint = f"; did you mean to call it, `{name}(learning_rate)`?"
    else:
        hint = ""
    raise TypeError(
        f"`inner` must be an optax GradientTransformation (such as `optax.adam(1e-3)`). "
        f"Received: inner={inner!r} (of type {type(inner).__name__}){hint}"
    )


def float16_paths(tree: Any) -> list[str]:
    """The paths of ``tree``'s float16 leaves."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [
        jax.tree_util.keystr(path, simple=True, separator="/") or "<root>"
        for path, x in leaves
        if getattr(x, "dtype", None) == np.float16
    ]


def warn_float16(paths: list[str]) -> None:
    """Warns that float16 gradients (at ``paths``) underflow when unscaled."""
    shown = ", ".join(repr(p) for p in paths[:3]) + (", ..." if len(paths) > 3 else "")
    warnings.warn(
        f"`loss_scaling` got float16 gradients ({len(paths)} "
        f"{'leaf' if len(paths) == 1 else 'leaves'}: {shown}), so the "
        f"parameters are stored in float16 with no float32 master weights. Unscaled back to "
        f"float16, every gradient below float16's smallest subnormal (6e-8) is 0 whatever the "
        f"loss scale. Keep the parameters in float32 and compute in float16: the policy "
        f'"mixed_float16".',
        UserWarning,
        stacklevel=user_stacklevel(),
    )


_MOMENT_DTYPES = ("float32", "bfloat16", "float16", "float64")


def check_moment_dtype(moment_dtype: Any, function: str) -> np.dtype:
    """``moment_dtype`` of ``function`` as a NumPy dtype: a float of 16 bits or more."""
    dtype = dtype_or_none(moment_dtype)
    if dtype is None or dtype.name not in _MOMENT_DTYPES:
        hint = did_you_mean(moment_dtype, DTYPE_NAMES) if isinstance(moment_dtype, str) else ""
        error = TypeError if dtype is None and not isinstance(moment_dtype, str) else ValueError
        raise error(
            f"`moment_dtype` of `{function}` must be a float dtype of 16 bits or more: one of "
            f"{', '.join(_MOMENT_DTYPES)} (a name, a NumPy or jnp dtype).{hint} Received: "
            f"moment_dtype={bounded_repr(moment_dtype)} (of type {type(moment_dtype).__name__})"
        )
    return dtype


def resolve_key(key: Any) -> tuple[jax.Array, Any]:
    """``stochastic_rounding``'s ``key`` as (raw ``uint32`` key data, the key's impl)."""
    if isinstance(key, (int, np.integer)) and not isinstance(key, bool):
        key = jax.random.key(int(key))
    elif isinstance(key, (jax.Array, np.ndarray)) and key.dtype == np.uint32 and key.shape == (2,):
        key = jax.random.wrap_key_data(jnp.asarray(key))  # a raw `jax.random.PRNGKey(0)`
    if not (isinstance(key, jax.Array) and jnp.issubdtype(key.dtype, jax.dtypes.prng_key)):
        raise TypeError(
            "`key` of `stochastic_rounding` must be a PRNG key (`jax.random.key(0)`, or a raw "
            f"`jax.random.PRNGKey(0)`) or an int seed. Received: key={bounded_repr(key)} "
            f"(of type {type(key).__name__})"
        )
    if key.shape != ():
        raise ValueError(
            "`key` of `stochastic_rounding` must be one key, of shape (); pick one "
            f"(`keys[0]`). Received: key of shape {key.shape}: {bounded_repr(key)}"
        )
    return jax.random.key_data(key), jax.random.key_impl(key)
