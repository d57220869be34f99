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

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from jmp_policy._src import quantization

_LOCK = threading.Lock()
_ACTIVE = 0
_ORIGINAL: list[Callable[..., Any]] = []
_DEPTH = threading.local()


@contextlib.contextmanager
def _attribute(module: Any, name: str, value: Any) -> Iterator[None]:
    old = getattr(module, name)
    object.__setattr__(module, name, value)
    try:
        yield
    finally:
        object.__setattr__(module, name, old)


def _einsum(*args: Any, **kwargs: Any) -> Any:
    if getattr(_DEPTH, "value", 0) > 0:
        return quantization.int8_einsum(*args, **kwargs)
    return _ORIGINAL[0](*args, **kwargs)


@contextlib.contextmanager
def _int8_einsum() -> Iterator[None]:
    """This thread's ``jnp.einsum`` calls are int8 inside the block."""
    global _ACTIVE
    with _LOCK:
        if _ACTIVE == 0:
            _ORIGINAL[:] = [jnp.einsum]
            jnp.einsum = _einsum
        _ACTIVE += 1
    _DEPTH.value = getattr(_DEPTH, "value", 0) + 1
    try:
        yield
    finally:
        _DEPTH.value -= 1
        with _LOCK:
            _ACTIVE -= 1
            if _ACTIVE == 0:
                jnp.einsum = _ORIGINAL.pop()


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
        with _attribute(module, "dot_general", quantization.int8_dot_general):
            return next_fn(*args, **kwargs)
    if isinstance(module, nn.Einsum):
        with _int8_einsum():
            return next_fn(*args, **kwargs)
    return next_fn(*args, **kwargs)
