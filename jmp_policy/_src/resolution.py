"""Resolution: which policy a module call and a variable run under.

One rule, shared by ``cast_apply`` and the Linen and NNX integrations. For a module path,
from the path itself up to its top-level ancestor (the map's own walk,
``path_and_ancestors``), at each level: a key of the map that names the path (exact, else a
regular expression by ``fullmatch``) wins, then the module's class in ``type_policies`` (by
identity, or by module and qualified name after a reload); otherwise the default policy
(the root ``""`` is not an ancestor). Then the module's own ``dtype`` attribute (Flax's
``nn.Dense(..., dtype=...)``) wins over the compute and output dtypes, unless
``module_dtype="override"``. A variable takes the policy of a key that names the variable
itself (a key that matches the variable's path and not its module path), else its
module's.

The wrappers' options (:class:`~jmp_policy._src.options.Options`) and their checks are
:mod:`jmp_policy._src.options`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from jmp_policy._src import global_state
from jmp_policy._src.options import Island, Options
from jmp_policy._src.policy import DTypePolicy
from jmp_policy._src.policy_map import DTypePolicyMap, parent_path, path_and_ancestors


class ModuleInfo(NamedTuple):
    """What the glue knows of the module at a path: its class and its own ``dtype``."""

    cls: type | None
    own_dtype: np.dtype | None


class Resolution(NamedTuple):
    """The resolved policy of one module path, and why."""

    policy: DTypePolicy  # what the module computes in (own dtype applied)
    chosen_policy: DTypePolicy  # what the map (or type_policies) chose, before the own dtype
    source: str  # "key '<key>'", "type <Class>" or "default"
    key: str | None  # the map key that chose it, if any
    own_dtype: np.dtype | None  # the module's own floating `dtype` attribute
    set_dtype: np.dtype | None  # module_dtype="override": the dtype to give the module
    autocast: bool  # whether inputs are cast (False: autocast_exclude)
    island: bool  # outputs go back to the caller's compute dtype


class Resolver:
    """Module and variable policies of one model run, cached per path.

    ``infos`` (path -> :class:`ModuleInfo`) is what the glue has learnt of the model's
    modules; it grows as modules are called (:meth:`module` records them).
    """

    def __init__(
        self,
        policy_or_map: Any,
        options: Options,
        infos: dict[str, ModuleInfo] | None = None,
    ):
        self.policy_or_map = policy_or_map
        self.options = options
        self.infos: dict[str, ModuleInfo] = {} if infos is None else infos
        self._modules: dict[str, Resolution] = {}
        self.used_keys: set[str] = set()

    def _default(self) -> DTypePolicy:
        if isinstance(self.policy_or_map, DTypePolicyMap):
            return self.policy_or_map.default_policy
        if self.policy_or_map is None:
            return global_state.dtype_policy()
        return self.policy_or_map

    def _choose(self, path: str) -> tuple[DTypePolicy | Island, str, str | None]:
        policy_map = self.policy_or_map if isinstance(self.policy_or_map, DTypePolicyMap) else None
        for current in path_and_ancestors(path):
            if policy_map is not None:
                key = policy_map.match(current)
                if key is not None:
                    self.used_keys.add(key)
                    return policy_map[key], f"key {key!r}", key
            cls = self.infos.get(current, ModuleInfo(None, None)).cls
            found = self.options.type_entry(cls)
            if found is not None and cls is not None:
                return found[0], f"type {cls.__name__}", None
        return self._default(), "default", None

    def module(
        self, path: str, cls: type | None = None, own_dtype: np.dtype | None = None
    ) -> Resolution:
        """The resolution of a module path (recording ``cls`` and ``own_dtype``)."""
        cached = self._modules.get(path)
        if cached is not None:
            return cached
        if cls is not None:
            self.infos.setdefault(path, ModuleInfo(cls, own_dtype))
        info = self.infos.get(path, ModuleInfo(None, None))
        chosen, source, key = self._choose(path)
        island = isinstance(chosen, Island)
        chosen_policy = chosen.policy if isinstance(chosen, Island) else chosen
        policy, set_dtype, own = chosen_policy, None, info.own_dtype
        if own is not None and own != chosen_policy.compute_dtype:
            if self.options.module_dtype == "override":
                set_dtype = chosen_policy.compute_dtype
            else:
                policy = chosen_policy.with_compute_dtype(own).with_output_dtype(own)
                island = False
        autocast = not self.options.excluded(path, info.cls)
        result = Resolution(policy, chosen_policy, source, key, own, set_dtype, autocast, island)
        self._modules[path] = result
        return result

    def variable(self, path: str) -> tuple[DTypePolicy, bool]:
        """A variable's policy (its compute dtype is what the module reads) and whether a
        key names the variable itself."""
        if isinstance(self.policy_or_map, DTypePolicyMap):
            key = self.policy_or_map.match_variable(path)
            if key is not None:
                self.used_keys.add(key)
                return self.policy_or_map[key], True
        return self.module(parent_path(path) or "").policy, False

    def variable_dtype(self, path: str) -> np.dtype:
        """The dtype a variable is stored in (``init``): the chosen policy's (the module's
        own ``dtype`` is a compute dtype, never a stored one)."""
        if isinstance(self.policy_or_map, DTypePolicyMap):
            key = self.policy_or_map.match_variable(path)
            if key is not None:
                return self.policy_or_map[key].variable_dtype
        return self.module(parent_path(path) or "").chosen_policy.variable_dtype

    def overridden(self) -> list[str]:
        """Paths whose own ``dtype`` overrides the policy's compute dtype (``respect``)."""
        if self.options.module_dtype != "respect":
            return []
        return [
            path
            for path, r in self._modules.items()
            if r.own_dtype is not None and r.own_dtype != r.chosen_policy.compute_dtype
        ]

    def unused_keys(self) -> list[str]:
        """The map's keys that chose nothing in this run (typos, most likely)."""
        if not isinstance(self.policy_or_map, DTypePolicyMap):
            return []
        return [k for k in self.policy_or_map if k not in self.used_keys]
