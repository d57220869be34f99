"""Threading records out of a body traced apart: a ``jax.lax.scan``'s (a layer stack's
loop), a ``jax.checkpoint``'s (``nn.remat``, ``nnx.remat``) and a ``jax.vmap``'s (a
layer stack run in parallel: ``nn.vmap``, ``nnx.vmap``).

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
- :data:`VMAP_AROUND`, the same for ``jax.vmap`` while :data:`VMAPS` is active (how
  ``nn.vmap`` and ``nnx.vmap`` run): ``around(original, plain, fun, args, kwargs, a, k)``
  may call :func:`vmap_with_records`, which runs ``fun`` with each lane entered in
  ``step(i, n)`` as a scan's iterations are (``i`` the lane's index, traced, of ``n``);
  the lanes' records leave as extra outputs mapped on axis 0, one leading axis of ``n``.
  A ``jax.vmap`` made before the block (a function vmapped at import) is not seen.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import jax
import jax.numpy as jnp

from jmp_policy._src import transforms

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

# The same for each call of a function vmapped while VMAPS is active.
VMAP_AROUND: contextvars.ContextVar[Callable[..., Any] | None] = contextvars.ContextVar(
    "jmp_policy_vmap_around", default=None
)


def _transform(
    around_var: contextvars.ContextVar[Callable[..., Any] | None],
    patch: Callable[[], transforms.ThreadPatch],
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The wrapper of a JAX transform ``original(fun, *args, **kwargs)`` whose calls go
    through ``around_var``'s hook while ``patch()`` is active in this thread."""

    def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def transform(fun: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            plain = original(fun, *args, **kwargs)
            if not patch().inside() or around_var.get() is None:
                return plain

            @functools.wraps(fun)
            def call(*a: Any, **k: Any) -> Any:
                around = around_var.get()
                if around is None:
                    return plain(*a, **k)
                return around(original, plain, fun, args, kwargs, a, k)

            return call

        return transform

    return wrap


_remat = _transform(REMAT_AROUND, lambda: REMATS)

#: ``jax.checkpoint``/``jax.remat`` wrapped while a thread is inside ``REMATS.active()``.
REMATS: transforms.ThreadPatch = transforms.ThreadPatch(
    "remats", {"checkpoint": _remat, "remat": _remat}
)

#: ``jax.vmap`` wrapped while a thread is inside ``VMAPS.active()``.
VMAPS: transforms.ThreadPatch = transforms.ThreadPatch(
    "vmaps", {"vmap": _transform(VMAP_AROUND, lambda: VMAPS)}
)


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


class _Lanes:
    """The axis name given a ``jax.vmap`` that has none, to read each lane's index."""

    def __repr__(self) -> str:
        return "jmp_policy_lanes"


def vmap_with_records(
    original: Callable[..., Any],
    fun: Callable[..., Any],
    args: Any,
    kwargs: Any,
    a: Any,
    k: Any,
    step: Step,
) -> tuple[Any, Any]:
    """``(outputs, records)`` of ``fun(*a, **k)`` vmapped as ``original(fun, *args,
    **kwargs)``, each lane entered in ``step(i, n)`` (see the module docstring); the
    records are mapped on their leading axis (``out_axes`` 0), whatever the inputs'
    ``in_axes`` (a lane whose records do not depend on its index gets them repeated)."""
    bound = inspect.signature(original).bind(fun, *args, **kwargs)
    options = dict(bound.arguments)
    del options["fun"]
    name = options.get("axis_name")
    if name is None:
        name = options["axis_name"] = _Lanes()
    options["out_axes"] = (options.get("out_axes", 0), 0)

    def lanes(*a: Any, **k: Any) -> Any:
        i, n = jax.lax.axis_index(name), jax.lax.axis_size(name)
        with step(i, int(n)) as records:
            out = fun(*a, **k)
            got = records()
        return out, got

    return original(lanes, **options)(*a, **k)  # type: ignore[no-any-return]
