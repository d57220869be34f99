"""Running an NNX model per submodule: a policy-running copy of the object graph."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jmp_policy._src import casting, float8, interception, quantization
from jmp_policy._src.policy_map import leaf_path, parent_path
from jmp_policy._src.resolution import ModuleInfo, Resolution, Resolver
from jmp_policy._src.run_report import compute_modules, warn_once
from jmp_policy.nnx._modules import (
    MATMUL_CLASSES,
    filled_dtype,
    is_nnx_object,
    method_of,
    methods_for,
    own_dtype,
    path_of,
    prepare,
)
from jmp_policy.nnx._quantization import quantized_matmuls, quantized_run, routable, stacked

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


def resolver_for(model: nnx.Module, policies: Any, options: Any) -> Resolver:
    """A resolver that knows every module of ``model`` (classes and own dtypes)."""
    # Every module is recorded before any is resolved: NNX lists children before their
    # parents, and a child inherits its parent's class policy (`type_policies`).
    infos: dict[str, ModuleInfo] = {}
    modules = sorted(nnx.iter_modules(model), key=lambda item: len(item[0]) > 0)  # root first
    for parts, module in modules:
        cls = getattr(type(module), _ORIGINAL, type(module))
        infos.setdefault(path_of(parts), ModuleInfo(cls, own_dtype(module)))
    resolver = Resolver(policies, options, infos)
    for path in sorted(infos, key=len):  # the root first, parents before children
        resolver.module(path)
    return resolver


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


def apply(
    model: nnx.Module,
    policy_or_map: Any,
    method: str | Callable[..., Any] = "__call__",
    **options: Any,
) -> Callable[..., Any]:
    """Makes a function that runs an NNX ``model`` per submodule under a policy or a map.

    The returned function takes ``method``'s arguments. Each submodule (the root: path
    ``""``; a module's path is its ``'/'``-joined attribute path, ``"layers/0"``) runs
    under :func:`jmp_policy.current_policy` set to its policy, the floating leaves of its
    arguments and its ``nnx.Param`` values cast to its compute dtype; its outputs are cast
    only when its policy's output dtype differs from its compute dtype, and loop carries
    keep their dtype. A parameter's policy is resolved from its own path
    (``"embed/embedding"``), otherwise its module's. The rules are those of
    :func:`jmp_policy.linen.apply`, warnings included. Each call runs a copy of the model
    (``nnx.split``, cast, ``nnx.merge``): ``model`` keeps its stored parameters,
    ``nnx.grad`` gives gradients in their stored dtype, and the copy's non-``Param`` state
    (batch statistics, caches, RNG counts) is written back in its stored dtype. Int8 and
    float8 policies run ``nnx.Linear``, ``nnx.LinearGeneral`` and ``nnx.Einsum`` matmuls
    quantized (float8 state: :func:`jmp_policy.nnx.init_float8`). Works under
    ``nnx.jit``, ``nnx.grad``, ``nnx.vmap`` and ``nnx.scan`` over a model: call
    ``apply`` inside the transformed function. The README's "How the Flax wrappers work"
    gives the details and what is not covered.

    Args:
        model: an ``nnx.Module``; never modified except for its non-``Param`` state.
        policy_or_map: as for :func:`jmp_policy.linen.apply`.
        method: the name of the model's method to run (``"__call__"``), or a function
            ``fn(model, *args, **kwargs)`` that runs under the root policy.
        **options: as for :func:`jmp_policy.linen.apply`.

    Returns:
        A function ``(*args, **kwargs)`` returning the method's outputs.

    Raises:
        TypeError: ``model`` is not an ``nnx.Module``, ``method`` is neither a string nor
            callable, or an option has the wrong type.
        ValueError: ``policy_or_map`` or a policy of ``type_policies`` is not a valid
            floating policy, or the model has no method ``method``.

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
        >>> policy_map = jp.DTypePolicyMap("mixed_bfloat16", {"head": "float32"})
        >>> run = jp.nnx.apply(model, policy_map)
        >>> run(jnp.ones((1, 3))).dtype   # the float32 head's logits
        dtype('float32')
        >>> model.encoder.kernel.dtype  # the stored parameters are unchanged
        dtype('float32')
        >>> loss = lambda m, x: jp.nnx.apply(m, "mixed_bfloat16")(x).astype("float32").sum()
        >>> grads = nnx.grad(loss)(model, jnp.ones((1, 3)))
        >>> {x.dtype for x in jax.tree.leaves(grads)}
        {dtype('float32')}
    """
    policies, opts = prepare(model, policy_or_map, options)
    return apply_with(model, policies, opts, method)


def _warn_plain_arrays(model: str, paths: list[str]) -> None:
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


def apply_with(
    model: nnx.Module, policies: Any, opts: Any, method: str | Callable[..., Any]
) -> Callable[..., Any]:
    """:func:`apply` with checked arguments and built options (``diagnose`` adds its taps)."""
    methods = methods_for(model, method)
    # Quantized layers' matmuls innermost, and only on the layers they can reach: each
    # Python frame a module call adds costs trace time in every op it runs.
    extensions = (*opts.extensions, quantized_matmuls)
    warned: set[str] = set()  # what this wrapper has warned about

    def run(*args: Any, **kwargs: Any) -> Any:
        resolver = resolver_for(model, policies, opts)
        copy, casts = _cast_copy(model, resolver)
        _dress(copy, resolver, methods, opts.extensions)
        # Before the call: a policy turned off by modules' own dtypes may well make the
        # model fail (a cache of one dtype written with another), so say why first.
        compute = compute_modules(resolver, nnx.state(model), MATMUL_CLASSES)
        warn_once(resolver, type(model).__name__, warned, compute)
        if casts.plain and "plain" not in warned:
            warned.add("plain")
            _warn_plain_arrays(type(model).__name__, casts.plain)
        with interception.model_run(opts), quantized_run(casts.whole):
            if isinstance(method, str):
                out = getattr(copy, method)(*args, **kwargs)
            else:
                call = interception.Call("", copy, resolver.module(""))
                out = interception.run(
                    call,
                    functools.partial(method, copy),
                    args,
                    kwargs,
                    extensions=extensions,
                    opaque=is_nnx_object,
                )
        _write_back(model, copy, casts.stored)
        return out

    return run


class _Casts(NamedTuple):
    """What :func:`_cast_copy` did: the stored dtypes of the non-parameter state (to write
    it back in), the QuantizedArray kernels passed whole, the plain floating arrays the
    policy would have cast."""

    stored: dict[str, np.dtype]
    whole: dict[str, Any]
    plain: list[str]


def _cast_copy(model: nnx.Module, resolver: Resolver) -> tuple[nnx.Module, _Casts]:
    """The policy-running copy of ``model``: parameters in their compute dtypes (a
    quantized kernel of a routed layer as its integer values, read whole by the layer's
    matmul), every other variable a fresh one in its stored dtype."""
    graphdef, state = nnx.split(model)
    casts = _Casts({}, {}, [])
    # A stacked layer (nnx.vmap'd, run under nnx.scan) sees a slice of its kernel:
    # its QuantizedArray is dequantized ahead of the model, not passed whole.
    whole_paths = {
        path_of(parts)
        for parts, module in nnx.iter_modules(model)
        if routable(module) and not stacked(module)
    }

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
            policy = resolver.variable(path)[0]
            module_path, _, name = path.rpartition("/")
            if (
                quantization.is_quantized(value)
                and name == "kernel"
                and module_path in whole_paths
                and not float8.is_float8(policy)
            ):
                # The layer's matmul reads the QuantizedArray itself (see
                # jmp_policy._src.matmuls); NNX's promote_dtype gets its integers.
                casts.whole[module_path] = value
                ints = value.values
                return variable.replace(ints.astype(jnp.int8) if ints.dtype == jnp.int4 else ints)
            return variable.replace(policy.cast_to_compute(value))
        if isinstance(value, (jax.Array, np.ndarray)):
            casts.stored[path] = value.dtype
        return variable.replace(value)  # A fresh variable for the copy.

    copy_state = jax.tree_util.tree_map_with_path(
        cast_variable, state, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )
    return nnx.merge(graphdef, copy_state), casts


def _dress(
    copy: nnx.Module,
    resolver: Resolver,
    methods: tuple[str, ...],
    extensions: tuple[Any, ...],
) -> None:
    """Each module of the copy computes in its policy's dtype (where its ``dtype`` is not
    the user's) and runs its methods through the hook (a policy subclass) with
    ``extensions``, and the quantized matmuls innermost where a layer's matmul is
    routable."""
    for parts, module in list(nnx.iter_modules(copy)):
        path = path_of(parts)
        resolution = resolver.module(path)
        if resolution.set_dtype is not None:
            object.__setattr__(module, "dtype", resolution.set_dtype)
        elif filled_dtype(module):  # not the user's: computes in the policy's dtype
            object.__setattr__(module, "dtype", resolution.policy.compute_dtype)
        wrapped = tuple(name for name in methods if method_of(type(module), name))
        if wrapped:
            own = (*extensions, quantized_matmuls) if routable(module) else extensions
            subclass = _policy_subclass(type(module), path, resolution, own, wrapped)
            object.__setattr__(module, "__class__", subclass)


def _write_back(model: nnx.Module, copy: nnx.Module, stored: dict[str, np.dtype]) -> None:
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
