"""DTypePolicyMap's config: its default policy read, ``get_config`` and ``from_config``.

Functions of the map that it binds as its methods (as ``_trees``'s tree methods), their
docstrings kept. A config is Keras 3's form; reading one never mutates it.
"""

from __future__ import annotations

from collections.abc import ItemsView
from typing import Any, Protocol

import jmp_policy._src.policy_map._values as _values
from jmp_policy._src import config_fields, identifiers
from jmp_policy._src.policy import DTypePolicy

CONFIG_FIELDS = ("default_policy", "policy_map")


class PolicyMap(Protocol):
    """What the config functions use of a ``DTypePolicyMap``: its stored default (``None``:
    the global policy at lookup time) and its stored keys and policies. (``_mapping``
    imports this module, so the map is described here, not imported.)"""

    _default_policy: DTypePolicy | None

    def items(self) -> ItemsView[str, DTypePolicy]: ...


def read_default(default_policy: Any) -> DTypePolicy | None:
    """The map's ``default_policy`` argument as a policy (``None`` stays ``None``)."""
    if default_policy is None:
        return None
    _values.check_not_paths(default_policy)
    _values.check_config(default_policy, "Invalid `default_policy`")
    try:
        return identifiers.get(default_policy)  # type: ignore[no-any-return]
    except (TypeError, ValueError) as e:
        raise type(e)(f"Invalid `default_policy`: {e}") from e


def get_config(policy_map: PolicyMap) -> dict[str, Any]:
    """A JSON-ready dict: the default policy and every key's serialized policy.

    tf.keras's ``"_infer"`` policy, which :func:`~jmp_policy.serialize` writes as
    ``None``, is written in full here: a ``None`` default means the global policy.
    """
    default = policy_map._default_policy
    return {
        "default_policy": None if default is None else _values.serialize_value(default),
        "policy_map": {k: _values.serialize_value(v) for k, v in policy_map.items()},
    }


def from_config(cls: Any, config: dict[str, Any]) -> Any:
    """Builds a map from :meth:`get_config`'s dict (also Keras 3's); never mutates it."""
    example = "{'default_policy': None, 'policy_map': {}}"
    config_fields.check_fields(config, CONFIG_FIELDS, "DTypePolicyMap", example)
    policy_map: Any = config.get("policy_map")
    if _values.is_wrapped_dict(policy_map):
        policy_map = policy_map["config"]  # Keras serializes the dict itself.
    return cls(config.get("default_policy"), policy_map)
