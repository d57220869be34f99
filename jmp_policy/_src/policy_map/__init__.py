"""DTypePolicyMap: a policy per submodule, chosen from the submodule's path.

A private package, one module per concept:

* ``_mapping``: the map itself (stored keys and policies, path resolution, config);
* ``_values``: the values it holds (policies from names or configs, validated);
* ``_index``: the key index and matching (which stored key names a module or a variable);
* ``_trees``: the tree walks (``policy_tree``, ``cast_to_*``, ``unused_keys``, ``explain``);
* ``_resolution``: the Flax glue's resolution with per-class policies (to be moved to
  ``jmp_policy/_src/resolution.py``).

Explain rows and their formatting are ``jmp_policy._src.explain``.
"""

from jmp_policy._src.policy_map._mapping import DTypePolicyMap as DTypePolicyMap
from jmp_policy._src.policy_map._resolution import format_table as format_table
from jmp_policy._src.policy_map._resolution import (
    normalize_type_policies as normalize_type_policies,
)
from jmp_policy._src.policy_map._resolution import resolve_module as resolve_module
from jmp_policy._src.policy_map._resolution import resolve_variable as resolve_variable
from jmp_policy._src.policy_map._resolution import type_policy_for as type_policy_for
from jmp_policy._src.policy_map._trees import leaf_path as leaf_path
from jmp_policy._src.policy_map._trees import parent_path as parent_path

__all__ = [
    "DTypePolicyMap",
    "format_table",
    "leaf_path",
    "normalize_type_policies",
    "parent_path",
    "resolve_module",
    "resolve_variable",
    "type_policy_for",
]
