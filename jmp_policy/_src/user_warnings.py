"""Warnings attributed to the user's line, not to the library frames in between.

A bottom module (it imports nothing of jmp_policy), so that any module may warn without
climbing above the code that calls it.
"""

from __future__ import annotations

import os
import sys
import warnings
from types import FrameType

import jax
import optax

# The packages whose frames stand between the user's line and a model run's warning: it is
# attributed to the first frame outside them (the user's `init(...)` or `step(...)` line,
# not `jax/_src/pjit.py`).
_LIBRARIES = ("jmp_policy", "jax", "jaxlib", "flax")


def _library_prefixes() -> tuple[str, ...]:
    prefixes = []
    for name in _LIBRARIES:
        file = getattr(sys.modules.get(name), "__file__", None)
        if file:  # only imported packages can have frames on the stack
            prefixes.append(os.path.dirname(file) + os.sep)
    return tuple(prefixes)


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` attributed to the user's line: the first frame outside jmp_policy,
    JAX and Flax (``skip_file_prefixes`` on Python 3.12+, the same walk by hand before)."""
    prefixes = _library_prefixes()
    if sys.version_info >= (3, 12):
        warnings.warn(message, category, stacklevel=2, skip_file_prefixes=prefixes)
        return
    frame: FrameType | None = sys._getframe(1)
    level = 2  # the caller of `warn`
    while frame is not None and frame.f_code.co_filename.startswith(prefixes):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level if frame is not None else 2)


# jax's, optax's and jmp_policy's `_src` (this file's) directories.
_LIBRARY_DIRS = tuple(
    os.path.dirname(path) + os.sep for path in (jax.__file__, optax.__file__, __file__) if path
)


def user_stacklevel() -> int:
    """The ``stacklevel`` of the first frame outside jax, optax and jmp_policy's ``_src``
    (the user's call, however deep in ``jit`` tracing the warning is raised), for the
    caller's ``warnings.warn``."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_LIBRARY_DIRS):
        frame, level = frame.f_back, level + 1  # type: ignore[assignment]
    return level
