"""Gathering each calibrated layer's input statistics in one run of the model.

The glues give each GPTQ/AWQ layer :func:`capturing_dot_general` as its matmul and run
the model inside :func:`gathering`; each call adds its input rows to the layer's
:class:`~jmp_policy._src.quantization.calibration_stats.LayerStats`. A layer stack run in
a loop (``nn.scan``, ``nnx.scan`` over ``nnx.vmap``-created layers: one module path, its
kernel ``[depth, ...]``) runs its layers in a body traced apart: the statistics gathered
there leave the loop as its stacked outputs (through ``interception.SCAN_AROUND`` and
:mod:`jmp_policy._src.traced_records`, as the map search's taps do), so each layer of the
stack gets its own ``XᵀX`` and ``mean |x|`` (``[depth, in, in]``, ``[depth, in]``). A
stack run by ``vmap`` (``nn.vmap`` with ``variable_axes={'params': 0}``, ``nnx.vmap``
over ``nnx.vmap``-created layers) is gathered the same way, through
``traced_records.VMAP_AROUND``: each lane's statistics, from the inputs that lane sees
(the same ``x`` in every lane when the inputs are broadcast), leave the vmap as extra
outputs mapped on axis 0. A layer whose kernel is not stacked but runs in a loop or a
vmap (one kernel shared by the iterations or lanes) gets the sum over them. A
rematerialized call (``nn.remat``, also inside ``nn.scan``; ``nnx.remat``) threads its
statistics out the same way, as extra outputs. A call made inside a transform the run
cannot see into (``shard_map``, ``pmap``, a ``jax.vmap``/``nnx.vmap`` function made before
the run, at import) is not gathered: its layer is said unseen, and rounded to nearest
with a warning.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from jmp_policy._src import interception, traced_records, transforms
from jmp_policy._src.batch_checks import blaming
from jmp_policy._src.int_arguments import check_int
from jmp_policy._src.quantization.calibration import rows_for_kernel
from jmp_policy._src.quantization.calibration_stats import LayerStats


class _Gathering:
    """One run's statistics at one loop depth: ``level`` enclosing scans, its trace."""

    def __init__(self, stacked: Mapping[str, int], unseen: dict[str, str], level: int = 0):
        self.stats: dict[str, LayerStats] = {}
        self.stacked = stacked
        self.unseen = unseen
        self.level = level
        self.trace = transforms.current_trace()

    def add(self, path: str, stats: LayerStats) -> None:
        before = self.stats.get(path)
        self.stats[path] = stats if before is None else before.merge(stats)


_GATHERING: contextvars.ContextVar[_Gathering | None] = contextvars.ContextVar(
    "jmp_policy_calibration_gathering", default=None
)


@contextlib.contextmanager
def gathering(
    stats: Mapping[str, LayerStats], stacked: Mapping[str, int], unseen: dict[str, str]
) -> Iterator[dict[str, LayerStats]]:
    """Inside the block, :func:`capturing_dot_general` adds to the statistics it yields
    (a copy of ``stats``); ``stacked``: module path -> its kernel's leading layer axes;
    ``unseen`` collects why a layer's inputs were not gathered."""
    state = _Gathering(stacked, unseen)
    state.stats.update(stats)
    token = _GATHERING.set(state)
    around = interception.SCAN_AROUND.set(_around_scan)
    remat = traced_records.REMAT_AROUND.set(_around_remat)
    vmap = traced_records.VMAP_AROUND.set(_around_vmap)
    try:
        with (
            interception.loop_carries(),
            traced_records.REMATS.active(),
            traced_records.VMAPS.active(),
        ):
            yield state.stats
    finally:
        traced_records.VMAP_AROUND.reset(vmap)
        traced_records.REMAT_AROUND.reset(remat)
        interception.SCAN_AROUND.reset(around)
        _GATHERING.reset(token)


def capturing_dot_general(path: str, shape: tuple[int, ...]) -> Any:
    """A drop-in ``jax.lax.dot_general`` for the layer at ``path`` (one layer's kernel
    ``shape``) that adds its input rows to the statistics of :func:`gathering` (created at
    the first call, with as many features as the matmul contracts), or says in its
    ``unseen`` why it cannot, then multiplies as written."""

    def dot_general(lhs: Any, rhs: Any, dims: Any, *a: Any, **k: Any) -> Any:
        state = _GATHERING.get()
        if state is not None:
            _capture(state, path, shape, lhs, rhs, dims)
        return jax.lax.dot_general(lhs, rhs, dims, *a, **k)

    return dot_general


def _capture(
    state: _Gathering, path: str, shape: tuple[int, ...], lhs: Any, rhs: Any, dims: Any
) -> None:
    if transforms.current_trace() is not state.trace:
        state.unseen[path] = (
            "its layer runs inside a transform calibrate cannot see into (one other than "
            "a scan, remat or vmap, such as shard_map or pmap, or a jax.vmap/nnx.vmap "
            "function made before calibrate ran, at import)"
        )
        return
    rows = rows_for_kernel(lhs, shape, dims) if tuple(rhs.shape) == shape else None
    if rows is None:
        state.unseen[path] = "its matmul contracts the kernel in a layout GPTQ/AWQ do not read"
        return
    before = state.stats.get(path)
    if before is None:
        before = LayerStats.zeros(int(rows.shape[-1]))
    elif before.gram.ndim != 2:  # a stack's statistics, reached outside its loop
        state.unseen[path] = "its stacked layers run outside a loop calibrate sees"
        return
    state.stats[path] = before.update(rows)


def _around_scan(
    scan: Callable[..., Any], f: Callable[..., Any], init: Any, args: Any, kwargs: Any
) -> Any:
    """A ``jax.lax.scan`` in a gathering run: each iteration gathers into statistics of
    its own, which leave the loop stacked (see :func:`_add_stacked`)."""
    state = _GATHERING.get()
    if state is None or transforms.current_trace() is not state.trace:
        return scan(f, init, *args, **kwargs)
    done = traced_records.scan_with_records(scan, f, init, args, kwargs, _stepping(state))
    if done is None:
        return scan(f, init, *args, **kwargs)  # JAX says what is missing
    result, records = done
    _add_stacked(state, records)
    return result


def _around_vmap(
    original: Callable[..., Any], plain: Any, fun: Any, args: Any, kwargs: Any, a: Any, k: Any
) -> Any:
    """A call of a function vmapped in a gathering run (``nn.vmap``, ``nnx.vmap``): each
    lane gathers into statistics of its own, from the inputs it sees (the same ``x`` in
    every lane when the inputs are broadcast), which leave the call stacked (see
    :func:`_add_stacked`)."""
    state = _GATHERING.get()
    if state is None or transforms.current_trace() is not state.trace:
        return plain(*a, **k)
    out, records = traced_records.vmap_with_records(
        original, fun, args, kwargs, a, k, _stepping(state)
    )
    _add_stacked(state, records)
    return out


def _stepping(state: _Gathering) -> traced_records.Step:
    """``step(i, n)`` for a scan's iterations or a vmap's lanes: each gathers into
    statistics of its own, one loop deeper than ``state``."""

    @contextlib.contextmanager
    def step(i: Any, n: int) -> Iterator[Callable[[], Any]]:
        inner = _Gathering(state.stacked, state.unseen, state.level + 1)
        token = _GATHERING.set(inner)
        try:
            yield lambda: inner.stats
        finally:
            _GATHERING.reset(token)

    return step


def _add_stacked(state: _Gathering, records: Mapping[str, LayerStats]) -> None:
    """Adds the statistics that left a scan or a vmap with a new leading axis: a layer
    whose kernel stacks this loop's layers keeps the axis, any other sums over it."""
    for path, stacked in records.items():
        if state.level >= state.stacked.get(path, 0):  # not this loop's layers: summed
            stacked = stacked.total()
        state.add(path, stacked)


def _around_remat(
    original: Callable[..., Any], plain: Any, fun: Any, args: Any, kwargs: Any, a: Any, k: Any
) -> Any:
    """A call of a function checkpointed in a gathering run: its statistics, gathered
    apart, leave the call as extra outputs and are added to the run's."""
    state = _GATHERING.get()
    if state is None or transforms.current_trace() is not state.trace:
        return plain(*a, **k)

    @contextlib.contextmanager
    def step() -> Iterator[Callable[[], Any]]:
        inner = _Gathering(state.stacked, state.unseen, state.level)
        token = _GATHERING.set(inner)
        try:
            yield lambda: inner.stats
        finally:
            _GATHERING.reset(token)

    out, records = traced_records.checkpoint_with_records(original, fun, args, kwargs, a, k, step)
    for path, stats in records.items():
        state.add(path, stats)
    return out


def check_max_bytes(max_statistics_bytes: Any) -> int | None:
    """``calibrate``'s ``max_statistics_bytes``: ``None`` or a positive int.

    Raises:
        TypeError: not an int (nor ``None``).
        ValueError: below 1.
    """
    if max_statistics_bytes is None:
        return None
    return check_int(
        max_statistics_bytes, "max_statistics_bytes", 1, why=" or None (every layer at once)"
    )


def gather(
    make_run: Callable[[Mapping[str, Any]], Callable[..., Any]],
    targets: Mapping[str, Any],
    operand: Any,
    calls: list[tuple[Any, ...]],
    max_bytes: int | None,
) -> dict[str, LayerStats]:
    """Each target's statistics over ``calls``: ``make_run(some_targets)`` gives
    ``run(operand, stats, args) -> stats``, gathering those targets' (jit-compiled here,
    one compilation per batch shape). With ``max_bytes`` (``None``: every target in one
    pass over the calls), the targets are gathered in groups whose statistics take at most
    ``max_bytes`` (a layer larger than that alone), one pass per group, each group's moved
    to host memory (NumPy) before the next: the device then holds one group's at a time."""
    run = make_run(targets)
    with blaming("batches[0]", calls[0], "calibrate"):
        shapes = jax.eval_shape(run, operand, {}, calls[0])
    groups = _groups(shapes, max_bytes)
    gathered: dict[str, LayerStats] = {}
    for group in groups:
        part = run if len(groups) == 1 else make_run({p: targets[p] for p in group})
        stats = zero_stats({p: shapes[p] for p in group})
        part_jit = jax.jit(part)
        for i, args in enumerate(calls):
            with blaming(f"batches[{i}]", args, "calibrate"):
                stats = part_jit(operand, stats, args)
        gathered.update(stats if len(groups) == 1 else jax.device_get(stats))
    return gathered


def _groups(shapes: Mapping[str, Any], max_bytes: int | None) -> list[list[str]]:
    """The layers of ``shapes`` (path -> its statistics' shapes) in order, in groups of at
    most ``max_bytes`` of statistics each (a larger layer alone)."""
    if max_bytes is None:
        return [list(shapes)] if shapes else []
    groups: list[list[str]] = []
    size = 0
    for path, layer in shapes.items():
        n = sum(math.prod(s.shape) * s.dtype.itemsize for s in jax.tree.leaves(layer))
        if not groups or size + n > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(path)
        size += n
    return groups


def zero_stats(shapes: Any) -> dict[str, LayerStats]:
    """Statistics of no rows with the shapes ``jax.eval_shape`` of a gathering run gave
    (each layer's feature count is known once its matmul is traced)."""
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)  # type: ignore[no-any-return]
