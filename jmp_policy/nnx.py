"""Flax NNX integration: run an NNX model per submodule under a policy or a map.

:func:`apply` makes a function that runs an NNX model with each submodule's inputs and
parameters in its own compute dtype and its outputs in its output dtype, without
changing the model's stored parameters. ``NORM_FLOAT32`` is a ready ``type_policies``
mapping that keeps NNX's normalisation layers (``LayerNorm``, ``RMSNorm``,
``BatchNorm``, ``GroupNorm``, ``InstanceNorm``) in float32, as
``jmp_policy.linen.NORM_FLOAT32`` does for Linen; extend it as
``{**NORM_FLOAT32, MyNorm: "float32"}``.

Examples:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import jmp_policy as jp
    >>> sorted(cls.__name__ for cls in jp.nnx.NORM_FLOAT32)
    ['BatchNorm', 'GroupNorm', 'InstanceNorm', 'LayerNorm', 'RMSNorm']
    >>> norm = nnx.LayerNorm(4, rngs=nnx.Rngs(0))
    >>> x = jnp.ones((2, 4))
    >>> jp.nnx.apply(norm, "bfloat16")(x).dtype
    dtype(bfloat16)
    >>> jp.nnx.apply(norm, "bfloat16", type_policies=jp.nnx.NORM_FLOAT32)(x).dtype
    dtype('float32')
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx

from jmp_policy._src import casting, global_state
from jmp_policy._src import dtypes as dt
from jmp_policy._src.apply import as_policy_or_map
from jmp_policy._src.policy import DTypePolicy
from jmp_policy._src.policy_map import (
    leaf_path,
    normalize_type_policies,
    parent_path,
    resolve_module,
    resolve_variable,
)

__all__ = ["NORM_FLOAT32", "apply"]

NORM_FLOAT32: Mapping[type, str] = types.MappingProxyType(
    {
        nnx.LayerNorm: "float32",
        nnx.RMSNorm: "float32",
        nnx.BatchNorm: "float32",
        nnx.GroupNorm: "float32",
        nnx.InstanceNorm: "float32",
    }
)
"""``type_policies`` that keep NNX's normalisation layers in float32 (read-only)."""

# The attribute a policy-running subclass keeps its original class under.
_ORIGINAL = "_jmp_policy_original_class"
_POLICY = "_jmp_policy_policy"
_SUBCLASSES: dict[tuple[type, DTypePolicy, str, tuple[str, ...]], type] = {}


def _is_nnx_object(x: Any) -> bool:
    # Modules, Rngs and Variables passed as arguments are left alone: rebuilding them
    # through a tree map would cut them off from the graph the caller holds.
    return isinstance(x, (nnx.Pytree, nnx.Variable))


def _cast(tree: Any, dtype: np.dtype) -> Any:
    return jax.tree.map(
        lambda x: x if _is_nnx_object(x) else casting.cast_leaf(x, dtype),
        tree,
        is_leaf=_is_nnx_object,
    )


def _run_in_policy(policy: DTypePolicy, fn: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    """Runs ``fn`` with inputs in compute dtype, under ``current_policy()``, outputs cast."""
    args, kwargs = _cast((args, kwargs), policy.compute_dtype)
    with global_state.current_policy_scope(policy):
        out = fn(*args, **kwargs)
    return _cast(out, policy.output_dtype)


def _policy_method(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        # Bound as Python would: a function or a transform's wrapper (`@nnx.jit`) gets
        # `self`; a staticmethod or a plain callable object does not.
        get = getattr(type(original), "__get__", None)
        bound = original if get is None else get(original, self, type(self))
        return _run_in_policy(getattr(type(self), _POLICY), bound, args, kwargs)

    return method


def _method_of(cls: type, name: str) -> Callable[..., Any] | None:
    """The callable ``cls`` defines (or inherits) as method ``name``, else None.

    A plain function, or a callable such as the wrapper ``@nnx.jit``/``@nnx.remat``
    leave on a method. Looked up in the class's own MRO: ``getattr(cls, "__call__")``
    would find the metaclass's ``__call__`` for modules that define none (``nnx.List``).
    """
    for klass in cls.__mro__:
        if name in vars(klass):
            attr = vars(klass)[name]
            return attr if callable(attr) else None
    return None


def _policy_subclass(cls: type, policy: DTypePolicy, methods: tuple[str, ...]) -> type:
    """A subclass of ``cls`` whose ``methods`` run under ``policy`` (cached).

    The policy is a class attribute, not an instance attribute nor an ``id()``-keyed
    table, so NNX transforms that split and re-merge a submodule inside the model
    (``nnx.scan``, ``nnx.remat``, ``nnx.vmap``) recreate it with the same behaviour.
    """
    cls = getattr(cls, _ORIGINAL, cls)
    # Equal policies may have different names: keep the one the user gave.
    key = (cls, policy, policy.name, methods)
    subclass = _SUBCLASSES.get(key)
    if subclass is None:
        namespace: dict[str, Any] = {
            _ORIGINAL: cls,
            _POLICY: policy,
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
        }
        for name in methods:
            original = _method_of(cls, name)
            if original is not None:
                namespace[name] = _policy_method(name, original)
        subclass = type(cls)(
            cls.__name__, (cls,), namespace, pytree=getattr(cls, "_pytree__is_pytree", True)
        )
        _SUBCLASSES[key] = subclass
    return subclass


def _own_dtype(module: Any) -> np.dtype | None:
    """The module's own ``dtype`` attribute when it is set to a floating dtype."""
    dtype = dt.floating_or_none(getattr(module, "dtype", None))
    if isinstance(module, nnx.Embed) and dtype == dt.floating_or_none(module.param_dtype):
        return None  # `nnx.Embed` fills an unset `dtype` in from its `param_dtype`.
    return dtype


def _path(parts: tuple[Any, ...]) -> str:
    return "/".join(str(p) for p in parts)


def _check_type_policies(type_policies: Any) -> dict[type, DTypePolicy]:
    return normalize_type_policies(type_policies, nnx.Module, "nnx.Module", "nnx.LayerNorm")


def apply(
    model: nnx.Module,
    policy_or_map: Any,
    method: str | Callable[..., Any] = "__call__",
    *,
    type_policies: Mapping[type, Any] | None = None,
) -> Callable[..., Any]:
    """Makes a function that runs an NNX ``model`` per submodule under a policy or a map.

    The returned function takes ``method``'s arguments. Each submodule (the root under
    the path ``""``) runs with the floating leaves of its positional and keyword
    arguments and its ``nnx.Param`` values in its own compute dtype, under
    :func:`jmp_policy.current_policy` returning its policy, and its outputs cast to its
    output dtype. A module's path is its ``'/'``-joined attribute path, integers as
    digits (``"layers/0"``; an ``nnx.Sequential``'s children are ``"<name>/layers/<i>"``),
    the same as its ``State`` paths without ``.value``. A parameter's policy is resolved
    from its own path (``"embed/embedding"``), so a key may name one variable; otherwise
    it is its module's. With ``type_policies``, a key matching the module's own path wins
    over its class's policy, which wins over inheritance from an ancestor. A submodule
    whose own ``dtype`` attribute is set (``nnx.Linear(..., dtype=jnp.float32)``)
    computes in that dtype whatever the policy says, as in :mod:`jmp_policy.linen`: its
    inputs and parameters are cast to it (float32 weights are not rounded through
    bfloat16) and its output is left in it.

    **How it works.** Each call splits ``model`` (``nnx.split``), casts the ``nnx.Param``
    values per variable path and merges a fresh copy of the object graph
    (``nnx.merge``), so ``model`` keeps its stored parameters and ``nnx.grad`` through
    the call gives gradients in their stored dtype (float32 master weights get float32
    gradients). In the copy, each submodule's class is swapped for a cached subclass
    whose ``__call__`` (and ``method``, when a name) casts the inputs, enters the
    submodule's policy, calls the original method and casts the outputs. The policy is
    a class attribute, so NNX transforms used inside the model (which re-merge
    submodules into new instances) keep it. After the call, every non-``Param``
    variable of the copy (``BatchStat``, RNG counts, ``Cache``, sown ``Intermediate``)
    is written back into ``model`` with ``nnx.update``, cast to its stored dtype.

    Works under ``nnx.jit``, ``nnx.grad``/``nnx.value_and_grad``, ``nnx.vmap`` and
    ``nnx.scan`` over a model and ``jax.jit`` of a ``split``/``merge`` function: call
    ``apply`` inside the transformed function, on the model it receives.

    **Not covered.** Only ``__call__`` (and ``method``) of submodules is wrapped: other
    methods a parent calls on a submodule (``self.embed.attend(x)``,
    ``self.encoder.encode(x)``) and code that reads a submodule's parameters directly
    (``x @ self.linear.kernel``) run with the caller's inputs and ``current_policy()``,
    on parameters already cast for their owner. A module or parameter shared at several
    paths (tied weights) gets the policy of the first path NNX's graph traversal finds.
    Changes to ``nnx.Param`` values made inside the call are not written back. Modules
    created inside the call run unwrapped. A submodule called as the body of an
    ``nnx.scan`` inside the model returns its carry in its output dtype: use a policy
    whose output dtype is the carry's, or cast the carry back in the body. Non-``Param``
    variables (batch statistics, caches) are not cast to the compute dtype.

    Args:
        model: an ``nnx.Module``; never modified except for its non-``Param`` state.
        policy_or_map: a policy, a policy name, a ``DTypePolicyMap``, a ``dict`` of keys
            to policies (a map whose default is the global policy) or ``None`` (the
            global policy).
        method: the name of the model's method to run (``"__call__"``), or a function
            ``fn(model, *args, **kwargs)`` that runs under the root policy.
        type_policies: ``{module class: policy or name}``, such as
            :data:`NORM_FLOAT32`, giving every instance of a class (or subclass) a policy.

    Returns:
        A function ``(*args, **kwargs)`` returning the method's outputs.

    Raises:
        TypeError: ``model`` is not an ``nnx.Module``, ``method`` is neither a string nor
            callable, or ``type_policies`` is not a mapping of ``nnx.Module`` classes.
        ValueError: ``policy_or_map`` or a policy of ``type_policies`` is not a valid
            policy, or the model has no method ``method``.

    Examples:
        >>> import jax
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import jmp_policy as jp
        >>> class Model(nnx.Module):
        ...     def __init__(self, rngs):
        ...         self.encoder = nnx.Linear(3, 4, rngs=rngs)
        ...         self.head = nnx.Linear(4, 2, rngs=rngs)
        ...     def __call__(self, x):
        ...         return self.head(self.encoder(x))
        >>> model = Model(nnx.Rngs(0))
        >>> policy_map = jp.DTypePolicyMap("float32", {"encoder": "mixed_bfloat16"})
        >>> run = jp.nnx.apply(model, policy_map)
        >>> run(jnp.ones((1, 3))).dtype
        dtype('float32')
        >>> model.encoder.kernel.dtype  # the stored parameters are unchanged
        dtype('float32')
        >>> loss = lambda m, x: jp.nnx.apply(m, "mixed_bfloat16")(x).astype("float32").sum()
        >>> grads = nnx.grad(loss)(model, jnp.ones((1, 3)))
        >>> {x.dtype for x in jax.tree.leaves(grads)}
        {dtype('float32')}
    """
    if not isinstance(model, nnx.Module):
        raise TypeError(
            "`model` must be an `nnx.Module`. Received: "
            f"model={model!r} (of type {type(model).__name__})"
        )
    resolved = as_policy_or_map(policy_or_map)
    types_ = _check_type_policies(type_policies)
    if isinstance(method, str):
        if _method_of(type(model), method) is None:
            raise ValueError(
                f"`method` must name a method of {type(model).__name__}. Received: "
                f"method={method!r}"
            )
        methods = ("__call__",) if method == "__call__" else ("__call__", method)
    elif callable(method):
        methods = ("__call__",)
    else:
        raise TypeError(
            "`method` must be a method name such as '__call__' or a function "
            f"fn(model, *args, **kwargs). Received: method={method!r}"
        )

    def run(*args: Any, **kwargs: Any) -> Any:
        modules = [(_path(parts), module) for parts, module in nnx.iter_modules(model)]
        classes = {path: getattr(type(m), _ORIGINAL, type(m)) for path, m in modules}
        owns = {path: own for path, m in modules if (own := _own_dtype(m)) is not None}

        def module_policy(path: str) -> DTypePolicy:
            policy = resolve_module(resolved, path, classes, types_)[0]
            own = owns.get(path)
            if own is not None:  # `nnx.Linear(..., dtype=jnp.float32)` computes in float32.
                policy = policy.with_compute_dtype(own).with_output_dtype(own)
            return policy

        def param_policy(path: str) -> DTypePolicy:
            policy, source = resolve_variable(resolved, path, classes, types_)
            module = parent_path(path) or ""
            if module in owns and source == resolve_module(resolved, module, classes, types_)[1]:
                return module_policy(module)  # No key names the variable itself.
            return policy

        graphdef, state = nnx.split(model)
        stored: dict[str, np.dtype] = {}

        def cast_variable(key_path: Any, variable: Any) -> Any:
            path = leaf_path(key_path)
            if isinstance(variable, nnx.Param):
                policy = param_policy(path)
                return variable.replace(policy.cast_to_compute(variable.get_value()))
            value = variable.get_value()
            if isinstance(value, (jax.Array, np.ndarray)):
                stored[path] = value.dtype
            return variable.replace(variable.get_value())  # A fresh variable for the copy.

        copy_state = jax.tree_util.tree_map_with_path(
            cast_variable, state, is_leaf=lambda x: isinstance(x, nnx.Variable)
        )
        copy = nnx.merge(graphdef, copy_state)
        for parts, module in list(nnx.iter_modules(copy)):
            path = _path(parts)
            wrapped = tuple(m for m in methods if _method_of(type(module), m) is not None)
            if wrapped:
                subclass = _policy_subclass(type(module), module_policy(path), wrapped)
                object.__setattr__(module, "__class__", subclass)

        if isinstance(method, str):
            out = getattr(copy, method)(*args, **kwargs)
        else:
            out = _run_in_policy(module_policy(""), functools.partial(method, copy), args, kwargs)

        def restore(key_path: Any, variable: Any) -> Any:
            dtype = stored.get(leaf_path(key_path))
            if dtype is None:  # Created during the call, or not an array: kept as is.
                return variable
            return variable.replace(casting.cast_leaf(variable.get_value(), dtype))

        updates = nnx.state(copy, nnx.Not(nnx.Param))
        updates = jax.tree_util.tree_map_with_path(
            restore, updates, is_leaf=lambda x: isinstance(x, nnx.Variable)
        )
        nnx.update(model, updates)
        return out

    return run
