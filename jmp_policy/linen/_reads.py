"""Parameters cast as a Linen model reads them: a hook on Flax's parameter reads
(``Scope.get_variable`` and ``Module.variables``) active for one traced run.

:func:`read_fix` decides each read's dtype; :func:`reading` runs a block with it.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.core.tracers import current_trace

from jmp_policy._src import casting, quantization, transforms
from jmp_policy._src import dtypes as dt
from jmp_policy._src.policy_map import leaf_path, parent_path
from jmp_policy._src.quantization import stack_layers
from jmp_policy._src.resolution import Resolver
from jmp_policy.linen._kv_cache import cache_get_variable, cache_put_variable


class Stale(Exception):
    """A module met during a run changes how its parameters should have been cast."""


# The parameter reads of the run in progress: fix(path, value) -> value.
_READS: contextvars.ContextVar[Callable[[str, Any], Any] | None] = contextvars.ContextVar(
    "jmp_policy_linen_reads", default=None
)


def _get_variable(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def get_variable(scope: Any, col: str, name: str, default: Any = None) -> Any:
        value = original(scope, col, name, default)
        fix = None if _UNFIXED.get() else _READS.get()
        if fix is None or col != "params" or value is default:
            return value
        return fix("/".join(str(p) for p in (*scope.path, name)), value)

    return get_variable


def _variables(original: Any) -> Any:
    def variables(module: nn.Module) -> Any:
        value = original.fget(module)
        fix = _READS.get()
        scope = module.scope
        if fix is None or scope is None or not isinstance(value, Mapping):
            return value
        if "params" not in value:
            return value
        stem = tuple(str(p) for p in scope.path)

        def fixed(key_path: Any, leaf: Any) -> Any:
            return fix("/".join((*stem, leaf_path(key_path))), leaf)

        result = dict(value)
        result["params"] = jax.tree_util.tree_map_with_path(
            fixed, value["params"], is_leaf=quantization.is_quantized
        )
        return result

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


_UNFIXED: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "jmp_policy_linen_unfixed", default=False
)


@contextlib.contextmanager
def unfixed_reads() -> Iterator[None]:
    """Parameter reads in the block return the values as passed to Flax, not cast."""
    token = _UNFIXED.set(True)
    try:
        yield
    finally:
        _UNFIXED.reset(token)


def read_fix(
    chosen: Resolver, resolver: Resolver, stored: dict[str, Any], early: set[str]
) -> Callable[[str, Any], Any]:
    """Casts each parameter as the model reads it, to its module's compute dtype (the module
    is recorded before it runs). One read before its module is met (a parent reading a
    child's) is cast as ``chosen`` and its path added to ``early``, checked after the run; a
    QuantizedArray read not as stored (an ``nn.scan`` layer's slice) stops the run.
    """
    # A value read twice in one trace is cast once; the trace is checked, so a cast made
    # inside a JAX transform (`jax.checkpoint` in a module) never leaks out of it.
    done: dict[tuple[str, int], tuple[Any, Any, Any]] = {}

    def fix(path: str, value: Any) -> Any:
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
            return value.astype(jnp.int8) if value.dtype == jnp.int4 else value
        if quantization.is_quantized(original):
            if chosen.variable(path)[0].compute_dtype == want:
                return value
            if getattr(original, "shape", None) != getattr(value, "shape", ()):
                raise Stale(path)
            return casting.compute_leaf(original, want)
        key, trace = (path, id(value)), current_trace()
        entry = done.get(key)
        if entry is None or entry[1] != trace:
            entry = done[key] = (value, trace, casting.compute_tree(value, want))
        return entry[2]

    return fix


@contextlib.contextmanager
def reading(fix: Callable[[str, Any], Any]) -> Iterator[None]:
    """Every parameter read in the block goes through ``fix(path, value)``."""
    token = _READS.set(fix)
    try:
        with _PARAM_READS.active(), _MODULE_READS.active():
            yield
    finally:
        _READS.reset(token)
