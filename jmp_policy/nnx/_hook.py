"""The NNX hook: each module of a policy-running copy is re-classed to a subclass whose
methods run through :func:`jmp_policy._src.interception.run` under its own policy."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from flax import nnx

from jmp_policy._src import interception
from jmp_policy._src.resolution import Resolution, Resolver
from jmp_policy.nnx._modules import filled_dtype, is_nnx_object, method_of, path_of
from jmp_policy.nnx._quantization import routable

# The attributes a policy-running subclass keeps its original class and its call under.
_ORIGINAL = "_jmp_policy_original_class"
_CALL = "_jmp_policy_call"
_SUBCLASSES: dict[tuple[Any, ...], type] = {}


def _policy_method(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        # Bound as Python would: a function or a transform's wrapper (`@nnx.jit`) gets
        # `self`; a staticmethod or a plain callable object does not.
        get = getattr(type(original), "__get__", None)
        bound = original if get is None else get(original, self, type(self))
        path, resolution, extensions = getattr(type(self), _CALL)
        call = interception.Call(path, self, resolution)
        return interception.run(
            call, bound, args, kwargs, extensions=extensions, opaque=is_nnx_object
        )

    return method


def call_path(module: Any) -> str | None:
    """The path of a module of a policy-running copy (``None`` for any other module)."""
    found = getattr(type(module), _CALL, None)
    return None if found is None else found[0]  # type: ignore[no-any-return]


def original_class(module: Any) -> type:
    """The module's class as the user wrote it (not its policy-running subclass)."""
    return getattr(type(module), _ORIGINAL, type(module))  # type: ignore[no-any-return]


def _policy_subclass(
    cls: type, path: str, resolution: Resolution, extensions: Any, methods: tuple[str, ...]
) -> type:
    """A subclass of ``cls`` whose ``methods`` run through the hook (cached).

    The call's path and resolution are class attributes, not instance attributes nor an
    ``id()``-keyed table, so NNX transforms that split and re-merge a submodule inside
    the model (``nnx.scan``, ``nnx.remat``, ``nnx.vmap``) recreate it with the same
    behaviour.
    """
    cls = getattr(cls, _ORIGINAL, cls)
    # Equal policies may have different names: keep the ones the user gave.
    names = (resolution.policy.name, resolution.chosen_policy.name)
    key = (cls, path, resolution, names, extensions, methods)
    subclass = _SUBCLASSES.get(key)
    if subclass is None:
        namespace: dict[str, Any] = {
            _ORIGINAL: cls,
            _CALL: (path, resolution, extensions),
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
        }
        for name in methods:
            original = method_of(cls, name)
            if original is not None:
                namespace[name] = _policy_method(original)
        subclass = type(cls)(
            cls.__name__, (cls,), namespace, pytree=getattr(cls, "_pytree__is_pytree", True)
        )
        _SUBCLASSES[key] = subclass
    return subclass


def dress(
    copy: nnx.Module,
    resolver: Resolver,
    methods: tuple[str, ...],
    extensions: tuple[Any, ...],
    routed: Any = None,
) -> None:
    """Each module of the copy computes in its policy's dtype (where its ``dtype`` is not
    the user's) and runs its methods through the hook (a policy subclass) with
    ``extensions``, less ``routed`` (the core's routed matmuls) where the module's matmul
    is not routable."""
    for parts, module in list(nnx.iter_modules(copy)):
        path = path_of(parts)
        resolution = resolver.module(path)
        if resolution.set_dtype is not None:
            object.__setattr__(module, "dtype", resolution.set_dtype)
        elif filled_dtype(module):  # not the user's: computes in the policy's dtype
            object.__setattr__(module, "dtype", resolution.policy.compute_dtype)
        wrapped = tuple(name for name in methods if method_of(type(module), name))
        if wrapped:
            # The routed matmuls only on the layers they can reach: each Python frame a
            # module call adds costs trace time in every op it runs.
            own = tuple(e for e in extensions if e is not routed or routable(module))
            subclass = _policy_subclass(type(module), path, resolution, own, wrapped)
            object.__setattr__(module, "__class__", subclass)
