"""Tree walks of a DTypePolicyMap: every leaf of a module tree under its own policy.

A module tree is Linen's ``variables["params"]`` or an NNX ``State``. A leaf's *module
path* is its key path without its own variable name (``{"Dense_0": {"kernel": w}}`` ->
``"Dense_0"``; a leaf at the top of the tree is a variable of the root module, path ``""``);
NNX's trailing ``.value`` is dropped and integers are written as digits. A leaf's policy is
the one of the key that names the variable itself (``DTypePolicyMap.match_variable``), else
its module's (``map[module path]``, the root's included): one rule for every tree method.

The tree methods are functions of the map, taking it first: ``DTypePolicyMap`` binds each
as its method of the same name (``cast_to_compute = _trees.cast_to_compute``), so their
docstrings are the methods' and are written as methods.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, ValuesView
from typing import Any, Protocol, TypeVar

import jax
import numpy as np

from jmp_policy._src import casting, quantization
from jmp_policy._src import explain as explain_rows
from jmp_policy._src.dtypes import bounded_repr
from jmp_policy._src.policy import DTypePolicy
from jmp_policy._src.policy_map._index import KeyIndex, path_and_ancestors
from jmp_policy._src.tree_paths import MAX_TREE_DEPTH, check_depth
from jmp_policy._src.tree_paths import is_value_suffix as _is_value_suffix
from jmp_policy._src.tree_paths import key_name as _key_name

T = TypeVar("T")


class PolicyMap(Protocol):
    """What the tree functions use of a ``DTypePolicyMap``: its stored keys and policies,
    its key index (which key chooses a path's policy) and the policy of a chosen key.
    (``_mapping`` imports this module, so the map is described here, not imported.)"""

    _index: KeyIndex

    @property
    def default_policy(self) -> DTypePolicy: ...

    def __iter__(self) -> Iterator[str]: ...

    def values(self) -> ValuesView[DTypePolicy]: ...

    def _policy_of(self, key: str | None) -> DTypePolicy: ...

    def _variable_policy(self, module: str, name: str) -> DTypePolicy: ...


# Leaves of every walk; a QuantizedArray is one leaf at its kernel's path.
_ARRAY_TYPES = (
    jax.Array,
    np.ndarray,
    np.generic,
    int,
    float,
    complex,
    str,
    quantization.QuantizedArray,
)


def _join(stem: str, rest: str) -> str:
    return f"{stem}/{rest}" if stem and rest else stem or rest


def leaves(tree: Any) -> tuple[list[tuple[str, str, Any]], Any]:
    """``(module path, variable name, leaf)`` per leaf, and the treedef.

    Consecutive leaves share their module's key path, so each module path is joined once,
    not once per leaf.
    """
    check_depth(tree)
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=quantization.is_quantized)
    out = []
    prev: tuple[Any, ...] | None = None
    module = ""
    for key_path, leaf in flat:
        if _is_value_suffix(key_path):
            key_path = key_path[:-1]  # NNX's State: "<path>/<name>.value"
        prefix = key_path[:-1]
        if prefix != prev:
            module = "/".join([_key_name(k) for k in prefix])
            prev = prefix
        out.append((module, _key_name(key_path[-1]) if key_path else "", leaf))
    return out, treedef


def map_leaves(tree: T, fn: Callable[[str, str, Any], Any]) -> T:
    """``fn(module path, variable name, leaf)`` on every leaf, same structure back.

    Plain dicts, lists and tuples (Linen's parameter trees) are walked directly, which is
    several times faster than flattening with paths; any other pytree node (NNX's ``State``,
    dataclasses, ``FrozenDict``) goes through ``tree_flatten_with_path``.
    """

    def visit(node: Any, module: str, name: str, depth: int = 0) -> Any:
        kind = type(node)
        if kind is dict or kind is list or kind is tuple:
            stem = f"{module}/{name}" if module else name
            if depth >= MAX_TREE_DEPTH:
                raise ValueError(
                    f"`tree` is nested more than {MAX_TREE_DEPTH} levels deep (at "
                    f"{bounded_repr(stem)}), past the limit of the tree walks. Received: "
                    f"tree={bounded_repr(tree)}"
                )
            depth += 1
            if kind is dict:
                return {k: visit(v, stem, str(k), depth) for k, v in node.items()}
            return kind(visit(v, stem, str(i), depth) for i, v in enumerate(node))
        if node is None:
            return None
        if isinstance(node, _ARRAY_TYPES):
            return fn(module, name, node)
        found, treedef = leaves(node)
        if len(found) == 1 and found[0][2] is node:  # not a pytree node: a leaf
            return fn(module, name, node)
        stem = f"{module}/{name}" if module else name
        return jax.tree_util.tree_unflatten(
            treedef,
            [fn(_join(stem, m), n, x) if m or n else fn(module, name, x) for m, n, x in found],
        )

    return visit(tree, "", "")  # type: ignore[no-any-return]


def _map_policies(policy_map: PolicyMap, tree: T, fn: Callable[[DTypePolicy, Any], Any]) -> T:
    return map_leaves(tree, lambda m, n, x: fn(policy_map._variable_policy(m, n), x))


def policy_tree(policy_map: PolicyMap, tree: Any) -> Any:
    """A tree of the same structure holding each leaf's policy.

    A leaf's policy is the one of the key naming the variable itself, else its
    module's; a variable at the top of the tree belongs to the root module (path
    ``""``), so ``{"": "float32"}`` keeps it float32.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jmp_policy as jp
        >>> m = jp.DTypePolicyMap("float32", {"embed/embedding": "bfloat16"})
        >>> m.policy_tree({"embed": {"embedding": jnp.ones(2)}, "out": {"kernel": jnp.ones(2)}})
        {'embed': {'embedding': <DTypePolicy "bfloat16">}, 'out': {'kernel': <DTypePolicy "float32">}}
        >>> jp.DTypePolicyMap("bfloat16", {"": "float32"}).policy_tree({"pos": jnp.ones(2)})
        {'pos': <DTypePolicy "float32">}
    """
    return _map_policies(policy_map, tree, lambda policy, _: policy)


def cast_to_compute(policy_map: PolicyMap, tree: T) -> T:
    """Casts each floating leaf to its own policy's compute dtype (by path).

    A :class:`~jmp_policy.QuantizedArray` is dequantized to it. Works under ``jit``;
    gradients flow back to each leaf's stored dtype.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jmp_policy as jp
        >>> m = jp.DTypePolicyMap("mixed_bfloat16", {"head": "float32"})
        >>> cast = m.cast_to_compute({"body": {"w": jnp.ones(2)}, "head": {"w": jnp.ones(2)}})
        >>> cast["body"]["w"].dtype, cast["head"]["w"].dtype
        (dtype(bfloat16), dtype('float32'))
    """
    return _map_policies(policy_map, tree, lambda p, x: casting.compute_leaf(x, p.compute_dtype))


def cast_to_variable(policy_map: PolicyMap, tree: T) -> T:
    """Casts each floating leaf to its own policy's variable dtype (by path).

    Examples:
        >>> import jax.numpy as jnp
        >>> import jmp_policy as jp
        >>> m = jp.DTypePolicyMap("float32", {"body": "bfloat16"})
        >>> m.cast_to_variable({"body": {"w": jnp.ones(2)}})["body"]["w"].dtype
        dtype(bfloat16)
    """
    return _map_policies(policy_map, tree, lambda p, x: casting.cast_leaf(x, p.variable_dtype))


def cast_to_output(policy_map: PolicyMap, tree: T) -> T:
    """Casts each floating leaf to its own policy's output dtype (by path).

    Examples:
        >>> import jax.numpy as jnp
        >>> import jmp_policy as jp
        >>> m = jp.DTypePolicyMap("p=f32,c=bf16,o=f16")
        >>> m.cast_to_output({"body": {"y": jnp.ones(2)}})["body"]["y"].dtype
        dtype('float16')
    """
    return _map_policies(policy_map, tree, lambda p, x: casting.cast_leaf(x, p.output_dtype))


def _stores_weights(policy: Any) -> bool:
    return policy.scheme is not None and policy.scheme.stores_weights


def quantize(policy_map: PolicyMap, tree: T, *, stacked_axes: Any = None) -> T:
    """Quantizes the kernels of the modules the map puts under int8 or int4 policies.

    Every floating leaf of rank >= 2 whose policy (the key naming the variable, else
    its module's) is int8 or int4 becomes a :class:`~jmp_policy.QuantizedArray`, as
    :meth:`QuantizedDTypePolicy.quantize <jmp_policy.QuantizedDTypePolicy.quantize>`
    makes it; every other leaf (biases, norms, modules under float or float8
    policies, leaves already quantized) is returned as it is. Works under ``jit``;
    the result runs through ``cast_apply``, ``linen.apply`` and ``nnx.apply``, which
    dequantize each kernel to its compute dtype.

    A layer stack's kernels (``nn.scan``, ``nnx.scan`` or vmapped layers: ``[depth,
    in, out]``) are quantized per layer when ``stacked_axes`` says how many leading
    axes stack layers (a tree alone cannot tell them from a ``DenseGeneral`` kernel's
    ``[in, heads, dim]``); a leaf whose layers are of rank < 2 (a stacked bias) then
    stays float. ``jmp_policy.linen.quantize`` and ``jmp_policy.nnx.quantize`` find
    the stacked axes from the model.

    Args:
        tree: a pytree of parameters (Linen's ``params``, NNX's ``nnx.state``).
        stacked_axes: ``None`` (no stacked axes), an int for every leaf, or a mapping
            from path regular expression (matched against a leaf's whole
            ``"/"``-joined path; the first key that matches wins, no match is 0) to
            an int, or a pair ``(n, axis)``: ``n`` stacked axes from ``axis``.

    Raises:
        ValueError: the map holds no int8 or int4 policy (quantizing would do
            nothing, which is always a mistake), or a ``stacked_axes`` count is not
            a non-negative int.
        TypeError: ``stacked_axes`` is not None, an int or a mapping of strings.

    Warns:
        UserWarning: the map has such a policy but no kernel of ``tree`` is under
            it (a key that matches nothing, most likely); the tree comes back as is. With
            no ``stacked_axes``, once if a kernel of rank >= 3 might be a layer stack.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jmp_policy as jp
        >>> m = jp.DTypePolicyMap("mixed_bfloat16", {"mlp/.*": "int8_from_mixed_bfloat16"})
        >>> params = {"mlp": {"up": {"kernel": jnp.ones((64, 8)), "bias": jnp.ones(8)}},
        ...           "head": {"kernel": jnp.ones((8, 2))}}
        >>> q = m.quantize(params)
        >>> q["mlp"]["up"]["kernel"], q["head"]["kernel"].dtype
        (QuantizedArray(int8, shape=(64, 8), original_dtype=float32), dtype('float32'))
        >>> m.cast_to_compute(q)["mlp"]["up"]["kernel"].dtype
        dtype(bfloat16)
        >>> stack = {"mlp": {"layers": {"kernel": jnp.ones((4, 64, 8))}}}
        >>> m.quantize(stack, stacked_axes={"mlp/layers/.*": 1})["mlp"]["layers"]["kernel"]
        QuantizedArray(int8, shape=(4, 64, 8), original_dtype=float32, stacked=1)
    """
    policies = [*policy_map.values(), policy_map.default_policy]
    if not any(_stores_weights(p) for p in policies):
        names = sorted({p.name for p in policies})
        raise ValueError(
            f"This map holds no int8 or int4 policy (it holds {names}), so `quantize` "
            "has nothing to do. Put the modules to quantize under a quantized policy, "
            "such as {'mlp/.*': 'int8_from_mixed_bfloat16'} or "
            "{'.*': 'int4/128_from_float32'}."
        )
    stacked_of = quantization.stack_of(stacked_axes)
    done: list[tuple[str, tuple[int, ...]]] = []

    def leaf(module: str, name: str, x: Any) -> Any:
        policy = policy_map._variable_policy(module, name)
        if not _stores_weights(policy):
            return x
        k, at = stacked_of(path := f"{module}/{name}" if module else name)
        if not quantization.quantizable_layers(x, k, path):
            return x
        done.append((path, tuple(x.shape)))
        return quantization.quantize_stacked(policy.scheme.quantize, x, k, at, path)

    result = map_leaves(tree, leaf)
    quantization.warn_maybe_stacked(stacked_axes, done)
    if not done:
        warnings.warn(
            "DTypePolicyMap.quantize: no floating leaf of rank >= 2 of the tree is under "
            "an int8 or int4 policy; the tree is returned unchanged. Check the map's "
            "keys against the tree's paths (`map.explain(tree)`).",
            stacklevel=2,
        )
    return result


def unused_keys(policy_map: PolicyMap, tree: Any) -> list[str]:
    """Keys that choose the policy of no module or variable of ``tree`` (typos).

    The modules of a tree are the root (``""``) and every module path of its leaves
    with their ancestors; the variables are its leaves. Keys come back in insertion
    order.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jmp_policy as jp
        >>> m = jp.DTypePolicyMap(None, {"Dense_0": "bfloat16", "Dnse_1": "bfloat16"})
        >>> m.unused_keys({"Dense_0": {"kernel": jnp.ones(2)}, "Dense_1": {"kernel": jnp.ones(2)}})
        ['Dnse_1']
    """
    used: set[str | None] = {policy_map._index.resolve("")}
    seen: set[str] = set()
    for module, name, _ in leaves(tree)[0]:
        used.add(policy_map._index.resolve_variable(module, name))
        for path in path_and_ancestors(module) if module else ():
            if path in seen:
                break
            seen.add(path)
            used.add(policy_map._index.resolve(path))
    return [k for k in policy_map if k not in used]


def explain(policy_map: PolicyMap, tree: Any) -> str:
    """A table of which policy each module of ``tree`` gets, and why.

    One row per module path that holds leaves (``<root>`` for variables at the top
    of the tree), and one per variable that a key names itself: the policy, its
    source (``key '<key>'``, or ``default``), the stored and compute dtypes of its
    leaves (``f32→bf16``), their bytes stored and in compute (``c.bytes``; 1K =
    1024), and a total line. Leaves may be arrays or
    ``jax.ShapeDtypeStruct``. The table fits 100 columns (see
    ``jmp_policy._src.explain.format_rows``).

    Examples:
        >>> import jax.numpy as jnp
        >>> import jmp_policy as jp
        >>> m = jp.DTypePolicyMap("float32", {"encoder/.*": "mixed_bfloat16"})
        >>> print(m.explain({"encoder": {"mlp": {"kernel": jnp.ones((4, 4))}},
        ...                  "head": {"kernel": jnp.ones((4, 2))}}))
        path         policy          source            dtype     bytes  c.bytes
        encoder/mlp  mixed_bfloat16  key 'encoder/.*'  f32→bf16     64       32
        head         float32         default           f32          32       32
        total                                                       96       64
        bytes: as stored; c.bytes: as the compute reads them (K = 1024, M = 1024 K)
    """
    rows: dict[str, explain_rows.ExplainRow] = {}
    for module, name, leaf in leaves(tree)[0]:
        key = policy_map._index.resolve_variable(module, name)
        # A key naming the variable itself gives it a row of its own.
        row_path = module if key == policy_map._index.resolve(module) else _join(module, name)
        row = rows.get(row_path)
        if row is None:
            policy = policy_map._policy_of(key)
            source = "default" if key is None else f"key {key!r}"
            row = explain_rows.ExplainRow(row_path, policy=policy.name, source=source)
        rows[row_path] = explain_rows.with_leaf(row, leaf, policy_map._policy_of(key).compute_dtype)
    return explain_rows.format_rows(rows.values())
