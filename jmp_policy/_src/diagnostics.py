"""Diagnostics: per-submodule statistics of a model run, and the report that holds them.

A statistics **tap** is an extension of the one per-submodule hook
(:mod:`jmp_policy._src.interception`); it exists only while a ``diagnose`` wrapper runs a
model, so plain ``apply`` pays nothing. For each submodule call it records, for the
floating leaves of the call's inputs and outputs, and for the cotangents that reach its
outputs in the backward pass:

* ``max_abs``: the largest finite absolute value;
* ``non_finite``: how many values are ``inf`` or ``nan``;
* ``underflow``: how many are nonzero but below the smallest normal of the module's
  compute dtype (they lose precision, then flush to zero);
* ``near_overflow``: how many finite values are within a factor 2 of its largest value;
* ``zeros`` and ``size``.

Everything is computed with ``jnp`` ops into a :class:`Report` pytree: it works under
``jit``, ``grad`` and ``scan`` with no host synchronisation. Execution order survives
``jit`` because it is taken at trace time (a sequence number per tap, in the order the
Python code calls the modules) and kept in the report's static metadata.

**Backward statistics through the gradient.** Each call's outputs pass through a
``jax.custom_vjp`` identity whose second input is one row of a zero-valued **probe**
(``{path: zeros((calls, 6))}``, see :meth:`Report.probe`). Its backward pass returns the
cotangents unchanged and, as the cotangent of that row, the statistics of the cotangents.
Differentiating the user's unchanged loss with respect to the probe therefore gives the
backward statistics; :meth:`Report.with_gradients` puts them into the report.

**Tapping less.** A :class:`Selection` (``every=``, ``paths=``) taps only the submodules
whose path a key names (exact, else ``re.fullmatch``, as a ``DTypePolicyMap`` key) and
computes the statistics on one step in ``every``: each statistic sits in a ``lax.cond`` on
``step % every == 0``, so the other steps skip the reductions with no recompilation.

Submodules called inside a transform of their own (``nn.scan``, ``nn.remat``, ``nn.vmap``,
``nnx.scan``, ...) run in an inner trace whose values cannot leave it: their statistics
are not collected, and the report lists their paths as ``skipped``.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import re
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jmp_policy._src import numerics
from jmp_policy._src.policy_map._index import is_literal

try:  # The current trace, to tell a module called inside a transform of its own.
    from jax._src import core as _jax_core

    def _current_trace() -> Any:
        return _jax_core.trace_ctx.trace

except (ImportError, AttributeError):  # pragma: no cover - other JAX versions

    def _current_trace() -> Any:
        return None


NUM_STATS = 6  # max_abs, non_finite, underflow, near_overflow, zeros, size


@dataclasses.dataclass(frozen=True)
class Stats:
    """Statistics of a group of arrays (a call's inputs, outputs or output cotangents).

    ``max_abs`` is float32; the counts are int32 (under ``jax_enable_x64``, too) and
    add up over the calls of one path.
    """

    max_abs: jax.Array
    non_finite: jax.Array
    underflow: jax.Array
    near_overflow: jax.Array
    zeros: jax.Array
    size: jax.Array

    @property
    def underflow_fraction(self) -> jax.Array:
        """The fraction of values that are nonzero but below the smallest normal."""
        return self.underflow / jnp.maximum(self.size, 1)

    @property
    def near_overflow_fraction(self) -> jax.Array:
        """The fraction of values within a factor 2 of the largest finite value."""
        return self.near_overflow / jnp.maximum(self.size, 1)

    def row(self) -> jax.Array:
        """The statistics as one float32 vector (the probe's layout)."""
        return jnp.stack([jnp.asarray(v, jnp.float32) for v in dataclasses.astuple(self)])

    @classmethod
    def from_row(cls, row: jax.Array) -> Stats:
        counts = [jnp.round(row[..., i]).astype(jnp.int32) for i in range(1, NUM_STATS)]
        return cls(row[..., 0], *counts)

    def merge(self, other: Stats) -> Stats:
        """The statistics of both groups together."""
        return Stats(
            jnp.maximum(self.max_abs, other.max_abs),
            *(
                a + b
                for a, b in zip(
                    dataclasses.astuple(self)[1:], dataclasses.astuple(other)[1:], strict=True
                )
            ),
        )


jax.tree_util.register_dataclass(
    Stats,
    data_fields=["max_abs", "non_finite", "underflow", "near_overflow", "zeros", "size"],
    meta_fields=[],
)


def stats_of(leaves: list[Any], dtype: Any) -> Stats:
    """:class:`Stats` of the floating ``leaves``, thresholds from floating ``dtype``.

    Each leaf is read once: its statistics are one variadic ``lax.reduce`` (a max and
    four counts over the same elementwise tests), which XLA compiles into one reduction
    fusion, not five passes over memory.
    """
    info = jnp.finfo(dtype)
    tiny, near = float(info.tiny), float(info.max) / 2
    max_abs = jnp.zeros((), jnp.float32)
    counts = [jnp.zeros((), jnp.int32) for _ in range(4)]
    size = 0
    for leaf in leaves:
        x = jax.lax.stop_gradient(jnp.asarray(leaf))  # statistics are never differentiated
        leaf_max, *leaf_counts = _one_pass(x, tiny, near)
        max_abs = jnp.maximum(max_abs, leaf_max.astype(jnp.float32))
        counts = [c + n for c, n in zip(counts, leaf_counts, strict=True)]
        size += int(np.prod(x.shape))
    non_finite, underflow, near_overflow, zeros = counts
    return Stats(max_abs, non_finite, underflow, near_overflow, zeros, jnp.asarray(size, jnp.int32))


def _no_stats() -> Stats:
    """The statistics of a step that is not sampled: all zero, ``size`` too."""
    return Stats(jnp.zeros((), jnp.float32), *(jnp.zeros((), jnp.int32) for _ in range(5)))


def _one_pass(x: jax.Array, tiny: float, near: float) -> tuple[jax.Array, ...]:
    """Max finite |x| and the counts of non-finite, underflowing, near-overflow and zero
    values of ``x``, as one reduction over all its axes."""
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        x = jnp.abs(x)
    a = jnp.abs(x.astype(jnp.promote_types(x.dtype, jnp.float32)))
    finite = jnp.isfinite(a)
    masks = (~finite, (a > 0) & (a < tiny), finite & (a >= near), a == 0)
    operands = (jnp.where(finite, a, 0), *(m.astype(jnp.int32) for m in masks))
    init = (np.zeros((), a.dtype), *(np.zeros((), np.int32) for _ in masks))
    return tuple(jax.lax.reduce(operands, init, _combine, tuple(range(a.ndim))))


def _combine(x: tuple[jax.Array, ...], y: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    return (
        jax.lax.max(x[0], y[0]),
        *(jax.lax.add(a, b) for a, b in zip(x[1:], y[1:], strict=True)),
    )


@dataclasses.dataclass(frozen=True)
class Selection:
    """What a ``diagnose`` function taps: the submodules named by ``paths`` (``None``: all)
    on one step in ``every``. Made (and checked) by :func:`selection`."""

    every: int = 1
    paths: tuple[str, ...] | None = None

    @functools.cached_property
    def _patterns(self) -> tuple[frozenset[str], tuple[re.Pattern[str], ...]]:
        keys = self.paths or ()
        return (
            frozenset(k for k in keys if is_literal(k)),
            tuple(re.compile(k) for k in keys if not is_literal(k)),
        )

    def taps(self, path: str) -> bool:
        """Whether the submodule at ``path`` is tapped (an exact key, else a fullmatch)."""
        if self.paths is None:
            return True
        exact, patterns = self._patterns
        return path in exact or any(p.fullmatch(path) for p in patterns)

    def sample(self, step: Any) -> jax.Array | None:
        """``step % every == 0`` as a bool scalar (traced under ``jit``); ``None`` when
        every step is sampled."""
        if step is not None:
            integer = isinstance(step, (int, np.integer)) and not isinstance(step, bool)
            if not integer and not (
                isinstance(step, (jax.Array, np.ndarray))
                and step.shape == ()
                and jnp.issubdtype(step.dtype, jnp.integer)
            ):
                raise TypeError(
                    "`step` must be the training step, an int or an integer scalar array "
                    f"(traced under jit). Received: step={step!r}"
                )
        if self.every == 1:
            return None
        if step is None:
            raise ValueError(
                f"`step` is required with `every={self.every}`: pass the training step "
                "(an int, or an integer scalar array inside a jitted loop); the statistics "
                f"are computed when `step % {self.every} == 0`."
            )
        return jnp.asarray(step) % self.every == 0


def selection(every: Any = 1, paths: Any = None) -> Selection:
    """Checks ``diagnose``'s ``every`` and ``paths`` arguments and returns a :class:`Selection`."""
    if isinstance(every, bool) or not isinstance(every, (int, np.integer)):
        raise TypeError(
            "`every` must be an int >= 1 (compute the statistics on one step in `every`). "
            f"Received: every={every!r} of type {type(every).__name__}"
        )
    if every < 1:
        raise ValueError(
            "`every` must be an int >= 1 (compute the statistics on one step in `every`). "
            f"Received: every={every!r}"
        )
    if paths is None:
        return Selection(int(every), None)
    keys = (paths,) if isinstance(paths, str) else paths
    if not isinstance(keys, (list, tuple)) or not all(isinstance(k, str) for k in keys):
        raise TypeError(
            "`paths` must be None (tap every submodule), a module path or regular "
            "expression, or a list of them (the keys of a DTypePolicyMap, e.g. "
            f"['head', 'encoder/layers_1(/.*)?']). Received: paths={paths!r}"
        )
    if not keys:
        raise ValueError(
            "`paths` is empty, so nothing would be tapped; pass None to tap every "
            f"submodule. Received: paths={paths!r}"
        )
    for key in keys:
        try:
            re.compile(key)
        except re.error as e:
            raise ValueError(
                f"`paths` holds {key!r}, which is not a valid regular expression ({e}); "
                "keys are exact module paths or regular expressions matched with "
                "`re.fullmatch`, as in a DTypePolicyMap."
            ) from e
    return Selection(int(every), tuple(keys))


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


# -- the taps --------------------------------------------------------------------------


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
    return jax.lax.cond(sample, lambda v: stats_of(v, dtype), lambda v: _no_stats(), leaves)


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
        select: Selection = Selection(),
        step: Any = None,
    ):
        self.probe = probe
        self.select = select
        self.sample = select.sample(step)
        self.trace = _current_trace()
        self.reset()

    def reset(self) -> None:
        self.entries: dict[str, _Entry] = {}
        self.skipped: list[str] = []
        self.untapped: list[str] = []
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
        if _current_trace() is not self.trace:
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
        rows = None if self.probe is None else self.probe.get(path)
        if rows is None:
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
    select: Selection = Selection(),
    step: Any = None,
) -> Iterator[Collector]:
    """Inside the block, the taps record into the collector it yields: the submodules
    ``select`` names, with statistics computed when ``select.sample(step)`` is true."""
    if probe is not None and not isinstance(probe, Mapping):
        raise TypeError(
            "`probe` must be None or a probe from `Report.probe()` (a dict of paths to "
            f"float32 arrays). Received: probe of type {type(probe).__name__}"
        )
    collector = Collector(probe, select, step)
    token = _COLLECTOR.set(collector)
    try:
        yield collector
    finally:
        _COLLECTOR.reset(token)
