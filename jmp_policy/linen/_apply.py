"""Running a Linen model per submodule: ``apply``, the core's with the Linen adapter."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn

from jmp_policy._src.framework import entry_points
from jmp_policy._src.framework.shared_docs import fill
from jmp_policy._src.options import Options
from jmp_policy._src.resolution import Resolver
from jmp_policy._src.run_report import compute_modules, warn_once
from jmp_policy.linen._adapter import ADAPTER, Bound
from jmp_policy.linen._modules import MATMUL_CLASSES, check_method, check_variables, prepare


@fill
def apply(
    module: nn.Module,
    policy_or_map: Any,
    method: Any = None,
    **options: Any,
) -> Callable[..., Any]:
    """Makes ``module.apply`` run every submodule under its own policy.

    The returned function has ``module.apply``'s signature, ``fn(variables, *args,
    rngs=None, method=None, mutable=False, capture_intermediates=False, **kwargs)``, and
    returns what ``module.apply`` returns. Only ``"params"`` is cast, and comes back as
    stored under ``mutable`` (float8 state: :func:`init`, :func:`split_gradients`).
    {apply_rules}

    Args:
        module: a ``flax.linen`` Module instance.
        {apply_policy_or_map}
        method: the method to run (a name or ``fn(module, *args)``); ``None`` is
            ``__call__``. The returned function's ``method=`` overrides it.
        {apply_options}

    {apply_tail}

    Examples:
        >>> import jax, jax.numpy as jnp, flax.linen as nn
        >>> import jmp_policy as jp
        >>> model, x = nn.Sequential([nn.Dense(8), nn.Dense(2)]), jnp.ones((4, 3))
        >>> variables = model.init(jax.random.key(0), x)
        >>> fn = jp.linen.apply(model, jp.DTypePolicyMap(
        ...     "mixed_bfloat16", {"layers_1": "float32"}))
        >>> fn(variables, x).dtype   # the float32 head's output, as computed
        dtype('float32')
        >>> loss = lambda p: fn({"params": p}, x).sum()
        >>> grads = jax.jit(jax.grad(loss))(variables["params"])
        >>> grads["layers_0"]["kernel"].dtype
        dtype('float32')
    """
    policies, opts = prepare(module, policy_or_map, method, options)
    return apply_with(module, policies, opts, method)


def apply_with(
    module: nn.Module,
    policies: Any,
    opts: Options,
    method: Any,
    extensions: tuple[Any, ...] = (),
) -> Callable[..., Any]:
    """:func:`apply` with checked arguments and built options: the core's ``apply`` on
    each call's variables (``extensions``: ``diagnose``'s taps). ``fn.bind(variables,
    **apply_kwargs)`` is the core's model of one call."""
    default_method = method
    known: dict[str, Any] = {}  # the modules met, kept across calls
    warned: set[str] = set()  # what this wrapper has warned about

    def apply_fn(
        variables: Mapping[str, Any],
        *args: Any,
        rngs: Any = None,
        method: Any = None,
        mutable: Any = False,
        capture_intermediates: Any = False,
        **kwargs: Any,
    ) -> Any:
        model = bind(
            variables,
            rngs=rngs,
            method=method,
            mutable=mutable,
            capture_intermediates=capture_intermediates,
            **kwargs,
        )
        return entry_points.apply(ADAPTER, model, policies, opts, extensions)(*args)

    def bind(variables: Mapping[str, Any], method: Any = None, **apply_kwargs: Any) -> Bound:
        """The core's model for one call (``apply_kwargs``: ``module.apply``'s keywords
        and the model's); checks ``variables`` and ``method``."""
        check_variables(variables)
        method = default_method if method is None else method
        check_method(module, method)
        params = variables.get("params")

        def report(resolver: Resolver) -> None:
            compute = compute_modules(resolver, params, MATMUL_CLASSES)
            warn_once(resolver, type(module).__name__, warned, compute)

        return Bound(module, variables, known, method, apply_kwargs, report)

    apply_fn.bind = bind  # type: ignore[attr-defined]
    return apply_fn
