"""Paths of pytree leaves as jmp_policy writes them (``"encoder/Dense_0/kernel"``).

One concept: from a JAX key path to the slash-separated path every map key, explain row
and warning uses. It imports nothing of jmp_policy, so every module can use it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

_KEY_NAMES: dict[type, Callable[[Any], Any]] = {
    jax.tree_util.DictKey: lambda k: k.key,
    jax.tree_util.GetAttrKey: lambda k: k.name,
    jax.tree_util.SequenceKey: lambda k: k.idx,
    jax.tree_util.FlattenedIndexKey: lambda k: k.key,
}


def key_name(key: Any) -> str:
    """One key of a JAX key path as a path segment (a dict key, attribute or index)."""
    getter = _KEY_NAMES.get(type(key))
    if getter is not None:
        return str(getter(key))
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def is_value_suffix(key_path: tuple[Any, ...]) -> bool:
    """Whether a key path ends in NNX's ``.value`` (dropped from paths)."""
    return bool(
        key_path and type(key_path[-1]) is jax.tree_util.GetAttrKey and key_path[-1].name == "value"
    )


def leaf_path(key_path: tuple[Any, ...]) -> str:
    """A leaf's variable path (``"Dense_0/kernel"``) from a JAX key path.

    NNX's trailing ``.value`` is dropped; integers are written as digits.
    """
    if is_value_suffix(key_path):
        key_path = key_path[:-1]
    return "/".join([key_name(k) for k in key_path])


def parent_path(path: str) -> str | None:
    """``"a/b/c"`` -> ``"a/b"``; ``"a"`` -> ``""``; ``""`` -> ``None``."""
    if not path:
        return None
    return path.rpartition("/")[0]


#: How deep a tree the library's tree functions walk (real models nest a few dozen
#: levels). JAX's own flattening fails past about a thousand levels with a
#: ``RecursionError`` that leaves the interpreter unusable, so a deeper tree is refused
#: before JAX sees it.
MAX_TREE_DEPTH = 200


def check_depth(tree: Any, argument: str = "tree") -> None:
    """A ``ValueError`` naming ``argument`` when ``tree``'s dicts, lists and tuples nest
    more than :data:`MAX_TREE_DEPTH` levels (an iterative walk: no recursion of its own).

    Examples:
        >>> deep = 1
        >>> for _ in range(300):
        ...     deep = [deep]
        >>> check_depth(deep, "params")
        Traceback (most recent call last):
        ...
        ValueError: `params` is nested more than 200 levels deep (dicts, lists or tuples), past the limit of the tree functions (JAX's flattening fails on much deeper trees). Received: a list at depth 200 that holds more
    """
    stack = [(tree, 0)]
    containers = (dict, list, tuple)
    while stack:
        node, depth = stack.pop()
        if not isinstance(node, containers):
            continue
        if depth >= MAX_TREE_DEPTH:
            raise ValueError(
                f"`{argument}` is nested more than {MAX_TREE_DEPTH} levels deep (dicts, lists "
                "or tuples), past the limit of the tree functions (JAX's flattening fails on "
                f"much deeper trees). Received: a {type(node).__name__} at depth {depth} "
                "that holds more"
            )
        stack.extend((c, depth + 1) for c in _children(node))


def _children(node: Any) -> Any:
    return node.values() if isinstance(node, dict) else node
