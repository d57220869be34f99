"""The quantized kernels of the model run in progress, by layer path, for an adapter whose
policy-running copy hands them to its layers beside their own attributes (NNX's): a
kernel its layer's matmul reads whole, one dequantized ahead of its layer (a stack's that
the layer cannot read a slice of), and a stacked one whose layers each read their own
slice in the stack's loop. A run also records the layers called so far, for an adapter
that keeps one state per layer and refuses a second call of a stateful one.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import jax.numpy as jnp

from jmp_policy._src.quantization import is_quantized, stack_layers


class RunKernels(NamedTuple):
    """Layer path -> ``QuantizedArray`` kernel: read whole, dequantized ahead, sliced."""

    whole: Mapping[str, Any]
    ahead: Mapping[str, Any]
    sliced: Mapping[str, Any]


_NONE = RunKernels({}, {}, {})
# The run in progress: its kernels, id(layer) -> layer for the layers called so far, and
# id(layer) -> (layer, its calls so far) for an adapter keeping one state per call.
_RUN: contextvars.ContextVar[
    tuple[RunKernels, dict[int, Any], dict[int, tuple[Any, int]]] | None
] = contextvars.ContextVar("jmp_policy_run_kernels", default=None)


@contextlib.contextmanager
def running(
    whole: Mapping[str, Any] | None = None,
    ahead: Mapping[str, Any] | None = None,
    sliced: Mapping[str, Any] | None = None,
) -> Iterator[None]:
    """One model run, whose layers receive these kernels (layer path -> kernel)."""
    token = _RUN.set((RunKernels(whole or {}, ahead or {}, sliced or {}), {}, {}))
    try:
        yield
    finally:
        _RUN.reset(token)


def kernels() -> RunKernels:
    """The kernels of the run in progress (none outside a run)."""
    run = _RUN.get()
    return _NONE if run is None else run[0]


def first_call(layer: Any) -> bool:
    """Whether this is ``layer``'s first call in the run in progress (recorded: the layer
    kept alive, so its id is not reused in the run); always true outside a run."""
    run = _RUN.get()
    if run is None:
        return True
    called = run[1]
    if id(layer) in called:
        return False
    called[id(layer)] = layer
    return True


def call_index(layer: Any) -> int:
    """How many calls of ``layer`` came before this one in the run in progress (this one
    recorded, the layer kept alive); 0 outside a run."""
    run = _RUN.get()
    if run is None:
        return 0
    index = run[2].get(id(layer), (layer, 0))[1]
    run[2][id(layer)] = (layer, index + 1)
    return index


def route(kernel: Any, policy: Any, routed: bool, lead: int) -> str | None:
    """How a layer's stored ``kernel`` reaches its matmul in the run: ``"whole"`` (a
    ``QuantizedArray`` a routed layer's matmul reads whole), ``"sliced"`` (a stacked one,
    ``lead`` stacked axes, whose layers each read their slice in the stack's loop),
    ``"ahead"`` (any other ``QuantizedArray``: dequantized ahead of its layer), or ``None``
    (a float kernel, cast to the compute dtype). A scheme that does not read stored
    kernels gets them ahead."""
    if not is_quantized(kernel):
        return None
    reads = policy.scheme is None or policy.scheme.reads_stored_kernels
    if routed and reads and not lead:
        return "whole"
    if routed and reads and lead and stack_layers.servable(kernel) and kernel.stacked == lead:
        return "sliced"
    return "ahead"


class Staging:
    """A policy-running copy's kernels as it is made (:meth:`param`), then its run
    (:meth:`running`): layer path -> ``QuantizedArray`` read whole, dequantized ahead, sliced."""

    def __init__(self) -> None:
        self.whole: dict[str, Any] = {}
        self.ahead: dict[str, Any] = {}
        self.sliced: dict[str, Any] = {}

    def param(self, path: str, name: str, value: Any, policy: Any, routed: bool, lead: int) -> Any:
        """What the copy holds for the parameter ``name`` of the layer at ``path`` (its
        policy's, its matmul ``routed`` or not, ``lead`` stacked axes): a quantized
        ``kernel`` its matmul reads whole as its integer values (promotable), a stacked one's
        values (each layer's matmul reads its slice in the loop), else the value cast to
        the compute dtype (a quantized kernel dequantized ahead of its layer)."""
        how = route(value, policy, routed, lead) if name == "kernel" else None
        if how == "whole":
            self.whole[path] = value
            return promotable(value.values)
        if how == "sliced":
            self.sliced[path] = value
            return value.values
        if how == "ahead":
            self.ahead[path] = value
        return policy.cast_to_compute(value)

    def running(self) -> contextlib.AbstractContextManager[None]:
        """The run of the copy, its layers receiving these kernels."""
        return running(self.whole, self.ahead, self.sliced)


def layer_kernel(path: str | None, values: Any, leaf: Callable[[str], Any]) -> Any:
    """The ``QuantizedArray`` the routed layer at ``path`` reads in the run in progress:
    the one it reads whole, or its own slice of a stacked one, rebuilt from the slices its
    loop body holds (``values``, and ``leaf(name)`` for each
    :func:`~jmp_policy._src.quantization.stack_layers.leaf_name`); else ``None``."""
    run = kernels()
    if path is None or path in run.whole:
        return None if path is None else run.whole[path]
    stack = run.sliced.get(path)
    if stack is None:
        return None
    fields = stack_layers.extra_leaves(stack)
    leaves = {field: leaf(stack_layers.leaf_name("kernel", field)) for field in fields}
    return stack_layers.layer_of(stack, values, leaves)


def promoting(promote: Callable[..., Any]) -> Callable[..., Any]:
    """A layer's dtype promotion given integer values as :func:`promotable` (int4 as int8):
    a stacked layer's matmul reads its values with their scales, so the promoted copy is
    dead code."""

    def promote_dtype(arrays: Any, *args: Any, **kwargs: Any) -> Any:
        return promote(tuple(map(promotable, arrays)), *args, **kwargs)

    return promote_dtype


def promotable(values: Any) -> Any:
    """Integer kernel values as a framework's dtype promotion takes them: int4 as int8
    (int4 has no implicit promotion in JAX; the routed matmul reads the stored values)."""
    return values.astype(jnp.int8) if getattr(values, "dtype", None) == jnp.int4 else values
