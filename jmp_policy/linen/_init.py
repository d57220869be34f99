"""``init``: creating a Linen model's variables under a policy or a map."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
from flax.core.scope import in_filter

from jmp_policy._src import interception
from jmp_policy._src.framework import run_kernels
from jmp_policy._src.framework.params_tree import in_variable_dtypes
from jmp_policy._src.framework.shared_docs import fill
from jmp_policy._src.options import Options
from jmp_policy._src.resolution import Resolver
from jmp_policy._src.run_report import compute_modules, warn_once
from jmp_policy.linen._adapter import ADAPTER, Bound
from jmp_policy.linen._modules import MATMUL_CLASSES, check_method, prepare
from jmp_policy.linen._trace import interceptor, method_for

_INIT_MUTABLE = nn.DenyList("intermediates")  # `module.init`'s default


@fill
def init(
    module: nn.Module,
    policy_or_map: Any,
    method: Any = None,
    **options: Any,
) -> Callable[..., Any]:
    """Makes ``module.init`` run under a policy or a map; parameters in their variable dtype.

    The returned function has ``module.init``'s signature, ``fn(rngs, *args, method=None,
    mutable=DenyList("intermediates"), capture_intermediates=False, **kwargs)``, and returns
    the variables. Submodules run as under :func:`apply`; each leaf of ``"params"`` is then
    cast to the variable dtype of its path's policy (usually float32, the master weights).
    Other collections are returned as created: among them, for every call of a ``Dense``,
    ``DenseGeneral`` or ``Einsum`` under a float8 policy, its state ``float8_<i>`` in
    ``"_overwrite_with_gradient"`` (a state per call: a module called twice has two).
    {float8_state}

    Args:
        module: a ``flax.linen`` Module instance.
        policy_or_map: as in :func:`apply`.
        method: as in :func:`apply`.
        {options}

    Returns:
        A function with ``module.init``'s signature.

    Raises:
        {apply_raises}

    Examples:
        >>> import jax, jax.numpy as jnp, flax.linen as nn
        >>> import jmp_policy as jp
        >>> model = nn.Dense(2, param_dtype=jnp.bfloat16)
        >>> fn = jp.linen.init(model, {"": "p=f32,c=bf16,o=f32"})
        >>> variables = fn(jax.random.key(0), jnp.ones((1, 3)))
        >>> variables["params"]["kernel"].dtype
        dtype('float32')
        >>> jp.linen.init(model, "bfloat16")(jax.random.key(0), jnp.ones((1, 3)))[
        ...     "params"]["bias"].dtype
        dtype(bfloat16)
    """
    policies, opts = prepare(module, policy_or_map, method, options)
    default_method = method
    warned: set[str] = set()  # what this wrapper has warned about

    def init_fn(
        rngs: Any,
        *args: Any,
        method: Any = None,
        mutable: Any = _INIT_MUTABLE,
        capture_intermediates: Any = False,
        **kwargs: Any,
    ) -> Any:
        method = default_method if method is None else method
        check_method(module, method)
        init_kwargs = {"mutable": mutable, "capture_intermediates": capture_intermediates}
        created, first = _create(module, policies, opts, rngs, args, kwargs, method, init_kwargs)
        if "params" not in created:
            warn_once(first, type(module).__name__, warned)
            return created
        params = created["params"]
        # The other collections (caches, batch statistics, float8 state) are made as
        # `apply` uses them: by a run on the parameters cast to compute dtypes.
        apply_rngs: Any = rngs if isinstance(rngs, Mapping) else {"params": rngs}
        model = Bound(
            module,
            {"params": params},
            dict(first.infos),
            method,
            {"rngs": apply_rngs, "mutable": True, "capture_intermediates": capture_intermediates},
        )
        resolver = Resolver(policies, opts)
        _, state = ADAPTER.run(model, resolver, opts, (), lambda m: m(*args, **kwargs))
        variables = {"params": in_variable_dtypes(params, resolver)}
        for name, collection in state.items():
            if name != "params" and in_filter(mutable, name):
                variables[name] = collection
        compute = compute_modules(resolver, params, MATMUL_CLASSES)
        warn_once(resolver, type(module).__name__, warned, compute)
        return variables

    return init_fn


def _create(
    module: nn.Module,
    policies: Any,
    opts: Options,
    rngs: Any,
    args: Any,
    kwargs: Mapping[str, Any],
    method: Any,
    init_kwargs: Mapping[str, Any],
) -> tuple[Any, Resolver]:
    """``module.init``'s variables and the resolver that learnt the model's modules: Flax
    creates the parameters (in their ``param_dtype``) and reads them as created."""
    resolver = Resolver(policies, opts)
    with (
        nn.intercept_methods(interceptor(resolver, method)),
        interception.model_run(opts),
        run_kernels.running(),
    ):
        created = module.init(
            rngs, *args, method=method_for(resolver, method), **init_kwargs, **kwargs
        )
    return created, resolver
