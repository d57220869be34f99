"""The NNX adapter of the framework protocol (:mod:`jmp_policy._src.framework`).

A run is of a policy-running copy (``nnx.split``, cast, ``nnx.merge``, each module
re-classed to run through the hook: :func:`dress`); modules in ``nnx.iter_modules``'
order, root first. Under :func:`applying` (``jp.nnx.apply``) a run also warns, runs
quantized KV caches and writes the copy's non-parameter state back; ``explain``'s
shape-only trace does none of these.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from flax import nnx

import jmp_policy.nnx._copy as _copy
import jmp_policy.nnx._modules as m
from jmp_policy._src import interception
from jmp_policy._src.framework import policy_class, run_kernels
from jmp_policy._src.framework import stack_axes as core_axes
from jmp_policy._src.framework.protocol import InstallsMatmuls, Layer
from jmp_policy._src.framework.routing import routed_matmuls
from jmp_policy._src.framework.search import param_kernels
from jmp_policy._src.quantization import matmuls
from jmp_policy._src.resolution import Resolver
from jmp_policy._src.run_report import compute_modules, warn_once
from jmp_policy.nnx._quantization import layer_state, state_type

# What the apply wrapper in progress has warned about (None outside `applying`).
_APPLYING: contextvars.ContextVar[set[str] | None] = contextvars.ContextVar(
    "jmp_policy_nnx_applying", default=None
)


@contextlib.contextmanager
def applying(warned: set[str]) -> Iterator[None]:
    """Runs inside are ``jp.nnx.apply``'s: warned once (``warned``, the wrapper's), with
    their KV caches, their non-parameter state written back."""
    token = _APPLYING.set(warned)
    try:
        yield
    finally:
        _APPLYING.reset(token)


def dress(
    copy: nnx.Module, resolver: Resolver, methods: tuple[str, ...], extensions: Any, routed: Any
) -> None:
    """Each module of the copy computes in its policy's dtype (where its ``dtype`` is not
    the user's) and runs its methods through the hook (a policy subclass) with
    ``extensions``, less ``routed`` (the core's routed matmuls) where the module's matmul
    is not routable (each Python frame a module call adds costs trace time in every op
    it runs)."""
    for parts, module in list(nnx.iter_modules(copy)):
        path, cls = m.path_of(parts), type(module)
        resolution = resolver.module(path)
        if resolution.set_dtype is not None:
            object.__setattr__(module, "dtype", resolution.set_dtype)
        elif m.filled_dtype(module):  # not the user's: computes in the policy's dtype
            object.__setattr__(module, "dtype", resolution.policy.compute_dtype)
        wrapped = tuple(name for name in methods if policy_class.method_of(cls, name))
        if wrapped:
            own = tuple(e for e in extensions if e is not routed or m.routable(module))
            pytree = {"pytree": getattr(cls, "_pytree__is_pytree", True)}
            subclass = policy_class.policy_subclass(
                cls, path, resolution, own, wrapped, opaque=m.is_nnx_object, class_kwargs=pytree
            )
            object.__setattr__(module, "__class__", subclass)


def stack_axes(model: Any) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """Path -> ``(kernel shape, one layer's)`` of each layer created stacked (NNX names a
    stack's axis at the call, not in the layer: :mod:`jmp_policy._src.framework.stack_axes`
    reads it from these)."""
    modules = nnx.iter_modules(model)
    return {
        m.path_of(p): (m.kernel_shape(x), m.own_shape(x) or ()) for p, x in modules if m.stacked(x)
    }


class NnxAdapter(InstallsMatmuls):
    """The adapter protocol (:class:`jmp_policy._src.framework.protocol.Adapter`) for NNX,
    with the routing operations (:class:`~jmp_policy._src.framework.protocol.Routing`);
    ``methods`` are the methods of every module that run through the hook."""

    model_name = "nnx.Module"

    def __init__(self, methods: tuple[str, ...] = ("__call__",)) -> None:
        self.methods = methods

    def check(self, model: Any) -> None:
        m.check_model(model)

    def layers(self, model: Any) -> Iterator[Layer]:
        modules = sorted(nnx.iter_modules(model), key=lambda item: len(item[0]) > 0)
        for parts, module in modules:  # the root first (NNX lists children before parents)
            path, cls = m.path_of(parts), policy_class.original_class(module)
            if not m.routable(module):
                yield Layer(path, cls, m.own_dtype(module))
                continue
            kernel = getattr(module, "kernel").get_value()  # noqa: B009
            yield Layer(path, cls, m.own_dtype(module), "kernel", kernel, m.stacked(module))

    def params(self, model: Any) -> Mapping[str, Any]:
        return nnx.to_pure_dict(nnx.state(model, nnx.Param))  # type: ignore[no-any-return]

    def kernel_of(self, module: Any) -> Any:
        if not m.routable(module):
            return None
        # The QuantizedArray it reads whole or its own slice of a stack's, else its value.
        value, path = module.kernel.get_value(), policy_class.call_path(module)
        leaf = lambda name: getattr(module, name).get_value()  # noqa: E731
        found = run_kernels.layer_kernel(path, value, leaf)
        return value if found is None else found

    def matmul_kind(self, module: Any) -> str:
        return "einsum" if m.replacement(module) == "einsum_op" else "dot_general"

    def install_matmul(self, call: Any, matmul: Callable[..., Any]) -> Any:
        # In its matmul's attribute (a stacked layer's reading its slice, its int4 values
        # promoted as int8).
        module, stack = call.module, contextlib.ExitStack()
        if call.path in run_kernels.kernels().sliced:
            matmul = matmuls.in_stack(matmul, call.path)
            promote = run_kernels.promoting(module.promote_dtype)
            stack.enter_context(interception.attribute_set(module, "promote_dtype", promote))
        name = m.replacement(module)  # the core routes routable layers only
        stack.enter_context(interception.attribute_set(module, name, matmul))  # type: ignore[arg-type]
        return stack

    def kernel_ahead(self, call: Any) -> Any:
        return run_kernels.kernels().ahead.get(call.path)

    def layer_state(self, call: Any, scheme: Any) -> Any:
        return layer_state(call, scheme)

    def run(self, model: Any, resolver: Any, options: Any, extensions: Any, call: Any) -> Any:
        copy, casts = _copy.cast_copy(model, resolver)
        dress(copy, resolver, self.methods, extensions, routed_matmuls(self))
        warned = _APPLYING.get()
        if warned is None:
            with casts.kernels.running():
                return call(copy)
        # Before the call: a policy turned off by modules' own dtypes may well make the
        # model fail (a cache of one dtype written with another), so say why first.
        compute = compute_modules(resolver, nnx.state(model), m.MATMUL_CLASSES)
        warn_once(resolver, type(model).__name__, warned, compute)
        if casts.plain and "plain" not in warned:
            warned.add("plain")
            _copy.warn_plain_arrays(type(model).__name__, casts.plain)
        with casts.kernels.running(), _copy.kv_caches(options.kv_cache, copy, casts.stored):
            out = call(copy)
        _copy.write_back(model, copy, casts.stored)
        return out

    def weights(self, model: Any) -> tuple[Any, Any, Callable[[Any], Any]]:
        # Every nnx.Param of a copy (the map quantizes those of rank >= 2), a stacked
        # layer's at the axis its stack is on (left whole, with a warning, when unknown).
        copy = nnx.clone(model)
        stacked_axes = core_axes.quantize_axes(stack_axes(copy), "`nnx.vmap(..., out_axes=0)`")
        state = nnx.state(copy, nnx.Param)

        def rebuild(quantized: Any) -> Any:
            nnx.replace_by_pure_dict(state, quantized)
            nnx.update(copy, state)
            return copy

        return nnx.to_pure_dict(state), stacked_axes, rebuild

    def search_kernels(self, model: Any) -> tuple[dict[str, Any], dict[str, int]]:
        # Every nnx.Param kernel of rank >= 2 (nnx.Conv's too), and where a stack's
        # layers start when not on axis 0.
        kernels = param_kernels(nnx.state(model, nnx.Param))
        return kernels, {p: at for p, at in core_axes.stack_axes(stack_axes(model)).items() if at}

    def with_states(self, model: Any, states: Mapping[str, Any]) -> Any:
        copy = nnx.clone(model)
        modules = {m.path_of(parts): module for parts, module in nnx.iter_modules(copy)}
        for path, slot in states.items():
            module, kind = modules[path], state_type(slot.kind)
            current = getattr(module, slot.kind, None)
            if current is not None and not isinstance(current, kind):
                raise ValueError(
                    f"{type(module).__name__} at {path or 'the root'!r} runs under the "
                    f"{slot.kind} policy {slot.policy!r}, but its attribute {slot.kind!r}, "
                    f"where its {slot.kind} state goes, already holds {current!r}. Rename "
                    "that attribute."
                )
            setattr(module, slot.kind, kind(slot.value))
        return copy

    def split(self, model: Any) -> tuple[Any, Callable[[Any], Any]]:
        graphdef, state = nnx.split(model)
        return state, lambda s: nnx.merge(graphdef, s)


@functools.cache
def adapter_for(methods: tuple[str, ...]) -> NnxAdapter:
    """The adapter whose runs hook ``methods`` (one per tuple: the core caches per adapter)."""
    return NnxAdapter(methods)


ADAPTER = adapter_for(("__call__",))
