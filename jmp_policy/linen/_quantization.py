"""int8 compute for Linen: the hook's extension that gives int8 layers an int8 matmul.

Under an int8 policy, a ``Dense`` or ``DenseGeneral`` whose user set neither
``dot_general`` nor ``dot_general_cls`` runs with
:func:`~jmp_policy._src.quantization.int8_dot_general` as its ``dot_general`` for the
duration of the call (Flax reads the attribute at call time; it is restored after). An
``nn.Einsum`` has no such attribute and calls ``jnp.einsum`` itself: while one runs under
an int8 policy, ``jax.numpy.einsum`` is replaced by a wrapper that sends the calls of
that thread to :func:`~jmp_policy._src.quantization.int8_einsum` (and every other
thread's calls to the original), restored when the last such call ends.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from jmp_policy._src import interception, quantization


def _einsum(original: Callable[..., Any]) -> Callable[..., Any]:
    def einsum(*args: Any, **kwargs: Any) -> Any:
        if _EINSUM.inside():
            return quantization.int8_einsum(*args, **kwargs)
        return original(*args, **kwargs)

    return einsum


# This thread's `jnp.einsum` calls are int8 while `_EINSUM.active()`.
_EINSUM = interception.ThreadPatch(jnp, {"einsum": _einsum})


def int8_matmuls(
    call: Any, next_fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """The hook extension: int8 layers' matmuls on int8 operands (see the module docstring)."""
    module = call.module
    if not quantization.is_int8(call.resolution.policy) or module is None:
        return next_fn(*args, **kwargs)
    if isinstance(module, (nn.Dense, nn.DenseGeneral)):
        if module.dot_general is not None or module.dot_general_cls is not None:
            return next_fn(*args, **kwargs)  # the user's own matmul
        with interception.attribute_set(module, "dot_general", quantization.int8_dot_general):
            return next_fn(*args, **kwargs)
    if isinstance(module, nn.Einsum):
        with _EINSUM.active():
            return next_fn(*args, **kwargs)
    return next_fn(*args, **kwargs)
