"""An integer argument checked against its bounds: the one check behind every count, length
and axis number the package takes (``num_grid_points``, ``amax_history_length``,
``block_size``, ``stacked``, ``in_axes``, ``every``...), and the one parser of the numbers a
name writes (``"int4/128"``, ``"gptq/4/128"``).

It imports nothing of ``jmp_policy``, so any module may use it.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np


def accepted_ints(low: int, high: int | None = None) -> str:
    """The words for the integers from ``low`` to ``high`` (no upper bound when ``None``).

    Examples:
        >>> accepted_ints(1), accepted_ints(0), accepted_ints(1, 8)
        ('a positive integer', 'a non-negative integer', 'an integer from 1 to 8')
    """
    if high is not None:
        return f"an integer from {low} to {high}"
    return {1: "a positive integer", 0: "a non-negative integer"}.get(low, f"an integer >= {low}")


def check_int(
    value: Any, argument: str, low: int, high: int | None = None, *, why: str = ""
) -> int:
    """``value`` as a Python int when it is an integer from ``low`` to ``high``.

    A Python int or a NumPy integer is accepted; a bool, a float (even ``2.0``), a string or
    an array is not. The message names ``argument``, says what is accepted (with ``why``, a
    note such as ``" (Keras's default 20)"``, after it) and quotes the value.

    Raises:
        TypeError: ``value`` is no integer (the message also gives its type).
        ValueError: ``value`` is below ``low`` or above ``high``.

    Examples:
        >>> check_int(np.int32(4), "amax_history_length", 1, 8)
        4
        >>> check_int(0, "block_size", 1)
        Traceback (most recent call last):
        ...
        ValueError: `block_size` must be a positive integer. Received: block_size=0
        >>> check_int(2.0, "stacked", 0)
        Traceback (most recent call last):
        ...
        TypeError: `stacked` must be a non-negative integer. Received: stacked=2.0 (of type float)
    """
    message = (
        f"`{argument}` must be {accepted_ints(low, high)}{why}. Received: {argument}={value!r}"
    )
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{message} (of type {type(value).__name__})")
    if value < low or (high is not None and value > high):
        raise ValueError(message)
    return int(value)


# ASCII digits only (int() also reads full-width digits, "12_8", "+8" and " 8 "), no leading 0.
_INT_TEXT = re.compile(r"0|-?[1-9][0-9]*")


def int_from_text(text: str, low: int, high: int) -> int | None:
    """The integer ``text`` writes when it is one from ``low`` to ``high``, else ``None``.

    The one reader of the numbers in names: ASCII digits with an optional ``-``, no ``+``,
    ``_``, spaces, leading zeros or other scripts' digits, and never longer than the bounds
    allow (so a 10,000-digit text is not converted).

    Examples:
        >>> int_from_text("128", -1, 65536), int_from_text("-1", -1, 65536)
        (128, -1)
        >>> int_from_text("\\uff11\\uff12\\uff18", -1, 65536), int_from_text("12_8", -1, 65536)
        (None, None)
        >>> int_from_text("99999999999999999999", -1, 65536), int_from_text("0128", 0, 999)
        (None, None)
    """
    longest = max(len(str(low)), len(str(high)))
    if not isinstance(text, str) or len(text) > longest or not _INT_TEXT.fullmatch(text):
        return None
    value = int(text)
    return value if low <= value <= high else None
