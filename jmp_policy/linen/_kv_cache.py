"""Quantized KV caches for Linen: a hook on Flax's ``"cache"`` variables for one run.

Under ``kv_cache=`` the stored ``cached_key``/``cached_value`` is a
:class:`~jmp_policy.QuantizedKVCache`: a read hands the module the cache dequantized, whose
``dynamic_update_slice`` quantizes the new tokens alone
(:mod:`jmp_policy._src.kv_cache.hook`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

from jmp_policy._src import transforms
from jmp_policy._src.kv_cache import KVCacheSpec
from jmp_policy._src.kv_cache.hook import CACHE_NAMES, CacheRun, active

COLLECTION = "cache"
__all__ = ["CACHE_NAMES", "kv_caches"]


def _cache_format(scope: Any, col: str, name: str) -> tuple[Any, str, Any]:
    run = active()
    if run is None or col != COLLECTION:
        return run, "", None
    path = "/".join(str(p) for p in scope.path)
    return run, path, run.format_of(path, name)


def _get_variable(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def get_variable(scope: Any, col: str, name: str, default: Any = None) -> Any:
        value = original(scope, col, name, default)
        run, path, fmt = _cache_format(scope, col, name)
        if fmt is None or value is default:
            return value
        run.hooked.add(path)
        return run.hand_out(run.as_stored(value, fmt, f"{path}/{name}"))

    return get_variable


def _put_variable(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def put_variable(scope: Any, col: str, name: str, value: Any) -> Any:
        run, path, fmt = _cache_format(scope, col, name)
        if fmt is not None:
            existed = scope.has_variable(col, name)
            value = run.stored(value, fmt, f"{path}/{name}", existed)
            run.hooked.add(path)
        return original(scope, col, name, value)

    return put_variable


# Flax's Scope methods are patched once, with the parameter reads' (linen/_reads.py builds
# the one patch from both; the hooks act only inside their own runs).
cache_get_variable, cache_put_variable = _get_variable, _put_variable


def kv_caches(
    spec: KVCacheSpec | None, scope_patch: transforms.ThreadPatch
) -> contextlib.AbstractContextManager[Any]:
    """Runs a Linen model call with its attention caches stored as ``spec`` says
    (``scope_patch``: the patch of Flax's ``Scope`` holding this module's hooks)."""
    return contextlib.nullcontext() if spec is None else CacheRun(spec, scope_patch)
