"""Diagnosing an NNX model: its run function with statistics taps, returning a report."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flax import nnx

from jmp_policy._src.framework.diagnose import diagnose as diagnose_once
from jmp_policy._src.framework.shared_docs import fill
from jmp_policy.nnx._adapter import ADAPTER
from jmp_policy.nnx._apply import apply_with
from jmp_policy.nnx._modules import is_nnx_object, prepare


@fill
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

    The returned function takes ``method``'s arguments.
    {diagnose_description}
    NNX objects passed as arguments are not data, and not measured.

    Args:
        model: an ``nnx.Module``; never modified except for its non-``Param`` state.
        {diagnose_args}

    {diagnose_tail}

    Examples:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import jmp_policy as jp
        >>> model = nnx.Sequential(nnx.Linear(3, 4, rngs=nnx.Rngs(0)),
        ...                        lambda x: x * 1e5,   # overflows float16
        ...                        nnx.Linear(4, 2, rngs=nnx.Rngs(1)))
        >>> out, report = jp.nnx.diagnose(model, "float16")(jnp.ones((1, 3)))
        >>> print(jp.format_report(report).splitlines()[0])
        first non-finite: layers/2 (forward input)
        >>> report.paths[1].path, report.paths[1].dtype
        ('layers/0', 'float16')
    """
    policies, opts = prepare(model, policy_or_map, options)
    run = lambda model, taps: apply_with(model, policies, opts, method, taps)  # noqa: E731
    return diagnose_once(
        ADAPTER, model, policies, opts, every, paths, opaque=is_nnx_object, apply=run
    )
