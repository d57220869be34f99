"""A matmul for a layer that calls ``jnp.einsum`` itself (Linen's ``nn.Einsum``: no
attribute holds its matmul): while one such call runs, ``jax.numpy.einsum`` is a router
that sends this thread's calls to the replacement and every other thread's to the
original, restored when the last such call ends (:class:`~jmp_policy._src.transforms.ThreadPatch`).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

from jmp_policy._src import transforms

# This thread's `jnp.einsum` calls go to `_EINSUM_AS.get()` while `_EINSUM.inside()`.
_EINSUM_AS: contextvars.ContextVar[Callable[..., Any] | None] = contextvars.ContextVar(
    "jmp_policy_einsum_route", default=None
)


def _einsum(original: Callable[..., Any]) -> Callable[..., Any]:
    def einsum(*args: Any, **kwargs: Any) -> Any:
        replacement = _EINSUM_AS.get() if _EINSUM.inside() else None
        return (original if replacement is None else replacement)(*args, **kwargs)

    return einsum


_EINSUM = transforms.ThreadPatch("einsum", {"einsum": _einsum})


@contextlib.contextmanager
def einsum_as(replacement: Callable[..., Any]) -> Iterator[None]:
    """In the block, this thread's ``jnp.einsum`` calls run ``replacement``."""
    token = _EINSUM_AS.set(replacement)
    try:
        with _EINSUM.active():
            yield
    finally:
        _EINSUM_AS.reset(token)
