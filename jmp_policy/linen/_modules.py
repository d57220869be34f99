"""What the Linen glue reads of modules: paths, own dtypes, argument checks, options."""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import numpy as np

from jmp_policy._src import dtypes as dt
from jmp_policy._src.identifiers import get as _get_policy
from jmp_policy._src.options import Island, Options, floating_policy_or_map, make_options

NORM_FLOAT32: Mapping[type, Any] = types.MappingProxyType(
    {
        cls: Island(_get_policy("float32"))
        for cls in (nn.LayerNorm, nn.RMSNorm, nn.BatchNorm, nn.GroupNorm, nn.InstanceNorm)
    }
)
"""``type_policies`` that compute Flax's normalisation layers in float32 (read-only).

Each norm layer's inputs and parameters are cast to float32 and its output goes back to
the compute dtype of the module that called it, so the residual stream stays 16-bit
(Keras's normalization layers and Haiku's ``p=f32,c=f32,o=half`` recipe do the same).
Extend it as ``{**NORM_FLOAT32, MyNorm: NORM_FLOAT32[nn.LayerNorm]}``; a plain
``"float32"`` value instead leaves that layer's output in float32.
"""


# Classes whose own call runs matmuls without holding a kernel (attention's logits):
# compute-carrying modules for the own-dtype warning, with those that hold kernels.
MATMUL_CLASSES: tuple[type, ...] = (nn.MultiHeadDotProductAttention,)


def prepare(
    module: Any, policy_or_map: Any, method: Any, option_kwargs: dict[str, Any]
) -> tuple[Any, Options]:
    """Checks a wrapper's arguments once: ``(policy or map, options)``."""
    check_module(module)
    policies = floating_policy_or_map(policy_or_map)
    opts = options(option_kwargs)
    check_method(module, method)
    return policies, opts


def options(option_kwargs: dict[str, Any]) -> Options:
    """The wrappers' keyword options, validated once."""
    return make_options(nn.Module, "nn.Module", "nn.LayerNorm", **option_kwargs)


def check_module(module: Any) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(
            "`module` must be a flax.linen Module instance (such as `MyModel()`). "
            f"Received: module={module!r} (of type {type(module).__name__})"
        )


def check_method(module: nn.Module, method: Any) -> None:
    if method is None or callable(method):
        return
    if not isinstance(method, str):
        raise TypeError(
            "`method` must be None, the name of a method of the module or a callable "
            f"`fn(module, *args, **kwargs)`. Received: method={method!r} "
            f"(of type {type(method).__name__})"
        )
    if not callable(getattr(module, method, None)):
        raise ValueError(
            f"`method` names no method of {type(module).__name__}. Received: method={method!r}"
        )


def check_variables(variables: Any) -> None:
    if not isinstance(variables, Mapping):
        raise TypeError(
            "`variables` must be a mapping of collections such as {'params': ...}, as "
            f"returned by `init`. Received: variables of type {type(variables).__name__}"
        )


def check_params(variables: Any, action: str) -> None:
    """``variables`` is a mapping of collections holding ``"params"`` (what ``action``,
    such as ``"quantize"``, works on)."""
    check_variables(variables)
    if "params" not in variables:
        raise ValueError(
            f"`variables` has no 'params' collection: nothing to {action}. Received: "
            f"variables with collections {sorted(variables)}"
        )


def path_of(module: nn.Module) -> str:
    return "/".join(str(p) for p in module.path)


def own_dtype(module: Any) -> np.dtype | None:
    """The module's own ``dtype`` attribute when it is set to a floating dtype."""
    return dt.floating_or_none(getattr(module, "dtype", None))
