"""The context variables: the process default policy, the ``policy_scope`` stack and the
current submodule call.

This module sits under everything and imports nothing of jmp_policy, so any module may read
it without an import cycle (as Flax's ``configurations.py`` does). It only holds values;
the rules (what may be global, what ``current_policy`` returns) live in ``global_state``.
"""

from __future__ import annotations

import contextvars
from typing import Any, NamedTuple


class RunningCall(NamedTuple):
    """The submodule call running now: its policy and its module path (``None``: unknown)."""

    policy: Any
    path: str | None


class _DefaultHolder:
    """The process default policy (``None``: unset, which means ``"float32"``)."""

    __slots__ = ("policy",)

    def __init__(self) -> None:
        self.policy: Any = None


DEFAULT = _DefaultHolder()

# The innermost `policy_scope` (thread- and asyncio-task-local); None outside any scope.
SCOPE: contextvars.ContextVar[Any] = contextvars.ContextVar("jmp_policy_scope", default=None)

# The submodule call that apply wrappers run now; None outside any call.
CALL: contextvars.ContextVar[RunningCall | None] = contextvars.ContextVar(
    "jmp_policy_call", default=None
)


def global_policy_or_none() -> Any:
    """The innermost scope's policy, else the process default, else ``None`` (float32)."""
    scoped = SCOPE.get()
    return scoped if scoped is not None else DEFAULT.policy
