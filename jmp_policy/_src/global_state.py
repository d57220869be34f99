"""The global dtype policy: a process default plus a context-local scope, and the policy
and path of the submodule call running now.

The values live in :mod:`jmp_policy._src.context`; this module holds the rules.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from jmp_policy._src import context
from jmp_policy._src import dtypes as dt
from jmp_policy._src.policy import DTypePolicy
from jmp_policy._src.policy_names import policy_from_name

_FLOAT32 = DTypePolicy("float32")


def _as_global(policy: Any, argument: str = "policy", none_hint: bool = False) -> DTypePolicy:
    if isinstance(policy, str):
        policy = policy_from_name(policy, argument)
    elif not isinstance(policy, DTypePolicy):
        raise dt.TypeAndValueError(
            f"Invalid `{argument}` argument. Expected the string name of a policy (such as "
            f"'mixed_float16') or a `DTypePolicy` instance. Received: {argument}={policy!r} "
            f"(of type {type(policy).__name__})"
            + (
                ". To restore the default, pass 'float32' (or call set_global_policy(None), "
                "tf.keras's reset)"
                if policy is None and none_hint
                else ""
            )
        )
    if not dt.is_floating(policy.compute_dtype):
        raise ValueError(
            f"Only policies with a floating compute dtype, such as 'float32' or "
            f"'mixed_bfloat16', can be the global policy. Received: {argument}={policy!r}"
        )
    return policy


def set_dtype_policy(policy: DTypePolicy | str) -> None:
    """Sets the process-wide default policy (Keras 3's ``set_dtype_policy``).

    A :func:`policy_scope` that is active still wins inside its context. As in Keras 3,
    ``None`` is not a policy: restore the default with ``"float32"`` (or with
    :func:`set_global_policy`, tf.keras's name, which takes ``None`` as tf.keras does).

    Args:
        policy: a policy or any accepted name.

    Raises:
        TypeError: ``policy`` is neither a policy nor a string (``None`` too); the error
            is also a ``ValueError``, the type Keras 3 raises.
        ValueError: the policy's compute dtype is not floating (``"int32"``).

    Examples:
        >>> import jmp_policy as jp
        >>> jp.set_dtype_policy("mixed_bfloat16")
        >>> jp.dtype_policy()
        <DTypePolicy "mixed_bfloat16">
        >>> jp.set_dtype_policy("float32")
        >>> jp.dtype_policy()
        <DTypePolicy "float32">
    """
    context.DEFAULT.policy = _as_global(policy, none_hint=True)


def set_global_policy(policy: DTypePolicy | str | None) -> None:
    """Sets the process-wide default policy (tf.keras's ``set_global_policy``).

    :func:`set_dtype_policy`, except that ``None`` restores the default (``"float32"``),
    as in tf.keras.

    Args:
        policy: a policy, any accepted name, or ``None``.

    Raises:
        TypeError: ``policy`` is neither a policy, a string nor ``None``.
        ValueError: the policy's compute dtype is not floating (``"int32"``).

    Examples:
        >>> import jmp_policy as jp
        >>> jp.set_global_policy("mixed_float16")
        >>> jp.global_policy()
        <DTypePolicy "mixed_float16">
        >>> jp.set_global_policy(None)
        >>> jp.global_policy()
        <DTypePolicy "float32">
    """
    if policy is None:
        context.DEFAULT.policy = None
    else:
        set_dtype_policy(policy)


def dtype_policy() -> DTypePolicy:
    """The current global policy: the innermost :func:`policy_scope`, else the default.

    Examples:
        >>> import jmp_policy as jp
        >>> jp.dtype_policy()
        <DTypePolicy "float32">
    """
    policy = context.global_policy_or_none()
    return _FLOAT32 if policy is None else policy


global_policy = dtype_policy


@contextlib.contextmanager
def policy_scope(policy: DTypePolicy | str) -> Iterator[DTypePolicy]:
    """Makes ``policy`` the global policy inside a ``with`` block; nests and restores.

    The scope is local to its thread and asyncio task (a ``contextvars.ContextVar``) and
    is restored when the block exits, by an exception too.

    Args:
        policy: a policy or any accepted name with a floating compute dtype.

    Yields:
        The policy in force inside the block.

    Examples:
        >>> import jmp_policy as jp
        >>> with jp.policy_scope("mixed_float16") as p:
        ...     print(jp.dtype_policy().compute_dtype)
        float16
        >>> jp.dtype_policy().name
        'float32'
    """
    resolved = _as_global(policy)
    token = context.SCOPE.set(resolved)
    try:
        yield resolved
    finally:
        context.SCOPE.reset(token)


def current_policy() -> DTypePolicy:
    """The policy of the submodule running now (Haiku's ``current_policy``).

    Inside a submodule run by ``jmp_policy.linen.apply``, ``jmp_policy.nnx.apply`` or a
    function wrapped by :func:`cast_apply`, this is that submodule's policy; elsewhere it
    is the global policy. A module that creates arrays uses it to make them in its
    compute dtype. It is read while tracing, so it works under ``jit``.

    Examples:
        >>> import jax
        >>> import jmp_policy as jp
        >>> jp.current_policy()
        <DTypePolicy "float32">
        >>> @jp.cast_apply("mixed_bfloat16")
        ... def apply(params, key):
        ...     return jax.random.normal(key, (2,), jp.current_policy().compute_dtype)
        >>> apply({}, jax.random.key(0)).dtype
        dtype(bfloat16)
    """
    call = context.CALL.get()
    return dtype_policy() if call is None else call.policy


@contextlib.contextmanager
def current_policy_scope(policy: DTypePolicy, path: str | None = None) -> Iterator[None]:
    """Makes ``policy`` what :func:`current_policy` returns inside the block, and ``path``
    the path of the running call; nests and restores (for the glue)."""
    token = context.CALL.set(context.RunningCall(policy, path))
    try:
        yield
    finally:
        context.CALL.reset(token)
