"""The search's passes, in their order: gradients at every layer's output, then one per candidate.

The scoring of ModelOpt's ``auto_quantize``, on plain pytrees (the Linen and NNX glue
supply the runs). For each layer with a kernel:

1. a few backward passes on calibration batches cache its output ``y`` and the gradient
   ``g`` of the loss at that output (the taps, :mod:`._taps`);
2. for each candidate, one forward pass with every layer under the candidate, each layer
   given the *baseline* output of the layers before it, gives its own output error
   ``dy = Q(y) - y``;
3. its score is ``0.5 * mean over examples of (n * g_i . dy_i)^2`` (``n`` rows of the
   output's leading axis, the examples a mean loss averages; ``g_i . dy_i`` sums over the
   other axes). It weighs each format's *actual* output error by the gradient, not the
   Fisher trace alone. The scores add up to an estimate of the loss increase.

A layer stack is scored as one layer of the map (a path map cannot tell its layers apart):
the sum of its iterations' scores, all its layers' bytes. The choice is :mod:`._choice`'s.
"""

from __future__ import annotations

import collections
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jmp_policy._src import dtypes as dt
from jmp_policy._src.batch_checks import blaming, check_bool, check_no_nan
from jmp_policy._src.map_search._candidates import check_candidates, kernel_bytes, scored_as
from jmp_policy._src.map_search._choice import ScoredLayer, SearchResult, check_budget, choose
from jmp_policy._src.map_search._taps import Loops, State, tapping
from jmp_policy._src.policy_map import DTypePolicyMap

_HINT = (
    "Each batch is given to `inputs` (default: the model's one argument), and the model's "
    "outputs with the batch to `loss_fn`: check their shapes and dtypes."
)

# make_loss(policy_map) -> (fn(params, batch) -> scalar loss, params for that map)
MakeLoss = Callable[[DTypePolicyMap], tuple[Callable[[Any, Any], Any], Any]]


def search(
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
    _check_arguments(kernels, batches, jit, progress)
    say = progress or (lambda _: None)
    targets = frozenset(kernels)

    def wrap(f: Callable[..., Any], *pass_key: Any) -> Callable[..., Any]:
        if not jit:
            return f
        if reuse is None:
            return jax.jit(f)
        return _compiled(reuse, (base, tuple(sorted(targets)), *pass_key), f)

    fn, params = make_loss(DTypePolicyMap(base))
    eps, stacks = _shapes(fn, params, batches[0], targets)
    at = (stacked_at() if callable(stacked_at) else stacked_at) or {}
    # (stacked axes, the table's unit, the axis they start at)
    layout = {p: _stacking(kernels[p], stacks.get(p, Loops()), at.get(p, 0)) for p in kernels}
    cached = _gradients(wrap, fn, params, batches, eps, targets, say)
    scored = sorted(eps)
    scores: dict[str, dict[str, float]] = {p: {} for p in kernels}
    for name, policy in policies.items():
        if name == base:
            for p in scored:
                scores[p][name] = 0.0
            continue
        fits = [p for p in scored if kernel_bytes(policy, kernels[p], *layout[p][::2]) is not None]
        if fits:
            cand_map = DTypePolicyMap(base, {re.escape(p): scored_as(name, policy) for p in fits})
            totals = _candidate_scores(wrap, make_loss(cand_map), batches, cached, name, fits, say)
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
        layers.append(ScoredLayer(p, size, options, p in eps, layout[p][1]))
    return choose(layers, policies, base, kind, value)


def _check_arguments(kernels: Mapping[str, Any], batches: Any, jit: Any, progress: Any) -> None:
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


def _shapes(
    fn: Callable[[Any, Any], Any], params: Any, batch: Any, targets: frozenset[str]
) -> tuple[dict[str, list[Any]], dict[str, Loops]]:
    """The zero perturbations of every output the taps see (shapes only: nothing runs), and
    the loops each layer ran in."""
    stacks: dict[str, Loops] = {}

    def shapes(params: Any, batch: Any) -> dict[str, list[Any]]:
        with tapping(State("shapes", targets)) as state:
            fn(params, batch)
        stacks.update(state.stacks)
        return state.ys

    with blaming("batches[0]", batch, "search_map", _HINT):
        seen = jax.eval_shape(shapes, params, batch)
    eps = {p: [jnp.zeros(s.shape, s.dtype) for s in v] for p, v in seen.items()}
    return eps, stacks


def _gradients(
    wrap: Callable[..., Any],
    fn: Callable[[Any, Any], Any],
    params: Any,
    batches: Sequence[Any],
    eps: Any,
    targets: frozenset[str],
    say: Callable[[str], None],
) -> list[tuple[Any, Any]]:
    """The first pass: per batch, every layer's output ``y`` and the loss's gradient there."""

    def record(eps: Any, params: Any, batch: Any) -> Any:
        with tapping(State("record", targets, eps=eps)) as state:
            loss = fn(params, batch)
        return loss, state.ys

    grad = wrap(jax.grad(record, has_aux=True), "gradients")
    cached = []
    for i, batch in enumerate(batches):
        say(f"gradients: batch {i + 1}/{len(batches)}")
        with blaming(f"batches[{i}]", batch, "search_map", _HINT):
            gs, ys = grad(eps, params, batch)
        cached.append((ys, gs))
    return cached


def _candidate_scores(
    wrap: Callable[..., Any],
    loss: tuple[Callable[[Any, Any], Any], Any],
    batches: Sequence[Any],
    cached: list[tuple[Any, Any]],
    name: str,
    fits: list[str],
    say: Callable[[str], None],
) -> dict[str, float]:
    """A candidate's pass: the mean score over the batches of each layer in ``fits``."""
    cand_fn, cand_params = loss

    def score(params: Any, batch: Any, ys: Any, gs: Any) -> Any:
        with tapping(State("score", frozenset(fits), ys=ys, gs=gs)) as state:
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
    return totals


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
