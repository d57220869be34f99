"""Threading per-iteration records out of a ``jax.lax.scan`` (a layer stack's loop).

A tap inside a scan body (``nn.scan``, ``nnx.scan`` over layers) runs in the body's own
trace: what it records there cannot be kept in a Python container outside the loop.
:func:`scan_with_records`, called from an ``interception.SCAN_AROUND`` hook (the map
search's taps, calibration's input statistics), runs the scan with its body wrapped: each
traced iteration enters ``step(i, n)`` (``i`` the iteration index, a traced int, of
``n``), whose value, called after the body, gives that iteration's records; they leave
the loop as its stacked outputs, with one leading axis of ``n``.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import jax
import jax.numpy as jnp

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
