# long: the scoring taps and the search that drives them belong together (one concept).
"""Searching a policy map: one format per layer under a budget, by measured sensitivity.

The scoring of ModelOpt's ``auto_quantize``, on plain pytrees (the Linen and NNX glue
supply the runs). For each layer with a kernel:

1. a few backward passes on calibration batches cache its output ``y`` and the gradient
   ``g`` of the loss at that output (a zero perturbation added to ``y`` through the one
   per-submodule hook, :mod:`jmp_policy._src.interception`, differentiated);
2. for each candidate, one forward pass with every layer under the candidate, each layer
   given the *baseline* output of the layers before it (the hook returns the cached
   ``y`` downstream), gives its own output error ``dy = Q(y) - y``;
3. its score is the second-order Taylor estimate of the loss increase with the empirical
   Fisher at its output: ``0.5 * mean over examples of (n * g_i . dy_i)^2`` (``n`` rows
   of the output's leading axis, the examples a mean loss averages; ``g_i . dy_i`` sums
   over the other axes). It weighs each format's *actual* output error by the gradient,
   not the Fisher trace alone. The scores add up to an estimate of the loss increase.

A layer stack (``nn.scan``, ``nnx.scan``: one module path, its kernels ``[depth, ...]``)
runs its layers in a loop body traced apart: the taps thread the body's records out as the
loop's stacked outputs and read their iteration's slice of the cached arrays (see
:func:`_around_scan`), so the stack is scored as one layer of the map (a path map cannot
tell its layers apart): the sum of its iterations' scores, all its layers' bytes. A
rematerialized call (``jax.checkpoint`` made during the run: ``nn.remat``, also inside
``nn.scan``) threads its records out the same way, as extra outputs (:func:`_around_remat`),
and so does a stack run by ``vmap`` (``nn.vmap``, ``nnx.vmap``: each lane reads its slice
of the cached arrays, its records leave mapped on axis 0; :func:`_around_vmap`).

The choice is a multiple-choice knapsack (:mod:`jmp_policy._src.map_choice`); the base
policy (no quantization) is always an option. The result is a
:class:`~jmp_policy.DTypePolicyMap` (exact paths, compacted to regular expressions where a
pattern covers a run of layers and nothing else) and a table per layer.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import re
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jmp_policy._src import context, interception, map_choice, traced_records
from jmp_policy._src import dtypes as dt
from jmp_policy._src.batch_checks import blaming, check_bool, check_no_nan
from jmp_policy._src.policy_map import DTypePolicyMap
from jmp_policy._src.policy_names import get_policy

DEFAULT_CANDIDATES = (
    "mixed_bfloat16",
    "float8_from_mixed_bfloat16",
    "int8_from_mixed_bfloat16",
    "int4/128_from_mixed_bfloat16",
)
BUDGETS = ("effective_bits", "weight_bytes", "loss_increase")


class LayerRow(NamedTuple):
    """One layer (one path of the map) of a search's table.

    ``scores``/``bytes``: per candidate name (a candidate that cannot quantize the layer's
    kernel is absent); ``choice``: the chosen candidate; ``why``: the reason in words;
    ``unit``: ``"layer"``, or for a layer stack ``"per stack (scanned: N layers)"`` (one
    path, so one choice for all its layers) or ``"one kernel shared by N scan
    iterations"``; ``scored``: ``False`` where the search could not see the layer run
    (it keeps the base policy).
    """

    path: str
    params: int
    scores: dict[str, float]
    bytes: dict[str, int]
    choice: str
    why: str
    unit: str = "layer"
    scored: bool = True


class SearchResult(NamedTuple):
    """What a search returns: the map, the table per layer, and the totals.

    Unpacks as ``policy_map, table, ...``; ``str(result)`` is the table as text;
    :meth:`at` chooses again under another budget from the same scores.
    """

    policy_map: DTypePolicyMap
    table: tuple[LayerRow, ...]
    weight_bytes: int
    effective_bits: float
    loss_increase: float
    method: str

    def __str__(self) -> str:
        names = list(dict.fromkeys(n for row in self.table for n in row.scores))
        width = max([len("layer"), *(len(r.path) for r in self.table)])
        # Each column as wide as its policy's whole name (a cut name could be another's).
        widths = [max(len(n), 9) for n in names]
        head = f"{'layer':{width}}  " + "  ".join(
            f"{n:>{w}}" for n, w in zip(names, widths, strict=True)
        )
        lines = [head + "  choice"]
        for row in self.table:
            cells = [
                f"{row.scores[n]:>{w}.3g}" if n in row.scores else f"{'-':>{w}}"
                for n, w in zip(names, widths, strict=True)
            ]
            lines.append(f"{row.path:{width}}  " + "  ".join(cells) + f"  {row.choice}")
            lines.append(f"{'':{width}}  {row.why}")
        lines.append(
            f"total: {self.weight_bytes:,} bytes ({self.effective_bits:.3f} bits per "
            f"parameter), estimated loss increase {self.loss_increase:.4g} ({self.method})"
        )
        return "\n".join(lines)

    def at(self, budget: Mapping[str, float]) -> SearchResult:
        """The choice under another ``budget``, from this search's scores (no model runs).

        One search, then a sweep of budgets: ``result.at({"effective_bits": 5})`` is what
        ``search_map(..., budget={"effective_bits": 5})`` returns on the same arguments.

        Raises:
            TypeError, ValueError: ``budget`` is not one of the search's forms, or no
                choice meets it (the message names the cheapest possible).

        Examples:
            >>> import jmp_policy as jp
            >>> from jmp_policy._src.map_search import LayerRow, SearchResult
            >>> int4, bf16 = "int4/128_from_mixed_bfloat16", "mixed_bfloat16"
            >>> rows = tuple(LayerRow(path, 16384, {bf16: 0.0, int4: score},
            ...                       {bf16: 32768, int4: 8704}, bf16, "")
            ...              for path, score in [("up", 0.5), ("down", 0.1)])
            >>> result = SearchResult(jp.DTypePolicyMap(bf16), rows, 65536, 16.0, 0.0, "")
            >>> small = result.at({"effective_bits": 11})
            >>> [(row.path, row.choice) for row in small.table]
            [('up', 'mixed_bfloat16'), ('down', 'int4/128_from_mixed_bfloat16')]
            >>> small.weight_bytes
            41472
        """
        kind, value = check_budget(budget)
        layers = [
            _Layer(
                r.path, r.params, [(n, r.bytes[n], r.scores[n]) for n in r.bytes], r.scored, r.unit
            )
            for r in self.table
        ]
        names = {n for row in self.table for n in row.bytes}
        policies = {n: get_policy(n) for n in sorted(names)}
        return _choose(layers, policies, self.policy_map.default_policy.name, kind, value)


class _Layer(NamedTuple):
    """A layer as the choice sees it: its options ``(name, bytes, score)``."""

    path: str
    params: int
    options: list[tuple[str, int, float]]
    scored: bool
    unit: str


# -- arguments ----------------------------------------------------------------------------


def check_candidates(candidates: Any, base: Any) -> tuple[str, dict[str, Any]]:
    """The base name and ``{name: policy}`` of the candidates (the base always among them).

    Raises:
        TypeError: ``candidates`` is not a sequence of strings, or ``base`` not a string.
        ValueError: a name is not a policy name, or a candidate stores no format a kernel
            can take (a float policy other than the base).
    """
    if not isinstance(base, str):
        raise TypeError(f"`base` must be a policy name (a string). Received: base={base!r}")
    if isinstance(candidates, str) or not isinstance(candidates, Sequence) or not candidates:
        raise TypeError(
            "`candidates` must be a non-empty list of policy names such as "
            f"{list(DEFAULT_CANDIDATES)!r}. Received: candidates={candidates!r}"
        )
    out: dict[str, Any] = {}
    for name in [base, *candidates]:
        if not isinstance(name, str):
            raise TypeError(
                f"`candidates` must hold policy names (strings). Received: {name!r} "
                f"(of type {type(name).__name__}) in candidates={candidates!r}"
            )
        try:
            policy = get_policy(name)
        except (TypeError, ValueError) as e:
            arg = "base" if name == base and name not in candidates else "candidates"
            raise ValueError(
                f"`{arg}` holds {name!r}, which is not a policy name: {e} Accepted: a float "
                "policy (the base, no quantization) or a quantized policy such as "
                f"{list(DEFAULT_CANDIDATES[1:])!r}."
            ) from e
        # A candidate is an option a layer may take: the base (a float policy, always
        # one, so naming it changes nothing) or a quantized policy.
        if name != base and _scheme(policy) is None and policy == out.get(base):
            continue
        if name != base and _scheme(policy) is None:
            raise ValueError(
                f"`candidates` holds {name!r}, a float policy: the only unquantized option "
                f"is `base` ({base!r}). Give quantized policy names (or set `base`). "
                f"Received: candidates={candidates!r}"
            )
        if name == base and _scheme(policy) is not None:
            raise ValueError(
                f"`base` must be a float policy (no quantization). Received: base={base!r}"
            )
        out.setdefault(name, policy)
    if len(out) == 1:
        raise ValueError(
            f"`candidates` holds no quantized policy: {base!r} is `base`, which every layer "
            "may keep, so there is nothing to choose. Give quantized policy names such as "
            f"{list(DEFAULT_CANDIDATES[1:])!r}. Received: candidates={candidates!r}"
        )
    return base, out


def check_budget(budget: Any) -> tuple[str, float]:
    """``(kind, value)`` of a budget ``{"effective_bits": 4.5}`` (one key of BUDGETS)."""
    if not isinstance(budget, Mapping) or len(budget) != 1:
        raise TypeError(
            "`budget` must be a dict of one of "
            f"{list(BUDGETS)} to a positive number, such as {{'effective_bits': 4.5}}. "
            f"Received: budget={budget!r}"
        )
    ((kind, value),) = budget.items()
    if kind not in BUDGETS:
        raise ValueError(f"`budget` must name one of {list(BUDGETS)}. Received: budget={budget!r}")
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not 0 < value < float("inf")
    ):
        raise ValueError(
            f"`budget`'s {kind!r} must be a finite positive number. Received: budget={budget!r}"
        )
    return kind, float(value)


def _scheme(policy: Any) -> Any:
    return getattr(policy, "scheme", None)


def stores_weights(policy_map: DTypePolicyMap) -> bool:
    """Whether the map holds a policy whose format stores quantized kernels."""
    return any(getattr(_scheme(p), "stores_weights", False) for p in policy_map.values())


def _scored_as(name: str, policy: Any) -> Any:
    """The policy a candidate is scored under: a stateful format (float8 with delayed
    scaling) by its stateless form (current scaling), its state being unknown here."""
    scheme = _scheme(policy)
    if scheme is None or not scheme.stateful:
        return policy
    stateless = scheme.stateless()
    if stateless is None:
        raise ValueError(
            f"`candidates` holds {name!r}, whose layers keep state: it cannot be scored."
        )
    return get_policy(f"{stateless.mode_text()}_from_{policy.source_name}")


def kernel_bytes(policy: Any, kernel: Any, stacked: int = 0, at: int = 0) -> int | None:
    """Bytes of ``kernel`` as served under ``policy``; ``None``: the format cannot take it.

    A float policy counts its compute dtype; a format that stores weights its quantized
    array (scales included; ``stacked`` leading axes of layers, each quantized on its
    own, starting at axis ``at``); a format that quantizes at compute time (float8) one
    byte per parameter.
    """
    scheme = _scheme(policy)
    size = int(np.prod(kernel.shape))
    if scheme is None:
        return size * np.dtype(policy.compute_dtype).itemsize
    if not scheme.stores_weights:
        return size
    try:
        shapes = jax.eval_shape(
            lambda k: scheme.quantize(
                jnp.moveaxis(k, range(at, at + stacked), range(stacked)), stacked
            ),
            kernel,
        )
    except (TypeError, ValueError):
        return None
    return int(shapes.nbytes)


# -- the taps -----------------------------------------------------------------------------


class Loops(NamedTuple):
    """The loops a layer's taps ran in: their lengths and kinds (``"scan"``, ``"vmap"``)."""

    lengths: tuple[int, ...] = ()
    kinds: tuple[str, ...] = ()


class _State:
    """What the taps of one run record. A scan body over a layer stack (or a vmap's lane)
    gets a state of its own (its trace, its iteration ``index``), sharing ``stacks`` with
    the run's."""

    def __init__(self, mode: str, targets: frozenset[str], **arrays: Any):
        self.mode = mode
        self.targets = targets
        self.arrays = arrays
        self.trace = context.current_trace()
        self.index: tuple[Any, ...] = ()  # the iteration (or lane) of each enclosing loop
        self.lengths: tuple[int, ...] = ()  # and their lengths
        self.loops: tuple[str, ...] = ()  # and their kinds: "scan" or "vmap"
        self.calls: dict[str, int] = {}
        self.ys: dict[str, list[Any]] = {}
        self.scores: dict[str, Any] = {}
        self.stacks: dict[str, Loops] = {}  # path -> the lengths and kinds of its loops

    def inner(self, i: Any = None, length: int = 0, loop: str = "scan") -> _State:
        """The state of a body traced apart: a ``loop``'s (``"scan"``'s iteration or
        ``"vmap"``'s lane) ``i`` of ``length``, or (``i`` None) a rematerialized call, at
        this state's iteration."""
        state = _State.__new__(_State)
        state.mode, state.targets, state.arrays = self.mode, self.targets, self.arrays
        state.trace = context.current_trace()
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


_STATE: contextvars.ContextVar[_State | None] = contextvars.ContextVar(
    "jmp_policy_map_search", default=None
)


class ScoreTaps:
    """The search's extension of the hook; it acts only inside :func:`_tapping`."""

    def __call__(self, call: Any, next_fn: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        state = _STATE.get()
        path = call.path
        if state is None or path not in state.targets:
            return next_fn(*args, **kwargs)
        if context.current_trace() is not state.trace:  # a transform the search cannot see
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
    if state is None or context.current_trace() is not state.trace:
        return scan(f, init, *args, **kwargs)
    traced: list[_State] = []

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
    if state is None or context.current_trace() is not state.trace:
        return plain(*a, **k)
    traced: list[_State] = []

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
def _recording_into(inner: _State, traced: list[_State]) -> Iterator[Callable[[], Any]]:
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
    if state is None or context.current_trace() is not state.trace:
        return plain(*a, **k)
    traced: list[_State] = []

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
def _tapping(state: _State) -> Iterator[_State]:
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


# -- the search ---------------------------------------------------------------------------

_HINT = (
    "Each batch is given to `inputs` (default: the model's one argument), and the model's "
    "outputs with the batch to `loss_fn`: check their shapes and dtypes."
)

# make_loss(policy_map) -> (fn(params, batch) -> scalar loss, params for that map)
MakeLoss = Callable[[DTypePolicyMap], tuple[Callable[[Any, Any], Any], Any]]


def search(  # long: the passes in their order (gradients, then one per candidate)
    kernels: Mapping[str, Any],
    make_loss: MakeLoss,
    batches: Sequence[Any],
    *,
    candidates: Sequence[str],
    budget: Mapping[str, float],
    base: str,
    jit: bool,
    progress: Callable[[str], None] | None = None,
    stacked_at: Mapping[str, int] | Callable[[], Mapping[str, int]] | None = None,
    reuse: tuple[Any, ...] | None = None,
) -> SearchResult:
    """The search on ``kernels`` (``{layer path: kernel}``), with the glue's runs.

    ``stacked_at``: layer path -> the axis its stacked kernel's layer axes start at (absent:
    0, leading), or a function giving it, called once the batches are checked and the model
    ran on the first. ``reuse``: what the glue's runs are functions of besides their inputs (the
    module, ``loss_fn``, ...), by identity; with it, the jit-compiled passes are kept across
    calls (:func:`_compiled`), so searching the same model again compiles nothing new."""
    base, policies = check_candidates(candidates, base)
    kind, value = check_budget(budget)
    if isinstance(batches, (str, bytes)) or not isinstance(batches, Sequence) or not batches:
        shown = f"of type {type(batches).__name__}"
        if isinstance(batches, (str, bytes, Sequence)):
            shown = f"={dt.bounded_repr(batches)}"
        raise TypeError(
            f"`batches` must be a non-empty list of calibration batches. Received: batches{shown}"
        )
    check_bool(jit, "jit", "compile the passes")
    if progress is not None and not callable(progress):
        raise TypeError(
            "`progress` must be None or a callable given a message before each pass (print, "
            f"or a tqdm bar's set_description). Received: progress={progress!r} "
            f"(of type {type(progress).__name__})"
        )
    if not kernels:
        raise ValueError("The model has no layer with a kernel: there is nothing to search.")
    check_no_nan(batches, "search_map")
    say = progress or (lambda _: None)
    targets = frozenset(kernels)

    def wrap(f: Callable[..., Any], *pass_key: Any) -> Callable[..., Any]:
        if not jit:
            return f
        if reuse is None:
            return jax.jit(f)
        return _compiled(reuse, (base, tuple(sorted(targets)), *pass_key), f)

    base_map = DTypePolicyMap(base)
    fn, params = make_loss(base_map)

    stacks: dict[str, Loops] = {}

    def shapes(params: Any, batch: Any) -> dict[str, list[Any]]:
        with _tapping(_State("shapes", targets)) as state:
            fn(params, batch)
        stacks.update(state.stacks)
        return state.ys

    with blaming("batches[0]", batches[0], "search_map", _HINT):
        seen = jax.eval_shape(shapes, params, batches[0])
    eps = {p: [jnp.zeros(s.shape, s.dtype) for s in v] for p, v in seen.items()}
    scored = sorted(eps)
    at = (stacked_at() if callable(stacked_at) else stacked_at) or {}
    layout = {p: _stacking(kernels[p], stacks.get(p, Loops()), at.get(p, 0)) for p in kernels}
    # (stacked axes, the table's unit, the axis they start at)

    def record(eps: Any, params: Any, batch: Any) -> Any:
        with _tapping(_State("record", targets, eps=eps)) as state:
            loss = fn(params, batch)
        return loss, state.ys

    grad = wrap(jax.grad(record, has_aux=True), "gradients")
    cached = []
    for i, batch in enumerate(batches):
        say(f"gradients: batch {i + 1}/{len(batches)}")
        with blaming(f"batches[{i}]", batch, "search_map", _HINT):
            gs, ys = grad(eps, params, batch)
        cached.append((ys, gs))

    scores: dict[str, dict[str, float]] = {p: {} for p in kernels}
    for name, policy in policies.items():
        if name == base:
            for p in scored:
                scores[p][name] = 0.0
            continue
        fits = [p for p in scored if kernel_bytes(policy, kernels[p], *layout[p][::2]) is not None]
        if not fits:
            continue
        cand_map = DTypePolicyMap(base, {re.escape(p): _scored_as(name, policy) for p in fits})
        cand_fn, cand_params = make_loss(cand_map)

        def score(
            params: Any, batch: Any, ys: Any, gs: Any, cand_fn: Any = cand_fn, fits: Any = fits
        ) -> Any:
            with _tapping(_State("score", frozenset(fits), ys=ys, gs=gs)) as state:
                cand_fn(params, batch)
            return state.scores

        run = wrap(score, "score", name, tuple(fits))
        totals: dict[str, float] = {}
        for i, (batch, (ys, gs)) in enumerate(zip(batches, cached, strict=True)):
            say(f"{name}: batch {i + 1}/{len(batches)}")
            with blaming(f"batches[{i}]", batch, "search_map", _HINT):
                out = run(cand_params, batch, ys, gs)
            for p, s in out.items():
                totals[p] = totals.get(p, 0.0) + float(s) / len(batches)
        for p in fits:
            scores[p][name] = _finite(totals.get(p, 0.0), name, p)
    layers = []
    for p in kernels:
        options = []
        for name, policy in policies.items():
            if name in scores[p] or name == base:
                b = kernel_bytes(policy, kernels[p], *layout[p][::2])
                if b is not None:
                    options.append((name, b, scores[p].get(name, 0.0)))
        size = int(np.prod(kernels[p].shape))
        layers.append(_Layer(p, size, options, p in eps, layout[p][1]))
    return _choose(layers, policies, base, kind, value)


# (the ids of a search's `reuse` objects, its pass) -> (those objects, the jitted pass)
_COMPILED: collections.OrderedDict[tuple[Any, ...], tuple[tuple[Any, ...], Any]] = (
    collections.OrderedDict()
)
_COMPILED_LOCK = threading.Lock()
#: How many jitted passes are kept (each holds its model alive).
MAX_COMPILED = 64


def _compiled(reuse: tuple[Any, ...], pass_key: tuple[Any, ...], f: Callable[..., Any]) -> Any:
    """``jax.jit(f)``, the same one for the same pass of the same ``reuse`` objects (by
    identity, kept alive with it so that an id is never another object's; strings by
    value): jit's own cache then holds each shape's executable, and a second search of a
    model compiles nothing."""
    key = (tuple(r if isinstance(r, str) else id(r) for r in reuse), pass_key)
    with _COMPILED_LOCK:
        found = _COMPILED.get(key)
        same = found is not None and all(
            a is b or isinstance(a, str) for a, b in zip(found[0], reuse, strict=True)
        )  # a string (options' text) is in the key by value
        if found is not None and same:
            _COMPILED.move_to_end(key)
            return found[1]
        jitted = jax.jit(f)
        _COMPILED[key] = (reuse, jitted)
        if len(_COMPILED) > MAX_COMPILED:
            _COMPILED.popitem(last=False)
        return jitted


def _finite(score: float, name: str, path: str) -> float:
    """A layer's score, refused when not finite (a NaN loss would choose any candidate)."""
    if not np.isfinite(score):
        raise ValueError(
            f"search_map: the score of {name!r} on layer {path!r} is {score} (the loss or "
            "its gradient on the batches is not finite): check `loss_fn` and `batches` "
            "(the base policy's loss must be finite)."
        )
    return score


def _stacking(kernel: Any, loops: Loops, at: int = 0) -> tuple[int, str, int]:
    """How many axes of ``kernel`` (from axis ``at``, as the glue learnt from the stack's
    ``variable_axes``) stack layers, and the table's unit for a layer its taps saw inside
    ``loops`` (none: a layer)."""
    lengths = loops.lengths
    if not lengths:
        return 0, "layer", 0
    steps = int(np.prod(lengths))
    kinds = sorted(set(loops.kinds))  # ["scan"], ["vmap"] or both
    n = len(lengths)
    if tuple(kernel.shape[at : at + n]) == lengths and kernel.ndim - n >= 2:
        how = " and ".join({"scan": "scanned", "vmap": "vmapped"}[k] for k in kinds)
        return n, f"per stack ({how}: {steps} layers)", at
    over = " and ".join({"scan": "scan iterations", "vmap": "vmap lanes"}[k] for k in kinds)
    return 0, f"one kernel shared by {steps} {over}", 0


def _choose(  # long: feasibility, the knapsack and the table, in one place
    table: Sequence[_Layer],
    policies: Mapping[str, Any],
    base: str,
    kind: str,
    value: float,
) -> SearchResult:
    paths = [layer.path for layer in table]
    options = {layer.path: layer.options for layer in table}
    sizes = {layer.path: layer.params for layer in table}
    total_params = sum(sizes.values())
    layers = [[(float(b), s) for _, b, s in options[p]] for p in paths]
    least_bytes = map_choice.cheapest(layers, 0)
    if kind == "loss_increase":
        least_loss = map_choice.cheapest(layers, 1)
        if value < least_loss:
            raise ValueError(
                f"No choice of the candidates keeps the estimated loss increase within "
                f"`budget`={{'loss_increase': {value!r}}}: the least possible is "
                f"{least_loss:.6g}."
            )
        picks, method = map_choice.choose(layers, value, minimize="cost")
    else:
        bound = value if kind == "weight_bytes" else value * total_params / 8
        if bound < least_bytes:
            raise ValueError(
                f"No choice of the candidates fits `budget`={{{kind!r}: {value!r}}}: the "
                f"cheapest possible is {int(least_bytes):,} weight bytes "
                f"({8 * least_bytes / total_params:.4g} effective bits per parameter)."
            )
        picks, method = map_choice.choose(layers, bound, minimize="score")
    choices = {p: options[p][j][0] for p, j in zip(paths, picks, strict=True)}
    rows = []
    for layer, j in zip(table, picks, strict=True):
        p = layer.path
        rows.append(
            LayerRow(
                path=p,
                params=sizes[p],
                scores={n: s for n, _, s in options[p]},
                bytes={n: b for n, b, _ in options[p]},
                choice=choices[p],
                why=_why(options[p], j, layer.scored, layer.unit),
                unit=layer.unit,
                scored=layer.scored,
            )
        )
    entries = compact(choices, base)
    policy_map = DTypePolicyMap(base, {k: policies[n] for k, n in entries.items()})
    total_bytes = sum(options[p][j][1] for p, j in zip(paths, picks, strict=True))
    loss = sum(options[p][j][2] for p, j in zip(paths, picks, strict=True))
    return SearchResult(
        policy_map, tuple(rows), int(total_bytes), 8 * total_bytes / total_params, loss, method
    )


def _why(options: list[tuple[str, int, float]], j: int, scored: bool, unit: str) -> str:
    if not scored:
        return (
            "not scored (called inside a transform the search cannot see into: one other "
            "than a scan, remat or vmap, or an nnx.remat/nnx.vmap function made before the "
            "search ran): base kept"
        )
    _, b, s = options[j]
    if unit.startswith("per stack"):
        unit += ", one entry of the map for all its layers"
    if len(options) == 1:
        why = "the only candidate that fits its kernel"
    elif b == min(o[1] for o in options):
        why = f"the cheapest candidate ({b:,} bytes)"
    else:
        cheaper = [o for o in options if o[1] < b]
        nxt = max(cheaper, key=lambda o: (o[1], -o[2]))
        why = (
            f"on the budget's frontier: {nxt[0]} would save {b - nxt[1]:,} bytes for "
            f"+{nxt[2] - s:.3g} estimated loss"
        )
    return why if unit == "layer" else f"{unit}; {why}"


# -- compaction ---------------------------------------------------------------------------

_NUMBER = re.compile(r"\d+")


def compact(choices: Mapping[str, str], base: str) -> dict[str, str]:
    """Map entries for ``choices`` (``{path: name}``), base layers left to the default.

    Paths that differ only by their numbers (``blocks_0/mlp/up``, ``blocks_1/mlp/up``)
    and share a choice become one regular expression when it covers them and no other
    path; the others stay exact (escaped).
    """
    groups: dict[str, list[str]] = {}
    for path in choices:
        template = _NUMBER.sub("\0", path)
        groups.setdefault(template, []).append(path)
    entries: dict[str, str] = {}
    for template, paths in groups.items():
        named = [p for p in paths if choices[p] != base]
        by_choice: dict[str, list[str]] = {}
        for p in named:
            by_choice.setdefault(choices[p], []).append(p)
        for name, members in by_choice.items():
            if len(members) < 2 or template.count("\0") != 1:
                entries.update({re.escape(p): name for p in members})
                continue
            parts = [re.escape(part) for part in template.split("\0")]
            numbers = [_NUMBER.findall(p)[0] for p in members]
            every = len(members) == len(paths)
            middle = r"\d+" if every else "(?:" + "|".join(numbers) + ")"
            key = middle.join(parts)
            covered = [p for p in choices if re.fullmatch(key, p)]
            if sorted(covered) == sorted(members):
                entries[key] = name
            else:
                entries.update({re.escape(p): name for p in members})
    return entries
