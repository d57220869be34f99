"""The diagnostics report: per-submodule statistics of one model run, as a pytree."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jmp_policy._src.diagnostics.stats import NUM_STATS, Stats


class PathInfo(NamedTuple):
    """What the report knows statically of a path: in execution order, with its dtype."""

    path: str
    dtype: str  # the compute dtype that defines underflow and near-overflow
    calls: int  # how many calls were tapped
    input_seq: int  # the sequence number of its first input tap (execution order)
    output_seq: int  # the sequence number of its first output tap


@dataclasses.dataclass(frozen=True)
class Report:
    """Per-submodule statistics of one run of a model (a pytree).

    ``inputs``, ``outputs`` and ``gradients`` map module paths (``""`` is the root) to
    :class:`Stats`: of the floating leaves of the calls' arguments, of their outputs,
    and of the cotangents reaching their outputs (empty until :meth:`with_gradients`).
    ``paths`` lists each tapped path in execution order with its compute dtype and how
    many calls were tapped; ``skipped`` the paths called inside a transform of their own;
    ``untapped`` those the ``paths`` filter left out. With ``every > 1``, ``sampled`` is a
    bool (one per step when stacked by ``scan``): whether the statistics were computed;
    a step that was not sampled holds zeros. :func:`format_report` renders it.
    """

    inputs: dict[str, Stats]
    outputs: dict[str, Stats]
    gradients: dict[str, Stats]
    paths: tuple[PathInfo, ...] = ()
    skipped: tuple[str, ...] = ()
    untapped: tuple[str, ...] = ()
    every: int = 1
    sampled: Any = None

    def probe(self) -> dict[str, jax.Array]:
        """A zero-valued probe for this model: ``{path: zeros((calls, 6))}`` (float32).

        Pass it to the ``diagnose`` function (``probe=``) and differentiate with respect
        to it; its gradient goes to :meth:`with_gradients`. Reads static metadata only,
        so it works on a report from ``jax.eval_shape`` too.
        """
        return {p.path: jnp.zeros((p.calls, NUM_STATS), jnp.float32) for p in self.paths}

    def with_gradients(self, probe_gradient: Mapping[str, jax.Array]) -> Report:
        """This report with the backward statistics carried by the probe's gradient."""
        known = {p.path: p for p in self.paths}
        if not isinstance(probe_gradient, Mapping):
            raise TypeError(
                "`probe_gradient` must be the gradient with respect to a probe from "
                f"`Report.probe()` (a dict of paths). Received: {type(probe_gradient).__name__}"
            )
        unknown = sorted(set(probe_gradient) - set(known))
        if unknown:
            raise ValueError(
                f"`probe_gradient` holds paths this report does not know: {unknown}. Use "
                "the probe of the same model and the same diagnose function."
            )
        gradients = {}
        for path, rows in probe_gradient.items():
            rows = jnp.asarray(rows)
            if rows.shape[-2:] != (known[path].calls, NUM_STATS):
                raise ValueError(
                    f"`probe_gradient[{path!r}]` has shape {rows.shape}; expected "
                    f"{(known[path].calls, NUM_STATS)} (one row per call of {path!r})."
                )
            per_call = [Stats.from_row(rows[..., i, :]) for i in range(known[path].calls)]
            gradients[path] = functools.reduce(Stats.merge, per_call)
        return dataclasses.replace(self, gradients=gradients)


jax.tree_util.register_dataclass(
    Report,
    data_fields=["inputs", "outputs", "gradients", "sampled"],
    meta_fields=["paths", "skipped", "untapped", "every"],
)
