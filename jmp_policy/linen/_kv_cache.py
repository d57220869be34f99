"""Quantized KV caches for Linen: a hook on Flax's ``"cache"`` variable reads and writes
and on ``lax.dynamic_update_slice``, active for one model run.

Flax's ``MultiHeadDotProductAttention(decode=True)`` reads ``cached_key.value``, writes the
new token with ``lax.dynamic_update_slice`` and stores the result back. Under ``kv_cache=``
the stored value is a :class:`~jmp_policy.QuantizedKVCache`: a read hands the module the
cache dequantized (``values * scale``, elementwise, fused into the attention's dot); that
array's ``dynamic_update_slice`` quantizes the new tokens alone and writes them into the
stored values and scales, returning the updated cache dequantized; storing that array back
stores the quantized cache. So a token is quantized once, at its step, and never again.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import jax
from flax.core.scope import Scope

from jmp_policy._src import interception
from jmp_policy._src.kv_cache import KVCacheSpec, QuantizedKVCache
from jmp_policy._src.kv_cache.cache import check_shape
from jmp_policy._src.user_warnings import warn

# The cache variables of Flax's attention (and of the Hugging Face Flax models' own).
CACHE_NAMES = ("cached_key", "cached_value")
COLLECTION = "cache"


class _Run:
    """One model run's caches: reads handed out (by id, with the array kept alive so the
    id stays unique) and the module paths whose caches were quantized."""

    def __init__(self, spec: KVCacheSpec) -> None:
        self.spec = spec
        self.reads: dict[int, tuple[Any, QuantizedKVCache]] = {}
        self.hooked: set[str] = set()
        self.rewritten: set[str] = set()

    def hand_out(self, cache: QuantizedKVCache) -> Any:
        read = cache.dequantize()
        self.reads[id(read)] = (read, cache)
        return read

    def cache_of(self, array: Any) -> QuantizedKVCache | None:
        entry = self.reads.get(id(array))
        return entry[1] if entry is not None and entry[0] is array else None

    def format_of(self, scope: Any, col: str, name: str) -> tuple[str, Any]:
        path = "/".join(str(p) for p in scope.path)
        if col != COLLECTION or name not in CACHE_NAMES:
            return path, None
        return path, self.spec.resolve(path)


_RUN: contextvars.ContextVar[_Run | None] = contextvars.ContextVar(
    "jmp_policy_linen_kv_cache", default=None
)


def _active() -> _Run | None:
    return _RUN.get() if _SCOPE.inside() else None


def _get_variable(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def get_variable(scope: Any, col: str, name: str, default: Any = None) -> Any:
        value = original(scope, col, name, default)
        run = _active()
        if run is None or value is default:
            return value
        path, fmt = run.format_of(scope, col, name)
        if fmt is None:
            return value
        if not isinstance(value, QuantizedKVCache):  # a float cache: quantized from now on
            check_shape(getattr(value, "shape", None), fmt, f"{path}/{name}")
            value = QuantizedKVCache.quantize(value, fmt)
        elif value.format != fmt.name:
            raise ValueError(
                f"The cache {path}/{name} is stored as {value.format}, but `kv_cache` asks "
                f"for {fmt.name} there. Create the cache again under the new format (run "
                f"`init` with kv_cache={run.spec.given!r}). Received: kv_cache={run.spec.given!r}"
            )
        run.hooked.add(path)
        return run.hand_out(value)

    return get_variable


def _put_variable(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def put_variable(scope: Any, col: str, name: str, value: Any) -> Any:
        run = _active()
        fmt = None if run is None else run.format_of(scope, col, name)[1]
        if run is None or fmt is None:
            return original(scope, col, name, value)
        path = run.format_of(scope, col, name)[0]
        written = run.cache_of(value)
        if written is None and not isinstance(value, QuantizedKVCache):
            # A cache created (init), or replaced whole rather than written a token at a
            # time: quantized whole (said once per run when it replaces a stored cache).
            if scope.has_variable(col, name):
                run.rewritten.add(f"{path}/{name}")
            check_shape(getattr(value, "shape", None), fmt, f"{path}/{name}")
            written = QuantizedKVCache.quantize(value, fmt)
        run.hooked.add(path)
        return original(scope, col, name, value if written is None else written)

    return put_variable


def _dynamic_update_slice(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def dynamic_update_slice(operand: Any, update: Any, start_indices: Any, **kwargs: Any) -> Any:
        run = _active()
        cache = None if run is None or kwargs else run.cache_of(operand)
        if run is None or cache is None:
            return original(operand, update, start_indices, **kwargs)
        return run.hand_out(cache.write(update, start_indices))

    return dynamic_update_slice


_SCOPE = interception.ThreadPatch(
    Scope, {"get_variable": _get_variable, "put_variable": _put_variable}
)
_LAX = interception.ThreadPatch(jax.lax, {"dynamic_update_slice": _dynamic_update_slice})

# The specs that have warned (once each: a spec belongs to one wrapper's options).
_WARNED: weakref.WeakSet[KVCacheSpec] = weakref.WeakSet()


@contextlib.contextmanager
def kv_caches(spec: KVCacheSpec | None) -> Iterator[None]:
    """Runs a Linen model call with its attention caches stored as ``spec`` says."""
    if spec is None:
        yield
        return
    run = _Run(spec)
    token = _RUN.set(run)
    try:
        with _SCOPE.active(), _LAX.active():
            yield
    finally:
        _RUN.reset(token)
    _report(run)


def _report(run: _Run) -> None:
    if run.spec in _WARNED:
        return
    if run.rewritten:
        _WARNED.add(run.spec)
        warn(
            f"The caches {sorted(run.rewritten)} were replaced whole, not written a token at "
            "a time with `lax.dynamic_update_slice`: jmp_policy quantized them again whole, "
            "so their earlier tokens were quantized twice. Write new tokens with "
            "`lax.dynamic_update_slice(cached.value, new, indices)` as Flax's attention does."
        )
    elif not run.hooked:
        _WARNED.add(run.spec)
        warn(
            f"kv_cache={run.spec.given!r} matched no attention cache in this call: jmp_policy "
            f"quantizes the {COLLECTION!r} collection's {' and '.join(CACHE_NAMES)} of the "
            "modules it names (Flax's MultiHeadDotProductAttention(decode=True)). Check the "
            "module paths of `kv_cache` (jp.linen.explain lists them), build the model with "
            "decode=True and pass mutable=['cache'], or drop `kv_cache`."
        )
