"""Dtype names: the one parser for every way a dtype or a policy may be named.

Policy names come from three families, all read here:

* Keras: a dtype name (``"float32"``), ``"mixed_float16"``, ``"mixed_bfloat16"``;
* jmp: ``"p=f32,c=bf16,o=f32"`` (keys ``p``/``params``, ``c``/``compute``,
  ``o``/``output``), or one jmp dtype value alone (``"bf16"``);
* quantized: ``"<mode>_from_<source name>"`` (``"int8_from_mixed_bfloat16"``).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax.numpy as jnp
import numpy as np

# jmp's value spellings. ``half`` is always bfloat16 here: jmp makes it depend on the
# default device (float16 off TPU), which would make a policy name mean different things
# on different machines.
_JMP_VALUES: dict[str, str] = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "half": "bfloat16",
    "f16": "float16",
    "float16": "float16",
    "f32": "float32",
    "float32": "float32",
    "full": "float32",
    "f64": "float64",
    "float64": "float64",
}
_SHORT_NAMES: dict[str, str] = {
    "bfloat16": "bf16",
    "float16": "f16",
    "float32": "f32",
    "float64": "f64",
}
_JMP_KEYS: dict[str, str] = {
    "p": "params",
    "params": "params",
    "c": "compute",
    "compute": "compute",
    "o": "output",
    "output": "output",
}
_MIXED: dict[str, str] = {"mixed_float16": "float16", "mixed_bfloat16": "bfloat16"}

# tf.keras's policy whose dtypes follow the inputs (its TF1 leftover).
INFER = "_infer"

INT_QUANTIZATION_MODES = ("int8", "int4")
QUANTIZATION_MODES = ("int8", "int4", "float8")

VALID_FORMS = (
    "a dtype name ('float16', 'bfloat16', 'float32', 'float64'), "
    "'mixed_float16', 'mixed_bfloat16', a jmp string such as 'p=f32,c=bf16,o=f32' "
    "(keys p/params, c/compute, o/output; values bf16, bfloat16, f16, float16, f32, "
    "float32, full, f64, float64, half), or a quantized name such as "
    "'int8_from_mixed_bfloat16', 'int4/128_from_float32' or 'float8_from_mixed_bfloat16' "
    "(and tf.keras's '_infer')"
)


def canonicalize_dtype(dtype: Any) -> np.dtype:
    """Returns ``dtype`` as a ``numpy.dtype`` (bfloat16 and float8 via ml_dtypes)."""
    return np.dtype(jnp.dtype(dtype))


def is_floating(dtype: Any) -> bool:
    """True for every floating dtype, float8 types included; False for ``None``."""
    # `jnp.issubdtype(None, ...)` reads None as float64: "_infer" has no dtype.
    return dtype is not None and bool(jnp.issubdtype(dtype, jnp.floating))


def is_numeric(dtype: Any) -> bool:
    """True for bool and numeric dtypes (the dtypes a policy may name); False for ``None``."""
    return dtype is not None and bool(
        jnp.issubdtype(dtype, jnp.number) or jnp.issubdtype(dtype, jnp.bool_)
    )


def floating_or_none(value: Any) -> np.dtype | None:
    """``value`` as a floating dtype, or None (unset, not a dtype, or not floating).

    Reads a module's own ``dtype=`` attribute for the Flax glue.
    """
    if value is None:
        return None
    try:
        dtype = canonicalize_dtype(value)
    except (TypeError, ValueError):
        return None
    return dtype if is_floating(dtype) else None


def short_name(dtype: np.dtype) -> str:
    """jmp's short spelling of a dtype (``bf16``), or its numpy name."""
    return _SHORT_NAMES.get(dtype.name, dtype.name)


def _dtype_from_value(value: str) -> np.dtype | None:
    """A jmp value or a canonical numpy dtype name, else None."""
    if value in _JMP_VALUES:
        return canonicalize_dtype(_JMP_VALUES[value])
    try:
        dtype = canonicalize_dtype(value)
    except TypeError:
        return None
    # Only canonical names ("int32", "bool", "float8_e4m3fn"); not numpy's codes ("f4").
    return dtype if dtype.name == value and is_numeric(dtype) else None


@dataclasses.dataclass(frozen=True)
class ParsedName:
    """A parsed float policy name: its three dtypes."""

    params: np.dtype
    compute: np.dtype
    output: np.dtype


def _unknown(name: str, detail: str = "") -> ValueError:
    detail = f" {detail}" if detail else ""
    return ValueError(f"Cannot convert {name!r} to a dtype policy.{detail} Expected {VALID_FORMS}.")


class TypeAndValueError(TypeError, ValueError):
    """An argument of the wrong type, where Keras raises ``ValueError``: both catch it."""


def check_name_type(name: Any, argument: str = "name") -> str:
    if not isinstance(name, str):
        # Keras's phrase ("'name' must be a string"), with our argument named.
        raise TypeError(
            f"`{argument}`: 'name' must be a string, such as 'mixed_float16' or "
            f"'p=f32,c=bf16,o=f32'. Received: {argument}={name!r} (of type {type(name).__name__})"
        )
    return name


def parse_float_name(name: str) -> ParsedName:
    """Parses a Keras name, a jmp string or a dtype name into three dtypes.

    Raises:
        TypeError: ``name`` is not a string.
        ValueError: ``name`` is not a float policy name (quantized names included).
    """
    check_name_type(name)
    text = name.strip()
    if text in _MIXED:
        compute = canonicalize_dtype(_MIXED[text])
        return ParsedName(canonicalize_dtype("float32"), compute, compute)
    if "=" not in text:
        dtype = _dtype_from_value(text)
        if dtype is None:
            if "_from_" in text:
                raise _unknown(name, "A quantized name is not a float policy name.")
            # jmp's users expect jmp's phrase ("Unknown dtype") for a bad single value.
            raise _unknown(name, f"Unknown dtype or policy name {text!r}.")
        return ParsedName(dtype, dtype, dtype)
    values: dict[str, np.dtype] = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or key not in _JMP_KEYS:
            raise _unknown(name, f"Unknown key {key!r}; expected p/params, c/compute, o/output.")
        canonical_key = _JMP_KEYS[key]
        if canonical_key in values:
            raise _unknown(name, f"Key {canonical_key!r} is given twice.")
        dtype = _dtype_from_value(value)
        if dtype is None:
            raise _unknown(
                name,
                f"Unknown dtype {value!r}; expected one of {', '.join(_JMP_VALUES)} "
                "or a numpy dtype name.",
            )
        values[canonical_key] = dtype
    params = values.get("params", canonicalize_dtype("float32"))
    compute = values.get("compute", params)
    output = values.get("output", compute)
    return ParsedName(params, compute, output)


def float_policy_name(params: np.dtype, compute: np.dtype, output: np.dtype) -> str:
    """The canonical name of three dtypes: a Keras name where one fits, else jmp's."""
    if params == compute == output:
        return params.name
    if params == np.float32 and compute == output and compute.name in _MIXED.values():
        return f"mixed_{compute.name}"
    return f"p={short_name(params)},c={short_name(compute)},o={short_name(output)}"


def split_quantized_name(name: str) -> tuple[str, str] | None:
    """``"int8_from_mixed_bfloat16"`` -> ``("int8", "mixed_bfloat16")``; None if not quantized.

    Raises:
        ValueError: a name that starts like a quantized one (``"int8_abc"``) without
            ``_from_``.
    """
    mode, sep, source = name.strip().partition("_from_")
    if not sep:
        if re.match(r"(int8|int4|float8)(/-?\d+)?_", mode) and mode != "float8_current":
            raise ValueError(
                "Cannot convert `policy` into a valid pair (`mode`, `source_name`): a quantized "
                "policy name is '<mode>_from_<source name>', such as "
                f"'int8_from_mixed_bfloat16'. Received: policy={name!r}"
            )
        return None
    if mode.split("/")[0] not in (*QUANTIZATION_MODES, "float8_current"):
        return None
    return mode, source


def parse_int_mode(mode: Any) -> tuple[str, int | None]:
    """Validates an integer quantization mode.

    Returns ``("int8", None)`` or ``("int4", block)`` where ``block`` is -1 for per channel
    (``"int4"``, ``"int4/-1"`` and Keras's legacy ``"int4/None"``).
    """
    if not isinstance(mode, str):
        raise TypeError(
            f"`mode` must be a string such as 'int8', 'int4' or 'int4/128'. "
            f"Received: mode={mode!r} (of type {type(mode).__name__})"
        )
    base, sep, block_text = mode.partition("/")
    if base == "int8" and not sep:
        return "int8", None
    if base == "int4":
        if not sep or block_text == "None":
            return "int4", -1
        try:
            block = int(block_text)
        except ValueError:
            block = 0
        if block == 0 or block < -1 or str(block) != block_text:
            raise ValueError(
                f"Invalid quantization mode. The block size of `mode` must be -1 "
                f"(per channel) or a positive integer, as in 'int4/128'. Received: mode={mode!r}"
            )
        return "int4", block
    raise ValueError(
        "Invalid quantization mode. Expected one of 'int8', 'int4', 'int4/<block>' "
        f"(use QuantizedFloat8DTypePolicy for 'float8'). Received: mode={mode!r}"
    )
