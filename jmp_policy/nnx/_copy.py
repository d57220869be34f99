"""The NNX model's policy-running copy: parameters cast to their compute dtypes going in
(a quantized kernel as the run's kernels say: :mod:`jmp_policy._src.framework.run_kernels`),
its quantized KV caches handed out and taken back, the non-parameter state written back in
its stored dtypes coming out (the caches: :mod:`jmp_policy._src.kv_cache.variables`).
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, NamedTuple

import jax
import numpy as np
from flax import nnx

from jmp_policy._src import casting
from jmp_policy._src.framework.run_kernels import Staging
from jmp_policy._src.kv_cache import KVCacheSpec
from jmp_policy._src.kv_cache.variables import VariableCaches
from jmp_policy._src.policy_map import leaf_path, parent_path
from jmp_policy._src.quantization import stack_layers
from jmp_policy._src.resolution import Resolver
from jmp_policy.nnx._modules import path_of, routable, stacked


class Casts(NamedTuple):
    """What :func:`cast_copy` did: the stored dtypes of the non-parameter state (to write
    it back in), the plain floating arrays the policy would have cast, and the run's
    quantized kernels (:class:`~jmp_policy._src.framework.run_kernels.Staging`)."""

    stored: dict[str, np.dtype]
    plain: list[str]
    kernels: Staging


def cast_copy(model: nnx.Module, resolver: Resolver) -> tuple[nnx.Module, Casts]:
    """The policy-running copy of ``model``: parameters in their compute dtypes (a
    quantized kernel of a routed layer as its integer values, read whole by the layer's
    matmul), every other variable a fresh one in its stored dtype."""
    graphdef, state = nnx.split(model)
    casts = Casts({}, [], Staging())
    modules = {path_of(parts): module for parts, module in nnx.iter_modules(model)}

    def cast_variable(key_path: Any, variable: Any) -> Any:
        path = leaf_path(key_path)
        if not isinstance(variable, nnx.Variable):
            # A plain array attribute: not an `nnx.Param` for Flax (`nnx.grad` and
            # `nnx.Optimizer` leave it out by default), so it is state, kept in its
            # dtype like a `BatchStat`.
            if isinstance(variable, (jax.Array, np.ndarray)):
                casts.stored[path] = variable.dtype
                compute = resolver.module(parent_path(path) or "").policy.compute_dtype
                if casting.should_cast(variable, compute):
                    casts.plain.append(path)
            return variable
        value = variable.get_value()
        if isinstance(variable, nnx.Param):
            module_path, _, name = path.rpartition("/")
            module = modules.get(module_path)
            policy, lead = resolver.variable(path)[0], len(stacked(module))
            return variable.replace(
                casts.kernels.param(module_path, name, value, policy, routable(module), lead)
            )
        if isinstance(value, (jax.Array, np.ndarray)):
            casts.stored[path] = value.dtype
        return variable.replace(value)  # A fresh variable for the copy.

    copy_state = jax.tree_util.tree_map_with_path(
        cast_variable, state, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )
    copy = nnx.merge(graphdef, copy_state)
    for parts, module in nnx.iter_modules(copy):
        # A stacked layer (nnx.vmap'd, run under nnx.scan or nnx.vmap) sees a slice of its
        # kernel: its QuantizedArray is passed as its data arrays, which the loop slices
        # (jmp_policy._src.quantization.stack_layers): params, never written back.
        q = casts.kernels.sliced.get(path_of(parts))
        for field, leaf in ({} if q is None else stack_layers.extra_leaves(q)).items():
            setattr(module, stack_layers.leaf_name("kernel", field), nnx.Param(leaf))
    return copy, casts


def write_back(model: nnx.Module, copy: nnx.Module, stored: dict[str, np.dtype]) -> None:
    """The copy's non-parameter state (caches, batch statistics, counters) back into
    ``model``, in the dtypes it was stored in."""

    def restore(key_path: Any, variable: Any) -> Any:
        dtype = stored.get(leaf_path(key_path))
        if dtype is None:  # Created during the call, or not an array: kept as is.
            return variable
        if not isinstance(variable, nnx.Variable):  # a plain array attribute
            return casting.cast_leaf(variable, dtype)
        return variable.replace(casting.cast_leaf(variable.get_value(), dtype))

    updates = nnx.state(copy, nnx.Not(nnx.Param))
    updates = jax.tree_util.tree_map_with_path(
        restore, updates, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )
    nnx.update(model, updates)


def warn_plain_arrays(model: str, paths: list[str]) -> None:
    shown = ", ".join(paths[:5]) + (f", ... ({len(paths)} in all)" if len(paths) > 5 else "")
    warnings.warn(
        f"{model} keeps floating arrays as plain attributes ({shown}). Flax does not count "
        "plain arrays as `nnx.Param`s (`nnx.grad` and `nnx.Optimizer` leave them out by "
        "default), so the policy leaves them in their stored dtype, and computations that "
        "mix them with cast inputs promote to it. Wrap them in `nnx.Param` "
        "(`self.w = nnx.Param(...)`) to have the policy cast them.",
        UserWarning,
        stacklevel=3,
    )


def kv_caches(
    spec: KVCacheSpec | None, copy: nnx.Module, stored: dict[str, Any]
) -> contextlib.AbstractContextManager[Any]:
    """Runs a call of ``copy`` with its attention caches stored as ``spec`` says; their
    paths leave ``stored`` (the dtypes ``write_back`` would cast them to)."""
    if spec is None:
        return contextlib.nullcontext()
    modules = lambda: ((path_of(parts), x) for parts, x in nnx.iter_modules(copy))  # noqa: E731
    return VariableCaches(spec, modules, lambda x: isinstance(x, nnx.Variable), stored)
