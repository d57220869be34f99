"""int8 compute for NNX: the hook's extension that gives int8 layers an int8 matmul.

Under an int8 policy, an ``nnx.Linear`` whose ``dot_general`` is JAX's own, an
``nnx.LinearGeneral`` whose user set neither ``dot_general`` nor ``dot_general_cls``, and
an ``nnx.Einsum`` whose ``einsum_op`` is ``jnp.einsum`` run with
:func:`~jmp_policy._src.quantization.int8_dot_general` (or
:func:`~jmp_policy._src.quantization.int8_einsum`) in that attribute for the duration of
the call, on the policy-running copy of the model; it is restored after. A layer whose
user set their own matmul is left alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from jmp_policy._src import interception, quantization


def _replacement(module: Any) -> tuple[str, Any] | None:
    """The attribute to set and its int8 value, or None (not ours, or the user's own)."""
    if isinstance(module, nnx.Linear):
        if module.dot_general is jax.lax.dot_general:
            return "dot_general", quantization.int8_dot_general
    elif isinstance(module, nnx.LinearGeneral):
        if module.dot_general is None and module.dot_general_cls is None:
            return "dot_general", quantization.int8_dot_general
    elif isinstance(module, nnx.Einsum) and module.einsum_op is quantization.JNP_EINSUM:
        return "einsum_op", quantization.int8_einsum
    return None


def int8_matmuls(
    call: Any, next_fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """The hook extension: int8 layers' matmuls on int8 operands (see the module docstring)."""
    module = call.module
    if not quantization.is_int8(call.resolution.policy) or module is None:
        return next_fn(*args, **kwargs)
    replacement = _replacement(module)
    if replacement is None:
        return next_fn(*args, **kwargs)
    with interception.attribute_set(module, *replacement):
        return next_fn(*args, **kwargs)
