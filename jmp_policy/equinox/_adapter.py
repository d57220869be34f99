"""The Equinox adapter: what the core's entry points need to know of an Equinox model.

Modules are found by walking the model's pytree: a module's path is its attribute path as
the plain-tree functions write it (``mlp/layers/0``, ``attn/query_proj``). A model runs
as a copy whose modules are re-classed to cached subclasses whose ``__call__`` goes
through the hook (:func:`jmp_policy._src.interception.run`) with the path and resolution
as class attributes, so ``eqx.partition``/``eqx.combine`` and a ``jax.lax.scan`` over a
``eqx.filter_vmap``-made stack rebuild each module with the same behaviour. Nothing is
mutated: the copy is a new pytree, and ``with_kernels`` returns a new model
(``eqx.tree_at``).

``eqx.nn.Linear`` (weight ``[out, in]``, not ``"scalar"`` features) is the routed layer:
its matmul runs as the ``dot_general`` the core picks, on the weight as ``[in, out]`` (a
quantized weight is stored so, as a ``QuantizedArray``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import equinox as eqx
import jax

from jmp_policy._src import casting, interception
from jmp_policy._src import dtypes as dt
from jmp_policy._src.framework.protocol import OUT_IN, Layer
from jmp_policy._src.framework.state import per_batch
from jmp_policy._src.options import Options
from jmp_policy._src.quantization import is_quantized
from jmp_policy._src.resolution import Resolver
from jmp_policy._src.tree_paths import leaf_path
from jmp_policy.equinox._state import (
    holding,
    is_slot,
    public_class,
    slot_of,
    state_value,
)

_ORIGINAL = "_jmp_policy_original_class"
_CALL = "_jmp_policy_call"
_SUBCLASSES: dict[tuple[Any, ...], type] = {}


def _join(path: str, key_path: tuple[Any, ...]) -> str:
    tail = leaf_path(key_path)
    return f"{path}/{tail}" if path and tail else path or tail


def _children(node: Any) -> tuple[list[tuple[tuple[Any, ...], Any]], Any]:
    """The node's leaves one level down: arrays, ``QuantizedArray`` values and modules."""

    def stop(x: Any) -> bool:
        return x is not node and (isinstance(x, eqx.Module) or is_quantized(x))

    return jax.tree_util.tree_flatten_with_path(node, is_leaf=stop)


def _modules(model: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """``(path, module)`` of every module, the root first, parents before children."""
    if _is_module(model):
        yield path, model
    for key_path, child in _children(model)[0]:
        if _is_module(child):
            yield from _modules(child, _join(path, key_path))


def _is_module(x: Any) -> bool:
    return isinstance(x, eqx.Module) and not is_quantized(x) and not is_slot(x)


def _original(cls: type) -> type:
    return getattr(cls, _ORIGINAL, cls)


def _is_state(x: Any) -> bool:
    return isinstance(x, eqx.nn.State)


def _state_back(out: Any, args: Any) -> Any:
    """``out`` with each ``eqx.nn.State`` (batch statistics, caches) in the dtypes of the
    state the call received: a layer computes in its policy's dtype, and its state is
    kept in its stored dtype, as Flax's non-parameter collections are."""
    given = [x for x in jax.tree.leaves(args, is_leaf=_is_state) if _is_state(x)]
    if not given:
        return out
    stored = given[0]
    structure: Any = jax.tree.structure(stored)

    def back(x: Any) -> Any:
        if not _is_state(x) or jax.tree.structure(x) != structure:
            return x
        return jax.tree.map(
            lambda new, old: casting.cast_leaf(new, old.dtype) if hasattr(old, "dtype") else new,
            x,
            stored,
        )

    return jax.tree.map(back, out, is_leaf=_is_state)


def _routed(module: Any) -> bool:
    return (
        isinstance(module, eqx.nn.Linear)
        and module.in_features != "scalar"
        and module.out_features != "scalar"
    )


class EquinoxAdapter:
    """The adapter protocol (:class:`jmp_policy._src.framework.protocol.Adapter`)."""

    model_name = "eqx.Module"

    def check(self, model: Any) -> None:
        if not isinstance(model, eqx.Module):
            raise TypeError(
                "`model` must be an Equinox module (an `eqx.Module`). Received: "
                f"model={model!r} (of type {type(model).__name__})"
            )

    def layers(self, model: Any) -> Iterator[Layer]:
        for path, module in _modules(model):
            cls = public_class(_original(type(module)))
            if not _routed(module):
                yield Layer(path, cls, None)
                continue
            weight = module.weight
            own = 2  # Linear's [out, in]; leading axes beyond it are a stack's
            stacked = () if is_quantized(weight) else tuple(weight.shape[: weight.ndim - own])
            yield Layer(path, cls, None, "weight", weight, stacked, OUT_IN)

    def params(self, model: Any) -> Mapping[str, Any]:
        stop = lambda x: is_quantized(x) or is_slot(x)  # noqa: E731
        found = jax.tree_util.tree_flatten_with_path(model, is_leaf=stop)[0]
        return {  # a layer's state is not a parameter
            leaf_path(key_path): leaf
            for key_path, leaf in found
            if is_quantized(leaf) or (isinstance(leaf, jax.Array) and dt.is_floating(leaf.dtype))
        }

    def kernel_of(self, module: Any) -> Any:
        if not _routed(module):
            return None
        weight = module.weight  # [out, in]; a QuantizedArray is stored [in, out]
        return weight if is_quantized(weight) else jax.numpy.swapaxes(weight, -1, -2)

    def call_with_matmul(
        self,
        module: Any,
        matmul: Callable[..., Any],
        kernel: Any,
        args: tuple[Any, ...],
        kwargs: Any,
    ) -> Any:
        if len(args) != 1 or set(kwargs) - {"key"}:
            raise TypeError(
                f"{type(module).__name__} takes one input array (and `key=`). Received: "
                f"{len(args)} positional argument(s) and keywords {sorted(kwargs)}"
            )
        (x,) = args

        def run(x: Any) -> Any:
            y = matmul(x, kernel, (((x.ndim - 1,), (0,)), ((), ())))
            return y if module.bias is None else y + module.bias

        return run(x) if slot_of(module) is None else per_batch(run, x)

    def layer_state(self, call: Any, scheme: Any) -> Any:
        return state_value(call, scheme)

    def with_states(self, model: Any, states: Mapping[str, Any]) -> Any:
        modules = dict(_modules(model))
        paths = [p for p in states if p in modules]
        if not paths:
            return model
        return eqx.tree_at(
            lambda m: [_at(m, p) for p in paths],
            model,
            [holding(modules[p], states[p].kind, states[p].value) for p in paths],
        )

    def run(
        self,
        model: Any,
        resolver: Resolver,
        options: Options,
        extensions: tuple[Any, ...],
        call: Callable[[Any], Any],
    ) -> Any:
        return call(_dressed(model, "", resolver, extensions))

    def split(self, model: Any) -> tuple[Any, Callable[[Any], Any]]:
        arrays, static = eqx.partition(model, eqx.is_array)
        return arrays, lambda a: eqx.combine(a, static)

    def with_kernels(self, model: Any, kernels: Mapping[str, Any]) -> Any:
        modules = dict(_modules(model))
        paths = [p for p in kernels if p in modules]
        if not paths:
            return model
        return eqx.tree_at(
            lambda m: [_at(m, p).weight for p in paths],
            model,
            [kernels[p] for p in paths],
        )


def _at(model: Any, path: str) -> Any:
    return dict(_modules(model))[path]


def _dressed(node: Any, path: str, resolver: Resolver, extensions: tuple[Any, ...]) -> Any:
    """A copy of ``node`` whose modules run through the hook, parameters in their compute
    dtypes (a ``QuantizedArray`` kernel kept for its layer's matmul)."""
    leaves, treedef = _children(node)
    new = []
    for key_path, leaf in leaves:
        child = _join(path, key_path)
        if _is_module(leaf):
            new.append(_dressed(leaf, child, resolver, extensions))
        elif is_quantized(leaf) or is_slot(leaf):  # a layer's state: never cast
            new.append(leaf)
        else:
            new.append(resolver.variable(child)[0].cast_to_compute(leaf))
    copy = jax.tree_util.tree_unflatten(treedef, new)
    if isinstance(copy, eqx.Module) and callable(copy):
        cls = _original(type(copy))
        resolution = resolver.module(path, public_class(cls))
        subclass = _subclass(cls, path, resolution, extensions)
        object.__setattr__(copy, "__class__", subclass)
    return copy


def _subclass(cls: type, path: str, resolution: Any, extensions: tuple[Any, ...]) -> type:
    names = (resolution.policy.name, resolution.chosen_policy.name)
    key = (cls, path, resolution, names, extensions)
    subclass = _SUBCLASSES.get(key)
    if subclass is None:
        original = cls.__call__

        @functools.wraps(original)
        def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
            path, resolution, extensions = getattr(type(self), _CALL)
            call = interception.Call(path, self, resolution)
            bound = functools.partial(original, self)
            out = interception.run(call, bound, args, kwargs, extensions=extensions)
            return _state_back(out, (args, kwargs))

        namespace = {
            _ORIGINAL: cls,
            _CALL: (path, resolution, extensions),
            "__call__": __call__,
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
        }
        subclass = type(cls)(cls.__name__, (cls,), namespace)
        _SUBCLASSES[key] = subclass
    return subclass
