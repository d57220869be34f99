"""``diagnose``, written once against the adapter protocol: ``apply`` with statistics taps."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from jmp_policy._src import diagnostics
from jmp_policy._src.framework import entry_points
from jmp_policy._src.framework.protocol import Adapter
from jmp_policy._src.options import Options


def diagnose(
    adapter: Adapter,
    model: Any,
    policy_or_map: Any,
    options: Options,
    every: int = 1,
    paths: Any = None,
    *,
    opaque: Callable[[Any], bool] | None = None,
    apply: Callable[[Any, tuple[Any, ...]], Callable[..., Any]] | None = None,
) -> Callable[..., Any]:
    """``fn(*args, probe=None, step=None, **kwargs) -> (outputs, report)``: the model run
    as ``apply`` runs it, each module call tapped (the taps outermost, so they see the
    call's cast inputs and its outputs after the output rule); ``fn.probe(*args)`` a zero
    probe for the gradient statistics (traced shape-only, on the model's arrays split
    from it: nothing runs, nothing changes).

    ``opaque``: argument nodes the taps never measure (NNX objects); ``apply(model,
    extensions)``: the framework's run with the taps outermost (default: the core's
    ``apply`` with ``extensions``)."""
    select = diagnostics.selection(every, paths)
    taps = diagnostics.Taps(opaque=opaque)
    if apply is None:
        apply = _core_apply(adapter, policy_or_map, options)
    run = apply(model, (taps,))

    def diagnose_fn(*args: Any, probe: Any = None, step: Any = None, **kwargs: Any) -> Any:
        with diagnostics.collecting(probe, select, step) as collector:
            out = run(*args, **kwargs)
            report = collector.report()
        return out, report

    def make_probe(*args: Any, **kwargs: Any) -> dict[str, jax.Array]:
        step = kwargs.pop("step", 0)
        arrays, merge = adapter.split(model)

        def shapes(arrays: Any) -> Any:
            again = diagnose(
                adapter,
                merge(arrays),
                policy_or_map,
                options,
                every,
                paths,
                opaque=opaque,
                apply=apply,
            )
            return again(*args, step=step, **kwargs)[1]

        return jax.eval_shape(shapes, arrays).probe()  # type: ignore[no-any-return]

    diagnose_fn.probe = make_probe  # type: ignore[attr-defined]
    return diagnose_fn


def _core_apply(
    adapter: Adapter, policy_or_map: Any, options: Options
) -> Callable[[Any, tuple[Any, ...]], Callable[..., Any]]:
    def apply(model: Any, extensions: tuple[Any, ...]) -> Callable[..., Any]:
        return entry_points.apply(adapter, model, policy_or_map, options, extensions)

    return apply
