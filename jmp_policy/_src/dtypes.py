"""Dtype names: every way a dtype may be named (canonical names, jmp's values), read
without handing user text to NumPy's parser, and the dtype helpers every module shares.

Policy names are :mod:`jmp_policy._src.name_grammar`'s.
"""

from __future__ import annotations

import difflib
import reprlib
from typing import Any

import jax.numpy as jnp
import numpy as np

# jmp's value spellings. ``half`` is always bfloat16 here: jmp makes it depend on the
# default device (float16 off TPU), which would make a policy name mean different things
# on different machines.
JMP_VALUES: dict[str, str] = {
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
    if name in JMP_VALUES:
        return DTYPE_NAMES[JMP_VALUES[name]]
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


class TypeAndValueError(TypeError, ValueError):
    """An argument of the wrong type, where Keras raises ``ValueError``: both catch it."""


def as_dtype(dtype: Any, argument: str = "dtype") -> np.dtype:
    """``dtype`` as a numeric dtype; a ``TypeError`` naming ``argument`` when it is none."""
    # `None` would silently become float64 (numpy's default); object/str dtypes are no
    # policy; arrays, NumPy scalars and bytes are values, not dtypes (NumPy reads them as one).
    canonical = dtype_or_none(dtype)
    if canonical is None:
        hint = did_you_mean(dtype, DTYPE_NAMES) if isinstance(dtype, str) else ""
        raise TypeError(
            f"`{argument}` must be a numeric dtype, such as 'bfloat16' or jnp.float16 (a dtype, "
            f"a scalar type or a dtype name; not an array or a value).{hint} Received: "
            f"{argument}={dtype!r} (of type {type(dtype).__name__})"
        )
    return canonical


#: The longest float8 amax history (per tensor, per layer); the largest int4 block (rows).
MAX_AMAX_HISTORY = MAX_INT4_BLOCK = 65536
