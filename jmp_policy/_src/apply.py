"""Applying a policy or a map to a plain ``apply(params, *args, **kwargs)`` function."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from jmp_policy._src import global_state, serialization
from jmp_policy._src.policy import DTypePolicy
from jmp_policy._src.policy_map import DTypePolicyMap

F = TypeVar("F", bound=Callable[..., Any])


def as_policy_or_map(policy_or_map: Any, argument: str = "policy_or_map") -> Any:
    """A policy, a name or a config to a policy; a map as is; ``None`` is the global one."""
    if isinstance(policy_or_map, (DTypePolicy, DTypePolicyMap)):
        return policy_or_map
    if policy_or_map is None:
        return None
    if isinstance(policy_or_map, dict) and "class_name" not in policy_or_map:
        return DTypePolicyMap(None, policy_or_map)
    try:
        return serialization.get(policy_or_map)
    except (TypeError, ValueError) as e:
        raise type(e)(f"Invalid `{argument}`: {e}") from e


def root_policy(policy_or_map: Any) -> DTypePolicy:
    """The policy of the root module (path ``""``); the global policy for ``None``."""
    if policy_or_map is None:
        return global_state.dtype_policy()
    if isinstance(policy_or_map, DTypePolicyMap):
        return policy_or_map[""]
    return policy_or_map


def cast_params(policy_or_map: Any, params: Any) -> Any:
    """Casts a parameter tree to compute dtypes (per path with a map)."""
    if policy_or_map is None:
        return global_state.dtype_policy().cast_to_compute(params)
    return policy_or_map.cast_to_compute(params)


def cast_apply(policy_or_map: Any) -> Callable[[F], F]:
    """A decorator that runs ``apply(params, *args, **kwargs)`` under a policy or a map.

    ``params`` are cast to their compute dtype (per module path with a map), every
    floating leaf of every positional and keyword argument to the root policy's compute
    dtype (unlike tf.keras, which casts only the first argument), and the outputs to the
    root policy's output dtype. The root policy is the policy itself, or the map's policy
    of the path ``""`` (usually its default). Gradients flow back to the stored dtype.
    Works under ``jit`` and ``grad``; :func:`current_policy` returns the root policy
    inside.

    Args:
        policy_or_map: a policy, a name, a ``DTypePolicyMap`` or a ``dict`` (made a map
            with the global policy as its default).

    Returns:
        A decorator.

    Examples:
        >>> import jax
        >>> import jax.numpy as jnp
        >>> import jmp_policy as jp
        >>> @jp.cast_apply("p=f32,c=bf16,o=f32")
        ... def apply(params, x):
        ...     return x @ params["w"]
        >>> params = {"w": jnp.ones((3, 2))}
        >>> apply(params, jnp.ones((1, 3))).dtype
        dtype('float32')
        >>> grads = jax.grad(lambda p: apply(p, jnp.ones((1, 3))).sum())(params)
        >>> grads["w"].dtype
        dtype('float32')
    """
    resolved = as_policy_or_map(policy_or_map)

    def decorator(fn: F) -> F:
        @functools.wraps(fn)
        def wrapped(params: Any, *args: Any, **kwargs: Any) -> Any:
            root = root_policy(resolved)
            params = cast_params(resolved, params)
            args, kwargs = root.cast_to_compute((args, kwargs))
            with global_state.current_policy_scope(root):
                out = fn(params, *args, **kwargs)
            return root.cast_to_output(out)

        return wrapped  # type: ignore[return-value]

    return decorator
