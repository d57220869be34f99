"""The values a DTypePolicyMap holds: policies, read from policies, names or config dicts.

A value is validated on insertion (in the constructor too) and named by its key in every
error; a map, or a map's config, is never a value (nor a default) of another map.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jmp_policy._src import identifiers, serialization
from jmp_policy._src.dtypes import TypeAndValueError, bounded_repr
from jmp_policy._src.policy import DTypePolicy

# The keys of a policy's config dict (Keras's serialized form): a dict with none of them,
# given as a default policy, is a dict of paths to policies.
_CONFIG_KEYS = frozenset({"class_name", "config", "module", "registered_name", "name"})


def check_not_paths(default_policy: Any) -> None:
    """Refuses ``DTypePolicyMap({"head": "float32"})``: paths where the default goes."""
    if isinstance(default_policy, Mapping) and not _CONFIG_KEYS & set(default_policy):
        raise TypeAndValueError(
            "`default_policy` got a dict of paths to policies, which is the second argument, "
            "`policy_map`: write `DTypePolicyMap(None, {...})` (or "
            "`DTypePolicyMap(policy_map={...})`), or `DTypePolicyMap('mixed_bfloat16', {...})` "
            "with a default for the paths no key matches. A dict as `default_policy` is a "
            "policy's config, with a 'class_name'. "
            f"Received: default_policy={bounded_repr(default_policy)}"
        )


def read_once(value: Any, key: str, read: dict[Any, DTypePolicy]) -> Any:
    """``value`` as a policy, a name or JSON-like config read once per map (``read`` holds
    those read: equal texts, equal configs); anything else, and a config nested too deep to
    print or naming a map (refused as it is by ``map[key] = value``), as given."""
    if type(value) is not str and (
        type(value) is not dict or value.get("class_name") == "DTypePolicyMap"
    ):
        return value
    try:
        text = (type(value), repr(value))
    except RecursionError:
        return value
    if text not in read:
        read[text] = as_policy(value, key)
    return read[text]


def check_config(value: Any, argument: str) -> None:
    """Rejects config dicts that would not give one policy, naming ``argument``."""
    if not isinstance(value, dict):
        return
    class_name = value.get("class_name")
    if class_name is not None and not isinstance(class_name, str):
        raise TypeAndValueError(
            f"{argument}: `class_name` in a config must be a string such as 'DTypePolicy'. "
            f"Received: class_name={bounded_repr(class_name)} in {bounded_repr(value)}"
        )
    if class_name == "DTypePolicyMap":
        raise ValueError(
            f"{argument}: a DTypePolicyMap cannot be a policy of another map (a map's "
            f"values and default are policies). Received the map config "
            f"{bounded_repr(value)}"
        )


def as_policy(value: Any, key: str) -> DTypePolicy:
    """A map value (a policy, a name or a policy's config dict) as a policy."""
    argument = f"Cannot interpret the assigned value for key {key!r}"
    if isinstance(value, Mapping) and not isinstance(value, dict):  # a DTypePolicyMap
        raise TypeAndValueError(
            f"{argument}: a {type(value).__name__} cannot be a value of another map."
        )
    if isinstance(value, DTypePolicy):
        return value
    if not isinstance(value, (str, dict)):
        raise TypeAndValueError(
            f"{argument}. Expected a policy, a policy name or a config dict. "
            f"Received: {value!r} (of type {type(value).__name__})"
        )
    check_config(value, argument)
    try:
        return identifiers.read_policy(value, "value")  # type: ignore[no-any-return]
    except (TypeError, ValueError) as e:
        raise ValueError(f"{argument}: {e}") from e


def serialize_value(policy: DTypePolicy) -> dict[str, Any]:
    """A map value's (or default's) config; tf.keras's ``"_infer"`` written in full."""
    config = serialization.serialize(policy)
    if config is None:  # "_infer": a value is never None, and a None default is the global
        config = {"module": "jmp_policy", "class_name": "Policy", "config": policy.get_config()}
    return config


_WRAPPER_FIELDS = frozenset({"module", "class_name", "config", "registered_name"})


def is_wrapped_dict(policy_map: Any) -> bool:
    """Whether ``policy_map`` is a dict serialized as ``{"class_name": ..., "config": {...}}``
    rather than a map whose keys happen to be ``"class_name"`` and ``"config"`` (whose
    values are policies: names or config dicts, never a class name beside a plain dict of
    keys)."""
    if not isinstance(policy_map, dict) or not {"class_name", "config"} <= set(policy_map):
        return False
    if not set(policy_map) <= _WRAPPER_FIELDS:
        return False
    class_name, inner = policy_map["class_name"], policy_map["config"]
    if not (isinstance(class_name, str) and isinstance(inner, dict)):
        return False
    # A map {"class_name": "float32", "config": {"class_name": ..., "config": ...}} keeps
    # its keys: the inner dict is then a policy's config, not a dict of paths.
    return not {"class_name", "config"} <= set(inner) and "name" not in inner
