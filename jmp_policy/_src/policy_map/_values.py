"""The values a DTypePolicyMap holds: policies, read from policies, names or config dicts.

A value is validated on insertion (in the constructor too) and named by its key in every
error; a map, or a map's config, is never a value (nor a default) of another map.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jmp_policy._src import serialization
from jmp_policy._src.dtypes import TypeAndValueError
from jmp_policy._src.policy import DTypePolicy


def check_config(value: Any, argument: str) -> None:
    """Rejects config dicts that would not give one policy, naming ``argument``."""
    if not isinstance(value, dict):
        return
    class_name = value.get("class_name")
    if class_name is not None and not isinstance(class_name, str):
        raise TypeAndValueError(
            f"{argument}: `class_name` in a config must be a string such as 'DTypePolicy'. "
            f"Received: class_name={class_name!r} in {value!r}"
        )
    if class_name == "DTypePolicyMap":
        raise ValueError(
            f"{argument}: a DTypePolicyMap cannot be a policy of another map (a map's "
            f"values and default are policies). Received the map config {value!r}"
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
        return serialization.get(value)  # type: ignore[no-any-return]
    except (TypeError, ValueError) as e:
        raise ValueError(f"{argument}: {e}") from e
