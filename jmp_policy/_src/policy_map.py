"""DTypePolicyMap: a policy per submodule, chosen from the submodule's path.

Resolution of a path (``"encoder/layers_3/mlp"``):

1. an exact key wins;
2. otherwise every key is tried with ``re.fullmatch``; two or more matches are an error
   (Keras's rule);
3. otherwise the parent path is resolved the same way (Haiku's rule: a submodule inherits
   its nearest ancestor's policy);
4. otherwise the default policy (the global policy at lookup time when it is ``None``).

Resolution is cached per path as the chosen key, so a ``default_policy=None`` map follows
``policy_scope``. Non-matching paths are rejected cheaply: each regular expression's
literal prefix indexes it, so a path is only tried against keys whose prefix it starts with.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from typing import Any, TypeVar

import jax
import numpy as np

from jmp_policy._src import casting, global_state, serialization
from jmp_policy._src.dtypes import TypeAndValueError
from jmp_policy._src.policy import DTypePolicy

T = TypeVar("T")

_META = frozenset(".^$*+?{}[]\\|()")
_QUANTIFIERS = frozenset("*?{")


def _literal_prefix(pattern: str) -> str:
    """The literal text every ``re.fullmatch`` of ``pattern`` must start with."""
    if "|" in pattern:
        return ""
    for i, char in enumerate(pattern):
        if char in _META:
            # A quantifier makes the character before it optional.
            return pattern[: i - 1] if char in _QUANTIFIERS and i else pattern[:i]
    return pattern


def _is_literal(pattern: str) -> bool:
    return not any(char in _META for char in pattern)


def _as_policy(value: Any, key: str) -> DTypePolicy:
    if isinstance(value, DTypePolicyMap):
        raise TypeAndValueError(
            f"Cannot interpret the assigned value for key {key!r}: a DTypePolicyMap cannot be "
            "a value of another map."
        )
    if isinstance(value, DTypePolicy):
        return value
    if not isinstance(value, (str, dict)):
        raise TypeAndValueError(
            f"Cannot interpret the assigned value for key {key!r}. Expected a policy, a policy "
            f"name or a config dict. Received: {value!r} (of type {type(value).__name__})"
        )
    try:
        return serialization.get(value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"Cannot interpret the assigned value for key {key!r}: {e}") from e


_KEY_NAMES: dict[type, Callable[[Any], Any]] = {
    jax.tree_util.DictKey: lambda k: k.key,
    jax.tree_util.GetAttrKey: lambda k: k.name,
    jax.tree_util.SequenceKey: lambda k: k.idx,
    jax.tree_util.FlattenedIndexKey: lambda k: k.key,
}


def _key_name(key: Any) -> str:
    getter = _KEY_NAMES.get(type(key))
    if getter is not None:
        return str(getter(key))
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def leaf_path(key_path: tuple[Any, ...]) -> str:
    """A leaf's variable path (``"Dense_0/kernel"``) from a JAX key path.

    NNX's trailing ``.value`` is dropped; integers are written as digits.
    """
    if key_path and type(key_path[-1]) is jax.tree_util.GetAttrKey and key_path[-1].name == "value":
        key_path = key_path[:-1]
    return "/".join([_key_name(k) for k in key_path])


_ARRAY_TYPES = (jax.Array, np.ndarray, np.generic, int, float, complex, str)


def _join(stem: str, rest: str) -> str:
    return f"{stem}/{rest}" if stem and rest else stem or rest


def parent_path(path: str) -> str | None:
    """``"a/b/c"`` -> ``"a/b"``; ``"a"`` -> ``""``; ``""`` -> ``None``."""
    if not path:
        return None
    return path.rpartition("/")[0]


class DTypePolicyMap(MutableMapping[str, DTypePolicy]):
    """Maps module paths to dtype policies, with exact keys and regular expressions.

    A ``MutableMapping[str, DTypePolicy]``: ``in``, ``len``, iteration (insertion order),
    ``del``, ``pop`` and ``items`` are about the stored keys, while ``map[path]`` resolves a
    module path (exact key, then ``re.fullmatch`` of every key, then the nearest ancestor,
    then the default policy). Values may be given as names; they are validated on
    insertion, in the constructor too. Assigning a key that is already there raises
    ``ValueError`` (as in Keras): delete it first.

    A variable's policy is resolved from its own path (``"Dense_0/kernel"``) by the same
    rule, so it inherits its module's policy unless a key names it:
    ``{"embed/embedding": "float32"}`` or ``{".*/embedding": "float32"}`` keeps embeddings
    in float32. A regular expression names a variable only when its match depends on the
    variable's name: ``"encoder/.*"`` names modules, so with ``{"encoder/.*": a,
    "encoder/head": b}`` the head's kernel follows the head (``b``).

    Args:
        default_policy: the policy of paths no key resolves; ``None`` means the global
            policy at lookup time (so the map follows ``policy_scope``).
        policy_map: an initial mapping of keys to policies or policy names.

    Raises:
        TypeError: ``policy_map`` is not a mapping.
        ValueError: a value is not a policy, a key is not a valid regular expression, or
            ``default_policy`` is a map.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jmp_policy as jp
        >>> policy_map = jp.DTypePolicyMap("float32", {
        ...     "encoder/.*": "mixed_bfloat16",
        ...     ".*norm.*": "float32",
        ...     "decoder": "mixed_float16",
        ... })
        >>> policy_map["encoder/layers_1/mlp"]
        <DTypePolicy "mixed_bfloat16">
        >>> policy_map["decoder/attention/query"]   # inherits its ancestor's key
        <DTypePolicy "mixed_float16">
        >>> policy_map["head"]
        <DTypePolicy "float32">
        >>> params = {"encoder": {"layers_1": {"mlp": {"kernel": jnp.ones((2, 2))}}},
        ...           "head": {"kernel": jnp.ones((2, 2))}}
        >>> cast = policy_map.cast_to_compute(params)
        >>> cast["encoder"]["layers_1"]["mlp"]["kernel"].dtype, cast["head"]["kernel"].dtype
        (dtype(bfloat16), dtype('float32'))
        >>> policy_map["encoder/layers_1/norm"]
        Traceback (most recent call last):
        ...
        ValueError: Path 'encoder/layers_1/norm' matches multiple dtype policy keys: ...
    """

    def __init__(
        self,
        default_policy: DTypePolicy | str | None = None,
        policy_map: Mapping[str, DTypePolicy | str] | None = None,
    ):
        if isinstance(default_policy, DTypePolicyMap):
            raise ValueError("`default_policy` cannot be a `DTypePolicyMap`.")
        default: DTypePolicy | None = None
        if default_policy is not None:
            try:
                default = serialization.get(default_policy)
            except (TypeError, ValueError) as e:
                raise type(e)(f"Invalid `default_policy`: {e}") from e
        if policy_map is not None and not isinstance(policy_map, Mapping):
            raise TypeError(
                "If specified, `policy_map` must be a dict (a mapping of paths to policies). "
                f"Received: policy_map={policy_map!r} of type {type(policy_map).__name__}"
            )
        self._default_policy: DTypePolicy | None = default
        self._policies: dict[str, DTypePolicy] = {}
        self._regex: dict[str, re.Pattern[str]] = {}
        self._by_prefix: dict[str, list[str]] = {}
        self._prefix_lengths: list[int] = []
        self._cache: dict[str, str | None] = {}
        self._module_cache: dict[str, tuple[str | None, list[str], bool]] = {}
        self._sorted_prefixes: list[str] = []
        self._sorted_literals: list[str] = []
        for key, value in (policy_map or {}).items():
            self[key] = value

    # -- the mapping ----------------------------------------------------------------------

    def __setitem__(self, key: str, policy: DTypePolicy | str) -> None:
        if not isinstance(key, str):
            raise TypeError(
                f"Keys of a DTypePolicyMap are module paths (strings). "
                f"Received: key={key!r} (of type {type(key).__name__})"
            )
        if key in self._policies:
            raise ValueError(
                f"{key} already exist in the DTypePolicyMap with value "
                f"{self._policies[key]!r}. Please make sure to not use duplicated keys "
                "(delete the key first to replace its policy)."
            )
        policy = _as_policy(policy, key)
        if not _is_literal(key):
            try:
                self._regex[key] = re.compile(key)
            except re.error as e:
                raise ValueError(
                    f"Key {key!r} of the DTypePolicyMap is not a valid regular expression: {e}"
                ) from e
        self._policies[key] = policy
        self._reindex()

    def __getitem__(self, path: str) -> DTypePolicy:
        return self._policy_of(self._resolve_key(path))

    def __delitem__(self, key: str) -> None:
        del self._policies[key]
        self._regex.pop(key, None)
        self._reindex()

    def __contains__(self, key: object) -> bool:
        return key in self._policies

    def __len__(self) -> int:
        return len(self._policies)

    def __iter__(self) -> Iterator[str]:
        return iter(self._policies)

    def __repr__(self) -> str:
        default = None if self._default_policy is None else self._default_policy.name
        mapping = [(k, v.name) for k, v in self._policies.items()]
        return f"<DTypePolicyMap default_policy={default}, mapping={mapping}>"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DTypePolicyMap):
            return NotImplemented
        return self._default_policy == other._default_policy and list(
            self._policies.items()
        ) == list(other._policies.items())

    __hash__ = None  # type: ignore[assignment]  # mutable

    def _reindex(self) -> None:
        self._cache.clear()
        self._module_cache.clear()
        self._by_prefix = {}
        for key in self._regex:
            self._by_prefix.setdefault(_literal_prefix(key), []).append(key)
        self._prefix_lengths = sorted({len(p) for p in self._by_prefix})
        self._sorted_prefixes = sorted(self._by_prefix)
        self._sorted_literals = sorted(k for k in self._policies if k not in self._regex)

    # -- policy-like properties (as Keras's map has) --------------------------------------

    @property
    def default_policy(self) -> DTypePolicy:
        """The policy of unmatched paths (the global policy now, when it was ``None``)."""
        if self._default_policy is None:
            return global_state.dtype_policy()
        return self._default_policy

    @property
    def name(self) -> str:
        """``"map_<default policy name>"``, as in Keras."""
        return f"map_{self.default_policy.name}"

    @property
    def compute_dtype(self) -> np.dtype:
        """The default policy's compute dtype."""
        return self.default_policy.compute_dtype

    @property
    def variable_dtype(self) -> np.dtype:
        """The default policy's variable dtype."""
        return self.default_policy.variable_dtype

    @property
    def quantization_mode(self) -> str | None:
        """The default policy's quantization mode."""
        return self.default_policy.quantization_mode

    # -- resolution -----------------------------------------------------------------------

    def _policy_of(self, key: str | None) -> DTypePolicy:
        return self.default_policy if key is None else self._policies[key]

    def _match(self, path: str, variable: bool = False) -> str | None:
        """Steps 1 and 2: the key that names ``path`` itself, or None.

        For a variable path (``"enc/x/kernel"``) a regular expression names the variable
        only if its match depends on the variable's name: ``".*/embedding"`` does,
        ``"enc/.*"`` does not (it names every child of ``enc``, modules included, so the
        variable inherits from its module instead, and ``{"enc/.*": a, "enc/x": b}`` keeps
        ``enc/x``'s kernel in ``b``).
        """
        if path in self._policies:
            return path
        matches = []
        for length in self._prefix_lengths:
            if length > len(path):
                break
            for key in self._by_prefix.get(path[:length], ()):
                if self._regex[key].fullmatch(path):
                    matches.append(key)
        if variable and matches:
            module = path.rpartition("/")[0]
            other = f"{module}/\x00" if module else "\x00"
            matches = [k for k in matches if not self._regex[k].fullmatch(other)]
        if len(matches) > 1:
            self._raise_ambiguous(path, matches)
        return matches[0] if matches else None

    def _raise_ambiguous(self, path: str, matches: list[str]) -> None:
        order = list(self._policies)
        matches = sorted(matches, key=order.index)
        raise ValueError(
            f"Path {path!r} matches multiple dtype policy keys: {matches}. Please make "
            "sure each path only matches at most one key of the DTypePolicyMap."
        )

    def _module_info(self, module: str) -> tuple[str | None, list[str], bool]:
        """Per module (cached): its key, the regex keys that may name one of its
        variables by name, and whether an exact key starts with the module's path."""
        try:
            return self._module_cache[module]
        except KeyError:
            pass
        stem = f"{module}/" if module else ""
        candidates: list[str] = []
        for length in self._prefix_lengths:  # prefixes of the stem
            if length > len(stem):
                break
            candidates.extend(self._by_prefix.get(stem[:length], ()))
        i = bisect.bisect_right(self._sorted_prefixes, stem)  # prefixes longer than the stem
        while i < len(self._sorted_prefixes) and self._sorted_prefixes[i].startswith(stem):
            candidates.extend(self._by_prefix[self._sorted_prefixes[i]])
            i += 1
        other = f"{stem}\x00"  # a name no variable has: module-level keys match it
        by_name = [k for k in candidates if not self._regex[k].fullmatch(other)]
        j = bisect.bisect_left(self._sorted_literals, stem)
        has_exact = j < len(self._sorted_literals) and self._sorted_literals[j].startswith(stem)
        info = (self._resolve_key(module) if module else None, by_name, has_exact)
        if not module:
            info = (None, by_name, True)
        self._module_cache[module] = info
        return info

    def _resolve_variable_key(self, path: str) -> str | None:
        """The key that chooses a variable's policy: one naming it, else its module's."""
        module = path.rpartition("/")[0]
        module_key, by_name, has_exact = self._module_info(module)
        if has_exact and path in self._policies:
            return path
        if by_name:
            matches = [k for k in by_name if self._regex[k].fullmatch(path)]
            if len(matches) > 1:
                self._raise_ambiguous(path, matches)
            if matches:
                return matches[0]
        if not module:
            return self._resolve_key(path) if path else None
        return module_key

    def _resolve_key(self, path: str) -> str | None:
        """The key that chooses ``path``'s policy (None: the default policy)."""
        if not isinstance(path, str):
            raise TypeError(
                f"A module path must be a string such as 'encoder/layers_0'. "
                f"Received: path={path!r} (of type {type(path).__name__})"
            )
        try:
            return self._cache[path]
        except KeyError:
            pass
        key = self._match(path)
        if key is None:
            parent = parent_path(path)
            if parent:  # The root "" is not an ancestor: unmatched paths get the default.
                key = self._resolve_key(parent)
        self._cache[path] = key
        return key

    def resolve(self, path: str) -> tuple[DTypePolicy, str | None]:
        """The policy of ``path`` and the key that chose it (``None``: the default).

        Examples:
            >>> import jmp_policy as jp
            >>> m = jp.DTypePolicyMap("float32", {"encoder/.*": "bfloat16"})
            >>> m.resolve("encoder/layers_0/mlp")
            (<DTypePolicy "bfloat16">, 'encoder/.*')
            >>> m.resolve("head")
            (<DTypePolicy "float32">, None)
        """
        key = self._resolve_key(path)
        return self._policy_of(key), key

    # -- trees ----------------------------------------------------------------------------

    def _leaves(self, tree: Any) -> tuple[list[tuple[str, str, Any]], Any]:
        """``(module path, variable name, leaf)`` per leaf, and the treedef.

        Consecutive leaves share their module's key path, so each module path is joined
        once, not once per leaf.
        """
        flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
        out = []
        prev: tuple[Any, ...] | None = None
        module = ""
        for key_path, leaf in flat:
            if (
                key_path
                and type(key_path[-1]) is jax.tree_util.GetAttrKey
                and key_path[-1].name == "value"
            ):
                key_path = key_path[:-1]  # NNX's State: "<path>/<name>.value"
            prefix = key_path[:-1]
            if prefix != prev:
                module = "/".join([_key_name(k) for k in prefix])
                prev = prefix
            out.append((module, _key_name(key_path[-1]) if key_path else "", leaf))
        return out, treedef

    def _leaf_key(self, module: str, name: str) -> str | None:
        """The key that chooses the policy of the variable ``name`` of ``module``."""
        module_key, by_name, has_exact = self._module_info(module)
        if not has_exact and not by_name:
            return module_key
        return self._resolve_variable_key(f"{module}/{name}" if module else name)

    def _map_leaves(self, tree: T, fn: Callable[[DTypePolicy, Any], Any]) -> T:
        """``fn(policy, leaf)`` on every leaf, with the leaf's policy by its path.

        Plain dicts, lists and tuples (Linen's parameter trees) are walked directly, which
        is several times faster than flattening with paths; any other pytree node (NNX's
        ``State``, dataclasses, ``FrozenDict``) goes through ``tree_flatten_with_path``.
        """
        policy_of, leaf_key = self._policy_of, self._leaf_key

        def leaf(module: str, name: str, x: Any) -> Any:
            return fn(policy_of(leaf_key(module, name)), x)

        def visit(node: Any, module: str, name: str) -> Any:
            kind = type(node)
            if kind is dict or kind is list or kind is tuple:
                stem = f"{module}/{name}" if module else name
                if kind is dict:
                    return {k: visit(v, stem, str(k)) for k, v in node.items()}
                return kind(visit(v, stem, str(i)) for i, v in enumerate(node))
            if node is None:
                return None
            if isinstance(node, _ARRAY_TYPES):
                return leaf(module, name, node)
            leaves, treedef = self._leaves(node)
            if len(leaves) == 1 and leaves[0][2] is node:  # not a pytree node: a leaf
                return leaf(module, name, node)
            stem = f"{module}/{name}" if module else name
            return jax.tree_util.tree_unflatten(
                treedef,
                [
                    leaf(_join(stem, m), n, x) if m or n else leaf(module, name, x)
                    for m, n, x in leaves
                ],
            )

        return visit(tree, "", "")  # type: ignore[no-any-return]

    def policy_tree(self, tree: Any) -> Any:
        """A tree of the same structure holding each leaf's policy.

        Examples:
            >>> import jax.numpy as jnp
            >>> import jmp_policy as jp
            >>> m = jp.DTypePolicyMap("float32", {"embed/embedding": "bfloat16"})
            >>> m.policy_tree({"embed": {"embedding": jnp.ones(2)}, "out": {"kernel": jnp.ones(2)}})
            {'embed': {'embedding': <DTypePolicy "bfloat16">}, 'out': {'kernel': <DTypePolicy "float32">}}
        """
        return self._map_leaves(tree, lambda policy, _: policy)

    def cast_to_compute(self, tree: T) -> T:
        """Casts each floating leaf to its own policy's compute dtype (by path)."""
        return self._map_leaves(tree, lambda p, x: casting.cast_leaf(x, p.compute_dtype))

    def cast_to_variable(self, tree: T) -> T:
        """Casts each floating leaf to its own policy's variable dtype (by path)."""
        return self._map_leaves(tree, lambda p, x: casting.cast_leaf(x, p.variable_dtype))

    cast_to_param = cast_to_variable

    def cast_to_output(self, tree: T) -> T:
        """Casts each floating leaf to its own policy's output dtype (by path)."""
        return self._map_leaves(tree, lambda p, x: casting.cast_leaf(x, p.output_dtype))

    def unused_keys(self, tree: Any) -> list[str]:
        """Keys that choose the policy of no module or variable of ``tree`` (typos).

        Examples:
            >>> import jax.numpy as jnp
            >>> import jmp_policy as jp
            >>> m = jp.DTypePolicyMap(None, {"Dense_0": "bfloat16", "Dnse_1": "bfloat16"})
            >>> m.unused_keys({"Dense_0": {"kernel": jnp.ones(2)}, "Dense_1": {"kernel": jnp.ones(2)}})
            ['Dnse_1']
        """
        used: set[str | None] = set()
        for module, name, _ in self._leaves(tree)[0]:
            used.add(self._leaf_key(module, name))
            current: str | None = module
            while current:
                used.add(self._resolve_key(current))
                current = parent_path(current)
        return [k for k in self._policies if k not in used]

    def explain(self, tree: Any) -> str:
        """A table of which policy each module of ``tree`` gets, and why.

        One row per module path (and one per variable that a key names itself): the
        policy, the key that chose it (``<default>`` when none did), the stored and compute
        dtypes of its floating leaves, the bytes stored and the bytes in compute.

        Examples:
            >>> import jax.numpy as jnp
            >>> import jmp_policy as jp
            >>> m = jp.DTypePolicyMap("float32", {"encoder/.*": "mixed_bfloat16"})
            >>> print(m.explain({"encoder": {"mlp": {"kernel": jnp.ones((4, 4))}},
            ...                  "head": {"kernel": jnp.ones((4, 2))}}))
            path         policy          key         stored   compute   bytes  compute bytes
            encoder/mlp  mixed_bfloat16  encoder/.*  float32  bfloat16     64             32
            head         float32         <default>   float32  float32      32             32
            total                                                          96             64
        """
        rows: dict[str, list[Any]] = {}
        for module, name, leaf in self._leaves(tree)[0]:
            module_key = self._resolve_key(module)
            key = self._leaf_key(module, name)
            row_path = module if key == module_key else f"{module}/{name}".lstrip("/")
            policy = self._policy_of(key)
            row = rows.setdefault(row_path, [policy, key, set(), set(), 0, 0])
            if isinstance(leaf, (jax.Array, np.ndarray)):
                target = (
                    policy.compute_dtype
                    if casting.should_cast(leaf, policy.compute_dtype)
                    else leaf.dtype
                )
                row[2].add(np.dtype(leaf.dtype).name)
                row[3].add(np.dtype(target).name)
                row[4] += leaf.size * leaf.dtype.itemsize
                row[5] += leaf.size * np.dtype(target).itemsize
        table = [["path", "policy", "key", "stored", "compute", "bytes", "compute bytes"]]
        for path, (policy, key, stored, compute, nbytes, cbytes) in rows.items():
            table.append(
                [
                    path or "<root>",
                    policy.name,
                    "<default>" if key is None else key,
                    ",".join(sorted(stored)),
                    ",".join(sorted(compute)),
                    str(nbytes),
                    str(cbytes),
                ]
            )
        total_stored = sum(r[4] for r in rows.values())
        total_compute = sum(r[5] for r in rows.values())
        table.append(["total", "", "", "", "", str(total_stored), str(total_compute)])
        return format_table(table, numeric_columns=2)

    # -- config ---------------------------------------------------------------------------

    def get_config(self) -> dict[str, Any]:
        """A JSON-ready dict: the default policy and every key's serialized policy."""
        default = self._default_policy
        return {
            "default_policy": None if default is None else serialization.serialize(default),
            "policy_map": {k: serialization.serialize(v) for k, v in self._policies.items()},
        }

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> DTypePolicyMap:
        """Builds a map from :meth:`get_config`'s dict (also Keras 3's); never mutates it."""
        if not isinstance(config, dict):
            raise TypeError(f"`config` must be a dict. Received: config={config!r}")
        unknown = set(config) - {"default_policy", "policy_map"}
        if unknown:
            raise ValueError(
                f"Unknown fields {sorted(unknown)} in a DTypePolicyMap `config`; expected "
                "'default_policy' and 'policy_map'."
            )
        policy_map = config.get("policy_map") or {}
        if isinstance(policy_map, dict) and "class_name" in policy_map and "config" in policy_map:
            policy_map = policy_map["config"]  # Keras serializes the dict itself.
        return cls(config.get("default_policy"), dict(policy_map))


serialization.register_serializable(DTypePolicyMap)


# -- explain tables ------------------------------------------------------------------------


def format_table(table: list[list[str]], numeric_columns: int) -> str:
    """Aligns rows of strings in columns; the last ``numeric_columns`` right-aligned."""
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    first_numeric = len(widths) - numeric_columns
    lines = []
    for row in table:
        cells = [
            cell.ljust(width) if i < first_numeric else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


# -- resolution with per-class policies (the Flax glue's shared rule) ---------------------


def normalize_type_policies(
    type_policies: Any, base: type | None = None, base_name: str = "", example: str = ""
) -> dict[type, DTypePolicy]:
    """Validates ``type_policies`` (``{ModuleClass: policy or name}``) into policies.

    ``base``, when given, is the module class every key must derive from.
    """
    if type_policies is None:
        return {}
    if not isinstance(type_policies, Mapping):
        raise TypeError(
            "`type_policies` must be a mapping from module classes to policies, such as "
            f"{{nn.LayerNorm: 'float32'}}. Received: type_policies={type_policies!r}"
        )
    result: dict[type, DTypePolicy] = {}
    for cls, policy in type_policies.items():
        if not isinstance(cls, type):
            raise TypeError(
                f"Keys of `type_policies` must be module classes. Received key {cls!r} "
                f"(of type {type(cls).__name__})"
            )
        if base is not None and not issubclass(cls, base):
            raise TypeError(
                f"Keys of `type_policies` must be {base_name or base.__qualname__} subclasses, "
                f"such as {example}. Received key {cls!r}"
            )
        try:
            result[cls] = _as_policy(policy, cls.__name__)
        except ValueError as e:
            raise ValueError(f"Invalid `type_policies`: {e}") from e
    return result


def type_policy_for(cls: type, type_policies: Mapping[type, DTypePolicy]) -> DTypePolicy | None:
    """The policy of ``cls`` or of its nearest base class in ``type_policies``."""
    if not type_policies:
        return None
    for base in cls.__mro__:
        if base in type_policies:
            return type_policies[base]
    return None


def resolve_module(
    policy_or_map: DTypePolicy | DTypePolicyMap | None,
    path: str,
    classes: Mapping[str, type],
    type_policies: Mapping[type, DTypePolicy],
) -> tuple[DTypePolicy, str]:
    """A module's policy with per-class policies, and where it came from.

    At each level from ``path`` up to its top-level ancestor: a key that names the path
    itself (exact or regular expression) wins, then the class of the module at that path
    in ``type_policies``; otherwise the default (a single policy acts as a map with only a
    default). The root ``""`` is not an ancestor, as in :class:`DTypePolicyMap`.

    Returns:
        ``(policy, source)`` where ``source`` is ``"key '<key>'"``, ``"type <Name>"`` or
        ``"default"``.
    """
    current: str | None = path
    while current is not None:
        if isinstance(policy_or_map, DTypePolicyMap):
            key = policy_or_map._match(current)
            if key is not None:
                return policy_or_map._policies[key], f"key {key!r}"
        cls = classes.get(current)
        if cls is not None:
            typed = type_policy_for(cls, type_policies)
            if typed is not None:
                return typed, f"type {cls.__name__}"
        current = parent_path(current) or None
    if isinstance(policy_or_map, DTypePolicyMap):
        return policy_or_map.default_policy, "default"
    if policy_or_map is None:
        return global_state.dtype_policy(), "default"
    return policy_or_map, "default"


def resolve_variable(
    policy_or_map: DTypePolicy | DTypePolicyMap | None,
    path: str,
    classes: Mapping[str, type],
    type_policies: Mapping[type, DTypePolicy],
) -> tuple[DTypePolicy, str]:
    """A variable's policy: a key naming the variable path itself, else its module's."""
    if isinstance(policy_or_map, DTypePolicyMap):
        key = policy_or_map._match(path, variable=True)
        if key is not None:
            return policy_or_map._policies[key], f"key {key!r}"
    return resolve_module(policy_or_map, parent_path(path) or "", classes, type_policies)
