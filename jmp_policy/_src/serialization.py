"""Serialization of policies (and maps): JSON-ready dicts and Keras 3's own format.

Reads this library's configs, Keras 3's (``"module": "keras"``), tf.keras's
(``{"class_name": "Policy", "config": {"name": ...}}``, and ``None`` for its ``"_infer"``
policy) and tf.keras's old experimental configs, whose ``loss_scale`` field is dropped as
tf.keras did. A user's subclass is written under its own class name and read back through
``custom_objects``, as in Keras and tf.keras.
"""

from __future__ import annotations

import contextvars
from collections.abc import Mapping
from typing import Any

from jmp_policy._src import schemes
from jmp_policy._src.dtypes import bounded_repr
from jmp_policy._src.name_grammar import INFER
from jmp_policy._src.policy import DTypePolicy, FloatDTypePolicy, Policy
from jmp_policy._src.policy_names import policy_from_name
from jmp_policy._src.quantized_policy import QuantizedDTypePolicy

# The float classes this library and its peers write, to the class that reads them back;
# the quantized ones are the registry's (:func:`jmp_policy._src.schemes.policy_classes`),
# the map's is added by :func:`register_serializable`.
_CLASSES: dict[str, type[Any]] = {
    "DTypePolicy": DTypePolicy,
    "FloatDTypePolicy": FloatDTypePolicy,
    "Policy": Policy,
    "PolicyV1": Policy,  # tf.keras's experimental policy (with a loss scale).
}
_OWN_CLASSES: set[type[Any]] = set(_CLASSES.values())


def _known() -> dict[str, type[Any]]:
    """Class names to the classes :func:`deserialize` reads without ``custom_objects``."""
    return {**_CLASSES, **{cls.__name__: cls for cls in schemes.policy_classes()}}


def _is_own(cls: type[Any]) -> bool:
    """A class of this library (a user's registered format's class is not: it is written
    under its own module, and Keras cannot represent it)."""
    return cls in _OWN_CLASSES or (
        cls in schemes.policy_classes() and cls.__module__.startswith("jmp_policy.")
    )


_FORMATS = ("jmp_policy", "keras")

# The `custom_objects` of the `deserialize` call in progress, so that the configs nested in
# a map's config (read through `get`) find the user's classes too.
_CUSTOM_OBJECTS: contextvars.ContextVar[Mapping[str, type[Any]] | None] = contextvars.ContextVar(
    "jmp_policy_custom_objects", default=None
)

# Keras 3's dtype names (`keras.src.backend.common.dtypes.ALLOWED_DTYPES`, "string" aside).
_KERAS_DTYPES = frozenset(
    {
        *("bfloat16", "float16", "float32", "float64", "float8_e4m3fn", "float8_e5m2"),
        *("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"),
        *("bool", "complex64", "complex128"),
    }
)


def register_serializable(cls: type[Any]) -> type[Any]:
    """Lets :func:`deserialize` read configs whose ``class_name`` is ``cls.__name__``."""
    _CLASSES[cls.__name__] = cls
    _OWN_CLASSES.add(cls)
    return cls


def is_serializable(obj: Any) -> bool:
    """Whether ``obj`` is a policy or map that :func:`serialize` writes."""
    return isinstance(obj, _base_classes()) and hasattr(obj, "get_config")


def _base_classes() -> tuple[type[Any], ...]:
    return (*_OWN_CLASSES, *schemes.policy_classes())


def serialize(obj: Any, format: str = "jmp_policy") -> dict[str, Any] | None:
    """A JSON-ready dict for a policy or a policy map; :func:`deserialize` reverses it.

    A user's subclass of a policy class is written under its own class name (and its
    module); :func:`deserialize` reads it back given ``custom_objects``. tf.keras's
    ``"_infer"`` policy is written as ``None``, as tf.keras does.

    ``format="keras"`` writes Keras 3's own format, which
    ``keras.saving.deserialize_keras_object`` (and :func:`deserialize`) read: policies as
    Keras's classes under their Keras names (``get_policy("p=f32,c=bf16")`` is written
    ``"mixed_bfloat16"``), maps as Keras's ``DTypePolicyMap``. In Keras a map resolves a
    path by exact key, then regular expression, then its default: a submodule does not
    inherit its ancestor's policy there.

    Args:
        obj: a policy or a ``DTypePolicyMap``.
        format: ``"jmp_policy"`` (the default) or ``"keras"``.

    Returns:
        ``{"module": "jmp_policy", "class_name": ..., "config": ...}`` (with
        ``format="keras"``, Keras's ``module`` and a ``registered_name``); ``None`` for
        tf.keras's ``"_infer"`` policy.

    Raises:
        TypeError: ``obj`` is not a policy or a map.
        ValueError: an unknown ``format``; with ``format="keras"``, what Keras cannot
            represent (the message names it): an output dtype other than the compute
            dtype, variable and compute dtypes that no Keras name gives, ``"_infer"``, a
            user's subclass, or a map holding one of these.

    Examples:
        >>> import jmp_policy as jp
        >>> jp.serialize(jp.DTypePolicy("mixed_bfloat16"))
        {'module': 'jmp_policy', 'class_name': 'DTypePolicy', 'config': {'name': 'mixed_bfloat16'}}
        >>> jp.deserialize(jp.serialize(jp.get("int8_from_float32")))
        <QuantizedDTypePolicy "int8_from_float32">
        >>> jp.serialize(jp.get_policy("p=f32,c=bf16"), format="keras")
        {'module': 'keras', 'class_name': 'DTypePolicy', 'config': {'name': 'mixed_bfloat16'}, 'registered_name': None}
        >>> jp.serialize(jp.Policy("_infer")) is None
        True
    """
    if format not in _FORMATS:
        raise ValueError(
            f"Unknown `format`; expected one of {', '.join(map(repr, _FORMATS))}. "
            f"Received: format={format!r}"
        )
    if not is_serializable(obj):
        raise TypeError(
            f"`obj` must be a dtype policy or a DTypePolicyMap. Received: obj={obj!r} "
            f"(of type {type(obj).__name__})"
        )
    if format == "keras":
        try:
            return _to_keras(obj)
        except ValueError as e:  # quote `obj` once
            if "Received: obj=" in str(e):
                raise
            raise ValueError(f"{e} Received: obj={obj!r}") from e
    if isinstance(obj, DTypePolicy) and obj.compute_dtype is None:
        return None  # tf.keras's "_infer"
    cls = type(obj)
    module = "jmp_policy" if _is_own(cls) else cls.__module__
    return {"module": module, "class_name": cls.__name__, "config": obj.get_config()}


# -- Keras 3's format ---------------------------------------------------------------------


def _keras_entry(module: str, class_name: str, config: dict[str, Any]) -> dict[str, Any]:
    return {"module": module, "class_name": class_name, "config": config, "registered_name": None}


def _keras_float_name(policy: DTypePolicy) -> str:
    """The Keras name of a policy's dtypes, or a ValueError saying why there is none."""
    variable, compute, output = policy.variable_dtype, policy.compute_dtype, policy.output_dtype
    if output != compute:
        raise ValueError(
            f"Keras has no output dtype: the policy {policy.name!r} returns {output.name} "
            f"while it computes in {compute.name}, which Keras cannot represent."
        )
    if variable == compute and variable.name in _KERAS_DTYPES:
        return str(variable.name)
    if variable == "float32" and compute.name in ("float16", "bfloat16"):
        return f"mixed_{compute.name}"
    raise ValueError(
        f"Keras cannot represent the policy {policy.name!r} (variables {variable.name}, "
        f"compute {compute.name}): a Keras name is one dtype for both, 'mixed_float16' or "
        "'mixed_bfloat16'."
    )


def _to_keras(obj: Any) -> dict[str, Any]:
    if not isinstance(obj, DTypePolicy):
        return _map_to_keras(obj)
    if not _is_own(type(obj)):
        raise ValueError(
            f"Keras cannot represent a user's subclass {type(obj).__name__!r}: write it with "
            f"`serialize(policy)` and read it with `deserialize(config, custom_objects=...)`. "
            f"Received: obj={obj!r}"
        )
    if obj.compute_dtype is None:
        raise ValueError(
            f"Keras 3 has no '{INFER}' policy (tf.keras's, whose dtypes follow the inputs). "
            f"Received: obj={obj!r}"
        )
    if not isinstance(obj, QuantizedDTypePolicy):
        class_name = "FloatDTypePolicy" if type(obj) is FloatDTypePolicy else "DTypePolicy"
        return _keras_entry("keras", class_name, {"name": _keras_float_name(obj)})
    config = {**obj.get_config(), "source_name": _keras_float_name(obj)}
    class_name = schemes.class_for(obj.scheme, config["mode"]).__name__
    return _keras_entry("keras.dtype_policies", class_name, config)


def _map_to_keras(policy_map: Any) -> dict[str, Any]:
    default = policy_map.get_config()["default_policy"]
    try:
        keras_default = None if default is None else _to_keras(deserialize(default))
    except ValueError as e:
        raise ValueError(f"Cannot write the map's `default_policy` for Keras: {e}") from e
    entries = {}
    for key, policy in policy_map.items():
        try:
            entries[key] = _to_keras(policy)
        except ValueError as e:
            raise ValueError(f"Cannot write the map's key {key!r} for Keras: {e}") from e
    return _keras_entry(
        "keras.dtype_policies",
        "DTypePolicyMap",
        {"default_policy": keras_default, "policy_map": entries},
    )


# -- reading ------------------------------------------------------------------------------


def _check_custom_objects(custom_objects: Any) -> Mapping[str, type[Any]]:
    if custom_objects is None:
        return {}
    if not isinstance(custom_objects, Mapping):
        raise TypeError(
            "`custom_objects` must be a dict of class names to classes, such as "
            f"{{'MyPolicy': MyPolicy}}. Received: custom_objects={custom_objects!r}"
        )
    for name, cls in custom_objects.items():
        if not isinstance(cls, type) or not issubclass(cls, _base_classes()):
            raise TypeError(
                f"`custom_objects[{name!r}]` must be a policy class: a subclass of DTypePolicy "
                f"(or of DTypePolicyMap). Received: custom_objects={bounded_repr(custom_objects)}"
            )
    return custom_objects


def deserialize(config: Any, custom_objects: Mapping[str, type[Any]] | None = None) -> Any:
    """Builds a policy or map from a serialized config (never modifying ``config``).

    Accepts this library's :func:`serialize` output (either format), Keras 3 configs,
    tf.keras ``Policy`` configs (the old experimental ``loss_scale`` field is dropped),
    plain names, and ``None``, which is tf.keras's ``"_infer"`` policy (as in tf.keras).

    Args:
        config: a dict with ``class_name`` and ``config``, a policy name, or ``None``.
        custom_objects: class names to the user's classes (subclasses of the policy
            classes), looked up before this library's; the configs nested in a map's
            config use them too.

    Returns:
        The policy or map.

    Raises:
        TypeError: ``config`` is neither a dict, a string nor ``None``; ``custom_objects``
            is not a dict of classes.
        ValueError: an unknown ``class_name``, or a config the class rejects.

    Examples:
        >>> import jmp_policy as jp
        >>> jp.deserialize({"class_name": "Policy", "config": {"name": "mixed_float16"}})
        <Policy "mixed_float16">
        >>> jp.deserialize({"module": "keras", "class_name": "DTypePolicy",
        ...                 "config": {"name": "mixed_bfloat16"}, "registered_name": None})
        <DTypePolicy "mixed_bfloat16">
        >>> jp.deserialize(None)
        <Policy "_infer">
        >>> class MyPolicy(jp.DTypePolicy):
        ...     pass
        >>> config = jp.serialize(MyPolicy("mixed_float16"))
        >>> config["class_name"]
        'MyPolicy'
        >>> jp.deserialize(config, custom_objects={"MyPolicy": MyPolicy})
        <MyPolicy "mixed_float16">
    """
    if config is None or isinstance(config, str):
        _check_custom_objects(custom_objects)
        # tf.keras's reading of `None`; a name is read as `get` reads it.
        return Policy(INFER) if config is None else policy_from_name(config, "config")
    return read_config(config, custom_objects, "config")


def read_config(config: Any, custom_objects: Any, argument: str) -> Any:
    """:func:`deserialize` of a config dict, its errors naming the caller's ``argument``."""
    known = {**(_CUSTOM_OBJECTS.get() or {}), **_check_custom_objects(custom_objects)}
    if not isinstance(config, dict):
        raise TypeError(
            f"`{argument}` must be a dict with 'class_name' and 'config' (as `serialize` "
            f"returns) or a policy name. Received: {argument}={bounded_repr(config)} (of type "
            f"{type(config).__name__})"
        )
    class_name = config.get("class_name")
    cls = None
    if isinstance(class_name, str):
        cls = known.get(class_name) or _known().get(class_name)
    if cls is None:
        raise ValueError(
            f"Unknown `class_name` {class_name!r} in `{argument}`; expected one of "
            f"{sorted(_known())}, or a class of your own passed as "
            f"`custom_objects={{{bounded_repr(class_name)}: YourClass}}`. "
            f"Received: {argument}={bounded_repr(config)}"
        )
    inner = config.get("config", {})
    if not isinstance(inner, dict):
        raise ValueError(f"`{argument}['config']` must be a dict. Received: {argument}={config!r}")
    token = _CUSTOM_OBJECTS.set(known)
    try:
        return cls.from_config(inner)
    finally:
        _CUSTOM_OBJECTS.reset(token)
