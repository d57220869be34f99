"""DTypePolicyMap, the mapping: stored keys and policies, path resolution.

The mapping methods are about the stored keys; ``map[path]`` resolves a path (the class
docstring has the rule) to a key, by the key index (``_index``, which caches keys: a
``default_policy=None`` map follows ``policy_scope``). The tree methods are ``_trees``'s,
the config methods ``_config``'s.
"""

from __future__ import annotations

from collections.abc import ItemsView, Iterator, Mapping, MutableMapping, ValuesView
from typing import Any

import numpy as np

import jmp_policy._src.policy_map._config as _config
import jmp_policy._src.policy_map._index as _index
import jmp_policy._src.policy_map._matching as _matching
import jmp_policy._src.policy_map._trees as _trees
import jmp_policy._src.policy_map._values as _values
from jmp_policy._src import global_state, serialization
from jmp_policy._src.policy import DTypePolicy

_MISSING: Any = object()


class DTypePolicyMap(MutableMapping[str, DTypePolicy]):
    """Maps module paths to dtype policies, with exact keys and regular expressions.

    A ``MutableMapping[str, DTypePolicy]``: ``in``, ``len``, iteration (insertion order),
    ``get``, ``pop``, ``setdefault``, ``del``, ``items`` and ``==`` are about the stored
    keys, while ``map[path]`` resolves a module path (exact key, then ``re.fullmatch`` of
    every key, then the nearest ancestor, then the default policy). Values may be given as
    names or config dicts; they are validated on insertion, in the constructor too.
    Assigning a key that is already there raises ``ValueError`` (as in Keras): delete it
    first. Two maps are equal when their default policies and their stored keys with
    their policies are, whatever the insertion order.

    A variable's policy (``"Dense_0/kernel"``) is its module's unless a key names the
    variable itself: a key names a variable when it matches the variable's path (exactly
    or by ``fullmatch``) and does not match its module path. So
    ``{"embed/embedding": "float32"}`` or ``{".*/embedding": "float32"}`` keeps embeddings
    in float32, while ``"encoder/.*"`` names modules: with ``{"encoder/.*": a,
    "encoder/head": b}`` the head's kernel follows the head (``b``). A variable at the top
    of a tree belongs to the root module, path ``""``.

    Args:
        default_policy: the policy of paths no key resolves; ``None`` means the global
            policy at lookup time (so the map follows ``policy_scope``).
        policy_map: an initial mapping of keys to policies, policy names or configs.

    Raises:
        TypeError: ``policy_map`` is not a mapping.
        ValueError: a value is not a policy, a key is not a valid regular expression, or
            ``default_policy`` (or a value) is a map or a map's config.

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
        default_policy: DTypePolicy | str | dict[str, Any] | None = None,
        policy_map: Mapping[str, DTypePolicy | str | dict[str, Any]] | None = None,
    ):
        if isinstance(default_policy, DTypePolicyMap):
            raise ValueError("`default_policy` cannot be a `DTypePolicyMap`.")
        self._default_policy: DTypePolicy | None = _config.read_default(default_policy)
        if policy_map is not None and not isinstance(policy_map, Mapping):
            raise TypeError(
                "If specified, `policy_map` must be a dict (a mapping of paths to policies). "
                f"Received: policy_map={policy_map!r} of type {type(policy_map).__name__}"
            )
        self._policies: dict[str, DTypePolicy] = {}
        self._index = _index.KeyIndex()
        read: dict[Any, DTypePolicy] = {}  # a name or config read once (maps repeat them)
        for key, value in (policy_map or {}).items():
            self[key] = _values.read_once(value, key, read)

    # -- the mapping: stored keys ---------------------------------------------------------

    def update(self, other: Any = (), /, **kwargs: Any) -> None:
        """``dict.update``'s signature, all or nothing: a bad key or value anywhere leaves
        the map as it was (the error is the one ``map[key] = value`` raises)."""
        if isinstance(other, Mapping):
            pairs = list(other.items())
        elif hasattr(other, "keys"):
            pairs = [(key, other[key]) for key in other.keys()]  # noqa: SIM118 (dict.update)
        else:
            pairs = list(other)
        added: list[str] = []
        try:
            for key, value in [*pairs, *kwargs.items()]:
                self[key] = value
                added.append(key)
        except BaseException:
            for key in reversed(added):
                del self[key]
            raise

    def __setitem__(self, key: str, policy: DTypePolicy | str | dict[str, Any]) -> None:
        _index.check_key_type(key)
        if key in self._policies:
            raise self._duplicate(key)
        value = _values.as_policy(policy, key)
        with self._index.lock:  # the key and its policy appear together
            if key in self._policies:
                raise self._duplicate(key)
            self._index.add(key)
            self._policies[key] = value

    def _duplicate(self, key: str) -> ValueError:
        return ValueError(
            f"{key} already exist in the DTypePolicyMap with value "
            f"{self._policies.get(key)!r}. Please make sure to not use duplicated keys "
            f"(delete the key first to replace its policy). Received: key={key!r}"
        )

    def __delitem__(self, key: str) -> None:
        _index.check_key_type(key)
        with self._index.lock:
            if key not in self._policies:
                raise _index.absent_key(key, self._snapshot())
            del self._policies[key]
            self._index.remove(key)

    def _snapshot(self) -> dict[str, DTypePolicy]:
        """The stored keys and policies, copied while no other thread changes them."""
        with self._index.lock:
            return dict(self._policies)

    def __contains__(self, key: object) -> bool:
        # A dict raises TypeError for an unhashable key; no such key is stored here.
        return isinstance(key, str) and key in self._policies

    def __len__(self) -> int:
        return len(self._policies)

    def __iter__(self) -> Iterator[str]:
        return iter(self._snapshot())

    def items(self) -> ItemsView[str, DTypePolicy]:
        """The stored keys and their policies, in insertion order (as they were: another
        thread's changes do not reach an iteration under way)."""
        return self._snapshot().items()

    def values(self) -> ValuesView[DTypePolicy]:
        """The stored policies, in insertion order (as :meth:`items`)."""
        return self._snapshot().values()

    def get(self, key: str, default: Any = None) -> Any:  # type: ignore[override]
        """The policy stored under ``key``, or ``default`` when ``key`` is not stored.

        Only stored keys count (as for a dict); ``map[path]`` resolves a path instead.

        Examples:
            >>> import jmp_policy as jp
            >>> m = jp.DTypePolicyMap("float32", {"encoder/.*": "bfloat16"})
            >>> m.get("encoder/.*")
            <DTypePolicy "bfloat16">
            >>> m.get("encoder/mlp", "not stored"), m["encoder/mlp"]
            ('not stored', <DTypePolicy "bfloat16">)
        """
        _index.check_key_type(key)
        return self._policies.get(key, default)

    def pop(self, key: str, default: Any = _MISSING) -> Any:
        """Removes ``key`` and returns its policy; ``default`` (or ``KeyError``) when the
        key is not stored.

        Examples:
            >>> import jmp_policy as jp
            >>> m = jp.DTypePolicyMap("float32", {"head": "bfloat16"})
            >>> m.pop("head"), m.pop("head", None), len(m)
            (<DTypePolicy "bfloat16">, None, 0)
        """
        _index.check_key_type(key)
        with self._index.lock:
            if key not in self._policies:
                if default is _MISSING:
                    raise _index.absent_key(key, self._snapshot())
                return default
            policy = self._policies[key]
            del self[key]
            return policy

    def setdefault(self, key: str, default: Any = None) -> DTypePolicy:
        """The policy stored under ``key``; when not stored, stores ``default`` (a policy,
        name or config, validated) under ``key`` first.

        Examples:
            >>> import jmp_policy as jp
            >>> m = jp.DTypePolicyMap("float32")
            >>> m.setdefault("head", "bfloat16"), m.setdefault("head", "float16")
            (<DTypePolicy "bfloat16">, <DTypePolicy "bfloat16">)
        """
        _index.check_key_type(key)
        with self._index.lock:
            if key not in self._policies:
                self[key] = default
            return self._policies[key]

    def clear(self) -> None:
        """Removes every stored key."""
        for key in self._snapshot():
            self.pop(key, None)

    def __repr__(self) -> str:
        default = None if self._default_policy is None else self._default_policy.name
        mapping = [(k, v.name) for k, v in self._snapshot().items()]
        return f"<DTypePolicyMap default_policy={default}, mapping={mapping}>"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DTypePolicyMap):
            return NotImplemented
        # A dict comparison: lookups never depend on insertion order, so neither does ==.
        return bool(
            self._default_policy == other._default_policy and self._snapshot() == other._snapshot()
        )

    __hash__ = None  # type: ignore[assignment]  # mutable

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

    # -- matching (``_matching``'s functions) and resolution ------------------------------

    match = _matching.match
    match_variable = _matching.match_variable

    def _policy_of(self, key: str | None) -> DTypePolicy:
        return self.default_policy if key is None else self._policies[key]

    def _variable_policy(self, module: str, name: str) -> DTypePolicy:
        """The policy of the variable ``name`` of ``module`` (the tree methods' lookup)."""
        with self._index.lock:  # the key found and its policy read with no change between
            return self._policy_of(self._index.resolve_variable_unlocked(module, name))

    def __getitem__(self, path: str) -> DTypePolicy:
        with self._index.lock:
            return self._policy_of(self._index.resolve_unlocked(path))

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
        with self._index.lock:
            key = self._index.resolve(path)
            return self._policy_of(key), key

    # -- tree methods: ``_trees``'s functions of the map, whose docstrings they keep -------

    policy_tree = _trees.policy_tree
    cast_to_compute = _trees.cast_to_compute
    cast_to_variable = _trees.cast_to_variable
    cast_to_param = _trees.cast_to_variable
    cast_to_output = _trees.cast_to_output
    quantize = _trees.quantize
    unused_keys = _trees.unused_keys
    explain = _trees.explain

    # -- config: ``_config``'s functions --------------------------------------------------

    get_config = _config.get_config
    from_config = classmethod(_config.from_config)


serialization.register_serializable(DTypePolicyMap)
