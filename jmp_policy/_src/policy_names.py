"""From a name to a policy: the one place that picks the policy class for any accepted name
(float, quantized, tf.keras's ``"_infer"``), and jmp's ``get_policy``."""

from __future__ import annotations

import functools

from jmp_policy._src import dtypes as dt
from jmp_policy._src.calibrated_policy import AWQDTypePolicy, GPTQDTypePolicy
from jmp_policy._src.policy import DTypePolicy
from jmp_policy._src.quantized_policy import (
    Int4DTypePolicy,
    QuantizedDTypePolicy,
    QuantizedFloat8DTypePolicy,
)


def policy_from_name(name: str, argument: str = "name") -> DTypePolicy:
    """Any accepted name to the right policy class (see :func:`_policy_from_name`)."""
    dt.check_name_type(name, argument)
    # Policies are immutable values: a large map names a few policies many times.
    return _policy_from_name(name, argument)


@functools.lru_cache(maxsize=1024)
def _policy_from_name(name: str, argument: str) -> DTypePolicy:
    """Any accepted name to the right policy class, as Keras picks it.

    ``"int4/<block>_from_…"`` gives an :class:`Int4DTypePolicy`, ``"int4_from_…"`` and
    ``"int8_from_…"`` a :class:`QuantizedDTypePolicy`, ``"float8_from_…"`` (delayed
    scaling) and ``"float8_current_from_…"`` (current scaling) a
    :class:`QuantizedFloat8DTypePolicy`, ``"gptq/…"`` and ``"awq/…"`` a
    :class:`GPTQDTypePolicy` and an :class:`AWQDTypePolicy`, every other name a :class:`DTypePolicy`.
    ``argument`` names the caller's argument in error messages.
    """
    dt.check_name_type(name, argument)
    split = dt.split_quantized_name(name, argument)
    if split is None:
        if name.strip() == dt.INFER:
            return DTypePolicy(name)
        dt.parse_float_name(name, argument)  # errors that name the caller's argument
        return DTypePolicy(name)
    mode, source = split
    try:
        if mode in ("float8", "float8_current"):
            return QuantizedFloat8DTypePolicy(mode, source)
        if mode.startswith("gptq/"):
            return GPTQDTypePolicy(mode, source)
        if mode.startswith("awq/"):
            return AWQDTypePolicy(mode, source)
        if mode.startswith("int4/"):
            return Int4DTypePolicy(mode, source)
        return QuantizedDTypePolicy(mode, source)
    except ValueError as e:  # about the source or the mode: say which name held it
        raise ValueError(f"{e} Received: {argument}={name!r}") from e


def get_policy(name: str) -> DTypePolicy:
    """jmp's spelling: the policy of a name (any form :func:`get` accepts as a string).

    Args:
        name: a Keras name, a jmp string or a quantized name.

    Returns:
        The policy.

    Raises:
        TypeError: ``name`` is not a string.
        ValueError: ``name`` is not an accepted name.

    Examples:
        >>> import jmp_policy as jp
        >>> p = jp.get_policy("p=f32,c=bf16,o=f32")
        >>> p.param_dtype, p.compute_dtype, p.output_dtype
        (dtype('float32'), dtype(bfloat16), dtype('float32'))
        >>> jp.get_policy("c=f16")
        <DTypePolicy "c=f16">
        >>> str(jp.get_policy("half"))
        'p=bf16,c=bf16,o=bf16'
    """
    return policy_from_name(name)
