"""The context variables: the process default policy, the ``policy_scope`` stack and the
current submodule call.

It also reads JAX's current trace (``current_trace``), to tell a call made inside a
transform of its own. This module sits under everything and imports nothing of jmp_policy, so any module may read
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


try:
    from jax._src import core as _jax_core
except ImportError:  # pragma: no cover - a JAX without it: current_trace says so when used
    _jax_core = None  # type: ignore[assignment]


def current_trace() -> Any:
    """JAX's current trace, to tell a call made inside a transform of its own (calibration's
    and the search's guard against a foreign trace).

    Read from JAX's internals (``jax._src.core.trace_ctx.trace``, where jax 0.4.36 to 0.12
    keep it; Flax reads the same): on a JAX that moved it this raises a ``RuntimeError``
    naming the JAX version at first use, rather than turning the guard off.
    """
    try:
        return _jax_core.trace_ctx.trace  # type: ignore[union-attr]
    except AttributeError as e:
        import jax

        raise RuntimeError(
            "jmp_policy reads JAX's current trace from `jax._src.core.trace_ctx.trace`, "
            f"which jax {jax.__version__} does not have ({e}): this JAX version is newer "
            "than jmp_policy knows. Install a jax that jmp_policy supports (pyproject.toml "
            "says which), or a jmp_policy release that knows this one."
        ) from e


def global_policy_or_none() -> Any:
    """The innermost scope's policy, else the process default, else ``None`` (float32)."""
    scoped = SCOPE.get()
    return scoped if scoped is not None else DEFAULT.policy
