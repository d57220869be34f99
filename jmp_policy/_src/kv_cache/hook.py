"""One model run with quantized caches, whatever the framework: the caches handed to the
model dequantized, the ``lax.dynamic_update_slice`` that writes their new tokens, and what
is said once the run is over.

A framework's glue (Linen: Flax's ``"cache"`` variable reads and writes; NNX: the
``nnx.Cache`` variables of a policy-running copy) hands each stored
:class:`QuantizedKVCache` to the model through :meth:`Run.hand_out` (``values * scale``,
elementwise, fused into the attention's dot) and takes back with :meth:`Run.stored` what
the model stored. In between, a ``dynamic_update_slice`` into a handed-out array quantizes
the update alone and writes it into the stored values and scales, so a token is quantized
once, at its step.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import weakref
from collections.abc import Callable
from typing import Any

from jmp_policy._src import transforms
from jmp_policy._src.kv_cache.cache import QuantizedKVCache, check_shape
from jmp_policy._src.kv_cache.formats import KVCacheFormat, KVCacheSpec
from jmp_policy._src.user_warnings import warn

# The cache variables of Flax's attention (Linen and NNX; the Hugging Face Flax models' too).
CACHE_NAMES = ("cached_key", "cached_value")


class Run:
    """One model run's caches: reads handed out (by id, with the array kept alive so the
    id stays unique), the module paths whose caches were quantized, and those replaced
    whole rather than written a token at a time."""

    def __init__(self, spec: KVCacheSpec) -> None:
        self.spec = spec
        self.reads: dict[int, tuple[Any, QuantizedKVCache]] = {}
        self.hooked: set[str] = set()
        self.rewritten: set[str] = set()

    def format_of(self, module_path: str, name: str) -> KVCacheFormat | None:
        """The format of the cache variable ``name`` of the module at ``module_path``:
        Flax's attention caches by their module's path (or the default), any other
        variable only by a key naming its own path."""
        if name in CACHE_NAMES:
            return self.spec.resolve(module_path)
        return self.spec.resolve_variable(f"{module_path}/{name}" if module_path else name)

    def hand_out(self, cache: QuantizedKVCache) -> Any:
        """The cache as the model reads it, remembered so its writes reach the cache."""
        read = cache.dequantize()
        self.reads[id(read)] = (read, cache)
        return read

    def cache_of(self, array: Any) -> QuantizedKVCache | None:
        entry = self.reads.get(id(array))
        return entry[1] if entry is not None and entry[0] is array else None

    def as_stored(self, value: Any, fmt: KVCacheFormat, variable: str) -> QuantizedKVCache:
        """A stored cache (quantized already), or a float cache quantized whole."""
        if isinstance(value, QuantizedKVCache):
            if value.format != fmt.name:
                raise ValueError(
                    f"The cache {variable} is stored as {value.format}, but `kv_cache` asks "
                    f"for {fmt.name} there. Create the cache again under the new format. "
                    f"Received: kv_cache={self.spec.given!r}"
                )
            return value
        check_shape(getattr(value, "shape", None), fmt, variable)
        return QuantizedKVCache.quantize(value, fmt)

    def stored(self, value: Any, fmt: KVCacheFormat, variable: str, existed: bool) -> Any:
        """What the model stores as the cache ``variable``: a written read's quantized
        cache; anything else quantized whole (a cache that ``existed`` was thus replaced
        whole, which is said once the run is over)."""
        written = self.cache_of(value)
        if written is not None:
            return written
        if existed and not isinstance(value, QuantizedKVCache):
            self.rewritten.add(variable)
        return self.as_stored(value, fmt, variable)


_RUN: contextvars.ContextVar[Run | None] = contextvars.ContextVar(
    "jmp_policy_kv_cache_run", default=None
)


def active() -> Run | None:
    """The run of this thread's model call, inside :func:`running`."""
    return _RUN.get() if _LAX.inside() else None


def _dynamic_update_slice(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def dynamic_update_slice(operand: Any, update: Any, start_indices: Any, **kwargs: Any) -> Any:
        run = active()
        cache = None if run is None or kwargs else run.cache_of(operand)
        if run is None or cache is None:
            return original(operand, update, start_indices, **kwargs)
        return run.hand_out(cache.write(update, start_indices))

    return dynamic_update_slice


_LAX = transforms.ThreadPatch("cache_writes", {"dynamic_update_slice": _dynamic_update_slice})

# The specs that have warned (once each: a spec belongs to one wrapper's options).
_WARNED: weakref.WeakSet[KVCacheSpec] = weakref.WeakSet()


class CacheRun:
    """A model call with its caches stored as ``spec`` says (``patches``: the glue's own,
    active with this module's); what went wrong is said when it ends without an error.

    ``with CacheRun(spec) as run:``. A class, not a generator: its warnings are
    attributed to the user's line, which a generator's ``contextlib`` frame would hide."""

    def __init__(
        self,
        spec: KVCacheSpec,
        *patches: transforms.ThreadPatch,
        where: str = "the 'cache' collection's",
        hint: str | None = None,
        quiet: bool = False,
    ) -> None:
        self.run = Run(spec)
        self._where = where
        self._hint = hint
        self._quiet = quiet  # says nothing when it ends (explain's run around a framework's)
        self._stack = contextlib.ExitStack()
        self._patches = (_LAX, *patches)

    def __enter__(self) -> Run:
        self._token = _RUN.set(self.run)
        for patch in self._patches:
            self._stack.enter_context(patch.active())
        return self.run

    def __exit__(self, kind: Any, error: Any, traceback: Any) -> None:
        try:
            self._stack.close()
        finally:
            _RUN.reset(self._token)
        if kind is None and not self._quiet:
            report(self.run, self._where, self._hint)


_FLAX_HINT = (
    "Check the module paths of `kv_cache` (explain lists the caches), build the model with "
    "decode=True (Linen: pass mutable=['cache']; NNX: call init_cache), or drop `kv_cache`."
)


def report(run: Run, where: str, hint: str | None = None) -> None:
    if run.spec in _WARNED:
        return
    if run.rewritten:
        _WARNED.add(run.spec)
        warn(
            f"The caches {sorted(run.rewritten)} were replaced whole, not written a token at "
            "a time with `lax.dynamic_update_slice`: jmp_policy quantized them again whole, "
            "so their earlier tokens were quantized twice. Write new tokens with "
            "`lax.dynamic_update_slice(cache, new, indices)` as Flax's attention does."
        )
    elif not run.hooked:
        _WARNED.add(run.spec)
        warn(
            f"kv_cache={run.spec.given!r} matched no attention cache in this call: jmp_policy "
            f"quantizes {where} {' and '.join(CACHE_NAMES)} of the modules it names (Flax's "
            "attention with decode=True), and any other cache variable a key names by its "
            f"whole path. {hint or _FLAX_HINT}"
        )
