"""What the NNX glue reads of modules: paths, own dtypes, methods, options."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx

from jmp_policy._src import dtypes as dt
from jmp_policy._src.framework.policy_class import method_of
from jmp_policy._src.options import Options, float32_islands, floating_policy_or_map, make_options
from jmp_policy._src.quantization.quantized_matmul import JNP_EINSUM

NORM_FLOAT32: Mapping[type, Any] = float32_islands(
    nnx.LayerNorm, nnx.RMSNorm, nnx.BatchNorm, nnx.GroupNorm, nnx.InstanceNorm
)
"""``type_policies`` that compute NNX's normalisation layers in float32 (read-only).

Each norm layer's inputs and parameters are cast to float32 and its output goes back to
the compute dtype of the module that called it, so the residual stream stays 16-bit.
Extend it as ``{**NORM_FLOAT32, MyNorm: NORM_FLOAT32[nnx.LayerNorm]}``.
"""


# Classes whose own call runs matmuls without holding a kernel (attention's logits):
# compute-carrying modules for the own-dtype warning, with those that hold kernels.
MATMUL_CLASSES: tuple[type, ...] = (nnx.MultiHeadAttention,)


def prepare(model: Any, policy_or_map: Any, option_kwargs: dict[str, Any]) -> tuple[Any, Options]:
    """Checks a wrapper's arguments once: ``(policy or map, options)`` (as Linen's)."""
    check_model(model)
    policies = floating_policy_or_map(policy_or_map)
    return policies, make_options(nnx.Module, "nnx.Module", "nnx.LayerNorm", **option_kwargs)


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
    dtype = dt.floating_or_none(getattr(module, "dtype", None))
    return isinstance(module, nnx.Embed) and dtype is not None and own_dtype(module) is None


def path_of(parts: tuple[Any, ...]) -> str:
    return "/".join(str(p) for p in parts)


def replacement(module: Any) -> str | None:
    """The attribute holding the module's matmul, when routable (NNX's own matmul: an
    ``nnx.Linear`` whose ``dot_general`` is JAX's, an ``nnx.LinearGeneral`` whose user set
    neither ``dot_general`` nor ``dot_general_cls``, an ``nnx.Einsum`` whose ``einsum_op``
    is ``jnp.einsum``)."""
    if isinstance(module, nnx.Linear):
        if module.dot_general is jax.lax.dot_general:
            return "dot_general"
    elif isinstance(module, nnx.LinearGeneral):
        if module.dot_general is None and module.dot_general_cls is None:
            return "dot_general"
    elif isinstance(module, nnx.Einsum) and module.einsum_op is JNP_EINSUM:
        return "einsum_op"
    return None


def routable(module: Any) -> bool:
    """Whether a quantized policy reaches the module's matmul (:func:`replacement`)."""
    return replacement(module) is not None


def own_shape(module: Any) -> tuple[int, ...] | None:
    """One layer's kernel shape, for an ``nnx.Linear``, ``nnx.LinearGeneral``,
    ``nnx.Einsum`` or ``nnx.Conv`` (``None`` for any other module: its own axes are
    unknown)."""
    if isinstance(module, nnx.Linear):
        return (module.in_features, module.out_features)
    if isinstance(module, nnx.LinearGeneral):
        batch = tuple(dict(module.batch_axis).values())
        return (*batch, *module.in_features, *module.out_features)
    if isinstance(module, (nnx.Einsum, nnx.Conv)):
        return tuple(module.kernel_shape)
    return None


def kernel_shape(module: Any) -> tuple[int, ...]:
    kernel = getattr(module, "kernel", None)
    return tuple(getattr(kernel, "shape", ()))


def stacked(module: Any) -> tuple[int, ...]:
    """The leading axes of a layer created stacked (``nnx.vmap`` of its constructor, for
    ``nnx.scan`` over layers): its kernel's axes before the layer's own (:func:`own_shape`;
    ``()`` for other modules)."""
    own, shape = own_shape(module), kernel_shape(module)
    return () if own is None else shape[: max(len(shape) - len(own), 0)]


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
