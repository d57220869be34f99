"""What the NNX glue reads of modules: paths, own dtypes, methods, options."""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import Any

import numpy as np
from flax import nnx

from jmp_policy._src import dtypes as dt
from jmp_policy._src.framework.policy_class import method_of
from jmp_policy._src.identifiers import get as _get_policy
from jmp_policy._src.options import Island, Options, floating_policy_or_map, make_options

NORM_FLOAT32: Mapping[type, Any] = types.MappingProxyType(
    {
        cls: Island(_get_policy("float32"))
        for cls in (nnx.LayerNorm, nnx.RMSNorm, nnx.BatchNorm, nnx.GroupNorm, nnx.InstanceNorm)
    }
)
"""``type_policies`` that compute NNX's normalisation layers in float32 (read-only).

Each norm layer's inputs and parameters are cast to float32 and its output goes back to
the compute dtype of the module that called it, so the residual stream stays 16-bit.
Extend it as ``{**NORM_FLOAT32, MyNorm: NORM_FLOAT32[nnx.LayerNorm]}``.
"""


# Classes whose own call runs matmuls without holding a kernel (attention's logits):
# compute-carrying modules for the own-dtype warning, with those that hold kernels.
MATMUL_CLASSES: tuple[type, ...] = (nnx.MultiHeadAttention,)


def options(option_kwargs: dict[str, Any]) -> Options:
    """The wrappers' keyword options, validated once."""
    return make_options(nnx.Module, "nnx.Module", "nnx.LayerNorm", **option_kwargs)


def prepare(model: Any, policy_or_map: Any, option_kwargs: dict[str, Any]) -> tuple[Any, Options]:
    """Checks a wrapper's arguments once: ``(policy or map, options)`` (as Linen's)."""
    check_model(model)
    return floating_policy_or_map(policy_or_map), options(option_kwargs)


def is_nnx_object(x: Any) -> bool:
    """Modules, Rngs and Variables passed as arguments are passed as they are: rebuilding
    them through a tree map would cut them off from the graph the caller holds."""
    return isinstance(x, (nnx.Pytree, nnx.Variable))


def own_dtype(module: Any) -> np.dtype | None:
    """The module's own ``dtype`` attribute when it is set to a floating dtype."""
    dtype = dt.floating_or_none(getattr(module, "dtype", None))
    if isinstance(module, nnx.Embed) and dtype == dt.floating_or_none(module.param_dtype):
        return None  # `nnx.Embed` fills an unset `dtype` in from its `param_dtype`.
    return dtype


def filled_dtype(module: Any) -> bool:
    """Whether the module's ``dtype`` was filled in by NNX rather than set by the user
    (``nnx.Embed`` copies an unset ``dtype`` from its ``param_dtype``)."""
    return (
        isinstance(module, nnx.Embed)
        and own_dtype(module) is None
        and (dt.floating_or_none(getattr(module, "dtype", None)) is not None)
    )


def path_of(parts: tuple[Any, ...]) -> str:
    return "/".join(str(p) for p in parts)


def check_model(model: Any) -> None:
    if not isinstance(model, nnx.Module):
        raise TypeError(
            "`model` must be an `nnx.Module`. Received: "
            f"model={model!r} (of type {type(model).__name__})"
        )


def methods_for(model: nnx.Module, method: Any) -> tuple[str, ...]:
    """The method names wrapped on every submodule, after checking ``method``."""
    if isinstance(method, str):
        if method_of(type(model), method) is None:
            raise ValueError(
                f"`method` must name a method of {type(model).__name__}. Received: "
                f"method={method!r}"
            )
        return ("__call__",) if method == "__call__" else ("__call__", method)
    if callable(method):
        return ("__call__",)
    raise TypeError(
        "`method` must be a method name such as '__call__' or a function "
        f"fn(model, *args, **kwargs). Received: method={method!r}"
    )
