"""The batches ``calibrate`` and ``search_map`` run the user's model on, checked.

A batch is the model's call arguments (a tuple per call, or one array). What the model
raises on a batch (a Flax shape error, a JAX ``dot_general`` shape error, an
``IndexError`` from a layer given ``None``) is re-raised naming the batch
(``batches[1]``) and its shapes, the model's own error chained; a batch holding NaN is
refused before it turns every statistic or score into NaN.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def check_bool(value: Any, argument: str, meaning: str) -> bool:
    """``value`` when it is a bool (NumPy's included); ``TypeError`` naming ``argument``
    otherwise (``"yes"`` is truthy, not a yes).

    Examples:
        >>> check_bool(True, "jit", "compile the passes")
        True
        >>> check_bool("yes", "jit", "compile the passes")
        Traceback (most recent call last):
        ...
        TypeError: `jit` must be True (compile the passes) or False. Received: jit='yes' (of type str)
    """
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(
            f"`{argument}` must be True ({meaning}) or False. "
            f"Received: {argument}={value!r} (of type {type(value).__name__})"
        )
    return bool(value)


def describe(batch: Any) -> str:
    """A batch's structure with its arrays as ``float32[4, 8]`` (no values)."""

    def one(leaf: Any) -> str:
        shape, dtype = getattr(leaf, "shape", None), getattr(leaf, "dtype", None)
        if shape is None or dtype is None:
            text = repr(leaf)
            return text if len(text) <= 40 else text[:37] + "..."
        return f"{np.dtype(dtype).name}{list(shape)}"

    leaves, tree = jax.tree.flatten(batch, is_leaf=lambda x: x is None)
    return str(jax.tree.unflatten(tree, [_Shown(one(leaf)) for leaf in leaves]))


class _Shown(str):
    """A string shown without quotes inside a container's repr."""

    def __repr__(self) -> str:
        return str(self)


BATCH_HINT = (
    "Each batch must be the model's call arguments (a tuple per call, or one array) of the "
    "shapes and dtypes it takes."
)


@contextlib.contextmanager
def blaming(argument: str, batch: Any, caller: str, hint: str = BATCH_HINT) -> Iterator[None]:
    """Errors the model raises on ``batch`` re-raised naming ``argument`` (``batches[0]``)
    and the batch's shapes, with ``hint``; a ``TypeError`` stays one, anything else
    becomes a ``ValueError``, the model's error chained."""
    try:
        yield
    except (TypeError, ValueError, IndexError, KeyError, AttributeError) as e:
        raise _wrapped(e, argument, batch, caller, hint) from e
    except Exception as e:  # Flax's errors (ScopeParamShapeError...) derive from Exception
        if type(e).__module__.split(".")[0] not in ("flax", "jax", "jaxlib"):
            raise
        raise _wrapped(e, argument, batch, caller, hint) from e


def _wrapped(e: Exception, argument: str, batch: Any, caller: str, hint: str) -> Exception:
    if f"Received: {argument}" in str(e):  # already said by an inner check
        return e
    cls = TypeError if isinstance(e, TypeError) else ValueError
    return cls(
        f"{caller}: the model failed on `{argument}` ({type(e).__name__}: {e}). {hint} "
        f"Received: {argument}={describe(batch)}"
    )


def check_no_nan(batches: Any, caller: str) -> None:
    """``ValueError`` naming the first batch that holds NaN in a floating array (its
    statistics or scores would all be NaN). Infinities pass: an additive mask's ``-inf``
    is a model input."""
    for i, batch in enumerate(batches):
        for path, leaf in jax.tree_util.tree_flatten_with_path(batch)[0]:
            dtype = getattr(leaf, "dtype", None)
            if dtype is None or not jnp.issubdtype(dtype, jnp.inexact):
                continue
            if isinstance(leaf, jax.core.Tracer):
                continue
            count = int(jnp.isnan(leaf).sum())
            if count:
                where = f"batches[{i}]{jax.tree_util.keystr(path)}"
                raise ValueError(
                    f"{caller}: `{where}` holds {count} NaN value(s): every statistic or "
                    "score computed from it would be NaN. Remove those examples or replace "
                    f"the NaNs. Received: batches[{i}]={describe(batch)}"
                )
