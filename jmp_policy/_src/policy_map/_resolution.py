"""TO BE MOVED to ``jmp_policy/_src/resolution.py`` by the lead (then delete this file).

Resolution with per-class policies, the rule the Flax glue shares: which policy for a
module and for a variable, given a policy or a map and ``type_policies``. It reaches the
map only through its public matching methods (:meth:`DTypePolicyMap.match`,
:meth:`DTypePolicyMap.match_variable`). ``format_table`` is the glue's old table writer;
new tables use ``jmp_policy._src.explain.format_rows``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jmp_policy._src import global_state
from jmp_policy._src.policy import DTypePolicy
from jmp_policy._src.policy_map._mapping import DTypePolicyMap
from jmp_policy._src.policy_map._trees import parent_path
from jmp_policy._src.policy_map._values import as_policy


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
            result[cls] = as_policy(policy, cls.__name__)
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
            key = policy_or_map.match(current)
            if key is not None:
                return policy_or_map[key], f"key {key!r}"
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
        key = policy_or_map.match_variable(path)
        if key is not None:
            return policy_or_map[key], f"key {key!r}"
    return resolve_module(policy_or_map, parent_path(path) or "", classes, type_policies)
