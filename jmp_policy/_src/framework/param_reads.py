"""Parameters cast as a model reads them, for an adapter that hooks its framework's
parameter reads (Linen's ``Scope.get_variable``): :func:`read_fix` decides each read's
dtype, :func:`reading` makes it the fix of the run in progress, which the hooks ask for
(:func:`fix`), and :func:`unfixed_reads` lets a block read the values as passed.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from jmp_policy._src import casting, quantization, transforms
from jmp_policy._src import dtypes as dt
from jmp_policy._src.framework.run_kernels import promotable
from jmp_policy._src.options import Options
from jmp_policy._src.quantization import stack_layers
from jmp_policy._src.resolution import Resolver
from jmp_policy._src.tree_paths import parent_path

_MAX_RETRACES = 8


class Stale(Exception):
    """A module met during a run changes how its parameters should have been cast."""


# The parameter reads of the run in progress: fix(path, value) -> value.
_READS: contextvars.ContextVar[Callable[[str, Any], Any] | None] = contextvars.ContextVar(
    "jmp_policy_param_reads", default=None
)
_UNFIXED: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "jmp_policy_param_reads_unfixed", default=False
)


def fix(raw_too: bool = False) -> Callable[[str, Any], Any] | None:
    """The fix of the run in progress: ``None`` outside one, and inside
    :func:`unfixed_reads` unless ``raw_too``."""
    return None if _UNFIXED.get() and not raw_too else _READS.get()


@contextlib.contextmanager
def unfixed_reads() -> Iterator[None]:
    """Parameter reads in the block return the values as passed, not cast."""
    token = _UNFIXED.set(True)
    try:
        yield
    finally:
        _UNFIXED.reset(token)


@contextlib.contextmanager
def reading(read: Callable[[str, Any], Any]) -> Iterator[None]:
    """Every parameter read in the block goes through ``read(path, value)``."""
    token = _READS.set(read)
    try:
        yield
    finally:
        _READS.reset(token)


def read_fix(
    chosen: Resolver, resolver: Resolver, stored: dict[str, Any], early: set[str]
) -> Callable[[str, Any], Any]:
    """Casts each parameter as the model reads it, to the compute dtype of its module's
    policy (known by then: the interceptor records a module before it runs), so each is
    cast once, in the dtype it is used in, and one never read is never cast.

    A parameter read before its module is met (a parent reading a child's variables) is
    cast as ``chosen`` (what earlier runs knew) and its path added to ``early``, checked
    after the run. QuantizedArrays reach Flax already cast (as ``chosen``): one whose
    module wants another dtype is read cast from its stored value; a stored value that is
    not the one read (a layer of an ``nn.scan`` stack) stops the run instead."""
    # A value read twice in one trace is cast once; the trace is checked, so a cast made
    # inside a JAX transform (`jax.checkpoint` in a module) never leaks out of it.
    done: dict[tuple[str, int], tuple[Any, Any, Any]] = {}

    def read(path: str, value: Any) -> Any:
        if stack_layers.is_extra_leaf(path.rpartition("/")[2]):
            return value  # a stacked kernel's scales, read by its layer's matmul as stored
        module = parent_path(path) or ""
        if module in resolver.infos:
            want = resolver.variable(path)[0].compute_dtype
        else:
            early.add(path)  # not met yet: read as chosen, checked after the run
            want = chosen.variable(path)[0].compute_dtype
        original = stored.get(path)
        if quantization.is_quantized(original) and not dt.is_floating(
            np.dtype(getattr(value, "dtype", np.float32))
        ):
            # Quantized values (a whole kernel's, or a stack's layer's slice), which the
            # layer's matmul reads with the scales; Flax promotes this copy (int4 has no
            # implicit promotion: int8), unused by the matmul, so it is dead code.
            return promotable(value)
        if quantization.is_quantized(original):
            if chosen.variable(path)[0].compute_dtype == want:
                return value
            if getattr(original, "shape", None) != getattr(value, "shape", ()):
                raise Stale(path)
            return casting.compute_leaf(original, want)
        key, trace = (path, id(value)), transforms.current_trace()
        entry = done.get(key)
        if entry is None or entry[1] != trace:
            entry = done[key] = (value, trace, casting.compute_tree(value, want))
        return entry[2]

    return read


def settle(
    known: dict[str, Any],
    resolved: Any,
    options: Options,
    stored: dict[str, Any],
    cast_for: Callable[[Resolver], Any],
    attempt: Callable[[Any, Resolver, Callable[[str, Any], Any]], Any],
    relearn: Callable[[Any], None],
    on_error: Callable[[Resolver], None] | None,
    name: str,
) -> tuple[Any, Resolver, Any]:
    """Runs the model until its parameter casts settle: ``attempt(cast, resolver, read)``
    on the parameters ``cast_for(chosen)`` gives (``chosen``: a resolver of the modules
    ``known`` so far), each read going through ``read`` (:func:`read_fix` on ``stored``,
    variable path -> stored leaf). A run cut short (:class:`Stale`) has the model's shape
    learnt (``relearn(cast)``, adding to ``known``) and runs again; so does one in which
    a parameter read before its module was met was cast otherwise than its module wants.

    Returns:
        ``(result, resolver, cast)`` of the run that counts.
    """
    for _ in range(_MAX_RETRACES):
        chosen = Resolver(resolved, options, dict(known))
        cast = cast_for(chosen)
        resolver = Resolver(resolved, options, dict(known))
        error: Exception | None = None
        early: set[str] = set()
        try:
            result = attempt(cast, resolver, read_fix(chosen, resolver, stored, early))
        except Stale:
            # Cut short: a module met changes a cast. Learn the whole model shape-only
            # (nothing computed, nothing added to the caller's trace), then run again.
            known.update(resolver.infos)
            relearn(cast)
            continue
        except Exception as e:
            error = e
        resolver.used_keys |= chosen.used_keys
        learnt = Resolver(resolved, options, dict(resolver.infos))
        # Parameters read after their module was met were read in the right dtype; a
        # difference left is one read before (a parent reading a child's variables).
        stale = any(
            chosen.variable(p)[0].compute_dtype != learnt.variable(p)[0].compute_dtype
            for p in early
        )
        known.update(resolver.infos)
        if error is not None:
            if not stale:
                if on_error is not None:
                    on_error(resolver)  # say what was turned off before the error
                raise error
            continue
        if not stale:
            return result, resolver, cast
    raise RuntimeError(  # pragma: no cover - only a model that changes with every trace
        f"{name} calls different modules on every trace; jmp_policy could not settle the "
        "dtypes of its parameters."
    )
