"""Parameters cast as a Linen model reads them: a hook on Flax's parameter reads
(``Scope.get_variable`` and ``Module.variables``) active for one traced run, each read
handed to the run's fix (:mod:`jmp_policy._src.framework.param_reads`).
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
from jmp_policy._src.tree_paths import leaf_path
from jmp_policy.linen._kv_cache import cache_get_variable, cache_put_variable


def _get_variable(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def get_variable(scope: Any, col: str, name: str, default: Any = None) -> Any:
        value = original(scope, col, name, default)
        fix = param_reads.fix()
        if fix is None or col != "params" or value is default:
            return value
        return fix("/".join(str(p) for p in (*scope.path, name)), value)

    return get_variable


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


def _scope_get_variable(original: Callable[..., Any]) -> Callable[..., Any]:
    """Flax's ``Scope.get_variable`` with both hooks: attention caches handed out
    dequantized (``kv_cache=``), parameters cast (each acts only inside its own run)."""
    return _get_variable(cache_get_variable(original))


# One patch of Flax's Scope for both of its users (two patches of one attribute would
# restore each other's replacements when threads interleave).
PARAM_READS = _PARAM_READS = transforms.ThreadPatch(
    "param_reads",
    {"get_variable": _scope_get_variable, "put_variable": cache_put_variable},
)
_MODULE_READS = transforms.ThreadPatch("module_reads", {"variables": _variables})


@contextlib.contextmanager
def reading(fix: Callable[[str, Any], Any]) -> Iterator[None]:
    """Every parameter read in the block goes through ``fix(path, value)``."""
    with param_reads.reading(fix), _PARAM_READS.active(), _MODULE_READS.active():
        yield
