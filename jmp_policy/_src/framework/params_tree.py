"""A model's parameters as one nested mapping by variable path (Linen's ``"params"``
collection): cast for a run (a quantized kernel handed to its layer as its integer
values, a stacked one's scales beside them for the stack's loop to slice), and handed
back in their stored dtypes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax

from jmp_policy._src import casting
from jmp_policy._src.framework.run_kernels import promotable
from jmp_policy._src.quantization import QuantizedArray, is_quantized, stack_layers
from jmp_policy._src.resolution import Resolver
from jmp_policy._src.tree_paths import leaf_path, parent_path


def flat_params(params: Any) -> tuple[list[tuple[Any, Any]], Any]:
    """Flattened with paths; a QuantizedArray is one leaf at its kernel's path."""
    return jax.tree_util.tree_flatten_with_path(params, is_leaf=is_quantized)


def by_path(params: Any) -> dict[str, Any]:
    """Variable path -> leaf (a QuantizedArray one leaf)."""
    return {leaf_path(key_path): leaf for key_path, leaf in flat_params(params)[0]}


def with_params(variables: Mapping[str, Any], fn: Callable[[Any], Any]) -> Any:
    """``variables`` with ``fn(variables["params"])`` as its ``"params"`` (when it has some)."""
    if "params" not in variables:
        return variables
    return {**variables, "params": fn(variables["params"])}


def cast_params(
    params: Any,
    resolver: Resolver,
    whole: Mapping[str, Any] = {},
    floats: bool = True,
    sliced: Mapping[str, Any] = {},
) -> Any:
    """Parameters in their compute dtypes; the kernels of the module paths in ``whole``
    as their quantized integer values (the layer's matmul reads them with the scales; int4
    as int8, a framework's promotion taking it: dead code); those in ``sliced`` (stacks')
    as their values, their scales beside them. With ``floats=False`` only QuantizedArrays
    are cast (an adapter casting plain arrays as they are read)."""
    flat, treedef = flat_params(params)
    leaves = []
    for kp, leaf in flat:
        if not floats and not is_quantized(leaf):
            leaves.append(leaf)
            continue
        path = leaf_path(kp)
        module = parent_path(path) or ""
        if sliced.get(module) is leaf:
            leaves.append(getattr(leaf, "values"))  # noqa: B009 (int4 stays int4: sliced)
        elif isinstance(leaf, QuantizedArray) and whole.get(module) is leaf:
            leaves.append(promotable(getattr(leaf, "values")))  # noqa: B009
        else:
            leaves.append(casting.compute_leaf(leaf, resolver.variable(path)[0].compute_dtype))
    params = jax.tree_util.tree_unflatten(treedef, leaves)
    for module_path, q in sliced.items():  # rebuilt dicts: the caller's never changed
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


def quantized_kernels(params: Any) -> dict[str, Any]:
    """Module path -> its ``QuantizedArray`` parameter named ``kernel``."""
    return {
        parent_path(path) or "": leaf
        for path, leaf in by_path(params).items()
        if is_quantized(leaf) and path.rpartition("/")[2] == "kernel"
    }


def restore_params(returned: Any, passed: Any, stored: Any, resolver: Resolver) -> Any:
    """Parameters a run hands back (``returned``; it was ``passed`` cast) in their stored
    dtypes: the stored leaf when unchanged, a quantized kernel as stored, the scales a
    stack's loop sliced beside it dropped; a new one in its variable dtype."""
    passed_leaves, stored_leaves = by_path(passed), by_path(stored)
    flat, treedef = flat_params(_without_layer_leaves(returned))
    leaves = []
    for key_path, leaf in flat:
        path = leaf_path(key_path)
        old: Any = stored_leaves.get(path)
        if path in stored_leaves and (leaf is passed_leaves[path] or is_quantized(old)):
            leaves.append(old)
        elif path in stored_leaves and hasattr(old, "dtype"):
            leaves.append(casting.cast_leaf(leaf, old.dtype))
        else:
            leaves.append(casting.cast_leaf(leaf, resolver.variable_dtype(path)))
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _without_layer_leaves(tree: Any) -> Any:
    if not isinstance(tree, Mapping):
        return tree
    return type(tree)(  # type: ignore[call-arg]
        {
            name: _without_layer_leaves(value)
            for name, value in tree.items()
            if not stack_layers.is_extra_leaf(str(name))
        }
    )


def in_variable_dtypes(params: Any, resolver: Resolver) -> Any:
    """Each parameter cast to the variable dtype of its path's policy."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    leaves = [casting.cast_leaf(leaf, resolver.variable_dtype(leaf_path(kp))) for kp, leaf in flat]
    return jax.tree_util.tree_unflatten(treedef, leaves)
