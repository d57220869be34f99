"""Diagnosing an NNX model: its run function with statistics taps, returning a report."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flax import nnx

from jmp_policy._src.framework.diagnose import diagnose as diagnose_once
from jmp_policy.nnx._adapter import ADAPTER
from jmp_policy.nnx._apply import apply_with
from jmp_policy.nnx._modules import is_nnx_object, prepare


def diagnose(
    model: nnx.Module,
    policy_or_map: Any,
    method: str | Callable[..., Any] = "__call__",
    *,
    every: int = 1,
    paths: Any = None,
    **options: Any,
) -> Callable[..., Any]:
    """Makes a function that runs ``model`` as :func:`apply` does and also returns a report.

    The NNX counterpart of :func:`jmp_policy.linen.diagnose`: the returned function takes
    ``method``'s arguments plus keywords ``probe`` and ``step`` and returns
    ``(outputs, report)``; the report holds, per submodule path, the statistics of the
    floating leaves of its inputs
    and outputs (NNX objects passed as arguments are not data, and not measured), and,
    through the gradient with respect to ``probe``, of the cotangents reaching its outputs
    (``report.with_gradients(probe_gradient)``). It works under ``nnx.jit``/``jax.jit``,
    ``nnx.grad``/``jax.grad``, with no host synchronisation; submodules called inside a
    transform of their own (``nnx.scan``, ``nnx.remat``, ``nnx.vmap``) are listed as
    ``skipped``. :func:`apply` pays nothing: the taps exist only here. ``every`` and
    ``paths`` tap less, as in :func:`jmp_policy.linen.diagnose`.

    Args:
        model: an ``nnx.Module``; never modified except for its non-``Param`` state.
        policy_or_map: as for :func:`apply`.
        method: as for :func:`apply`.
        every: compute the statistics when ``step % every == 0`` (requires ``step=``
            when > 1; steps not sampled skip the reductions and report zeros).
        paths: ``None`` (every submodule), or a path or regular expression, or a list of
            them (``DTypePolicyMap`` key syntax): the submodules to tap; the report lists
            the others as ``untapped``.
        **options: as for :func:`apply`.

    Returns:
        A function ``fn(*args, probe=None, step=None, **kwargs)`` returning ``(outputs, report)``;
        ``fn.probe(*args, **kwargs)`` returns a zero-valued probe for that call (traced
        with ``jax.eval_shape`` on a copy of the model: nothing runs, nothing changes).

    Raises:
        TypeError, ValueError: as :func:`apply`; ``every`` or ``paths`` is not valid;
            ``probe`` is not a probe of this model; ``step`` is missing with ``every > 1``.

    Examples:
        >>> import jax
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import jmp_policy as jp
        >>> class Model(nnx.Module):
        ...     def __init__(self, rngs):
        ...         self.body = nnx.Linear(3, 4, rngs=rngs)
        ...         self.head = nnx.Linear(4, 2, rngs=rngs)
        ...     def __call__(self, x):
        ...         return self.head(self.body(x) * 1e5)   # overflows float16
        >>> model = Model(nnx.Rngs(0))
        >>> out, report = jp.nnx.diagnose(model, "float16")(jnp.ones((1, 3)))
        >>> print(jp.format_report(report).splitlines()[0])
        first non-finite: head (forward input)
        >>> report.paths[1].path, report.paths[1].dtype
        ('body', 'float16')
    """
    policies, opts = prepare(model, policy_or_map, options)
    run = lambda model, taps: apply_with(model, policies, opts, method, taps)  # noqa: E731
    return diagnose_once(
        ADAPTER, model, policies, opts, every, paths, opaque=is_nnx_object, apply=run
    )
