"""The routed matmuls: the hook extension that installs, for one call of a routable layer,
the matmul the core picks (:func:`jmp_policy._src.quantization.matmuls.pick`).

The adapter says which modules are routable (``kernel_of``) and how a matmul reaches one
(``call_with_matmul``, or ``install_matmul`` for a framework whose layer reads its matmul
from an attribute). The optional operations of
:class:`~jmp_policy._src.framework.protocol.Routing` (a matmul kind, a kernel
dequantized ahead of a stack's layer, the per-layer state slot) are asked only of an
adapter that has them; without a state slot, a stateful scheme is refused by name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from jmp_policy._src import interception
from jmp_policy._src.quantization import is_quantized, matmuls


def _where(call: interception.Call) -> str:
    return f"{type(call.module).__name__} at {call.path or 'the root'!r}"


def matmul_kind(adapter: Any, module: Any) -> str:
    """``"dot_general"`` or ``"einsum"``: the drop-in the layer's matmul is."""
    kind = getattr(adapter, "matmul_kind", None)
    return "dot_general" if kind is None else str(kind(module))


def layer_state(adapter: Any, call: interception.Call) -> Any:
    """The state the layer of ``call`` holds for its scheme's ``state_kind`` (the
    adapter's per-layer state slot), or a ``ValueError`` when the adapter holds none."""
    slot = getattr(adapter, "layer_state", None)
    policy = call.resolution.policy
    if slot is None:
        raise ValueError(
            f"{_where(call)} runs under {policy.name!r}, whose scheme keeps state per "
            f"layer (float8 delayed scaling), which {adapter.model_name} models do not "
            "hold yet. Use current scaling, 'float8_current_from_<source>' (the tensor's "
            "own amax, no state), or a float or int8 policy for this layer."
        )
    return slot(call, policy.scheme)


def call_routed(
    adapter: Any,
    call: interception.Call,
    matmul: Callable[..., Any],
    kernel: Any,
    next_fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: Any,
) -> Any:
    """One call of a routed layer with ``matmul`` (its kind's drop-in) as its matmul."""
    install = getattr(adapter, "install_matmul", None)
    if install is None:
        return adapter.call_with_matmul(call.module, matmul, kernel, args, kwargs)
    with install(call, matmul):
        return next_fn(*args, **kwargs)


# id(adapter) -> (adapter, its routed-matmul extension): one extension per adapter, so the
# classes an adapter caches per (path, resolution, extensions) are made once.
_ROUTED: dict[int, tuple[Any, interception.Extension]] = {}


def routed_matmuls(adapter: Any) -> interception.Extension:
    """The hook extension that installs, for one call, the matmul the core picks for a
    routable layer (its policy's scheme, or a ``QuantizedArray`` kernel read whole)."""
    if id(adapter) in _ROUTED:
        return _ROUTED[id(adapter)][1]
    ahead_of = getattr(adapter, "kernel_ahead", lambda call: None)

    def extension(
        call: interception.Call, next_fn: Callable[..., Any], args: tuple[Any, ...], kwargs: Any
    ) -> Any:
        kernel = None if call.module is None else adapter.kernel_of(call.module)
        policy = call.resolution.policy
        scheme = policy.scheme
        if kernel is None:  # not a layer whose matmul the core can route
            matmuls.own_matmul_in_stack(call.path, ahead_of(call), scheme)
            return next_fn(*args, **kwargs)
        state = None
        if scheme is not None and scheme.stateful:
            state = layer_state(adapter, call)
        elif matmuls.dequantized_ahead(call.path, ahead_of(call), scheme):
            return next_fn(*args, **kwargs)  # a stack's layer, on its dequantized copy
        dequantized = (
            is_quantized(kernel) and scheme is not None and not scheme.reads_stored_kernels
        )
        if dequantized:  # its format reads a stored kernel dequantized, as Linen and NNX do
            kernel = policy.cast_to_compute(kernel)
        stored = kernel if is_quantized(kernel) else None
        kind = matmul_kind(adapter, call.module)
        matmul = matmuls.pick(policy, kind, call.path, state, stored)
        if matmul is None:
            if not dequantized:
                return next_fn(*args, **kwargs)  # the layer as written
            matmul = matmuls.of_kind(kind, jax.lax.dot_general)
        return call_routed(adapter, call, matmul, kernel, next_fn, args, kwargs)

    _ROUTED[id(adapter)] = (adapter, extension)  # the adapter kept: its id is never reused
    return extension
