"""Diagnosing a Linen model: the core's ``diagnose`` on each call's variables."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax

from jmp_policy._src import diagnostics
from jmp_policy._src.framework.diagnose import diagnose as diagnose_once
from jmp_policy._src.framework.shared_docs import fill
from jmp_policy.linen._adapter import ADAPTER
from jmp_policy.linen._apply import apply_with
from jmp_policy.linen._modules import prepare


@fill
def diagnose(
    module: nn.Module,
    policy_or_map: Any,
    method: Any = None,
    *,
    every: int = 1,
    paths: Any = None,
    **options: Any,
) -> Callable[..., Any]:
    """Makes ``module.apply`` run as :func:`apply` does and also return a diagnostics report.

    The returned function has ``module.apply``'s signature plus keywords ``probe`` and
    ``step``.
    {diagnose_description}

    Args:
        module: a ``flax.linen`` Module instance.
        {diagnose_args}

    {diagnose_tail}

    Examples:
        >>> import jax, jax.numpy as jnp, flax.linen as nn
        >>> import jmp_policy as jp
        >>> model, x = nn.Sequential([nn.Dense(4), nn.Dense(2)]), jnp.ones((8, 3))
        >>> variables = model.init(jax.random.key(0), x)
        >>> diag = jp.linen.diagnose(model, "mixed_float16")
        >>> out, report = jax.jit(diag)(variables, x)
        >>> [p.path for p in report.paths]   # in execution order
        ['', 'layers_0', 'layers_1']
        >>> def loss(params, probe):
        ...     out, report = diag({"params": params}, x, probe=probe)
        ...     return (out.astype(jnp.float32) ** 2).mean(), report
        >>> grad = jax.grad(loss, argnums=(0, 1), has_aux=True)
        >>> (grads, probe_grad), report = grad(variables["params"], diag.probe(variables, x))
        >>> int(report.with_gradients(probe_grad).gradients["layers_1"].size)   # (8, 2)
        16
    """
    diagnostics.selection(every, paths)  # checked now, as the other arguments
    policies, opts = prepare(module, policy_or_map, method, options)
    bind = apply_with(module, policies, opts, method).bind  # type: ignore[attr-defined]

    def diagnose_fn(
        variables: Mapping[str, Any],
        *args: Any,
        probe: Any = None,
        step: Any = None,
        **kwargs: Any,
    ) -> tuple[Any, diagnostics.Report]:
        run = diagnose_once(ADAPTER, bind(variables, **kwargs), policies, opts, every, paths)
        return run(*args, probe=probe, step=step)  # type: ignore[no-any-return]

    def probe(variables: Mapping[str, Any], *args: Any, **kwargs: Any) -> dict[str, jax.Array]:
        step = kwargs.pop("step", 0)
        run = diagnose_once(ADAPTER, bind(variables, **kwargs), policies, opts, every, paths)
        return run.probe(*args, step=step)  # type: ignore[attr-defined,no-any-return]

    diagnose_fn.probe = probe  # type: ignore[attr-defined]
    return diagnose_fn
