"""An integer argument checked against its bounds: the one check behind every count, length
and axis number the package takes (``num_grid_points``, ``amax_history_length``,
``block_size``, ``stacked``, ``in_axes``, ``every``...).

It imports nothing of ``jmp_policy``, so any module may use it.
"""

from __future__ import annotations

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
