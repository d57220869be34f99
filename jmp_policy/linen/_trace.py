"""Tracing a Linen model run under policies: the interceptor, parameters cast as read, the
shape-only learn pass. :func:`run_traced` is the entry every public function runs
through.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax

from jmp_policy._src import interception
from jmp_policy._src.framework import run_kernels
from jmp_policy._src.framework.param_reads import settle
from jmp_policy._src.framework.params_tree import (
    by_path,
    cast_params,
    quantized_kernels,
    with_params,
)
from jmp_policy._src.options import Options
from jmp_policy._src.quantization import stack_layers
from jmp_policy._src.resolution import ModuleInfo, Resolver
from jmp_policy.linen._modules import own_dtype, path_of
from jmp_policy.linen._reads import reading
from jmp_policy.linen._stacks import Seen


def interceptor(resolver: Resolver, method: Any) -> Callable[..., Any]:
    """The ``nn.intercept_methods`` interceptor: finds the call and hands it to the hook.

    Intercepted: every module's ``__call__``, and the root's ``method`` when named.
    """
    root = "__call__" if method is None else method if isinstance(method, str) else ""

    def intercept(next_fun: Callable[..., Any], args: Any, kwargs: Any, context: Any) -> Any:
        module, name = context.module, context.method_name
        if name not in ("__call__", "setup") and not (name == root and not module.path):
            return next_fun(*args, **kwargs)
        path = path_of(module)
        if name == "setup":  # known before `setup` reads its parameters
            if path not in resolver.infos:
                resolver.infos[path] = ModuleInfo(type(module), own_dtype(module))
            if resolver.options.module_dtype != "override":
                return next_fun(*args, **kwargs)
            # What `setup` derives from the module's dtype (its children's dtype, Hugging
            # Face's `attention_softmax_in_fp32`) follows the policy, as in a module built
            # with that dtype (a compact module already sees it when it makes children).
            with _dtype_set(module, resolver.module(path, type(module), own_dtype(module))):
                return next_fun(*args, **kwargs)
        resolution = resolver.module(path, type(module), own_dtype(module))
        call = interception.Call(path, module, resolution)
        extensions = resolver.options.extensions  # the core's routed matmuls innermost
        with _dtype_set(module, resolution):
            return interception.run(call, next_fun, args, kwargs, extensions=extensions)

    return intercept


def _dtype_set(module: nn.Module, resolution: Any) -> Any:
    """The module's ``dtype`` is the policy's in the block (``module_dtype="override"``)."""
    if resolution.set_dtype is None:
        return contextlib.nullcontext()
    return interception.attribute_set(module, "dtype", resolution.set_dtype)


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
    its stored shape or, inside a stack's loop, at one layer's (the shape-only run that
    learns the modules, watched by :class:`~jmp_policy.linen._stacks.Seen`)."""
    quantized = quantized_kernels(variables.get("params", {}))
    if not quantized:
        return {}, {}, {}
    chosen, seen = Resolver(resolved, options, dict(known)), Seen()
    # The casts happen inside the shape-only run: nothing is added to the caller's trace.
    _learn_shapes(
        known,
        resolved,
        options,
        lambda: with_params(variables, lambda p: cast_params(p, chosen)),
        call,
        method,
        seen,
    )
    chosen = Resolver(resolved, options, dict(known))
    found: dict[str, dict[str, Any]] = {"whole": {}, "ahead": {}, "sliced": {}}
    for path, q in quantized.items():
        seen_at, layer = seen.kernels.get(path), stack_layers.layer_shape(q)
        lead = 0 if seen_at == tuple(q.shape) else q.stacked if seen_at == layer else -1
        policy = chosen.variable(f"{path}/kernel" if path else "kernel")[0]
        how = run_kernels.route(q, policy, seen_at is not None and lead >= 0, max(lead, 0))
        found[how or "ahead"][path] = q
    return found["whole"], found["ahead"], found["sliced"]


def _learn_shapes(
    known: dict[str, Any],
    resolved: Any,
    options: Options,
    cast_variables: Any,
    call: Callable[[Any, Resolver], Any],
    method: Any,
    seen: Seen | None = None,
) -> None:
    """Records every module of the model into ``known`` by a shape-only run
    (``cast_variables``, or a function that makes them inside that run); what it shows
    into ``seen`` when given."""
    learner = Resolver(resolved, options, dict(known))

    def run() -> Any:
        with (
            # Outermost: `seen` sees each layer as written, before the hook installs a matmul.
            contextlib.nullcontext() if seen is None else seen.watching(),
            nn.intercept_methods(interceptor(learner, method)),
            interception.model_run(options),
            run_kernels.running(),  # no quantized kernel read whole: each as passed
        ):
            cast = cast_variables() if callable(cast_variables) else cast_variables
            return call(cast, learner)

    # A failure here is left for the real run to report; what was met is kept.
    with contextlib.suppress(Exception):
        jax.eval_shape(run)
    known.update(learner.infos)


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
    """Runs ``call(cast_variables, resolver)`` under the interceptor, learning the modules.

    Floating parameters are cast as they are read, once their module is met, so each is cast
    once into its module's compute dtype (a float32 island's weights never pass through
    bfloat16). One read before its module is met is cast as ``known`` (earlier runs) says;
    when that proves wrong, or an ``nn.scan`` stack's quantized kernel needs another dtype,
    the model's shape is learnt (``jax.eval_shape``) and it runs again. Returns ``(result,
    resolver, cast_variables)`` of the run that counts.
    """
    whole, ahead, sliced = _whole_kernels(variables, resolved, options, known, call, method)

    def cast_for(chosen: Resolver) -> Any:
        return with_params(
            variables, lambda p: cast_params(p, chosen, whole, floats=False, sliced=sliced)
        )

    def attempt(cast: Any, resolver: Resolver, read: Callable[[str, Any], Any]) -> Any:
        with (
            nn.intercept_methods(interceptor(resolver, method)),
            interception.model_run(options),
            run_kernels.running(whole, ahead, sliced),
            reading(read),
        ):
            return call(cast, resolver)

    def relearn(cast: Any) -> None:
        _learn_shapes(known, resolved, options, cast, call, method)

    stored = by_path(variables.get("params", {}))
    name = type(module).__name__
    return settle(known, resolved, options, stored, cast_for, attempt, relearn, on_error, name)


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
