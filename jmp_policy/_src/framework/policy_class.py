"""Policy-running subclasses: a module of a model's policy-running copy re-classed, for a
run, to a subclass of its class whose methods run through the hook
(:func:`jmp_policy._src.interception.run`) under its own policy.

The call's path, resolution and extensions are class attributes of the subclass, not
instance attributes nor an ``id()``-keyed table, so a framework transform that splits and
re-merges a module inside the model (NNX's ``nnx.scan``, ``nnx.remat``, ``nnx.vmap``)
recreates it with the same behaviour. Subclasses are cached per class, path, resolution
(and the names the user gave its policies), extensions and methods.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

from jmp_policy._src import interception
from jmp_policy._src.resolution import Resolution

# The attributes a policy-running subclass keeps its original class and its call under.
_ORIGINAL = "_jmp_policy_original_class"
_CALL = "_jmp_policy_call"
_SUBCLASSES: dict[tuple[Any, ...], type] = {}


def original_class(module: Any) -> type:
    """The module's class as the user wrote it (not its policy-running subclass)."""
    return getattr(type(module), _ORIGINAL, type(module))  # type: ignore[no-any-return]


def call_path(module: Any) -> str | None:
    """The path of a module of a policy-running copy (``None`` for any other module)."""
    found = getattr(type(module), _CALL, None)
    return None if found is None else found[0]  # type: ignore[no-any-return]


def method_of(cls: type, name: str) -> Callable[..., Any] | None:
    """The callable ``cls`` defines (or inherits) as method ``name``, else None.

    A plain function, or a callable such as the wrapper a framework's transform leaves on
    a method (``@nnx.jit``). Looked up in the class's own MRO: ``getattr(cls,
    "__call__")`` would find the metaclass's ``__call__`` for classes that define none.
    """
    for klass in cls.__mro__:
        if name in vars(klass):
            attr = vars(klass)[name]
            return attr if callable(attr) else None
    return None


def _policy_method(
    original: Callable[..., Any], opaque: Callable[[Any], bool] | None
) -> Callable[..., Any]:
    @functools.wraps(original)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        # Bound as Python would: a function or a transform's wrapper gets `self`; a
        # staticmethod or a plain callable object does not.
        get = getattr(type(original), "__get__", None)
        bound = original if get is None else get(original, self, type(self))
        path, resolution, extensions = getattr(type(self), _CALL)
        call = interception.Call(path, self, resolution)
        return interception.run(call, bound, args, kwargs, extensions=extensions, opaque=opaque)

    return method


def policy_subclass(
    cls: type,
    path: str,
    resolution: Resolution,
    extensions: tuple[Any, ...],
    methods: tuple[str, ...],
    *,
    opaque: Callable[[Any], bool] | None = None,
    class_kwargs: Mapping[str, Any] | None = None,
) -> type:
    """A subclass of ``cls`` (its original class, if ``cls`` is a policy-running one)
    whose ``methods`` run through the hook at ``path`` with ``resolution`` and
    ``extensions`` (cached). ``opaque``: argument nodes the hook passes as they are;
    ``class_kwargs``: the keywords of the class statement (``type(cls)(..., **them)``)."""
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
                namespace[name] = _policy_method(original, opaque)
        subclass = type(cls)(cls.__name__, (cls,), namespace, **(class_kwargs or {}))
        _SUBCLASSES[key] = subclass
    return subclass
