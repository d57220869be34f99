"""From a name to a policy: the one place that picks the policy class for any accepted name
(float, quantized, tf.keras's ``"_infer"``), and jmp's ``get_policy``.

The name is parsed once (:func:`jmp_policy._src.name_grammar.parse`) and the class it names
is built from the parsed value (:func:`jmp_policy._src.policy.from_name`), never from the
name again. A quantized name builds the class its format registered
(:func:`jmp_policy._src.schemes.register`)."""

from __future__ import annotations

from typing import Any, cast

from jmp_policy._src.policy import DTypePolicy, from_name


def policy_from_name(name: Any, argument: str = "name") -> DTypePolicy:
    """Any accepted name to the right policy class, as Keras picks it
    (:attr:`ParsedName.policy_class <jmp_policy._src.name_grammar.ParsedName.policy_class>`:
    ``"int4/<block>_from_…"`` gives an :class:`Int4DTypePolicy`, ``"float8_from_…"`` a
    :class:`QuantizedFloat8DTypePolicy`, a float name or ``"_infer"`` a :class:`DTypePolicy`).
    ``argument`` names the caller's argument in error messages.
    """
    return cast(DTypePolicy, from_name(name, argument))


def policy_from_name_or_dtype(identifier: Any, argument: str) -> DTypePolicy | None:
    """:func:`policy_from_name`, or the policy of a dtype (``jnp.bfloat16``:
    ``"bfloat16"``); ``None`` for any other value that is not a string."""
    return from_name(identifier, argument, or_dtype=True)


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
