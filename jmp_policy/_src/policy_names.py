"""From a name to a policy: the one place that picks the policy class for any accepted name
(float, quantized, tf.keras's ``"_infer"``), and jmp's ``get_policy``."""

from __future__ import annotations

import functools

from jmp_policy._src import (
    calibrated_policy,  # noqa: F401  (GPTQ/AWQ classes and formats)
    schemes,
)
from jmp_policy._src import dtypes as dt
from jmp_policy._src.policy import DTypePolicy
from jmp_policy._src.quantized_policy import CLASSES, QuantizedDTypePolicy


def policy_from_name(name: str, argument: str = "name") -> DTypePolicy:
    """Any accepted name to the right policy class (see :func:`_policy_from_name`)."""
    dt.check_name_type(name, argument)
    # Policies are immutable values: a large map names a few policies many times.
    return _policy_from_name(name, argument)


@functools.lru_cache(maxsize=1024)
def _policy_from_name(name: str, argument: str) -> DTypePolicy:
    """Any accepted name to the right policy class, as Keras picks it.

    A quantized name's format (:mod:`jmp_policy._src.schemes`) picks the class:
    ``"int4/<block>_from_…"`` gives an :class:`Int4DTypePolicy`, ``"int4_from_…"`` and
    ``"int8_from_…"`` a :class:`QuantizedDTypePolicy`, ``"float8_from_…"`` (delayed
    scaling) and ``"float8_current_from_…"`` (current scaling) a
    :class:`QuantizedFloat8DTypePolicy`, ``"gptq/…"`` and ``"awq/…"`` a
    :class:`GPTQDTypePolicy` and an :class:`AWQDTypePolicy`; every other name gives a
    :class:`DTypePolicy`.
    ``argument`` names the caller's argument in error messages.
    """
    split = dt.split_quantized_name(name, argument)
    if split is None:
        if name.strip() == dt.INFER:
            return DTypePolicy(name)
        parsed = dt.parse_float_name(name, argument)  # errors name the caller's argument
        # Built from the parsed value: the name is not parsed a second time.
        policy = object.__new__(DTypePolicy)
        policy._init(name.strip(), parsed.params, parsed.compute, parsed.output)
        return policy
    mode, source = split
    try:
        scheme_cls = schemes.lookup(mode)
        scheme = None if scheme_cls is None else scheme_cls.parse(mode)
        if scheme is None:  # a token's mode with a bad setting ("int8/128"): the class says why
            return QuantizedDTypePolicy(mode, source)
        quantized = object.__new__(CLASSES[scheme.policy_class_for(mode)])
        quantized._init_quantized(scheme.mode_text(mode), scheme, source)
        return quantized
    except ValueError as e:  # about the source or the mode: say which name held it
        message, received, detail = str(e).partition(" Received: ")
        where = f", where {detail}" if received else ""
        raise ValueError(f"{message} Received: {argument}={name!r}{where}") from e


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
