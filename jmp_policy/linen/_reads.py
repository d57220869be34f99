"""Flax's variable reads hooked for one run (one patch of ``Scope``, both hooks acting
only inside their own runs): parameters cast as the model reads them (``Scope.get_variable``
and ``Module.variables``; each read handed to the run's fix,
:mod:`jmp_policy._src.framework.param_reads`), and quantized KV caches under
``kv_cache=`` (:mod:`jmp_policy._src.kv_cache.hook` does the rest).

Flax's ``MultiHeadDotProductAttention(decode=True)`` reads ``cached_key.value``, writes the
new token with ``lax.dynamic_update_slice`` and stores the result back. Under ``kv_cache=``
the stored value is a :class:`~jmp_policy.QuantizedKVCache`: a read hands the module the
cache dequantized; that array's ``dynamic_update_slice`` quantizes the new tokens alone
into the stored values and scales; storing the result stores the quantized cache.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import flax.linen as nn
import jax

from jmp_policy._src import quantization, transforms
from jmp_policy._src.framework import param_reads
from jmp_policy._src.framework.params_tree import with_params
from jmp_policy._src.kv_cache import KVCacheSpec
from jmp_policy._src.kv_cache.hook import CacheRun, active
from jmp_policy._src.tree_paths import leaf_path


def _cache_format(scope: Any, col: str, name: str) -> tuple[Any, str, Any]:
    run = active()
    if run is None or col != "cache":
        return run, "", None
    path = "/".join(str(p) for p in scope.path)
    return run, path, run.format_of(path, name)


def _get_variable(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def get_variable(scope: Any, col: str, name: str, default: Any = None) -> Any:
        value = original(scope, col, name, default)
        if value is default:
            return value
        if col == "params":
            fix = param_reads.fix()
            return value if fix is None else fix("/".join(map(str, (*scope.path, name))), value)
        run, path, fmt = _cache_format(scope, col, name)
        if fmt is None:
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


def _variables(original: Any) -> Any:
    def variables(module: nn.Module) -> Any:
        value = original.fget(module)
        fix, scope = param_reads.fix(raw_too=True), module.scope
        if fix is None or scope is None or not isinstance(value, Mapping):
            return value
        stem = tuple(str(p) for p in scope.path)

        def fixed(key_path: Any, leaf: Any) -> Any:
            return fix("/".join((*stem, leaf_path(key_path))), leaf)

        is_leaf = quantization.is_quantized
        return with_params(
            value, lambda p: jax.tree_util.tree_map_with_path(fixed, p, is_leaf=is_leaf)
        )

    return property(variables, doc=original.__doc__)


# One patch of Flax's Scope for both hooks (two patches of one attribute would restore
# each other's replacements when threads interleave).
_SCOPE = transforms.ThreadPatch(
    "param_reads", {"get_variable": _get_variable, "put_variable": _put_variable}
)
_MODULE_READS = transforms.ThreadPatch("module_reads", {"variables": _variables})


@contextlib.contextmanager
def reading(fix: Callable[[str, Any], Any]) -> Iterator[None]:
    """Every parameter read in the block goes through ``fix(path, value)``."""
    with param_reads.reading(fix), _SCOPE.active(), _MODULE_READS.active():
        yield


def kv_caches(spec: KVCacheSpec | None) -> contextlib.AbstractContextManager[Any]:
    """Runs a Linen model call with its attention caches stored as ``spec`` says."""
    return contextlib.nullcontext() if spec is None else CacheRun(spec, _SCOPE)
