"""``explain``: which policy every submodule of a Linen model runs under, and why."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import numpy as np

import jmp_policy.linen._modules as m
import jmp_policy.linen._trace as _trace
from jmp_policy._src import matmuls
from jmp_policy._src.explain import format_matmuls, format_rows
from jmp_policy._src.options import OPTION_DEFAULTS, floating_policy_or_map
from jmp_policy._src.resolution import Resolver
from jmp_policy._src.run_report import resolved_rows


def explain(
    module: nn.Module,
    policy_or_map: Any,
    variables: Mapping[str, Any],
    *args: Any,
    **kwargs: Any,
) -> str:
    """A table of the policy every submodule runs under, and why.

    Traces ``module.apply(variables, *args, **kwargs)`` shape-only (nothing is computed)
    and lists, in the order the modules are first called, one row per module path (and one
    per variable that a key of the map names itself): the module's class, the policy
    resolved for it, its source (``key '<key>'``, ``type <Class>`` or ``default``), the
    module's own ``dtype`` attribute when set (it wins over the policy's compute dtype
    unless ``module_dtype="override"``), the stored and compute dtypes of its parameters
    and their bytes stored and in compute. ``rngs=``, ``method=`` and ``mutable=`` in
    ``kwargs`` go to ``module.apply``.

    Args:
        module: a ``flax.linen`` Module instance.
        policy_or_map: as in :func:`apply`.
        variables: the model's variables (arrays, or ``jax.ShapeDtypeStruct`` leaves such
            as ``jax.eval_shape(model.init, ...)`` gives).
        *args: the model's positional arguments (arrays or ``jax.ShapeDtypeStruct``).
        **kwargs: the options of :func:`apply` (``type_policies``, ``module_dtype``,
            ``autocast_exclude``), then the model's keyword arguments.

    Returns:
        The table as a string.

    Examples:
        >>> import jax
        >>> import jax.numpy as jnp
        >>> import flax.linen as nn
        >>> import jmp_policy as jp
        >>> class Model(nn.Module):
        ...     @nn.compact
        ...     def __call__(self, x):
        ...         x = nn.Dense(4, name="body")(x)
        ...         x = nn.LayerNorm(name="norm")(x)
        ...         return nn.Dense(2, dtype=jnp.float32, name="head")(x)
        >>> model = Model()
        >>> x = jnp.ones((1, 3))
        >>> variables = jax.eval_shape(model.init, jax.random.key(0), x)
        >>> print(jp.linen.explain(model, "mixed_bfloat16", variables, x,
        ...                        type_policies=jp.linen.NORM_FLOAT32))
        path    class      policy          source          own  dtype     bytes  c.bytes
        <root>  Model      mixed_bfloat16  default
        body    Dense      mixed_bfloat16  default              f32→bf16     64       32
        norm    LayerNorm  float32         type LayerNorm       f32          32       32
        head    Dense      mixed_bfloat16  default         f32  f32          40       40
        total                                                               136      104
    """
    m.check_module(module)
    m.check_variables(variables)
    resolved = floating_policy_or_map(policy_or_map)
    options = m.options({k: kwargs.pop(k) for k in OPTION_DEFAULTS if k in kwargs})
    apply_kwargs = {
        "rngs": kwargs.pop("rngs", None),
        "method": kwargs.pop("method", None),
        "mutable": kwargs.pop("mutable", False),
    }
    method = apply_kwargs["method"]
    m.check_method(module, method)
    known: dict[str, Any] = {}
    found: list[Resolver] = []
    leaves, treedef = jax.tree.flatten((dict(variables), args, kwargs))
    traced = [isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct)) for x in leaves]

    def trace(*arrays: Any) -> None:
        it = iter(arrays)
        full = [next(it) if flag else x for x, flag in zip(leaves, traced, strict=True)]
        v, a, k = jax.tree.unflatten(treedef, full)

        def call(cast_variables: Any, resolver: Resolver) -> Any:
            return module.apply(
                cast_variables,
                *a,
                **{**apply_kwargs, "method": _trace.method_for(resolver, method)},
                **k,
            )

        found.append(_trace.run_traced(module, resolved, options, known, v, call, method)[1])

    with matmuls.recording() as forms:
        jax.eval_shape(trace, *[x for x, flag in zip(leaves, traced, strict=True) if flag])
    resolver = found[-1]
    resolver.module("", type(module), m.own_dtype(module))
    table = format_rows(resolved_rows(resolver, variables.get("params", {})))
    return table + format_matmuls(forms)
