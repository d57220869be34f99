"""Quantized KV caches for NNX: the ``cached_key``/``cached_value`` variables of the
policy-running copy, handed to the model dequantized and taken back quantized
(:mod:`jmp_policy._src.kv_cache.hook`); ``write_back`` puts them in the model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from flax import nnx

from jmp_policy._src.kv_cache import KVCacheSpec
from jmp_policy._src.kv_cache.hook import CACHE_NAMES, CacheRun
from jmp_policy.nnx._modules import path_of


def kv_caches(
    spec: KVCacheSpec | None, copy: nnx.Module, stored: dict[str, Any]
) -> contextlib.AbstractContextManager[Any]:
    """Runs a call of ``copy`` with its attention caches stored as ``spec`` says; their
    paths leave ``stored`` (the dtypes ``write_back`` would cast them to)."""
    return contextlib.nullcontext() if spec is None else _CopyCaches(spec, copy, stored)


class _CopyCaches(CacheRun):
    def __init__(self, spec: KVCacheSpec, copy: nnx.Module, stored: dict[str, Any]) -> None:
        super().__init__(spec, where="the")
        self._copy, self._stored = copy, stored

    def __enter__(self) -> Any:
        run = super().__enter__()
        for variable, fmt, variable_path in _caches(self._copy, run):
            cache = run.as_stored(variable.get_value(), fmt, variable_path)
            variable.set_value(run.hand_out(cache))
            self._stored.pop(variable_path, None)
        return run

    def __exit__(self, kind: Any, error: Any, traceback: Any) -> None:
        if kind is None:
            # Caches made in the call (a method running `init_cache`) are stored too.
            for variable, fmt, variable_path in _caches(self._copy, self.run):
                value = variable.get_value()
                variable.set_value(self.run.stored(value, fmt, variable_path, False))
        super().__exit__(kind, error, traceback)


def _caches(copy: nnx.Module, run: Any) -> Iterator[tuple[nnx.Variable[Any], Any, str]]:
    """The cache variables of ``copy`` that ``run``'s spec quantizes, with their formats."""
    for parts, module in nnx.iter_modules(copy):
        path = path_of(parts)
        for name in CACHE_NAMES:
            variable = vars(module).get(name)
            fmt = run.format_of(path, name)
            if fmt is not None and isinstance(variable, nnx.Variable):
                run.hooked.add(path)
                yield variable, fmt, f"{path}/{name}" if path else name
