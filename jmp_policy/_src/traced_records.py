"""Threading records out of a body traced apart: a ``jax.lax.scan``'s (a layer stack's
loop) and a ``jax.checkpoint``'s (``nn.remat``, ``nnx.remat``).

A tap inside such a body runs in the body's own trace: what it records there cannot be
kept in a Python container outside it. The map search's taps and calibration's input
statistics thread their records out as extra outputs, by one mechanism:

- :func:`scan_with_records`, called from an ``interception.SCAN_AROUND`` hook, runs the
  scan with its body wrapped: each traced iteration enters ``step(i, n)`` (``i`` the
  iteration index, a traced int, of ``n``), whose value, called after the body, gives
  that iteration's records; they leave the loop as its stacked outputs, with one leading
  axis of ``n``.
- :data:`REMAT_AROUND`: while :data:`REMATS` is active (a thread-gated patch of
  ``jax.checkpoint``/``jax.remat``), each call of a function checkpointed during the run
  goes through this hook, ``around(original, plain, fun, args, kwargs, a, k)``, which may
  call :func:`checkpoint_with_records`: a fresh checkpoint of ``fun`` entered in
  ``step()`` (JAX caches a checkpointed function's trace: a second call of the same one
  would reuse the first call's taps), its records returned beside its outputs.
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import jax
import jax.numpy as jnp

from jmp_policy._src import interception

#: ``step(i, n)``: entered around each traced iteration; its value gives the records.
Step = Callable[[Any, int], AbstractContextManager[Callable[[], Any]]]


def scan_with_records(
    scan: Callable[..., Any], f: Callable[..., Any], init: Any, args: Any, kwargs: Any, step: Step
) -> tuple[Any, Any] | None:
    """``((carry, ys), records)`` of ``scan(f, init, *args, **kwargs)`` with ``f``'s
    iterations entered in ``step`` (see the module docstring); ``None`` when the scan's
    length is unknown (no ``xs`` leaves and no ``length``: run it as called, JAX says
    what is missing)."""
    args, kwargs = list(args), dict(kwargs)
    xs = args[0] if args else kwargs.get("xs")
    length = args[1] if len(args) > 1 else kwargs.get("length")
    leaves = jax.tree.leaves(xs)
    if length is None and not leaves:
        return None
    n = int(length) if length is not None else int(leaves[0].shape[0])
    if args:
        args[0] = (xs, jnp.arange(n))
    else:
        kwargs["xs"] = (xs, jnp.arange(n))

    def body(carry: Any, x_i: Any) -> Any:
        x, i = x_i
        with step(i, n) as records:
            new, y = f(carry, x)
            out = records()
        return new, (y, out)

    carry, (ys, records) = scan(body, init, *args, **kwargs)
    return (carry, ys), records


# ``around(original, plain, fun, args, kwargs, a, k) -> outputs``: runs each call ``plain(*a,
# **k)`` of a function checkpointed (``original(fun, *args, **kwargs)``) while REMATS is
# active; ``None``: the call as made.
REMAT_AROUND: contextvars.ContextVar[Callable[..., Any] | None] = contextvars.ContextVar(
    "jmp_policy_remat_around", default=None
)


def _remat(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def checkpoint(fun: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        plain = original(fun, *args, **kwargs)
        if not REMATS.inside() or REMAT_AROUND.get() is None:
            return plain

        @functools.wraps(fun)
        def call(*a: Any, **k: Any) -> Any:
            around = REMAT_AROUND.get()
            if around is None:
                return plain(*a, **k)
            return around(original, plain, fun, args, kwargs, a, k)

        return call

    return checkpoint


#: ``jax.checkpoint``/``jax.remat`` wrapped while a thread is inside ``REMATS.active()``.
REMATS = interception.ThreadPatch(jax, {"checkpoint": _remat, "remat": _remat})


def checkpoint_with_records(
    original: Callable[..., Any],
    fun: Callable[..., Any],
    args: Any,
    kwargs: Any,
    a: Any,
    k: Any,
    step: Callable[[], AbstractContextManager[Callable[[], Any]]],
) -> tuple[Any, Any]:
    """``(outputs, records)`` of ``fun(*a, **k)`` checkpointed as ``original(fun, *args,
    **kwargs)``, its body entered in ``step()`` (see the module docstring)."""

    def tapped(*a: Any, **k: Any) -> Any:
        with step() as records:
            out = fun(*a, **k)
            got = records()
        return out, got

    return original(tapped, *args, **kwargs)(*a, **k)  # type: ignore[no-any-return]
