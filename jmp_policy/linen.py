"""Flax Linen integration: run a Linen model under a policy or a map, per submodule.

A user keeps the model as it is and writes one policy or one
:class:`~jmp_policy.DTypePolicyMap`; :func:`apply` and :func:`init` wrap ``module.apply``
and ``module.init`` so that every submodule computes in its own dtype, with float32 master
weights and float32 gradients.

How it works:

* **Parameters** are cast before ``module.apply`` runs, leaf by leaf, to the compute dtype
  of the policy of each variable's path (``"encoder/mlp/kernel"`` resolves like its module
  ``"encoder/mlp"`` unless a key names the variable itself). Only the ``"params"``
  collection is cast; other collections (BatchNorm's ``"batch_stats"``, caches) are passed
  and returned in their stored dtype. The casts are ordinary ``astype`` ops, so gradients
  flow back to the stored dtype and XLA compiles the same code as a hand-written
  ``jax.tree.map(lambda x: x.astype(...), params)``.
* **Inputs and outputs** are cast by a ``flax.linen.intercept_methods`` interceptor on every
  submodule's ``__call__``: every floating leaf of its positional and keyword arguments to
  the submodule's compute dtype, its return value to the submodule's output dtype, and
  :func:`jmp_policy.current_policy` returns the submodule's policy while it runs. The root
  module runs under the policy of the path ``""`` (whichever method is called).
* **Module classes** (for ``type_policies``) and modules' own ``dtype=`` attributes are
  found by a shape-only pre-pass (``jax.eval_shape`` of ``module.apply`` with an
  interceptor that records ``module.path`` and the module's class), so parameters are cast
  straight to the right dtype: a float32 island's float32 weights are never rounded through
  bfloat16. The pre-pass traces the model once more (no computation), once per new input
  signature; under ``jit`` that is once per compilation.
* **Precedence** for a module: a key of the map that matches the module's own path, then
  its class in ``type_policies``, then inheritance from its nearest ancestor (by the same
  rule), then the default policy. A module whose own ``dtype`` attribute is set (Flax's
  ``nn.Dense(..., dtype=jnp.float32)``) computes in that dtype whatever the policy says:
  its inputs and parameters are cast to it, and its output is left in it; the policy's
  variable dtype still applies to :func:`init`. :func:`explain` shows all of this.
* **Lifted transforms.** ``nn.jit``, ``nn.remat``, ``nn.vmap`` and ``nn.scan`` work: the
  lifted wrapper's own call is not intercepted, the wrapped module's call inside it is. The
  body of an ``nn.scan`` is recognised as such, and the carry it returns is cast back to the
  dtype the carry came in with, so a policy never breaks a scan; the scanned outputs are
  cast to the output dtype.

What it does not cover: only ``__call__`` (and the root's method) is intercepted, so a
submodule's other methods called from outside (``embed.attend(x)``) see their parameters
in the compute dtype but receive their arguments as they are and run under the caller's
:func:`~jmp_policy.current_policy`; arrays a module closes over or creates itself are its
own business (``current_policy()`` is there to create them in the right dtype);
``nn.while_loop``/``nn.fori_loop``/``nn.cond`` bodies are plain functions, so their carries
are not protected the way ``nn.scan``'s is; the function-decorator form of ``nn.scan``
(on a method) is not recognised as a scan body. During :func:`init` parameters are created
in their ``param_dtype`` and read as created (Flax creates and reads them in one step).

``NORM_FLOAT32`` is a ready ``type_policies`` mapping (read-only) that keeps Flax's
normalisation layers (``LayerNorm``, ``RMSNorm``, ``BatchNorm``, ``GroupNorm``,
``InstanceNorm``) in float32; combine it with your own entries as
``{**NORM_FLOAT32, MyNorm: "float32"}``.

Examples:
    >>> import jax
    >>> import jax.numpy as jnp
    >>> import flax.linen as nn
    >>> import jmp_policy as jp
    >>> class Model(nn.Module):
    ...     @nn.compact
    ...     def __call__(self, x):
    ...         x = nn.Dense(8)(x)
    ...         x = nn.LayerNorm()(x)
    ...         return nn.Dense(2, name="head")(x)
    >>> model = Model()
    >>> x = jnp.ones((4, 3))
    >>> variables = jp.linen.init(model, "mixed_bfloat16")(jax.random.key(0), x)
    >>> variables["params"]["Dense_0"]["kernel"].dtype
    dtype('float32')
    >>> policy_map = jp.DTypePolicyMap("mixed_bfloat16", {"": "float32", "head": "float32"})
    >>> fn = jp.linen.apply(model, policy_map, type_policies=jp.linen.NORM_FLOAT32)
    >>> fn(variables, x).dtype   # the root ("") and the head run in float32
    dtype('float32')
    >>> sorted(jp.linen.NORM_FLOAT32, key=lambda c: c.__name__)[0].__name__
    'BatchNorm'
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from flax.core import lift as _lift

from jmp_policy._src import casting, global_state
from jmp_policy._src import dtypes as dt
from jmp_policy._src.apply import as_policy_or_map
from jmp_policy._src.policy import DTypePolicy
from jmp_policy._src.policy_map import (
    DTypePolicyMap,
    format_table,
    leaf_path,
    normalize_type_policies,
    parent_path,
    resolve_module,
    resolve_variable,
)

__all__ = ["NORM_FLOAT32", "apply", "explain", "init"]

NORM_FLOAT32: Mapping[type, str] = types.MappingProxyType(
    {
        nn.LayerNorm: "float32",
        nn.RMSNorm: "float32",
        nn.BatchNorm: "float32",
        nn.GroupNorm: "float32",
        nn.InstanceNorm: "float32",
    }
)

# path -> (module class, the module's own floating `dtype` attribute or None)
_Infos = dict[str, tuple[type, "np.dtype | None"]]
_CACHE_SIZE = 64
_INIT_MUTABLE = nn.DenyList("intermediates")  # `module.init`'s default


# -- arguments ----------------------------------------------------------------------------


def _check_module(module: Any) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(
            "`module` must be a flax.linen Module instance (such as `MyModel()`). "
            f"Received: module={module!r} (of type {type(module).__name__})"
        )


def _check_method(module: nn.Module, method: Any) -> None:
    if method is None or callable(method):
        return
    if not isinstance(method, str):
        raise TypeError(
            "`method` must be None, the name of a method of the module or a callable "
            f"`fn(module, *args, **kwargs)`. Received: method={method!r} "
            f"(of type {type(method).__name__})"
        )
    if not callable(getattr(module, method, None)):
        raise ValueError(
            f"`method` names no method of {type(module).__name__}. Received: method={method!r}"
        )


def _check_type_policies(type_policies: Any) -> dict[type, DTypePolicy]:
    return normalize_type_policies(type_policies, nn.Module, "nn.Module", "nn.LayerNorm")


def _check_variables(variables: Any) -> None:
    if not isinstance(variables, Mapping):
        raise TypeError(
            "`variables` must be a mapping of collections such as {'params': ...}, as "
            f"returned by `init`. Received: variables of type {type(variables).__name__}"
        )


# -- modules ------------------------------------------------------------------------------


def _path(module: nn.Module) -> str:
    return "/".join(str(p) for p in module.path)


def _own_dtype(module: Any) -> np.dtype | None:
    """The module's own ``dtype`` attribute when it is set to a floating dtype."""
    return dt.floating_or_none(getattr(module, "dtype", None))


def _is_scan_class(cls: type) -> bool:
    """Whether ``cls`` (or a class it derives from) was made by ``nn.scan``."""
    for klass in cls.__mro__:
        if klass.__module__ == "flax.linen.transforms" and klass.__name__.startswith("Scan"):
            return True
        fn = klass.__dict__.get("__call__")
        while fn is not None:
            for cell in getattr(fn, "__closure__", None) or ():
                try:
                    if cell.cell_contents is _lift.scan:
                        return True
                except ValueError:  # an empty cell
                    pass
            fn = getattr(fn, "__wrapped__", None)
    return False


def _is_scan_body(module: nn.Module, running: list[nn.Module], root: type) -> bool | None:
    """Whether this call is the body of an ``nn.scan`` (None: cannot tell).

    A lifted transform calls a clone of the wrapped module on a fresh root scope; its
    parent (still running) holds the lifted wrapper under the same name. When the root
    module itself is an ``nn.scan`` class, its body is the clone at the path ``()``.
    """
    scope = module.scope
    if scope is None or scope.parent is not None:
        return False
    if not module.path:
        return type(module) is not root and _is_scan_class(root)
    parent = tuple(module.path[:-1])
    for candidate in reversed(running):
        if tuple(candidate.path) == parent:
            try:
                child = candidate._state.children.get(module.path[-1])
            except AttributeError:
                return None
            if isinstance(child, nn.Module):
                return _is_scan_class(type(child))
            return None
    return None


class _Classes(Mapping[str, type]):
    """A live view of the module classes recorded so far, by path."""

    def __init__(self, infos: _Infos):
        self._infos = infos

    def __getitem__(self, path: str) -> type:
        return self._infos[path][0]

    def __iter__(self) -> Iterator[str]:
        return iter(self._infos)

    def __len__(self) -> int:
        return len(self._infos)


class _Resolver:
    """Per-call resolution of module and variable policies (cached per path)."""

    def __init__(
        self, policy_or_map: Any, type_policies: Mapping[type, DTypePolicy], infos: _Infos
    ):
        self.policy_or_map = policy_or_map
        self.type_policies = type_policies
        self.infos = infos
        self.classes = _Classes(infos)
        self._modules: dict[str, tuple[DTypePolicy, str, DTypePolicy, np.dtype | None]] = {}

    def module(
        self, path: str, cls: type | None = None, own: np.dtype | None = None
    ) -> tuple[DTypePolicy, str, DTypePolicy, np.dtype | None]:
        """``(effective policy, source, resolved policy, own dtype)`` of a module path."""
        if path in self._modules:
            return self._modules[path]
        if cls is not None:
            self.infos.setdefault(path, (cls, own))
        elif path in self.infos:
            cls, own = self.infos[path]
        policy, source = resolve_module(self.policy_or_map, path, self.classes, self.type_policies)
        effective = policy
        if own is not None:
            effective = policy.with_compute_dtype(own).with_output_dtype(own)
        result = (effective, source, policy, own)
        self._modules[path] = result
        return result

    def variable(self, path: str) -> tuple[DTypePolicy, bool]:
        """A variable's compute policy and whether a key names the variable itself."""
        module = parent_path(path) or ""
        effective, source, _, _ = self.module(module)
        if not isinstance(self.policy_or_map, DTypePolicyMap):
            return effective, False
        policy, var_source = resolve_variable(
            self.policy_or_map, path, self.classes, self.type_policies
        )
        if var_source != source:
            return policy, True
        return effective, False


def _cast_params(params: Any, resolver: _Resolver, variable: bool) -> Any:
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    leaves = []
    for key_path, leaf in flat:
        policy, _ = resolver.variable(leaf_path(key_path))
        dtype = policy.variable_dtype if variable else policy.compute_dtype
        leaves.append(casting.cast_leaf(leaf, dtype))
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _with_params(variables: Mapping[str, Any], fn: Callable[[Any], Any]) -> Any:
    if "params" not in variables:
        return variables
    result = dict(variables)
    result["params"] = fn(variables["params"])
    return result


def _restore_params(returned: Any, passed: Any, stored: Any, resolver: _Resolver) -> Any:
    """``mutable`` "params" back in their stored dtypes (the stored leaf when unchanged)."""

    def by_path(tree: Any) -> dict[str, Any]:
        flat = jax.tree_util.tree_flatten_with_path(tree)[0]
        return {leaf_path(key_path): leaf for key_path, leaf in flat}

    passed_leaves, stored_leaves = by_path(passed), by_path(stored)
    flat, treedef = jax.tree_util.tree_flatten_with_path(returned)
    leaves = []
    for key_path, leaf in flat:
        path = leaf_path(key_path)
        if path in stored_leaves and leaf is passed_leaves[path]:
            leaves.append(stored_leaves[path])
        elif path in stored_leaves and hasattr(stored_leaves[path], "dtype"):
            leaves.append(casting.cast_leaf(leaf, stored_leaves[path].dtype))
        else:
            leaves.append(casting.cast_leaf(leaf, resolver.variable(path)[0].variable_dtype))
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _keep_carry(out: Any, carry_in: Any, policy: DTypePolicy) -> Any:
    """Casts a scan body's ``(carry, y)``: carry to its incoming dtypes, ``y`` to output."""
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        return None
    carry_out, ys = out
    out_def: Any = jax.tree.structure(carry_out)
    if out_def != jax.tree.structure(carry_in):
        return None

    def back(new: Any, old: Any) -> Any:
        if isinstance(old, (jax.Array, np.ndarray)) and dt.is_floating(old.dtype):
            return casting.cast_leaf(new, old.dtype)
        return new

    carry_out = jax.tree.map(back, carry_out, carry_in)
    result = (carry_out, policy.cast_to_output(ys))
    return list(result) if isinstance(out, list) else result


def _interceptor(resolver: _Resolver, root: type) -> Callable[..., Any]:
    running: list[nn.Module] = []

    def interceptor(next_fun: Callable[..., Any], args: Any, kwargs: Any, context: Any) -> Any:
        module = context.module
        if context.method_name != "__call__":
            running.append(module)
            try:
                return next_fun(*args, **kwargs)
            finally:
                running.pop()
        policy = resolver.module(_path(module), type(module), _own_dtype(module))[0]
        scan_body = _is_scan_body(module, running, root)
        cast_args, cast_kwargs = casting.cast_tree((args, kwargs), policy.compute_dtype)
        running.append(module)
        try:
            with global_state.current_policy_scope(policy):
                out = next_fun(*cast_args, **cast_kwargs)
        finally:
            running.pop()
        if scan_body is not False and args:
            kept = _keep_carry(out, args[0], policy)
            if kept is not None:
                return kept
        return policy.cast_to_output(out)

    return interceptor


# -- the pre-pass -------------------------------------------------------------------------


def _record_modules(
    module: nn.Module,
    variables: Any,
    args: Any,
    kwargs: Any,
    apply_kwargs: dict[str, Any],
    policy_or_map: Any,
    type_policies: Mapping[type, DTypePolicy],
) -> _Infos:
    """Module classes and own dtypes by path, from a shape-only trace of ``module.apply``.

    The trace runs the model as the real call does (parameters, inputs and outputs cast,
    submodules intercepted), so a model that only type-checks under its policy (a
    bfloat16 attention cache written with bfloat16 keys) traces too. The parameters are
    cast before any class is known, so here ``type_policies`` do not reach them: the
    dtypes of this shape-only trace may differ there, never the modules it calls.
    """
    infos: _Infos = {}

    def record(next_fun: Callable[..., Any], a: Any, k: Any, context: Any) -> Any:
        if context.method_name.isidentifier():
            m = context.module
            infos.setdefault(_path(m), (type(m), _own_dtype(m)))
        return next_fun(*a, **k)

    rngs = apply_kwargs.get("rngs")
    leaves, treedef = jax.tree.flatten((variables, args, kwargs, rngs))
    is_array = [isinstance(leaf, (jax.Array, np.ndarray)) for leaf in leaves]

    def run(*arrays: Any) -> None:
        it = iter(arrays)
        full = [next(it) if flag else leaf for leaf, flag in zip(leaves, is_array, strict=True)]
        v, a, k, r = jax.tree.unflatten(treedef, full)
        params = _Resolver(policy_or_map, type_policies, {})
        v = _with_params(v, lambda p: _cast_params(p, params, variable=False))
        resolver = _Resolver(policy_or_map, type_policies, infos)
        root = resolver.module("", type(module), _own_dtype(module))[0]
        a, k = casting.cast_tree((a, k), root.compute_dtype)
        with (
            nn.intercept_methods(record),
            nn.intercept_methods(_interceptor(resolver, type(module))),
            global_state.current_policy_scope(root),
        ):
            module.apply(v, *a, **{**apply_kwargs, "rngs": r}, **k)

    jax.eval_shape(run, *[leaf for leaf, flag in zip(leaves, is_array, strict=True) if flag])
    return infos


def _signature(tree: Any) -> Any:
    """A hashable key of a tree's structure, array avals and other leaves (None: none)."""
    leaves, treedef = jax.tree.flatten(tree)
    key: list[Any] = [treedef]
    for leaf in leaves:
        if isinstance(leaf, (jax.Array, np.ndarray)):
            key.append((tuple(leaf.shape), str(leaf.dtype)))
        else:
            try:
                hash(leaf)
            except TypeError:
                return None
            key.append((type(leaf), leaf))
    return tuple(key)


def _frozen(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


# -- public -------------------------------------------------------------------------------


def apply(
    module: nn.Module,
    policy_or_map: Any,
    method: Any = None,
    *,
    type_policies: Mapping[type, Any] | None = None,
) -> Callable[..., Any]:
    """Makes ``module.apply`` run every submodule under its own policy.

    The returned function has ``module.apply``'s signature,
    ``fn(variables, *args, rngs=None, method=None, mutable=False,
    capture_intermediates=False, **kwargs)``, and returns what ``module.apply`` returns
    (``(outputs, mutated)`` when ``mutable`` is set). Each submodule's parameters and every
    floating leaf of its arguments are cast to its compute dtype, its outputs to its output
    dtype, and :func:`jmp_policy.current_policy` returns its policy while it runs; the root
    module runs under the policy of the path ``""``. Only the ``"params"`` collection is
    cast: BatchNorm statistics and other collections stay in their stored dtype; when
    ``mutable`` includes ``"params"``, the parameters come back as stored (not as cast).

    Works under ``jax.jit``, ``jax.grad`` (gradients come back in the stored dtype, float32
    for float32 master weights), ``nn.scan`` (the carry keeps the dtype it came in with),
    ``nn.remat``, ``nn.vmap``, with ``rngs=`` and ``mutable=``. See the module docstring
    for how it works and what it does not cover.

    Args:
        module: a ``flax.linen`` Module instance.
        policy_or_map: a policy, a policy name, a :class:`~jmp_policy.DTypePolicyMap`, a
            ``dict`` of keys to policies (a map whose default is the global policy) or
            ``None`` (the global policy).
        method: the method to run (a name or ``fn(module, *args)``); ``None`` is
            ``__call__``. The returned function's ``method=`` overrides it.
        type_policies: ``{ModuleClass: policy or name}``: every instance of a class (or a
            subclass) gets that policy, unless a key of the map matches its own path; it
            wins over inheritance from an ancestor. See :data:`NORM_FLOAT32`.

    Returns:
        A function with ``module.apply``'s signature.

    Raises:
        TypeError: ``module`` is not a Linen module, ``method``, ``type_policies`` or
            ``variables`` has the wrong type.
        ValueError: ``policy_or_map`` names no policy, or ``method`` names no method.

    Examples:
        >>> import jax
        >>> import jax.numpy as jnp
        >>> import flax.linen as nn
        >>> import jmp_policy as jp
        >>> class Model(nn.Module):
        ...     @nn.compact
        ...     def __call__(self, x):
        ...         h = nn.Dense(8, name="body")(x)
        ...         return nn.Dense(2, name="head")(h)
        >>> model = Model()
        >>> x = jnp.ones((4, 3))
        >>> variables = model.init(jax.random.key(0), x)
        >>> fn = jp.linen.apply(model, jp.DTypePolicyMap(
        ...     "float32", {"body": "mixed_bfloat16"}))
        >>> fn(variables, x).dtype
        dtype('float32')
        >>> loss = lambda p: fn({"params": p}, x).sum()
        >>> grads = jax.jit(jax.grad(loss))(variables["params"])
        >>> grads["body"]["kernel"].dtype
        dtype('float32')
        >>> jp.linen.apply(model, "mixed_bfloat16")(variables, x).dtype
        dtype(bfloat16)
    """
    _check_module(module)
    resolved = as_policy_or_map(policy_or_map)
    types_ = _check_type_policies(type_policies)
    _check_method(module, method)
    default_method = method
    cache: dict[Any, _Infos] = {}

    def apply_fn(
        variables: Mapping[str, Any],
        *args: Any,
        rngs: Any = None,
        method: Any = None,
        mutable: Any = False,
        capture_intermediates: Any = False,
        **kwargs: Any,
    ) -> Any:
        _check_variables(variables)
        method = default_method if method is None else method
        _check_method(module, method)
        apply_kwargs = {
            "rngs": rngs,
            "method": method,
            "mutable": mutable,
            "capture_intermediates": capture_intermediates,
        }
        key = _signature(
            (variables, args, kwargs, rngs, method, _frozen(mutable), capture_intermediates)
        )
        infos = cache.get(key) if key is not None else None
        if infos is None:
            infos = _record_modules(module, variables, args, kwargs, apply_kwargs, resolved, types_)
            if key is not None:
                if len(cache) >= _CACHE_SIZE:
                    cache.clear()
                cache[key] = infos
        resolver = _Resolver(resolved, types_, dict(infos))
        cast_variables = _with_params(
            variables, lambda p: _cast_params(p, resolver, variable=False)
        )
        root = resolver.module("", type(module), _own_dtype(module))[0]
        args, kwargs = casting.cast_tree((args, kwargs), root.compute_dtype)
        with (
            nn.intercept_methods(_interceptor(resolver, type(module))),
            global_state.current_policy_scope(root),
        ):
            result = module.apply(cast_variables, *args, **apply_kwargs, **kwargs)
        if mutable is not False or capture_intermediates:
            out, state = result
            if isinstance(state, Mapping) and "params" in state and "params" in variables:
                state = dict(state)
                state["params"] = _restore_params(
                    state["params"], cast_variables["params"], variables["params"], resolver
                )
            return root.cast_to_output(out), state
        return root.cast_to_output(result)

    return apply_fn


def init(
    module: nn.Module,
    policy_or_map: Any,
    method: Any = None,
    *,
    type_policies: Mapping[type, Any] | None = None,
) -> Callable[..., Any]:
    """Makes ``module.init`` run under a policy or a map; parameters in their variable dtype.

    The returned function has ``module.init``'s signature,
    ``fn(rngs, *args, method=None, mutable=DenyList("intermediates"),
    capture_intermediates=False, **kwargs)``, and returns the variables. Submodules run
    as under :func:`apply` (inputs cast to their compute dtype, outputs to their output
    dtype, :func:`jmp_policy.current_policy` set); each leaf of the ``"params"`` collection
    is then cast to the variable dtype of its path's policy (usually float32, the master
    weights). Other collections are returned as created. Module classes are recorded while
    ``init`` runs, so ``type_policies`` needs no pre-pass here.

    Args:
        module: a ``flax.linen`` Module instance.
        policy_or_map: as in :func:`apply`.
        method: as in :func:`apply`.
        type_policies: as in :func:`apply`.

    Returns:
        A function with ``module.init``'s signature.

    Raises:
        TypeError: ``module`` is not a Linen module, or ``method`` or ``type_policies``
            has the wrong type.
        ValueError: ``policy_or_map`` names no policy, or ``method`` names no method.

    Examples:
        >>> import jax
        >>> import jax.numpy as jnp
        >>> import flax.linen as nn
        >>> import jmp_policy as jp
        >>> model = nn.Dense(2, param_dtype=jnp.bfloat16)
        >>> fn = jp.linen.init(model, {"": "p=f32,c=bf16,o=f32"})
        >>> variables = fn(jax.random.key(0), jnp.ones((1, 3)))
        >>> variables["params"]["kernel"].dtype
        dtype('float32')
        >>> jp.linen.init(model, "bfloat16")(jax.random.key(0), jnp.ones((1, 3)))[
        ...     "params"]["bias"].dtype
        dtype(bfloat16)
    """
    _check_module(module)
    resolved = as_policy_or_map(policy_or_map)
    types_ = _check_type_policies(type_policies)
    _check_method(module, method)
    default_method = method

    def init_fn(
        rngs: Any,
        *args: Any,
        method: Any = None,
        mutable: Any = _INIT_MUTABLE,
        capture_intermediates: Any = False,
        **kwargs: Any,
    ) -> Any:
        method = default_method if method is None else method
        _check_method(module, method)
        infos: _Infos = {}
        resolver = _Resolver(resolved, types_, infos)
        root = resolver.module("", type(module), _own_dtype(module))[0]
        args, kwargs = casting.cast_tree((args, kwargs), root.compute_dtype)
        with (
            nn.intercept_methods(_recording(infos)),
            nn.intercept_methods(_interceptor(resolver, type(module))),
            global_state.current_policy_scope(root),
        ):
            variables = module.init(
                rngs,
                *args,
                method=method,
                mutable=mutable,
                capture_intermediates=capture_intermediates,
                **kwargs,
            )
        final = _Resolver(resolved, types_, infos)
        return _with_params(variables, lambda p: _cast_params(p, final, variable=True))

    return init_fn


def _recording(infos: _Infos) -> Callable[..., Any]:
    def record(next_fun: Callable[..., Any], a: Any, k: Any, context: Any) -> Any:
        if context.method_name.isidentifier():
            m = context.module
            infos.setdefault(_path(m), (type(m), _own_dtype(m)))
        return next_fun(*a, **k)

    return record


def _nbytes(leaf: Any, dtype: Any) -> int:
    return int(np.prod(leaf.shape, dtype=np.int64)) * np.dtype(dtype).itemsize


def explain(
    module: nn.Module,
    policy_or_map: Any,
    variables: Mapping[str, Any],
    *args: Any,
    type_policies: Mapping[type, Any] | None = None,
    **kwargs: Any,
) -> str:
    """A table of the policy every submodule runs under, and why.

    Traces ``module.apply(variables, *args, **kwargs)`` shape-only (nothing is computed)
    and lists, in the order the modules are first called, one row per module path (and one
    per variable that a key of the map names itself): the module's class, the policy
    resolved for it, its source (``key '<key>'``, ``type <Class>`` or ``default``), the
    module's own ``dtype`` attribute when set (it wins over the policy's compute dtype:
    Flax casts to it anyway), the stored and compute dtypes of its parameters and their
    bytes stored and in compute. ``rngs=``, ``method=`` and ``mutable=`` in ``kwargs`` go
    to ``module.apply``.

    Args:
        module: a ``flax.linen`` Module instance.
        policy_or_map: as in :func:`apply`.
        variables: the model's variables (arrays or ``jax.ShapeDtypeStruct``).
        *args: the model's positional arguments.
        type_policies: as in :func:`apply`.
        **kwargs: the model's keyword arguments.

    Returns:
        The table as a string.

    Examples:
        >>> import jax
        >>> import jax.numpy as jnp
        >>> import flax.linen as nn
        >>> import jmp_policy as jp
        >>> class Model(nn.Module):
        ...     @nn.compact
        ...     def __call__(self, x):
        ...         x = nn.Dense(4, name="body")(x)
        ...         x = nn.LayerNorm(name="norm")(x)
        ...         return nn.Dense(2, dtype=jnp.float32, name="head")(x)
        >>> model = Model()
        >>> x = jnp.ones((1, 3))
        >>> variables = model.init(jax.random.key(0), x)
        >>> print(jp.linen.explain(model, "mixed_bfloat16", variables, x,
        ...                        type_policies=jp.linen.NORM_FLOAT32))
        path    class      policy          source          own dtype  stored   compute   bytes  compute bytes
        <root>  Model      mixed_bfloat16  default
        body    Dense      mixed_bfloat16  default                    float32  bfloat16     64             32
        norm    LayerNorm  float32         type LayerNorm             float32  float32      32             32
        head    Dense      mixed_bfloat16  default         float32    float32  float32      40             40
        total                                                                              136            104
    """
    _check_module(module)
    _check_variables(variables)
    resolved = as_policy_or_map(policy_or_map)
    types_ = _check_type_policies(type_policies)
    apply_kwargs = {
        "rngs": kwargs.pop("rngs", None),
        "method": kwargs.pop("method", None),
        "mutable": kwargs.pop("mutable", False),
    }
    _check_method(module, apply_kwargs["method"])
    infos = _record_modules(module, variables, args, kwargs, apply_kwargs, resolved, types_)
    infos.setdefault("", (type(module), _own_dtype(module)))
    resolver = _Resolver(resolved, types_, dict(infos))

    rows: dict[str, list[Any]] = {}

    def row(path: str) -> list[Any]:
        if path not in rows:
            _, source, policy, own = resolver.module(path)
            cls = resolver.infos.get(path, (None, None))[0]
            rows[path] = [cls, policy, source, own, set(), set(), 0, 0]
        return rows[path]

    for path in infos:
        row(path)
    flat = jax.tree_util.tree_flatten_with_path(variables.get("params", {}))[0]
    for key_path, leaf in flat:
        path = leaf_path(key_path)
        policy, own_key = resolver.variable(path)
        if own_key:
            r = rows.setdefault(path, [None, policy, "key (variable)", None, set(), set(), 0, 0])
        else:
            r = row(parent_path(path) or "")
        if not hasattr(leaf, "dtype") or not hasattr(leaf, "shape"):
            continue
        stored = np.dtype(leaf.dtype)
        target = policy.compute_dtype if dt.is_floating(stored) else stored
        r[4].add(stored.name)
        r[5].add(np.dtype(target).name)
        r[6] += _nbytes(leaf, stored)
        r[7] += _nbytes(leaf, target)

    header = ["path", "class", "policy", "source", "own dtype", "stored", "compute"]
    header += ["bytes", "compute bytes"]
    table = [header]
    for path, (cls, policy, source, own, stored_set, compute_set, nbytes, cbytes) in rows.items():
        has_params = bool(stored_set)
        table.append(
            [
                path or "<root>",
                "" if cls is None else cls.__name__,
                policy.name,
                source,
                "" if own is None else own.name,
                ",".join(sorted(stored_set)),
                ",".join(sorted(compute_set)),
                str(nbytes) if has_params else "",
                str(cbytes) if has_params else "",
            ]
        )
    total = sum(r[6] for r in rows.values())
    total_compute = sum(r[7] for r in rows.values())
    table.append(["total", "", "", "", "", "", "", str(total), str(total_compute)])
    return format_table(table, numeric_columns=2)
