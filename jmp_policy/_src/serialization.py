"""Serialization of policies (and maps): JSON-ready dicts, and ``get``.

Reads this library's configs, Keras 3's (``"module": "keras"``), tf.keras's
(``{"class_name": "Policy", "config": {"name": ...}}``) and tf.keras's old experimental
configs, whose ``loss_scale`` field is dropped as tf.keras did.
"""

from __future__ import annotations

from typing import Any

from jmp_policy._src import global_state
from jmp_policy._src.dtypes import TypeAndValueError, canonicalize_dtype, is_numeric
from jmp_policy._src.policy import (
    DTypePolicy,
    FloatDTypePolicy,
    Policy,
    QuantizedDTypePolicy,
    QuantizedFloat8DTypePolicy,
    policy_from_name,
)

# Class names this library and its peers write, to the class that reads them back.
_CLASSES: dict[str, type[Any]] = {
    "DTypePolicy": DTypePolicy,
    "FloatDTypePolicy": FloatDTypePolicy,
    "Policy": Policy,
    "PolicyV1": Policy,  # tf.keras's experimental policy (with a loss scale).
    "QuantizedDTypePolicy": QuantizedDTypePolicy,
    "Int4DTypePolicy": QuantizedDTypePolicy,  # Keras 3's class for "int4/<block>".
    "QuantizedFloat8DTypePolicy": QuantizedFloat8DTypePolicy,
}


def register_serializable(cls: type[Any]) -> type[Any]:
    """Lets :func:`deserialize` read configs whose ``class_name`` is ``cls.__name__``."""
    _CLASSES[cls.__name__] = cls
    return cls


def serialize(obj: Any) -> dict[str, Any]:
    """A JSON-ready dict for a policy or a policy map; :func:`deserialize` reverses it.

    Args:
        obj: a policy or a ``DTypePolicyMap``.

    Returns:
        ``{"module": "jmp_policy", "class_name": ..., "config": ...}``.

    Raises:
        TypeError: ``obj`` is not a policy or a map.

    Examples:
        >>> import jmp_policy as jp
        >>> jp.serialize(jp.DTypePolicy("mixed_bfloat16"))
        {'module': 'jmp_policy', 'class_name': 'DTypePolicy', 'config': {'name': 'mixed_bfloat16'}}
        >>> jp.deserialize(jp.serialize(jp.get("int8_from_float32")))
        <QuantizedDTypePolicy "int8_from_float32">
    """
    if type(obj).__name__ not in _CLASSES or not hasattr(obj, "get_config"):
        raise TypeError(
            f"`obj` must be a dtype policy or a DTypePolicyMap. Received: obj={obj!r} "
            f"(of type {type(obj).__name__})"
        )
    return {"module": "jmp_policy", "class_name": type(obj).__name__, "config": obj.get_config()}


def deserialize(config: dict[str, Any] | str) -> Any:
    """Builds a policy or map from a serialized config (never modifying ``config``).

    Accepts this library's :func:`serialize` output, Keras 3 configs, tf.keras ``Policy``
    configs (the old experimental ``loss_scale`` field is dropped) and plain names.

    Args:
        config: a dict with ``class_name`` and ``config``, or a policy name.

    Returns:
        The policy or map.

    Raises:
        TypeError: ``config`` is neither a dict nor a string.
        ValueError: an unknown ``class_name``, or a config the class rejects.

    Examples:
        >>> import jmp_policy as jp
        >>> jp.deserialize({"class_name": "Policy", "config": {"name": "mixed_float16"}})
        <Policy "mixed_float16">
        >>> jp.deserialize({"module": "keras", "class_name": "DTypePolicy",
        ...                 "config": {"name": "mixed_bfloat16"}, "registered_name": None})
        <DTypePolicy "mixed_bfloat16">
    """
    if isinstance(config, str):
        return policy_from_name(config)
    if not isinstance(config, dict):
        raise TypeError(
            "`config` must be a dict with 'class_name' and 'config' (as `serialize` returns) "
            f"or a policy name. Received: config={config!r} (of type {type(config).__name__})"
        )
    class_name = config.get("class_name")
    if class_name not in _CLASSES:
        raise ValueError(
            f"Unknown `class_name` {class_name!r} in `config`; expected one of "
            f"{sorted(_CLASSES)}. Received: config={config!r}"
        )
    inner = config.get("config", {})
    if not isinstance(inner, dict):
        raise ValueError(f"`config['config']` must be a dict. Received: config={config!r}")
    return _CLASSES[class_name].from_config(inner)


def get(identifier: Any = None) -> Any:
    """Any policy identifier to a policy (or a map, returned as is).

    Args:
        identifier: ``None`` (the global policy), a name (every accepted form), a config
            dict, a policy or ``DTypePolicyMap`` (returned as is), or a numpy/JAX dtype.

    Returns:
        The policy (or map).

    Raises:
        TypeError: an identifier of another type.
        ValueError: a name or config that is not accepted.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jmp_policy as jp
        >>> jp.get("mixed_bfloat16")
        <DTypePolicy "mixed_bfloat16">
        >>> jp.get("int8_from_mixed_bfloat16")
        <QuantizedDTypePolicy "int8_from_mixed_bfloat16">
        >>> jp.get(jnp.bfloat16)
        <DTypePolicy "bfloat16">
        >>> jp.get(None) == jp.dtype_policy()
        True
    """
    if identifier is None:
        return global_state.dtype_policy()
    if isinstance(identifier, DTypePolicy):
        return identifier
    if isinstance(identifier, str):
        return policy_from_name(identifier)
    if isinstance(identifier, dict):
        return deserialize(identifier)
    if type(identifier).__name__ in _CLASSES:  # a DTypePolicyMap
        return identifier
    try:
        dtype = (
            None if isinstance(identifier, (bool, int, float)) else canonicalize_dtype(identifier)
        )
    except TypeError:
        dtype = None
    if dtype is None or not is_numeric(dtype):
        raise TypeAndValueError(
            "Cannot interpret `dtype` argument (`identifier`) as a dtype policy. Expected None, "
            "a policy name "
            "(such as 'mixed_bfloat16' or 'p=f32,c=bf16,o=f32'), a config dict, a policy, "
            f"a DTypePolicyMap or a dtype. Received: identifier={identifier!r} "
            f"(of type {type(identifier).__name__})"
        )
    return DTypePolicy(dtype.name)
