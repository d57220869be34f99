"""Applying a policy or a map to a plain ``apply(params, *args, **kwargs)`` function."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import jax

from jmp_policy._src import global_state, interception
from jmp_policy._src.options import Options, floating_policy_or_map
from jmp_policy._src.policy_map import DTypePolicyMap, leaf_path, parent_path
from jmp_policy._src.quantization import is_quantized
from jmp_policy._src.resolution import Resolver
from jmp_policy._src.run_report import closest_paths

F = TypeVar("F", bound=Callable[..., Any])


def cast_apply(policy_or_map: Any) -> Callable[[F], F]:
    """A decorator that runs ``apply(params, *args, **kwargs)`` under a policy or a map.

    ``params`` are cast to their compute dtype (per module path with a map: a variable at
    the top of ``params`` belongs to the root module ``""``; a Flax Linen variables dict,
    ``{"params": ..., "batch_stats": ...}``, is resolved by module path in each
    collection, so ``cast_apply(map)(model.apply)`` works; a key that matches nothing is
    warned about once, naming ``jmp_policy.linen.apply``), every floating leaf of every
    positional and keyword argument to the root policy's compute dtype (unlike tf.keras,
    which casts only the first argument). The outputs follow the output rule: they are cast
    to the root policy's output dtype only when it differs from its compute dtype
    (``"p=f32,c=bf16,o=f32"``), and left as computed otherwise (Keras names). The root
    policy is the policy itself, or the map's policy of the path ``""`` (usually its
    default). Loops inside keep their carry's dtypes. Gradients flow back to the stored
    dtype. Works under ``jit`` and ``grad``; :func:`current_policy` returns the root
    policy inside. A plain function has no layers whose matmuls could be routed: a
    float8 policy computes here in its source policy's dtypes, and the decorator warns so
    (float8 training is for Flax layers under ``jmp_policy.linen.apply``/``nnx.apply``).

    Args:
        policy_or_map: a policy, a name, a ``DTypePolicyMap`` or a ``dict`` (made a map
            with the global policy as its default).

    Returns:
        A decorator.

    Raises:
        ValueError: a policy of ``policy_or_map`` does not compute in a floating dtype.

    Examples:
        >>> import jax
        >>> import jax.numpy as jnp
        >>> import jmp_policy as jp
        >>> @jp.cast_apply("p=f32,c=bf16,o=f32")
        ... def apply(params, x):
        ...     return x @ params["w"]
        >>> params = {"w": jnp.ones((3, 2))}
        >>> apply(params, jnp.ones((1, 3))).dtype
        dtype('float32')
        >>> grads = jax.grad(lambda p: apply(p, jnp.ones((1, 3))).sum())(params)
        >>> grads["w"].dtype
        dtype('float32')
    """
    policies = floating_policy_or_map(policy_or_map)
    every_policy = [] if policies is None else [policies]
    if hasattr(policies, "values"):  # a map
        every_policy = [policies.default_policy, *policies.values()]
    named = sorted({p.name for p in every_policy if p.scheme and p.scheme.needs_routed_layers})
    if named:
        warnings.warn(
            f"cast_apply runs a plain function, whose matmuls it cannot route: the float8 "
            f"policies {named} compute here in their source policy's dtypes, without float8 "
            "quantization. Float8 training applies to Flax layers (Dense, DenseGeneral, "
            "Einsum; NNX Linear, LinearGeneral, Einsum) under `jmp_policy.linen.apply` or "
            "`jmp_policy.nnx.apply`.",
            UserWarning,
            stacklevel=2,
        )

    def decorator(fn: F) -> F:
        checked: set[Any] = set()  # tree structures checked for keys that match nothing

        @functools.wraps(fn)
        def wrapped(params: Any, *args: Any, **kwargs: Any) -> Any:
            if policies is None:
                cast = global_state.dtype_policy().cast_to_compute(params)
            elif isinstance(policies, DTypePolicyMap):
                cast = _map_cast(policies, params, checked)
            else:
                cast = policies.cast_to_compute(params)
            call = interception.Call("", None, Resolver(policies, Options()).module(""))
            with interception.model_run():
                return interception.run(call, functools.partial(fn, cast), args, kwargs)

        return wrapped  # type: ignore[return-value]

    return decorator


def is_variables(tree: Any, policy_map: DTypePolicyMap) -> bool:
    """Whether ``tree`` is a Flax Linen variables dict (``{"params": ..., "batch_stats":
    ...}``: collections of module trees) rather than a module tree, for ``policy_map``:
    a map with a key that starts at ``"params"`` reads the tree as a module tree."""
    return (
        isinstance(tree, Mapping)
        and "params" in tree
        and all(isinstance(v, Mapping) for v in tree.values())
        and not any(key.split("/")[0] == "params" for key in policy_map)
    )


def _map_cast(policy_map: DTypePolicyMap, tree: Any, checked: set[Any]) -> Any:
    """``tree`` cast by ``policy_map``: a Linen variables dict by module path in each
    collection (the collection level skipped); warns once when a key matches nothing."""
    variables = is_variables(tree, policy_map)
    structure = jax.tree.structure(tree)
    if structure not in checked:
        checked.add(structure)
        trees = list(tree.values()) if variables else [tree]
        unused = [k for k in policy_map if all(k in policy_map.unused_keys(t) for t in trees)]
        if unused:
            found = jax.tree_util.tree_flatten_with_path(trees, is_leaf=is_quantized)[0]
            paths = {leaf_path(key_path[1:]) for key_path, _ in found}
            paths |= {parent_path(p) or "" for p in paths} - {""}
            warnings.warn(
                f"Keys of the DTypePolicyMap match no module or variable of the tree "
                f"cast_apply received: {unused}. cast_apply resolves a parameter tree by "
                "path (a Flax Linen variables dict by module path, its collections "
                f"skipped): check the keys for typos: {closest_paths(unused, sorted(paths))}. To run each submodule of a Flax "
                "model under its own policy (its inputs and compute, not only its "
                "parameters), use `jmp_policy.linen.apply(model, policy_map)` (NNX: "
                "`jmp_policy.nnx.apply`).",
                UserWarning,
                stacklevel=3,
            )
    if not variables:
        return policy_map.cast_to_compute(tree)
    cast = {name: policy_map.cast_to_compute(c) for name, c in tree.items()}
    if isinstance(tree, dict):
        return cast
    try:
        return type(tree)(cast)  # a FrozenDict stays one
    except TypeError:
        return cast
