"""DTypePolicyMap: a policy per submodule, chosen from the submodule's path.

A private package, one module per concept:

* ``_mapping``: the map itself (stored keys and policies, path resolution);
* ``_matching``: which stored key names a path or a variable itself (``match``,
  ``match_variable``);
* ``_config``: its config (``get_config``, ``from_config``, the default policy read);
* ``_values``: the values it holds (policies from names or configs, validated);
* ``_index``: the key index: matching (which stored key names a module or a variable),
  resolution (which key chooses its policy) and the one ancestor walk;
* ``_trees``: the tree methods (``policy_tree``, ``cast_to_*``, ``quantize``, ``unused_keys``,
  ``explain``), functions of the map that it binds as its methods.

Regular-expression keys are compiled and matched (in bounded time) by
``jmp_policy._src.path_patterns``, as every user path pattern is. Explain rows and their
formatting are ``jmp_policy._src.explain``; the wrappers' resolution
(per-class policies, modules' own dtypes) is ``jmp_policy._src.resolution``.
"""

from jmp_policy._src.policy_map._index import path_and_ancestors as path_and_ancestors
from jmp_policy._src.policy_map._mapping import DTypePolicyMap as DTypePolicyMap
from jmp_policy._src.tree_paths import leaf_path as leaf_path
from jmp_policy._src.tree_paths import parent_path as parent_path

__all__ = [
    "DTypePolicyMap",
    "leaf_path",
    "parent_path",
    "path_and_ancestors",
]
