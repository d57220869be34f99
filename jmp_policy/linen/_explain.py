"""``explain``: which policy every submodule of a Linen model runs under, and why."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax.linen as nn

from jmp_policy._src.framework import entry_points
from jmp_policy._src.framework.shared_docs import fill
from jmp_policy._src.kv_cache import report as kv_report
from jmp_policy._src.kv_cache.hook import CACHE_NAMES
from jmp_policy._src.options import OPTION_DEFAULTS, floating_policy_or_map
from jmp_policy.linen._adapter import ADAPTER, Bound
from jmp_policy.linen._modules import check_method, check_module, check_variables, options


@fill
def explain(
    module: nn.Module,
    policy_or_map: Any,
    variables: Mapping[str, Any],
    *args: Any,
    **kwargs: Any,
) -> str:
    """A table of the policy every submodule runs under, and why.

    Traces ``module.apply(variables, *args, **kwargs)`` shape-only, listing the modules in
    the order they are first called.
    {explain_rows}

    Args:
        module: a ``flax.linen`` Module instance.
        policy_or_map: as in :func:`apply`.
        variables: the model's variables (arrays, or ``jax.ShapeDtypeStruct`` leaves such
            as ``jax.eval_shape(model.init, ...)`` gives).
        *args: the model's positional arguments (arrays or ``jax.ShapeDtypeStruct``).
        **kwargs: the options of :func:`apply`; ``rngs=``, ``method=`` and ``mutable=`` for
            ``module.apply``; the model's keyword arguments; and
            {explain_calibration}

    Returns:
        The table as a string.

    Examples:
        >>> import jax, jax.numpy as jnp, flax.linen as nn
        >>> import jmp_policy as jp
        >>> model = nn.Sequential([nn.Dense(4), nn.LayerNorm(), nn.Dense(2, dtype=jnp.float32)])
        >>> x = jnp.ones((1, 3))
        >>> variables = jax.eval_shape(model.init, jax.random.key(0), x)
        >>> print(jp.linen.explain(model, "mixed_bfloat16", variables, x,
        ...                        type_policies=jp.linen.NORM_FLOAT32))
        path      class       policy          source          own  dtype     bytes  c.bytes
        <root>    Sequential  mixed_bfloat16  default
        layers_0  Dense       mixed_bfloat16  default              f32→bf16     64       32
        layers_1  LayerNorm   float32         type LayerNorm       f32          32       32
        layers_2  Dense       mixed_bfloat16  default         f32  f32          40       40
        total                                                                  136      104
        bytes: as stored; c.bytes: as the compute reads them (K = 1024, M = 1024 K)
    """
    check_module(module)
    check_variables(variables)
    calibration = kwargs.pop("calibration", None)
    policies = floating_policy_or_map(policy_or_map)
    opts = options({k: kwargs.pop(k) for k in OPTION_DEFAULTS if k in kwargs})
    apply_kwargs = {"rngs": kwargs.pop("rngs", None), "mutable": kwargs.pop("mutable", False)}
    method = kwargs.pop("method", None)
    check_method(module, method)
    text: list[str] = []

    def trace(given: Any) -> None:  # variables given as shapes are traced with the rest
        v, a, k = given
        model = Bound(module, v, {}, method, {**apply_kwargs, **k})  # the call's keywords
        ADAPTER.learn(model, policies, opts, a, {})  # the modules, in the order of their calls
        text.append(
            entry_points.explain(ADAPTER, model, policies, opts, (), a, calibration, trace=True)
        )

    entry_points.eval_shapes(trace, (dict(variables), args, kwargs))
    caches = kv_report.cache_rows(variables.get("cache", {}), opts.kv_cache, CACHE_NAMES)
    return text[-1] + kv_report.format_caches(caches)
