"""Tracing a Linen model run under policies: the interceptor, parameters cast as the
model reads them, the shape-only learn pass, and which quantized kernels reach their
layers whole.

:func:`run_traced` is the one entry: ``apply``, ``init``, ``explain`` and ``diagnose`` run
their model through it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax

from jmp_policy._src import casting, interception, quantization
from jmp_policy._src.framework import run_kernels
from jmp_policy._src.options import Options
from jmp_policy._src.policy_map import leaf_path, parent_path
from jmp_policy._src.quantization import stack_layers
from jmp_policy._src.resolution import ModuleInfo, Resolver
from jmp_policy.linen._modules import own_dtype, path_of
from jmp_policy.linen._quantization import counting, learning_routes
from jmp_policy.linen._reads import Stale, read_fix, reading

_MAX_RETRACES = 8


def interceptor(
    resolver: Resolver,
    root_method: str | None,
    on_new: Callable[[str], None] | None = None,
) -> Callable[..., Any]:
    """The ``nn.intercept_methods`` interceptor: finds the call and hands it to the hook.

    Intercepted: every module's ``__call__``, and the root's ``root_method``. ``on_new``
    is told each module path the resolver had not met, once it is recorded.
    """
    calls: dict[int, tuple[Any, int]] = {}  # this run's float8 calls, per module

    def intercept(next_fun: Callable[..., Any], args: Any, kwargs: Any, context: Any) -> Any:
        module = context.module
        name = context.method_name
        if name == "setup":  # known before `setup` reads its parameters
            path = path_of(module)
            if path not in resolver.infos:
                resolver.infos[path] = ModuleInfo(type(module), own_dtype(module))
            if resolver.options.module_dtype != "override":
                return next_fun(*args, **kwargs)
            # What `setup` derives from the module's dtype (its children's dtype, Hugging
            # Face's `attention_softmax_in_fp32`) follows the policy, as in a module built
            # with that dtype (a compact module already sees it when it makes children).
            set_dtype = resolver.module(path, type(module), own_dtype(module)).set_dtype
            with (
                contextlib.nullcontext()
                if set_dtype is None
                else interception.attribute_set(module, "dtype", set_dtype)
            ):
                return next_fun(*args, **kwargs)
        if name != "__call__" and not (name == root_method and not module.path):
            return next_fun(*args, **kwargs)
        path = path_of(module)
        new = on_new is not None and path not in resolver.infos
        resolution = resolver.module(path, type(module), own_dtype(module))
        if new:
            on_new(path)  # type: ignore[misc]
        call = interception.Call(path, module, resolution)
        extensions = resolver.options.extensions  # the core's routed matmuls innermost
        with (
            contextlib.nullcontext()
            if resolution.set_dtype is None  # module_dtype="override" gives the policy's
            else interception.attribute_set(module, "dtype", resolution.set_dtype),
            counting(calls),
        ):
            return interception.run(call, next_fun, args, kwargs, extensions=extensions)

    return intercept


def flat_params(params: Any) -> tuple[list[tuple[Any, Any]], Any]:
    """Flattened with paths; a QuantizedArray is one leaf at its kernel's path."""
    return jax.tree_util.tree_flatten_with_path(params, is_leaf=quantization.is_quantized)


def _cast_params(
    params: Any,
    resolver: Resolver,
    whole: Mapping[str, Any] = {},
    floats: bool = True,
    sliced: Mapping[str, Any] = {},
) -> Any:
    """Parameters in their compute dtypes; the kernels of the module paths in ``whole``
    as their quantized integer values (the layer's matmul reads them with the scales);
    those in ``sliced`` (stacks') as their values, their scales beside them
    (:func:`_with_layer_leaves`). With ``floats=False`` only QuantizedArrays are cast:
    plain arrays are cast as they are read (:func:`~jmp_policy.linen._reads.read_fix`)."""
    flat, treedef = flat_params(params)
    leaves = []
    for kp, leaf in flat:
        if not floats and not quantization.is_quantized(leaf):
            leaves.append(leaf)
            continue
        path = leaf_path(kp)
        if sliced.get(parent_path(path) or "") is leaf:
            leaves.append(getattr(leaf, "values"))  # noqa: B009 (int4 stays int4: sliced)
        elif isinstance(leaf, quantization.QuantizedArray) and (
            whole.get(parent_path(path) or "") is leaf
        ):
            # Flax's promote_dtype gets int4 as int8; the layer's matmul reads the
            # QuantizedArray itself, so this copy is dead code.
            leaves.append(run_kernels.promotable(getattr(leaf, "values")))  # noqa: B009
        else:
            leaves.append(casting.compute_leaf(leaf, resolver.variable(path)[0].compute_dtype))
    return _with_layer_leaves(jax.tree_util.tree_unflatten(treedef, leaves), sliced)


def _with_layer_leaves(params: Any, sliced: Mapping[str, Any]) -> Any:
    """``params`` (rebuilt dicts, the caller's never changed) with the scales of each
    stacked kernel in ``sliced`` beside it, which the stack's loop slices with the values
    (:mod:`jmp_policy._src.quantization.stack_layers`)."""
    for module_path, q in sliced.items():
        names = module_path.split("/") if module_path else []
        params = _set_leaves(params, names, stack_layers.extra_leaves(q))
    return params


def _set_leaves(tree: Any, names: list[str], leaves: Mapping[str, Any]) -> Any:
    node = dict(tree)
    if names:
        node[names[0]] = _set_leaves(tree[names[0]], names[1:], leaves)
        return node
    for field, leaf in leaves.items():
        node[stack_layers.leaf_name("kernel", field)] = leaf
    return node


def _quantized_kernels(params: Any) -> dict[str, Any]:
    """Module path -> its ``QuantizedArray`` parameter named ``kernel``."""
    found = {}
    for kp, leaf in flat_params(params)[0]:
        path = leaf_path(kp)
        if quantization.is_quantized(leaf) and path.rpartition("/")[2] == "kernel":
            found[parent_path(path) or ""] = leaf
    return found


def _whole_kernels(
    variables: Mapping[str, Any],
    resolved: Any,
    options: Options,
    known: dict[str, Any],
    call: Callable[[Any, Resolver], Any],
    method: Any,
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The quantized kernels by how they reach their layers (module path -> kernel, for
    :func:`run_kernels.route`'s whole, ahead and sliced), a routed layer's kernel seen at
    its stored shape or, inside a stack's loop, at one layer's (a shape-only run)."""
    quantized = _quantized_kernels(variables.get("params", {}))
    if not quantized:
        return {}, {}, {}
    routes: dict[str, tuple[int, ...] | None] = {}
    chosen = Resolver(resolved, options, dict(known))
    with learning_routes(quantized, routes):
        # The casts happen inside the shape-only run: nothing is added to the caller's trace.
        _learn_shapes(
            known,
            resolved,
            options,
            lambda: _with_params(variables, lambda p: _cast_params(p, chosen)),
            call,
            method,
        )
    chosen = Resolver(resolved, options, dict(known))
    found: dict[str, dict[str, Any]] = {"whole": {}, "ahead": {}, "sliced": {}}
    for path, q in quantized.items():
        seen, layer = routes.get(path), stack_layers.layer_shape(q)
        lead = 0 if seen == tuple(q.shape) else q.stacked if seen == layer else -1
        policy = chosen.variable(f"{path}/kernel" if path else "kernel")[0]
        how = run_kernels.route(q, policy, seen is not None and lead >= 0, max(lead, 0))
        found[how or "ahead"][path] = q
    return found["whole"], found["ahead"], found["sliced"]


def _with_params(variables: Mapping[str, Any], fn: Callable[[Any], Any]) -> Any:
    if "params" not in variables:
        return variables
    result = dict(variables)
    result["params"] = fn(variables["params"])
    return result


def _learn_shapes(
    known: dict[str, Any],
    resolved: Any,
    options: Options,
    cast_variables: Any,
    call: Callable[[Any, Resolver], Any],
    method: Any,
) -> None:
    """Records every module of the model into ``known`` by a shape-only run
    (``cast_variables``, or a function that makes them inside that run)."""
    learner = Resolver(resolved, options, dict(known))

    def run() -> Any:
        with (
            nn.intercept_methods(interceptor(learner, root_method(method))),
            interception.model_run(options),
        ):
            cast = cast_variables() if callable(cast_variables) else cast_variables
            return call(cast, learner)

    # A failure here is left for the real run to report; what was met is kept.
    with contextlib.suppress(Exception):
        jax.eval_shape(run)
    known.update(learner.infos)


def root_method(method: Any) -> str:
    return "__call__" if method is None else method if isinstance(method, str) else ""


def run_traced(
    module: nn.Module,
    resolved: Any,
    options: Options,
    known: dict[str, Any],
    variables: Mapping[str, Any],
    call: Callable[[Any, Resolver], Any],
    method: Any,
    on_error: Callable[[Resolver], None] | None = None,
) -> tuple[Any, Resolver, Any]:
    """Runs ``call(cast_variables, resolver)`` under the interceptor, learning the model's modules.

    Floating parameters reach Flax as stored and are cast as they are read, once the
    interceptor has met their module (its class in ``type_policies``, its own ``dtype``):
    the model body is traced once, each parameter is cast once, into the dtype its module
    computes in, and a float32 island's weights are never rounded through bfloat16. A
    parameter read before its module is met is cast from what ``known`` (the classes and
    own dtypes of earlier runs) says; when that proves wrong, or a quantized kernel of an
    ``nn.scan`` stack needs another dtype, the model's shape is learnt
    (``jax.eval_shape``, nothing added to the caller's trace) and it runs again.

    Returns:
        ``(result, resolver, cast_variables)`` of the run that counts.
    """
    params = variables.get("params", {})
    stored = {leaf_path(kp): leaf for kp, leaf in flat_params(params)[0]}
    whole, ahead, sliced = _whole_kernels(variables, resolved, options, known, call, method)
    for _ in range(_MAX_RETRACES):
        chosen = Resolver(resolved, options, dict(known))
        cast_variables = _with_params(
            variables,
            lambda p: _cast_params(p, chosen, whole, floats=False, sliced=sliced),  # noqa: B023
        )
        resolver = Resolver(resolved, options, dict(known))
        error: Exception | None = None
        early: set[str] = set()
        try:
            with (
                nn.intercept_methods(interceptor(resolver, root_method(method))),
                interception.model_run(options),
                run_kernels.running(whole, ahead, sliced),
                reading(read_fix(chosen, resolver, stored, early)),
            ):
                result = call(cast_variables, resolver)
        except Stale:
            # Cut short: a module met changes a cast. Learn the whole model shape-only
            # (nothing computed, nothing added to the caller's trace), then run again.
            known.update(resolver.infos)
            _learn_shapes(known, resolved, options, cast_variables, call, method)
            continue
        except Exception as e:
            error = e
        resolver.used_keys |= chosen.used_keys
        learnt = Resolver(resolved, options, dict(resolver.infos))
        # Parameters read after their module was met were read in the right dtype; a
        # difference left is one read before (a parent reading a child's variables).
        stale = any(
            chosen.variable(p)[0].compute_dtype != learnt.variable(p)[0].compute_dtype
            for p in early
        )
        known.update(resolver.infos)
        if error is not None:
            if not stale:
                if on_error is not None:
                    on_error(resolver)  # say what was turned off before the error
                raise error
            continue
        if not stale:
            return result, resolver, cast_variables
    raise RuntimeError(  # pragma: no cover - only a model that changes with every trace
        f"{type(module).__name__} calls different modules on every trace; jmp_policy "
        "could not settle the dtypes of its parameters."
    )


def method_for(resolver: Resolver, method: Any) -> Any:
    """``method`` for ``module.apply``; a callable (not a module method) runs in the hook."""
    if not callable(method):
        return method

    def run_root(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        resolution = resolver.module("", type(module), own_dtype(module))
        call = interception.Call("", module, resolution)
        return interception.run(
            call,
            lambda *a, **k: method(module, *a, **k),
            args,
            kwargs,
            extensions=resolver.options.extensions,
        )

    return run_root
