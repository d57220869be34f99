"""Caches a model keeps in mutable variables (NNX's ``nnx.Cache``: a value read with
``get_value`` and written with ``set_value``), for one call of the model's policy-running
copy: handed to the model dequantized, taken back quantized (:mod:`.hook` does the rest).

``nnx.MultiHeadAttention`` (after ``init_cache``) reads ``self.cached_key[...]``, writes the
new token with ``lax.dynamic_update_slice`` and stores the result with
``self.cached_key[...] = key``. Before the call each such variable holds its cache
dequantized; the write quantizes the new tokens alone into the stored values and scales;
after the call the variable holds the quantized cache.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from jmp_policy._src.kv_cache import KVCacheSpec
from jmp_policy._src.kv_cache.hook import CACHE_NAMES, CacheRun


class VariableCaches(CacheRun):
    """A call whose cache variables (attributes named :data:`CACHE_NAMES` of the modules
    ``modules()`` lists as ``(path, module)``, where ``is_variable``) hold their caches as
    ``spec`` says; their paths leave ``stored`` (the dtypes the state would be written back
    in)."""

    def __init__(
        self,
        spec: KVCacheSpec,
        modules: Callable[[], Iterable[tuple[str, Any]]],
        is_variable: Callable[[Any], bool],
        stored: dict[str, Any],
    ) -> None:
        super().__init__(spec, where="the")
        self._modules, self._is_variable, self._stored = modules, is_variable, stored

    def __enter__(self) -> Any:
        run = super().__enter__()
        for variable, fmt, variable_path in self._caches(run):
            cache = run.as_stored(variable.get_value(), fmt, variable_path)
            variable.set_value(run.hand_out(cache))
            self._stored.pop(variable_path, None)
        return run

    def __exit__(self, kind: Any, error: Any, traceback: Any) -> None:
        if kind is None:
            # Caches made in the call (a method running `init_cache`) are stored too.
            for variable, fmt, variable_path in self._caches(self.run):
                value = variable.get_value()
                variable.set_value(self.run.stored(value, fmt, variable_path, False))
        super().__exit__(kind, error, traceback)

    def _caches(self, run: Any) -> Iterator[tuple[Any, Any, str]]:
        """The cache variables that ``run``'s spec quantizes, with their formats."""
        for path, module in self._modules():
            for name in CACHE_NAMES:
                variable = vars(module).get(name)
                fmt = run.format_of(path, name)
                if fmt is not None and self._is_variable(variable):
                    run.hooked.add(path)
                    yield variable, fmt, f"{path}/{name}" if path else name
