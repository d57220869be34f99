"""The apply wrappers' arguments: the policy or map they run, and their keyword options.

Every wrapper (``jmp_policy.linen``/``nnx`` ``apply``, ``init``, ``explain``, ``diagnose``
and ``cast_apply``) checks its policy argument with :func:`floating_policy_or_map` and
builds its options once with :func:`make_options` into one frozen :class:`Options` value:
a new option is one field here and one keyword. Which policy a module then runs under is
:mod:`jmp_policy._src.resolution`.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from jmp_policy._src import dtypes as dt
from jmp_policy._src import global_state, identifiers
from jmp_policy._src.kv_cache import KVCacheSpec, make_spec
from jmp_policy._src.path_patterns import PathPattern, compile_pattern
from jmp_policy._src.policy import DTypePolicy
from jmp_policy._src.policy_map import DTypePolicyMap
from jmp_policy._src.quantization import serving_kernels

MODULE_DTYPE_MODES = ("respect", "override")


@dataclasses.dataclass(frozen=True)
class Island:
    """A type policy that computes in ``policy`` and returns to the caller's dtype.

    The ready ``NORM_FLOAT32`` mappings use it: a norm layer computes in float32 and
    hands its output back in the compute dtype of the module that called it, as Keras's
    normalization layers and Haiku's ``p=f32,c=f32,o=half`` recipe do, so the residual
    stream stays 16-bit.
    """

    policy: DTypePolicy

    def __repr__(self) -> str:
        return f"Island({self.policy!r})"


@dataclasses.dataclass(frozen=True)
class Options:
    """The options of the apply wrappers, validated once (frozen, as qwix's rules)."""

    type_policies: Mapping[type, DTypePolicy | Island] = dataclasses.field(default_factory=dict)
    module_dtype: str = "respect"
    exclude_types: tuple[type, ...] = ()
    exclude_patterns: tuple[PathPattern, ...] = ()
    extensions: tuple[Callable[..., Any], ...] = ()
    serving_kernel: str = "auto"
    kv_cache: KVCacheSpec | None = None  # attention caches stored quantized, by path

    def excluded(self, path: str, cls: type | None) -> bool:
        """Whether ``autocast_exclude`` names this module (by class or by path)."""
        if cls is not None and self.exclude_types:
            names = {class_name(c) for c in self.exclude_types}
            if any(base in self.exclude_types or class_name(base) in names for base in cls.__mro__):
                return True
        return any(p.fullmatch(path) for p in self.exclude_patterns)

    def type_entry(self, cls: type | None) -> tuple[DTypePolicy | Island, type] | None:
        """The ``type_policies`` entry of a class (its own, else its nearest base's) and
        the class that matched.

        A class matches by identity, or by its module and qualified name: after
        ``importlib.reload`` (notebook autoreload) the model's class is a new object, and
        the policy follows it, as Haiku's per-class policies do.
        """
        types = self.type_policies
        if not types or cls is None:
            return None
        by_name = _by_name(types)
        for base in cls.__mro__:
            if base in types:
                return types[base], base
            entry = by_name.get(class_name(base))
            if entry is not None:
                return entry, base
        return None


def class_name(cls: type) -> tuple[str, str]:
    """A class's module and qualified name: what stays the same across a reload."""
    return (getattr(cls, "__module__", ""), getattr(cls, "__qualname__", cls.__name__))


def _by_name(types: Mapping[type, Any]) -> dict[tuple[str, str], Any]:
    return {class_name(cls): entry for cls, entry in types.items()}


def as_policy_or_map(policy_or_map: Any, argument: str = "policy_or_map") -> Any:
    """A policy, a name or a config to a policy; a map as is; ``None`` is the global one."""
    if isinstance(policy_or_map, (DTypePolicy, DTypePolicyMap)):
        return policy_or_map
    if policy_or_map is None:
        return None
    try:
        if isinstance(policy_or_map, dict) and "class_name" not in policy_or_map:
            return DTypePolicyMap(None, policy_or_map)
        return identifiers.read_policy(policy_or_map, argument)
    except (TypeError, ValueError) as e:
        raise type(e)(f"Invalid `{argument}`: {e}") from e


def quantizing_policy_or_map(policy_or_map: Any) -> Any:
    """The ``quantize`` wrappers' first step: the policy or map (:func:`as_policy_or_map`;
    ``None``: the global policy), checked to hold an int8 or int4 policy."""
    policies = as_policy_or_map(policy_or_map)
    if policies is None:
        policies = global_state.dtype_policy()
    held = list(_policies_of(policies))
    if not any(p.scheme is not None and p.scheme.stores_weights for p in held):
        raise ValueError(
            "`policy_or_map` quantizes nothing: only int8 and int4 policies store quantized "
            "weights. Pass one, such as 'int8_from_mixed_bfloat16' or "
            "'int4/128_from_float32', or a map holding one, such as "
            f"{{'mlp/.*': 'int8_from_mixed_bfloat16'}}. Received: "
            f"policy_or_map={policy_or_map!r}, which holds {sorted({p.name for p in held})}"
        )
    return policies


def _policies_of(policy_or_map: Any) -> Iterable[DTypePolicy]:
    if isinstance(policy_or_map, DTypePolicyMap):
        yield from policy_or_map.values()
        yield policy_or_map.default_policy
    elif isinstance(policy_or_map, DTypePolicy):
        yield policy_or_map


def floating_policy_or_map(policy_or_map: Any) -> Any:
    """Every wrapper's first step: the policy or map it runs (:func:`as_policy_or_map`),
    checked to compute in a floating dtype (:func:`check_floating`)."""
    resolved = as_policy_or_map(policy_or_map)
    check_floating(resolved)
    return resolved


def check_floating(policy_or_map: Any, argument: str = "policy_or_map") -> None:
    """Apply wrappers run only policies with a floating compute dtype (as the global one)."""
    for policy in _policies_of(policy_or_map):
        compute = policy.compute_dtype
        if compute is None or not dt.is_floating(compute):
            raise ValueError(
                "Apply wrappers run only policies with a floating compute dtype, such as "
                "'float32', 'mixed_bfloat16' or 'p=f32,c=bf16,o=f32' (quantized policies "
                f"name their float source: 'int8_from_mixed_bfloat16'). Received: "
                f"{argument}={policy_or_map!r}, which holds {policy!r}"
            )


def as_entry(value: Any, what: str) -> DTypePolicy | Island:
    """A ``type_policies`` value: a policy, a name or an :class:`Island`."""
    if isinstance(value, Island):
        return value
    try:
        policy = as_policy_or_map(value, "type_policies")
    except (TypeError, ValueError) as e:
        raise ValueError(f"Invalid `type_policies` value for {what}: {e}") from e
    if not isinstance(policy, DTypePolicy):
        raise TypeError(
            f"Values of `type_policies` must be policies or policy names. Received for "
            f"{what}: {value!r}"
        )
    check_floating(policy, f"type_policies[{what}]")
    return policy


# The apply wrappers' options and their defaults: a new option is one entry here, one
# field of `Options` and its check in `make_options`; every wrapper takes it as a keyword.
OPTION_DEFAULTS: Mapping[str, Any] = {
    "type_policies": None,
    "module_dtype": "respect",
    "autocast_exclude": (),
    "serving_kernel": "auto",
    "kv_cache": None,
}


def make_options(
    module_base: type | None = None,
    base_name: str = "",
    example: str = "",
    /,
    **options: Any,
) -> Options:
    """Validates the apply wrappers' keyword options into one frozen :class:`Options`.

    ``module_base`` is the class every module class named in the options derives from
    (``nn.Module``), ``base_name`` and ``example`` how errors spell it. ``options`` are
    the keywords of :data:`OPTION_DEFAULTS`.
    """
    unknown = sorted(set(options) - set(OPTION_DEFAULTS))
    if unknown:
        raise TypeError(
            f"Unknown option(s) {unknown}. The apply wrappers take {', '.join(OPTION_DEFAULTS)}."
        )
    values = {**OPTION_DEFAULTS, **options}
    checks = (module_base, base_name, example)
    types = _type_policies(values["type_policies"], *checks)
    module_dtype = values["module_dtype"]
    if not isinstance(module_dtype, str) or module_dtype not in MODULE_DTYPE_MODES:
        raise ValueError(
            "`module_dtype` must be 'respect' (a module's own `dtype` attribute wins over "
            "the policy, as an explicit layer dtype does in Keras) or 'override' (the "
            f"policy wins everywhere). Received: module_dtype={module_dtype!r}"
        )
    exclude_types, patterns = _exclusions(values["autocast_exclude"], *checks)
    return Options(
        type_policies=types,
        module_dtype=module_dtype,
        exclude_types=exclude_types,
        exclude_patterns=patterns,
        serving_kernel=serving_kernels.check(values["serving_kernel"]),
        kv_cache=make_spec(values["kv_cache"]),
    )


def _type_policies(
    type_policies: Any, module_base: type | None, base_name: str, example: str
) -> dict[type, DTypePolicy | Island]:
    """``type_policies`` checked: module classes to policies (or Islands)."""
    types: dict[type, DTypePolicy | Island] = {}
    if type_policies is None:
        return types
    if not isinstance(type_policies, Mapping):
        raise TypeError(
            "`type_policies` must be a mapping from module classes to policies, such "
            f"as {{{example or 'LayerNorm'}: 'float32'}}. Received: "
            f"type_policies={type_policies!r}"
        )
    for cls, value in type_policies.items():
        _check_class(cls, "type_policies", module_base, base_name, example)
        types[cls] = as_entry(value, cls.__name__)
    return types


def _exclusions(
    autocast_exclude: Any, module_base: type | None, base_name: str, example: str
) -> tuple[tuple[type, ...], tuple[PathPattern, ...]]:
    """``autocast_exclude`` checked, as the module classes and the path patterns it names."""
    given = autocast_exclude
    if isinstance(autocast_exclude, (str, type)):
        autocast_exclude = (autocast_exclude,)
    try:
        if isinstance(autocast_exclude, (bytes, bytearray, Mapping)):
            raise TypeError  # bytes iterate as ints, a mapping as its keys only
        entries = tuple(autocast_exclude)
    except TypeError:
        raise TypeError(
            "`autocast_exclude` must be a sequence of module classes and/or path regular "
            f"expressions (str). Received: autocast_exclude={given!r}"
        ) from None
    exclude_types: list[type] = []
    patterns: list[PathPattern] = []
    for entry in entries:
        if isinstance(entry, str):
            patterns.append(
                compile_pattern(
                    entry, "entry {key} of `autocast_exclude`", f"autocast_exclude={given!r}"
                )
            )
        elif isinstance(entry, type):
            _check_class(entry, "autocast_exclude", module_base, base_name, example)
            exclude_types.append(entry)
        else:
            raise TypeError(
                "`autocast_exclude` entries must be module classes or path regular "
                f"expressions (strings). Received: {entry!r} (of type {type(entry).__name__}) "
                f"in autocast_exclude={given!r}"
            )
    return tuple(exclude_types), tuple(patterns)


def _check_class(cls: Any, argument: str, base: type | None, base_name: str, example: str) -> None:
    if not isinstance(cls, type):
        raise TypeError(
            f"`{argument}` takes module classes. Received {cls!r} (of type {type(cls).__name__})"
        )
    if base is not None and not issubclass(cls, base):
        raise TypeError(
            f"`{argument}` takes {base_name or base.__qualname__} subclasses, such as "
            f"{example}. Received {cls!r}"
        )


def float32_islands(*classes: type) -> Mapping[type, Any]:
    """Read-only ``type_policies`` that compute ``classes`` in float32, each one's output
    back in its caller's compute dtype (a framework's ``NORM_FLOAT32``)."""
    return types.MappingProxyType({cls: Island(identifiers.get("float32")) for cls in classes})
