"""Dtype names: the one parser for every way a dtype or a policy may be named.

Policy names come from three families, all read here:

* Keras: a dtype name (``"float32"``), ``"mixed_float16"``, ``"mixed_bfloat16"``;
* jmp: ``"p=f32,c=bf16,o=f32"`` (keys ``p``/``params``, ``c``/``compute``,
  ``o``/``output``), or one jmp dtype value alone (``"bf16"``);
* quantized: ``"<mode>_from_<source name>"`` (``"int8_from_mixed_bfloat16"``).
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import reprlib
from typing import Any

import jax.numpy as jnp
import numpy as np

from jmp_policy._src import schemes

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

VALID_FORMS = (
    "a dtype name ('float16', 'bfloat16', 'float32', 'float64'), "
    "'mixed_float16', 'mixed_bfloat16', a jmp string such as 'p=f32,c=bf16,o=f32' "
    "(keys p/params, c/compute, o/output; values bf16, bfloat16, f16, float16, f32, "
    "float32, full, f64, float64, half), or a quantized name such as "
    "'int8_from_mixed_bfloat16', 'int4/128_from_float32' or 'float8_from_mixed_bfloat16' "
    "(and tf.keras's '_infer')"
)


# Every dtype a policy may be named by, under its canonical name: the names are looked up
# here, so that no text a user wrote ever reaches NumPy's dtype parser (which reads "f4",
# "(2,)f4," or "," as dtypes, or fails with a SyntaxError).
_DTYPE_CANDIDATES = (
    "bool",
    *(f"{k}{b}" for k in ("int", "uint") for b in (2, 4, 8, 16, 32, 64)),
    *("float16", "bfloat16", "float32", "float64", "complex64", "complex128"),
    *("float8_e3m4", "float8_e4m3", "float8_e4m3b11fnuz", "float8_e4m3fn", "float8_e4m3fnuz"),
    *("float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn"),
    *("float6_e2m3fn", "float6_e3m2fn"),
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


def _known_dtypes() -> dict[str, np.dtype]:
    known = {}
    for name in _DTYPE_CANDIDATES:
        try:
            dtype = canonicalize_dtype(name)
        except TypeError:  # not in this version of ml_dtypes
            continue
        if dtype.name == name and is_numeric(dtype):
            known[name] = dtype
    return known


#: The dtype names a policy name may use, to their dtypes (canonical names only: not
#: NumPy's codes such as ``"f4"``).
DTYPE_NAMES: dict[str, np.dtype] = _known_dtypes()


def dtype_from_name(name: str) -> np.dtype | None:
    """A canonical dtype name or a jmp value (``"bf16"``) to its dtype, else None.

    Never hands ``name`` to NumPy's parser.
    """
    if name in _JMP_VALUES:
        return DTYPE_NAMES[_JMP_VALUES[name]]
    return DTYPE_NAMES.get(name)


def did_you_mean(value: str, candidates: Any) -> str:
    """`` Did you mean 'x'?`` for a near miss among ``candidates`` (argparse's and Keras's
    hint), else ``""``."""
    if len(value) > 100:  # nothing to suggest for a long text (and keep errors cheap)
        return ""
    matches = difflib.get_close_matches(value, list(candidates), n=1, cutoff=0.75)
    return f" Did you mean {matches[0]!r}?" if matches else ""


_BOUNDED = reprlib.Repr()  # (keyword arguments only from Python 3.12)
_BOUNDED.maxlevel, _BOUNDED.maxdict, _BOUNDED.maxlist, _BOUNDED.maxstring = 12, 20, 20, 200


def bounded_repr(value: Any) -> str:
    """``repr(value)`` bounded in depth and length (a deep config is no RecursionError)."""
    return _BOUNDED.repr(value)


def dtype_or_none(value: Any) -> np.dtype | None:
    """``value`` as a numeric dtype when it *is* a dtype, else None.

    A dtype is a ``numpy.dtype``, a scalar type (``jnp.bfloat16``, ``np.float32``,
    ``float``) or a canonical dtype name (``"bfloat16"``, jmp's ``"bf16"``). Values are not
    dtypes, even where NumPy reads them as one: arrays, NumPy scalars (``np.True_``), bytes
    (``b"h"`` is int16 to NumPy) and numbers.
    """
    if isinstance(value, str):
        return dtype_from_name(value)
    if isinstance(value, np.dtype) or (
        isinstance(value, type) and not issubclass(value, (str, bytes))
    ):
        try:
            dtype = canonicalize_dtype(value)
        except (TypeError, ValueError):
            return None
        return dtype if is_numeric(dtype) else None
    return None


def short_name(dtype: np.dtype) -> str:
    """jmp's short spelling of a dtype (``bf16``), or its numpy name."""
    return _SHORT_NAMES.get(dtype.name, dtype.name)


def _dtype_from_value(value: str) -> np.dtype | None:
    """A jmp value or a canonical numpy dtype name, else None."""
    return dtype_from_name(value)


def _policy_names() -> list[str]:
    """The single-word names a policy may have (for "did you mean")."""
    return [*_MIXED, *DTYPE_NAMES, *_JMP_VALUES, INFER]


@dataclasses.dataclass(frozen=True)
class ParsedName:
    """A parsed float policy name: its three dtypes."""

    params: np.dtype
    compute: np.dtype
    output: np.dtype


def _unknown(name: str, detail: str = "", argument: str = "name") -> ValueError:
    detail = f" {detail}" if detail else ""
    return ValueError(
        f"Cannot convert {name!r} to a dtype policy.{detail} Expected {VALID_FORMS}. "
        f"Received: {argument}={name!r}"
    )


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


def parse_float_name(name: str, argument: str = "name") -> ParsedName:
    """Parses a Keras name, a jmp string or a dtype name into three dtypes.

    ``argument`` is the name of the caller's argument, for the error messages.

    Raises:
        TypeError: ``name`` is not a string.
        ValueError: ``name`` is not a float policy name (quantized names included).
    """
    check_name_type(name, argument)
    text = name.strip()
    if text in _MIXED:
        compute = DTYPE_NAMES[_MIXED[text]]
        return ParsedName(DTYPE_NAMES["float32"], compute, compute)
    if "=" not in text:
        dtype = _dtype_from_value(text)
        if dtype is None:
            if "_from_" in text:
                modes = [scheme.mode for scheme in schemes.registered()]
                hint = did_you_mean(text.partition("_from_")[0], modes)
                raise _unknown(
                    name, f"A quantized name is not a float policy name.{hint}", argument
                )
            # jmp's users expect jmp's phrase ("Unknown dtype") for a bad single value.
            hint = did_you_mean(text, _policy_names())
            raise _unknown(name, f"Unknown dtype or policy name {text!r}.{hint}", argument)
        return ParsedName(dtype, dtype, dtype)
    values: dict[str, np.dtype] = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or key not in _JMP_KEYS:
            hint = did_you_mean(key, _JMP_KEYS)
            raise _unknown(
                name,
                f"Unknown key {key!r}; expected p/params, c/compute, o/output.{hint}",
                argument,
            )
        canonical_key = _JMP_KEYS[key]
        if canonical_key in values:
            raise _unknown(name, f"Key {canonical_key!r} is given twice.", argument)
        dtype = _dtype_from_value(value)
        if dtype is None:
            hint = did_you_mean(value, [*_JMP_VALUES, *DTYPE_NAMES])
            raise _unknown(
                name,
                f"Unknown dtype {value!r}; expected one of {', '.join(_JMP_VALUES)} "
                f"or a numpy dtype name.{hint}",
                argument,
            )
        values[canonical_key] = dtype
    params = values.get("params", DTYPE_NAMES["float32"])
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


def split_quantized_name(name: str, argument: str = "policy") -> tuple[str, str] | None:
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
        if mode not in (*DTYPE_NAMES, *tokens) and re.match(
            rf"({'|'.join(map(re.escape, tokens))})(/-?\d+)*_", mode
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


#: The longest float8 amax history (per tensor, per layer); the largest int4 block (rows).
MAX_AMAX_HISTORY = MAX_INT4_BLOCK = 65536
