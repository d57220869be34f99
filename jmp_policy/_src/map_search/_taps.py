"""The search's taps: what each layer's output and its error record during a tapped run.

An extension of the one per-submodule hook (:mod:`jmp_policy._src.interception`). In a
``"record"`` run each target layer's output ``y`` is cached and a zero perturbation added
to it (its gradient is the loss's gradient ``g`` at that output); in a ``"score"`` run each
layer's output error ``dy = Q(y) - y`` is weighed by ``g`` (the second-order Taylor estimate
of the loss increase with the empirical Fisher) and the *baseline* ``y`` goes downstream.

A layer stack (``nn.scan``, ``nnx.scan``: one module path, its kernels ``[depth, ...]``)
runs its layers in a loop body traced apart: the taps thread the body's records out as the
loop's stacked outputs and read their iteration's slice of the cached arrays (see
:func:`_around_scan`). A rematerialized call (``jax.checkpoint`` made during the run:
``nn.remat``, also inside ``nn.scan``) threads its records out the same way, as extra
outputs (:func:`_around_remat`), and so does a stack run by ``vmap`` (``nn.vmap``,
``nnx.vmap``: each lane reads its slice of the cached arrays; :func:`_around_vmap`).
"""

from __future__ import annotations

import contextlib
import contextvars
import warnings
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jmp_policy._src import interception, traced_records, transforms


class Loops(NamedTuple):
    """The loops a layer's taps ran in: their lengths and kinds (``"scan"``, ``"vmap"``)."""

    lengths: tuple[int, ...] = ()
    kinds: tuple[str, ...] = ()


class State:
    """What the taps of one run record. A scan body over a layer stack (or a vmap's lane)
    gets a state of its own (its trace, its iteration ``index``), sharing ``stacks`` with
    the run's."""

    def __init__(self, mode: str, targets: frozenset[str], **arrays: Any):
        self.mode = mode
        self.targets = targets
        self.arrays = arrays
        self.trace = transforms.current_trace()
        self.index: tuple[Any, ...] = ()  # the iteration (or lane) of each enclosing loop
        self.lengths: tuple[int, ...] = ()  # and their lengths
        self.loops: tuple[str, ...] = ()  # and their kinds: "scan" or "vmap"
        self.calls: dict[str, int] = {}
        self.ys: dict[str, list[Any]] = {}
        self.scores: dict[str, Any] = {}
        self.stacks: dict[str, Loops] = {}  # path -> the lengths and kinds of its loops

    def inner(self, i: Any = None, length: int = 0, loop: str = "scan") -> State:
        """The state of a body traced apart: a ``loop``'s (``"scan"``'s iteration or
        ``"vmap"``'s lane) ``i`` of ``length``, or (``i`` None) a rematerialized call, at
        this state's iteration."""
        state = State.__new__(State)
        state.mode, state.targets, state.arrays = self.mode, self.targets, self.arrays
        state.trace = transforms.current_trace()
        state.index, state.lengths, state.loops = self.index, self.lengths, self.loops
        if i is not None:
            state.index, state.lengths = (*self.index, i), (*self.lengths, length)
            state.loops = (*self.loops, loop)
        state.calls, state.ys, state.scores = dict(self.calls), {}, {}
        state.stacks = self.stacks
        return state

    def cached(self, name: str, path: str, k: int) -> Any:
        """The ``k``-th cached array of ``path`` at this state's iteration."""
        array = self.arrays[name][path][k]
        for i in self.index:
            array = array[i]
        return array


_STATE: contextvars.ContextVar[State | None] = contextvars.ContextVar(
    "jmp_policy_map_search", default=None
)


class ScoreTaps:
    """The search's extension of the hook; it acts only inside :func:`tapping`."""

    def __call__(self, call: Any, next_fn: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        state = _STATE.get()
        path = call.path
        if state is None or path not in state.targets:
            return next_fn(*args, **kwargs)
        if transforms.current_trace() is not state.trace:  # a transform the search cannot see
            return next_fn(*args, **kwargs)
        out = next_fn(*args, **kwargs)
        if not isinstance(out, jax.Array) or not jnp.issubdtype(out.dtype, jnp.floating):
            return out
        k = state.calls.get(path, 0)
        state.calls[path] = k + 1
        state.stacks.setdefault(path, Loops(state.lengths, state.loops))
        if state.mode == "shapes":
            state.ys.setdefault(path, []).append(jnp.zeros(out.shape, jnp.float32))
            return out
        if state.mode == "record":
            state.ys.setdefault(path, []).append(jax.lax.stop_gradient(out.astype(jnp.float32)))
            return out + state.cached("eps", path, k).astype(out.dtype)
        y = state.cached("ys", path, k)
        g = state.cached("gs", path, k)
        dy = out.astype(jnp.float32) - y
        rows = out.shape[0] if out.ndim else 1
        dot = (g * dy).reshape(rows, -1).sum(axis=1) * rows
        score = 0.5 * jnp.mean(dot**2)
        state.scores[path] = state.scores.get(path, 0.0) + score
        return y.astype(out.dtype)


def _around_scan(
    scan: Callable[..., Any], f: Callable[..., Any], init: Any, args: Any, kwargs: Any
) -> Any:
    """A ``jax.lax.scan`` in a tapped run (a layer stack: ``nn.scan``, ``nnx.scan``): the
    body's taps read their iteration's slice of the cached arrays (closed over) and their
    records leave the loop as its stacked outputs, one leading axis per scan."""
    state = _STATE.get()
    if state is None or transforms.current_trace() is not state.trace:
        return scan(f, init, *args, **kwargs)
    traced: list[State] = []

    def step(i: Any, n: int) -> Any:
        return _recording_into(state.inner(i, n), traced)

    done = traced_records.scan_with_records(scan, f, init, args, kwargs, step)
    if done is None:
        return scan(f, init, *args, **kwargs)  # JAX says what is missing
    (carry, ys), (records, scores) = done
    last = traced[-1]
    for path, stacked in records.items():
        state.ys.setdefault(path, []).extend(stacked)
    for path, per_step in scores.items():
        state.scores[path] = state.scores.get(path, 0.0) + per_step.sum()
    state.calls = last.calls
    return carry, ys


def _around_vmap(
    original: Callable[..., Any], plain: Any, fun: Any, args: Any, kwargs: Any, a: Any, k: Any
) -> Any:
    """A call of a function vmapped in a tapped run (a layer stack run in parallel:
    ``nn.vmap``, ``nnx.vmap``): as a scan's iterations, each lane's taps read their lane's
    slice of the cached arrays, and their records leave the call stacked on axis 0."""
    state = _STATE.get()
    if state is None or transforms.current_trace() is not state.trace:
        return plain(*a, **k)
    traced: list[State] = []

    def step(i: Any, n: int) -> Any:
        return _recording_into(state.inner(i, n, "vmap"), traced)

    out, (records, scores) = traced_records.vmap_with_records(
        original, fun, args, kwargs, a, k, step
    )
    for path, stacked in records.items():
        state.ys.setdefault(path, []).extend(stacked)
    for path, per_lane in scores.items():
        state.scores[path] = state.scores.get(path, 0.0) + per_lane.sum()
    state.calls = traced[-1].calls
    return out


@contextlib.contextmanager
def _recording_into(inner: State, traced: list[State]) -> Iterator[Callable[[], Any]]:
    """The taps record into ``inner`` (a loop body's or a checkpointed call's own state,
    appended to ``traced``) while the body is traced; yields how to read its records."""
    traced.append(inner)
    token = _STATE.set(inner)
    try:
        yield lambda: (inner.ys, inner.scores)
    finally:
        _STATE.reset(token)


def _around_remat(
    original: Callable[..., Any], plain: Any, fun: Any, args: Any, kwargs: Any, a: Any, k: Any
) -> Any:
    """A call of a function checkpointed in a tapped run (``nn.remat``, also inside an
    ``nn.scan``; ``nnx.remat`` applied while the model runs): its taps record into a state
    of their own, whose records leave the call as extra outputs."""
    state = _STATE.get()
    if state is None or transforms.current_trace() is not state.trace:
        return plain(*a, **k)
    traced: list[State] = []

    def step() -> Any:
        return _recording_into(state.inner(), traced)

    out, (ys, scores) = traced_records.checkpoint_with_records(
        original, fun, args, kwargs, a, k, step
    )
    for path, entries in ys.items():
        state.ys.setdefault(path, []).extend(entries)
    for path, score in scores.items():
        state.scores[path] = state.scores.get(path, 0.0) + score
    state.calls = traced[-1].calls
    return out


@contextlib.contextmanager
def tapping(state: State) -> Iterator[State]:
    token = _STATE.set(state)
    around = interception.SCAN_AROUND.set(_around_scan)
    remat = traced_records.REMAT_AROUND.set(_around_remat)
    vmap = traced_records.VMAP_AROUND.set(_around_vmap)
    try:
        with (
            warnings.catch_warnings(),
            traced_records.REMATS.active(),
            traced_records.VMAPS.active(),
        ):
            # The float8 layers' "too small to gain" notice: these runs only measure error.
            warnings.filterwarnings("ignore", message="The float8 layer")
            yield state
    finally:
        traced_records.VMAP_AROUND.reset(vmap)
        traced_records.REMAT_AROUND.reset(remat)
        interception.SCAN_AROUND.reset(around)
        _STATE.reset(token)
