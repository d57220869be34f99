"""Any policy identifier to a policy: ``get``, and the wrappers' reading of their arguments.

An identifier is ``None`` (the global policy), a policy name (:mod:`jmp_policy._src.policy_names`),
a config dict (:mod:`jmp_policy._src.serialization`), a policy or ``DTypePolicyMap``, or a dtype.
This module sits above both the names and the configs, so that neither climbs to the other.
"""

from __future__ import annotations

from typing import Any

from jmp_policy._src import global_state, serialization
from jmp_policy._src.dtypes import TypeAndValueError
from jmp_policy._src.policy import DTypePolicy
from jmp_policy._src.policy_names import policy_from_name_or_dtype


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
    return read_policy(identifier, "identifier")


def read_policy(identifier: Any, argument: str) -> Any:
    """:func:`get`, its errors naming the caller's ``argument``."""
    if identifier is None:
        return global_state.dtype_policy()
    if isinstance(identifier, DTypePolicy) or serialization.is_serializable(identifier):
        return identifier  # a policy, or a map (not a class merely named like one)
    if not isinstance(identifier, dict):
        # A name, or a dtype (np.dtype, scalar types): never arrays, NumPy scalars or bytes,
        # which NumPy would read as their dtypes (`np.True_` as bool, `b"h"` as int16).
        policy = policy_from_name_or_dtype(identifier, argument)
        if policy is None:
            raise TypeAndValueError(
                f"Cannot interpret `dtype` argument (`{argument}`) as a dtype policy. Expected "
                "None, a policy name (such as 'mixed_bfloat16' or 'p=f32,c=bf16,o=f32'), a "
                "config dict, a policy, a DTypePolicyMap or a dtype. Received: "
                f"{argument}={identifier!r} (of type {type(identifier).__name__})"
            )
        return policy
    return serialization.read_config(identifier, None, argument)
