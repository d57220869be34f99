"""Caches passed as arguments: a model that takes its attention cache as an argument and
returns the new one (the Gemma library's ``cache`` dict, ``{"k", "v", "end_index", ...}``
per layer) rather than keeping it in a variable.

Inside a model run with ``kv_cache=`` (:class:`~jmp_policy._src.kv_cache.hook.CacheRun`),
each module call hands the cache arguments that a key of ``kv_cache`` names by their whole
path (the module path, the argument's name, the path inside it: ``"layer_0/attn/cache/k"``)
to the module as reads of the stored cache (:meth:`Run.hand_out`): the
:class:`QuantizedKVCache` the library returned on an earlier step, or, on the first step, a
floating array quantized whole. The module's ``lax.dynamic_update_slice`` into a read quantizes the new
tokens alone (the hook's), and a read the module returns goes back as its stored cache, so
the caller gets a :class:`QuantizedKVCache` to pass on the next step. Under no run, or with
a ``kv_cache`` that names no path, nothing here runs.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import jax

from jmp_policy._src import dtypes
from jmp_policy._src.kv_cache.cache import QuantizedKVCache
from jmp_policy._src.kv_cache.formats import KVCacheSpec
from jmp_policy._src.kv_cache.hook import CacheRun, Run, active
from jmp_policy._src.kv_cache.report import cache_rows, format_caches
from jmp_policy._src.tree_paths import leaf_path

# {variable path: stored cache} of the argument caches handed out inside `recording`.
_RECORDED: contextvars.ContextVar[dict[str, QuantizedKVCache] | None] = contextvars.ContextVar(
    "jmp_policy_argument_caches", default=None
)


def is_cache(x: Any) -> bool:
    return isinstance(x, QuantizedKVCache)


def run_for(opaque: Callable[[Any], bool] | None) -> tuple[Run | None, Any]:
    """The cache run of this call (``None`` when no argument can be a cache) and the
    ``opaque`` predicate the hook's casts use (a stored cache is never cast)."""
    run = active()
    if run is None:
        return None, opaque
    if opaque is None:
        return run, is_cache
    return run, lambda x: is_cache(x) or opaque(x)


def _names(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``{argument name: value}`` as ``fn`` binds them (``"0"``, ``"1"``... when its
    signature cannot be read or does not bind)."""
    try:
        bound = inspect.signature(fn).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return {**{str(i): a for i, a in enumerate(args)}, **kwargs}
    named: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        kind = bound.signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_POSITIONAL:
            named.update({f"{name}/{i}": v for i, v in enumerate(value)})
        elif kind is inspect.Parameter.VAR_KEYWORD:
            named.update(value)
        else:
            named[name] = value
    return named


def hand_out(
    run: Run, path: str, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """The call's arguments with their caches handed out as reads (see the module), or
    ``None`` when no argument is a cache a key names (the call is left as it is, and so
    are its outputs: a cache read that only passes through goes back where it was made)."""
    if not run.spec.entries:
        return None
    flat, _ = jax.tree_util.tree_flatten_with_path(_names(fn, args, kwargs), is_leaf=is_cache)
    reads: dict[int, Any] = {}
    for key_path, leaf in flat:
        if run.cache_of(leaf) is not None:
            continue  # handed out by a caller already
        floating = hasattr(leaf, "dtype") and dtypes.is_floating(leaf.dtype)
        if not (is_cache(leaf) or floating):
            continue
        variable = "/".join(p for p in (path, leaf_path(key_path)) if p)
        fmt = run.spec.resolve_variable(variable)
        if fmt is None:
            continue
        run.hooked.add(path)
        stored = run.as_stored(leaf, fmt, variable)
        recorded = _RECORDED.get()
        if recorded is not None:
            recorded[variable] = stored
        reads[id(leaf)] = run.hand_out(stored)
    if not reads:
        return None

    def swap(x: Any) -> Any:
        return reads.get(id(x), x)

    return jax.tree.map(swap, (args, kwargs), is_leaf=is_cache)


def take_back(run: Run, out: Any) -> Any:
    """``out`` with each cache read the module returns replaced by its stored cache."""

    def back(x: Any) -> Any:
        cache = run.cache_of(x)
        return x if cache is None else cache

    return jax.tree.map(back, out, is_leaf=is_cache)


@contextlib.contextmanager
def recording(spec: KVCacheSpec | None) -> Iterator[dict[str, QuantizedKVCache]]:
    """A block (``explain``'s shape-only run) inside which the argument caches handed out
    are recorded, ``{variable path: stored cache}``, under a run of its own when the
    framework's run does not enter one (it says nothing when it ends)."""
    recorded: dict[str, QuantizedKVCache] = {}
    if spec is None or not spec.entries:
        yield recorded
        return
    token = _RECORDED.set(recorded)
    try:
        with CacheRun(spec, quiet=True):
            yield recorded
    finally:
        _RECORDED.reset(token)


def table(recorded: dict[str, QuantizedKVCache]) -> str:
    """``explain``'s rows of the argument caches (empty when there are none)."""
    return format_caches(cache_rows(recorded, None))
