"""Diagnosing a Linen model: the core's ``diagnose`` on each call's variables."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax

from jmp_policy._src import diagnostics
from jmp_policy._src.framework.diagnose import diagnose as diagnose_once
from jmp_policy.linen._adapter import ADAPTER
from jmp_policy.linen._apply import apply_with
from jmp_policy.linen._modules import prepare


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
    ``step`` and returns ``(result, report)``: ``result`` is what :func:`apply` returns,
    ``report`` a :class:`~jmp_policy._src.diagnostics.Report` pytree holding, per submodule
    path, for the floating leaves of its inputs and outputs, the largest finite absolute
    value, the count of non-finite values, and the fractions that underflow its compute
    dtype or come within a factor 2 of its largest value. :func:`jmp_policy.format_report`
    renders it, naming the first submodule where a non-finite value appeared. It works
    under ``jax.jit``, ``jax.grad`` (return it as ``has_aux``) and ``jax.lax.scan``, with
    no host synchronisation. Backward statistics come back through the gradient with
    respect to ``probe`` (``report.with_gradients(probe_gradient)``). Submodules inside a
    transform of their own are listed as ``skipped``. :func:`apply` pays nothing; the
    README's "Diagnostics" gives the cost and how to tap less.

    Args:
        module: a ``flax.linen`` Module instance.
        policy_or_map: as for :func:`apply`.
        method: as for :func:`apply`.
        every: compute the statistics on the steps where ``step % every == 0`` (an int
            >= 1; with ``every > 1`` the function requires ``step=``); the other steps
            report zeros, with ``report.sampled`` false, and skip the reductions where
            the compiler keeps the conds (a CPU does; XLA's GPU compiler turns them into
            selects, so there the statistics are computed on every step).
        paths: ``None`` (tap every submodule), or a module path or regular expression,
            or a list of them (``DTypePolicyMap`` key syntax): the submodules to tap;
            the report lists the others as ``untapped``.
        **options: as for :func:`apply`.

    Returns:
        A function ``fn(variables, *args, probe=None, step=None, **apply_kwargs)`` returning
        ``(result, report)``; ``fn.probe(variables, *args, **apply_kwargs)`` returns a
        zero-valued probe for that call (traced with ``jax.eval_shape``: nothing runs).

    Raises:
        TypeError, ValueError: as :func:`apply`; ``every`` or ``paths`` is not valid;
            ``probe`` is not a probe of this model; ``step`` is missing with ``every > 1``.

    Examples:
        >>> import jax
        >>> import jax.numpy as jnp
        >>> import flax.linen as nn
        >>> import jmp_policy as jp
        >>> class Model(nn.Module):
        ...     @nn.compact
        ...     def __call__(self, x):
        ...         x = nn.Dense(4, name="body")(x)
        ...         return nn.Dense(2, name="head")(x)
        >>> model, x = Model(), jnp.ones((8, 3))
        >>> variables = model.init(jax.random.key(0), x)
        >>> diag = jp.linen.diagnose(model, "mixed_float16")
        >>> out, report = jax.jit(diag)(variables, x)
        >>> [p.path for p in report.paths]   # in execution order
        ['', 'body', 'head']
        >>> def loss(params, probe):
        ...     out, report = diag({"params": params}, x, probe=probe)
        ...     return (out.astype(jnp.float32) ** 2).mean(), report
        >>> grad = jax.grad(loss, argnums=(0, 1), has_aux=True)
        >>> (grads, probe_grad), report = grad(variables["params"], diag.probe(variables, x))
        >>> int(report.with_gradients(probe_grad).gradients["head"].size)   # head's (8, 2)
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
