"""Diagnostics taps: per-submodule statistics of a model run, gathered into a report.

A statistics **tap** is an extension of the one per-submodule hook
(:mod:`jmp_policy._src.interception`); it exists only while a ``diagnose`` wrapper runs a
model, so plain ``apply`` pays nothing. For each submodule call it records the statistics
(:mod:`~jmp_policy._src.diagnostics.stats`) of the floating leaves of the call's inputs and
outputs, and of the cotangents that reach its outputs in the backward pass, into a
:class:`~jmp_policy._src.diagnostics.report.Report` pytree. Execution order survives
``jit`` because it is taken at trace time (a sequence number per tap, in the order the
Python code calls the modules) and kept in the report's static metadata.

**Backward statistics through the gradient.** Each call's outputs pass through a
``jax.custom_vjp`` identity whose second input is one row of a zero-valued **probe**
(``{path: zeros((calls, 6))}``, see ``Report.probe``). Its backward pass returns the
cotangents unchanged and, as the cotangent of that row, the statistics of the cotangents.
Differentiating the user's unchanged loss with respect to the probe therefore gives the
backward statistics; ``Report.with_gradients`` puts them into the report.

**Tapping less.** With a :class:`~jmp_policy._src.diagnostics.tap_selection.Selection` only the
submodules it names are tapped, and each statistic sits in a ``lax.cond`` on
``step % every == 0``, so the other steps skip the reductions with no recompilation. (XLA's
GPU compiler turns these small conds into selects, computing the statistics on every step:
see docs/diagnostics.md.)

Submodules called inside a transform of their own (``nn.scan``, ``nn.remat``, ``nn.vmap``,
``nnx.scan``, ...) run in an inner trace whose values cannot leave it: their statistics
are not collected, and the report lists their paths as ``skipped``.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jmp_policy._src import numerics, transforms
from jmp_policy._src.diagnostics.report import PathInfo, Report
from jmp_policy._src.diagnostics.stats import NUM_STATS, Stats, no_stats, stats_of
from jmp_policy._src.diagnostics.tap_selection import Selection
from jmp_policy._src.diagnostics.tap_selection import selection as selection  # the glue's entry
from jmp_policy._src.dtypes import bounded_repr


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gradient_tap(dtype: str, leaves: list[Any], row: jax.Array) -> list[Any]:
    del dtype, row
    return leaves


def _gradient_tap_fwd(dtype: str, leaves: list[Any], row: jax.Array) -> Any:
    del dtype, row
    return leaves, None


def _gradient_tap_bwd(dtype: str, _: Any, cotangents: list[Any]) -> Any:
    return cotangents, stats_of(list(cotangents), dtype).row()


_gradient_tap.defvjp(_gradient_tap_fwd, _gradient_tap_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _sampled_gradient_tap(
    dtype: str, leaves: list[Any], row: jax.Array, sample: jax.Array
) -> list[Any]:
    del dtype, row, sample
    return leaves


def _sampled_gradient_tap_fwd(
    dtype: str, leaves: list[Any], row: jax.Array, sample: jax.Array
) -> Any:
    del dtype, row
    return leaves, sample


def _sampled_gradient_tap_bwd(dtype: str, sample: jax.Array, cotangents: list[Any]) -> Any:
    stats = _gated(sample, list(cotangents), dtype)
    return cotangents, stats.row(), None


_sampled_gradient_tap.defvjp(_sampled_gradient_tap_fwd, _sampled_gradient_tap_bwd)


def _gated(sample: jax.Array | None, leaves: list[Any], dtype: str) -> Stats:
    """:func:`stats_of`, computed only where ``sample`` is true (zeros elsewhere)."""
    if sample is None:
        return stats_of(leaves, dtype)
    leaves = [jax.lax.stop_gradient(x) for x in leaves]
    return jax.lax.cond(sample, lambda v: stats_of(v, dtype), lambda v: no_stats(), leaves)


_EVERY_CALL = Selection()  # the default: every submodule on every step (frozen, shared)


class _Entry:
    def __init__(self, dtype: str, seq: int):
        self.dtype = dtype
        self.input_seq = seq
        self.output_seq = -1
        self.calls = 0
        self.inputs: Stats | None = None
        self.outputs: Stats | None = None


class Collector:
    """The statistics of one model run, gathered by the taps while it is traced."""

    def __init__(
        self,
        probe: Mapping[str, jax.Array] | None,
        select: Selection = _EVERY_CALL,
        step: Any = None,
    ):
        self.probe = probe
        self.select = select
        self.sample = select.sample(step)
        self.trace = transforms.current_trace()
        self.reset()

    def reset(self) -> None:
        self.entries: dict[str, _Entry] = {}
        self.skipped: list[str] = []
        self.untapped: list[str] = []
        self.unprobed: list[str] = []  # tapped paths the probe has no rows for
        self.seq = 0

    def _next(self) -> int:
        self.seq += 1
        return self.seq - 1

    def tap(
        self,
        call: Any,
        next_fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        opaque: Callable[[Any], bool] | None,
    ) -> Any:
        path = call.path
        if path == "" and (self.entries or self.untapped):  # the model is traced again
            self.reset()
        if not self.select.taps(path):
            if path not in self.untapped:
                self.untapped.append(path)
            return next_fn(*args, **kwargs)
        if transforms.current_trace() is not self.trace:
            if path not in self.skipped:
                self.skipped.append(path)
            return next_fn(*args, **kwargs)
        dtype = np.dtype(call.resolution.policy.compute_dtype).name
        entry = self.entries.get(path)
        if entry is None:
            entry = self.entries[path] = _Entry(dtype, self._next())
        else:
            self._next()
        stats = _gated(self.sample, _float_leaves((args, kwargs), opaque)[0], dtype)
        entry.inputs = stats if entry.inputs is None else entry.inputs.merge(stats)
        out = next_fn(*args, **kwargs)
        seq = self._next()
        entry.output_seq = seq if entry.output_seq < 0 else entry.output_seq
        leaves, rebuild = _float_leaves(out, opaque)
        stats = _gated(self.sample, leaves, dtype)
        entry.outputs = stats if entry.outputs is None else entry.outputs.merge(stats)
        k = entry.calls
        entry.calls += 1
        if not leaves:
            return out
        row = self._probe_row(path, k)
        if self.sample is None:
            return rebuild(_gradient_tap(dtype, leaves, row))
        return rebuild(_sampled_gradient_tap(dtype, leaves, row, self.sample))

    def _probe_row(self, path: str, k: int) -> jax.Array:
        if self.probe is None:
            return jnp.zeros((NUM_STATS,), jnp.float32)
        rows = self.probe.get(path)
        if rows is None:  # its gradient statistics would be lost: `report` raises
            self.unprobed.append(path)
            return jnp.zeros((NUM_STATS,), jnp.float32)
        if k >= rows.shape[0]:
            raise ValueError(
                f"The probe has {rows.shape[0]} row(s) for {path!r} but the model called it "
                f"more often; make the probe from a report of the same call (Report.probe)."
            )
        return rows[k]

    def report(self) -> Report:
        missing = sorted(set(self.probe or {}) - set(self.entries))
        if missing:
            raise ValueError(
                f"The probe names paths this run did not call: {missing}. Make the probe "
                "from a report of the same model and call (Report.probe)."
            )
        if self.probe is not None and self.unprobed:
            given = f"probe with paths {[*self.probe][:10]}" if self.probe else "probe={}"
            raise ValueError(
                f"`probe` has no rows for {self.unprobed[0]!r}, which this run taps: make the "
                "probe from a report of the same model and call (`fn.probe(...)`, "
                f"`Report.probe()`), or pass probe=None. Received: {given}"
            )
        if self.select.paths is not None and not self.entries and self.untapped:
            warnings.warn(
                f"`paths={list(self.select.paths)!r}` named none of the submodules this "
                f"run called, so nothing was tapped; the paths are: {self.untapped[:10]}",
                stacklevel=2,
            )
        entries = self.entries.items()
        return Report(
            inputs={p: e.inputs for p, e in entries if e.inputs is not None},
            outputs={p: e.outputs for p, e in entries if e.outputs is not None},
            gradients={},
            paths=tuple(
                PathInfo(p, e.dtype, e.calls, e.input_seq, e.output_seq) for p, e in entries
            ),
            skipped=tuple(s for s in self.skipped if s not in self.entries),
            untapped=tuple(self.untapped),
            every=self.select.every,
            sampled=self.sample,
        )


def _float_leaves(tree: Any, opaque: Callable[[Any], bool] | None) -> tuple[list[Any], Any]:
    """The floating array leaves of ``tree`` and a function putting new ones back."""
    leaves, treedef = jax.tree.flatten(tree, is_leaf=opaque)
    index = [
        i
        for i, x in enumerate(leaves)
        if not (opaque is not None and opaque(x))
        and isinstance(x, (jax.Array, np.ndarray))
        and numerics.is_float_leaf(x)
    ]

    def rebuild(new: list[Any]) -> Any:
        out = list(leaves)
        for i, x in zip(index, new, strict=True):
            out[i] = x
        return jax.tree.unflatten(treedef, out)

    return [leaves[i] for i in index], rebuild


_COLLECTOR: contextvars.ContextVar[Collector | None] = contextvars.ContextVar(
    "jmp_policy_diagnostics", default=None
)


class Taps:
    """The statistics-tap extension of the hook; it acts only inside :func:`collecting`.

    ``opaque``: argument nodes that are not data (NNX modules, Rngs, Variables).
    """

    def __init__(self, opaque: Callable[[Any], bool] | None = None):
        self.opaque = opaque

    def __call__(self, call: Any, next_fn: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        collector = _COLLECTOR.get()
        if collector is None:
            return next_fn(*args, **kwargs)
        return collector.tap(call, next_fn, args, kwargs, self.opaque)


@contextlib.contextmanager
def collecting(
    probe: Mapping[str, jax.Array] | None = None,
    select: Selection = _EVERY_CALL,
    step: Any = None,
) -> Iterator[Collector]:
    """Inside the block, the taps record into the collector it yields: the submodules
    ``select`` names, with statistics computed when ``select.sample(step)`` is true."""
    if probe is not None and not isinstance(probe, Mapping):
        raise TypeError(
            "`probe` must be None or a probe from `Report.probe()` (a dict of paths to "
            f"float32 arrays). Received: probe={bounded_repr(probe)} (of type "
            f"{type(probe).__name__})"
        )
    collector = Collector(probe, select, step)
    token = _COLLECTOR.set(collector)
    try:
        yield collector
    finally:
        _COLLECTOR.reset(token)
