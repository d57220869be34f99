"""Policy names: the grammar of every accepted name, parsed once into a :class:`ParsedName`.

Policy names come from three families, all read here and nowhere else:

* Keras: a dtype name (``"float32"``), ``"mixed_float16"``, ``"mixed_bfloat16"``;
* jmp: ``"p=f32,c=bf16,o=f32"`` (keys ``p``/``params``, ``c``/``compute``,
  ``o``/``output``), or one jmp dtype value alone (``"bf16"``);
* quantized: ``"<mode>_from_<source name>"`` (``"int8_from_mixed_bfloat16"``), the mode
  read by its registered format (:mod:`jmp_policy._src.schemes`);

and tf.keras's ``"_infer"``. A policy class is built from the parsed value (its
constructors call :func:`parse_float`, :func:`parse_source` or :func:`from_dtypes`; ``get``
calls :func:`parse` and builds the class the value names), so a name is parsed once.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any

import numpy as np

from jmp_policy._src import dtypes as dt
from jmp_policy._src import schemes

_MIXED: dict[str, str] = {"mixed_float16": "float16", "mixed_bfloat16": "bfloat16"}
_JMP_KEYS: dict[str, str] = {
    "p": "params",
    "params": "params",
    "c": "compute",
    "compute": "compute",
    "o": "output",
    "output": "output",
}

# tf.keras's policy whose dtypes follow the inputs (its TF1 leftover).
INFER = "_infer"

VALID_FORMS = (
    "a dtype name ('float16', 'bfloat16', 'float32', 'float64'), "
    "'mixed_float16', 'mixed_bfloat16', a jmp string such as 'p=f32,c=bf16,o=f32' "
    "(keys p/params, c/compute, o/output; values bf16, bfloat16, f16, float16, f32, "
    "float32, full, f64, float64, half), or a quantized name such as "
    "'int8_from_mixed_bfloat16', 'int4/128_from_float32' or 'float8_from_mixed_bfloat16' "
    "(and tf.keras's '_infer')"
)


@dataclasses.dataclass(frozen=True)
class ParsedName:
    """A policy name, parsed: everything a policy is built from (frozen).

    Attributes:
        name: the policy's name (stripped; ``"<mode>_from_<source>"`` for a quantized one).
        params: the variable dtype (``None`` for ``"_infer"``).
        compute: the compute dtype (``None`` for ``"_infer"``).
        output: the output dtype (``None`` for ``"_infer"``).
        scheme: the quantization format, or ``None`` for a float policy.
        mode: the mode as the name writes it (``"int4/128"``), or ``None``.
        source: the float source name of a quantized policy, or ``None``.

    Examples:
        >>> from jmp_policy._src.name_grammar import parse
        >>> parsed = parse("int4/64_from_mixed_bfloat16")
        >>> parsed.compute, parsed.mode, parsed.source, parsed.policy_class
        (dtype(bfloat16), 'int4/64', 'mixed_bfloat16', 'Int4DTypePolicy')
        >>> parse("p=f32,c=bf16").output
        dtype(bfloat16)
    """

    name: str
    params: np.dtype | None
    compute: np.dtype | None
    output: np.dtype | None
    scheme: schemes.Scheme | None = None
    mode: str | None = None
    source: str | None = None

    @property
    def policy_class(self) -> str:
        """The class (this library's and Keras's) that a name of this form builds."""
        if self.scheme is None or self.mode is None:
            return "DTypePolicy"
        return schemes.class_for(self.scheme, self.mode).__name__


def _policy_names() -> list[str]:
    """The single-word names a policy may have (for "did you mean")."""
    return [*_MIXED, *dt.DTYPE_NAMES, *dt.JMP_VALUES, INFER]


def _unknown(name: str, detail: str = "", argument: str = "name") -> ValueError:
    detail = f" {detail}" if detail else ""
    if name.strip().endswith("_float32_vars"):  # tf.keras's removed names, its phrase
        detail += (
            " Policies ending in '_float32_vars' have been removed from TensorFlow: use "
            "'mixed_float16' or 'mixed_bfloat16', which keep float32 variables."
        )
    # tf.keras's phrase (its users' tests match it); Keras 3's begins the same way.
    plain = name.isprintable() and 0 < len(name) <= 80 and name == name.strip()
    shown = name if plain else dt.bounded_repr(name)
    return ValueError(
        f"Cannot convert value {shown} to a mixed precision Policy.{detail}"
        f" Expected {VALID_FORMS}. Received: {argument}={name!r}"
    )


def check_name_type(name: Any, argument: str = "name") -> str:
    """``name`` itself; a ``TypeError`` in Keras's words when it is not a string."""
    if not isinstance(name, str):
        # Keras's phrase ("'name' must be a string"), with our argument named.
        raise TypeError(
            f"`{argument}`: 'name' must be a string, such as 'mixed_float16' or "
            f"'p=f32,c=bf16,o=f32'. Received: {argument}={name!r} (of type {type(name).__name__})"
        )
    return name


def _float_dtypes(name: str, argument: str) -> tuple[np.dtype, np.dtype, np.dtype]:
    """The three dtypes of a Keras name, a jmp string or a dtype name (a string)."""
    text = name.strip()
    if text in _MIXED:
        compute = dt.DTYPE_NAMES[_MIXED[text]]
        return dt.DTYPE_NAMES["float32"], compute, compute
    if "=" not in text:
        dtype = dt.dtype_from_name(text)
        if dtype is None:
            if "_from_" in text:
                mode = text.partition("_from_")[0]
                hint = dt.did_you_mean(mode, [scheme.mode for scheme in schemes.registered()])
                detail = "A quantized name is not a float policy name."
                if schemes.lookup(mode) is None:  # no registered token (Keras's "ternary")
                    forms = ", ".join(
                        g
                        for scheme in schemes.registered()
                        for g in scheme.grammar or (repr(scheme.mode),)
                    )
                    detail = (
                        f"Unknown quantization mode {dt.bounded_repr(mode)} in a quantized "
                        f"name: the modes are {forms}."
                    )
                raise _unknown(name, detail + hint, argument)
            # jmp's users expect jmp's phrase ("Unknown dtype") for a bad single value.
            hint = dt.did_you_mean(text, _policy_names())
            raise _unknown(
                name, f"Unknown dtype or policy name {dt.bounded_repr(text)}.{hint}", argument
            )
        return dtype, dtype, dtype
    values: dict[str, np.dtype] = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or key not in _JMP_KEYS:
            hint = dt.did_you_mean(key, _JMP_KEYS)
            raise _unknown(
                name,
                f"Unknown key {key!r}; expected p/params, c/compute, o/output.{hint}",
                argument,
            )
        canonical_key = _JMP_KEYS[key]
        if canonical_key in values:
            raise _unknown(name, f"Key {canonical_key!r} is given twice.", argument)
        dtype = dt.dtype_from_name(value)
        if dtype is None:
            hint = dt.did_you_mean(value, [*dt.JMP_VALUES, *dt.DTYPE_NAMES])
            raise _unknown(
                name,
                f"Unknown dtype {value!r}; expected one of {', '.join(dt.JMP_VALUES)} "
                f"or a numpy dtype name.{hint}",
                argument,
            )
        values[canonical_key] = dtype
    params = values.get("params", dt.DTYPE_NAMES["float32"])
    compute = values.get("compute", params)
    output = values.get("output", compute)
    return params, compute, output


def parse_float(name: Any, argument: str = "name") -> ParsedName:
    """A float policy name (or ``"_infer"``) parsed; ``argument`` names the caller's
    argument in the errors.

    Raises:
        TypeError: ``name`` is not a string.
        ValueError: ``name`` is not a float policy name (quantized names included).
    """
    check_name_type(name, argument)
    text = name.strip()
    if text == INFER:
        return ParsedName(INFER, None, None, None)
    return ParsedName(text, *_float_dtypes(name, argument))


def parse_arguments(
    first: Any, compute: Any = None, output: Any = None, param: Any = None, variable: Any = None
) -> ParsedName:
    """``DTypePolicy``'s arguments parsed: a name (``first`` alone), or jmp's constructor
    ``Policy(param_dtype, compute_dtype, output_dtype)`` (``param_dtype=`` or
    ``variable_dtype=`` in place of the first), with jmp's defaults for what is left out:
    params float32, compute follows params, output follows compute.

    Raises:
        TypeError: a name that is not a string, a dtype that is not a numeric dtype, or
            the variable dtype given twice.
        ValueError: a name that is not a float policy name.
    """
    if (compute, output, param, variable) == (None,) * 4:
        return parse_float(first, "name")
    given = [
        (n, v)
        for n, v in (("name", first), ("param_dtype", param), ("variable_dtype", variable))
        if v is not None
    ]
    if len(given) > 1:
        raise TypeError(
            f"Give the variable dtype once: as the first argument (jmp's "
            f"`Policy(param_dtype, compute_dtype, output_dtype)`), `param_dtype=` or "
            f"`variable_dtype=`. Received: {', '.join(f'{n}={v!r}' for n, v in given)}"
        )
    params = dt.as_dtype(given[0][1], given[0][0]) if given else dt.DTYPE_NAMES["float32"]
    compute_ = params if compute is None else dt.as_dtype(compute, "compute_dtype")
    output_ = compute_ if output is None else dt.as_dtype(output, "output_dtype")
    return from_dtypes(params, compute_, output_)


def float_policy_name(params: np.dtype, compute: np.dtype, output: np.dtype) -> str:
    """The canonical name of three dtypes: a Keras name where one fits, else jmp's."""
    if params == compute == output:
        return str(params.name)
    if params == np.float32 and compute == output and compute.name in _MIXED.values():
        return f"mixed_{compute.name}"
    return f"p={dt.short_name(params)},c={dt.short_name(compute)},o={dt.short_name(output)}"


def from_dtypes(params: np.dtype, compute: np.dtype, output: np.dtype) -> ParsedName:
    """Three dtypes under their canonical name (:func:`float_policy_name`)."""
    return ParsedName(float_policy_name(params, compute, output), params, compute, output)


def _split_quantized(name: str, argument: str) -> tuple[str, str] | None:
    """``"int8_from_mixed_bfloat16"`` -> ``("int8", "mixed_bfloat16")``; None if not quantized
    (no registered format's token starts its mode).

    Raises:
        ValueError: a name that starts like a quantized one (``"int8_abc"``) without
            ``_from_``.
    """
    mode, sep, source = name.strip().partition("_from_")
    if not sep:
        # "float8_e4m3fn" is a dtype name, not a quantized name without its "_from_".
        tokens = schemes.tokens()
        if mode not in (*dt.DTYPE_NAMES, *tokens) and re.match(
            rf"({'|'.join(map(re.escape, tokens))})(/-?[0-9]+)*_", mode
        ):
            raise ValueError(
                "Cannot convert `policy` into a valid pair (`mode`, `source_name`): a quantized "
                "policy name is '<mode>_from_<source name>', such as "
                f"'int8_from_mixed_bfloat16'. Received: {argument}={name!r}"
            )
        return None
    if schemes.lookup(mode) is None:
        return None
    return mode, source


def parse_source(mode: str, scheme: schemes.Scheme, source_name: Any) -> ParsedName:
    """A quantized policy's name parsed from its mode (as names write it), its scheme and
    its source name, which must name a float policy with a floating compute dtype."""
    check_name_type(source_name, "source_name")
    if _split_quantized(source_name, "source_name") is not None:
        raise ValueError(
            f"Cannot convert {source_name!r} to a float source policy: `source_name` "
            f"must be a float policy name, not a quantized one. "
            f"Received: source_name={source_name!r}"
        )
    if source_name.strip() == INFER:
        raise ValueError(
            "A quantized policy needs a floating compute dtype; tf.keras's '_infer' has "
            f"none. Received: source_name={source_name!r}"
        )
    params, compute, output = _float_dtypes(source_name, "source_name")
    scheme.check_source(compute, mode, source_name)
    if not dt.is_floating(compute):
        raise ValueError(
            f"A quantized policy needs a floating compute dtype. "
            f"Received: source_name={source_name!r}"
        )
    source = source_name.strip()
    return ParsedName(f"{mode}_from_{source}", params, compute, output, scheme, mode, source)


def parse(name: Any, argument: str = "name") -> ParsedName:
    """Any accepted name parsed (cached: policies are values, and a large map names a few
    policies many times); ``argument`` names the caller's argument in the errors.

    A quantized name's format (:mod:`jmp_policy._src.schemes`) reads its mode:
    ``"int4/<block>_from_…"`` names an ``Int4DTypePolicy``, ``"int4_from_…"`` and
    ``"int8_from_…"`` a ``QuantizedDTypePolicy``, ``"float8_from_…"`` (delayed scaling) and
    ``"float8_current_from_…"`` (current scaling) a ``QuantizedFloat8DTypePolicy``,
    ``"gptq/…"`` and ``"awq/…"`` a ``GPTQDTypePolicy`` and an ``AWQDTypePolicy``
    (:attr:`ParsedName.policy_class`).

    Raises:
        TypeError: ``name`` is not a string.
        ValueError: ``name`` is not an accepted name (the message lists the forms).
    """
    check_name_type(name, argument)
    return _parse(name, argument)


@functools.lru_cache(maxsize=1024)
def _parse(name: str, argument: str) -> ParsedName:
    split = _split_quantized(name, argument)
    if split is None:
        return parse_float(name, argument)
    mode, source = split
    try:
        scheme_cls = schemes.lookup(mode)
        scheme = None if scheme_cls is None else scheme_cls.parse(mode)
        if scheme is None:  # a token's mode with a bad setting ("int8/128"): say why
            scheme = schemes.parse_mode(mode)
        return parse_source(scheme.mode_text(mode), scheme, source)
    except ValueError as e:  # about the source or the mode: say which name held it
        message, received, detail = str(e).partition(" Received: ")
        where = f", where {detail}" if received else ""
        raise ValueError(f"{message} Received: {argument}={name!r}{where}") from e


def forget_parsed() -> None:
    """Empties :func:`parse`'s cache (after a format is registered or removed)."""
    _parse.cache_clear()


schemes.on_change(forget_parsed)
