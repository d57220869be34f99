"""What a framework adapter answers: the few operations the entry points are written on.

An adapter never decides a policy nor a matmul: it says where the model's modules and
kernels are (:class:`Layer`), runs the model with the hook on every module call, calls one
layer with a matmul the core chose, and rebuilds a model with new kernels. The core
(:mod:`jmp_policy._src.framework.entry_points`) does the rest, the same for every framework.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple, Protocol

import numpy as np

from jmp_policy._src.options import Options
from jmp_policy._src.resolution import Resolver

#: A kernel stored as ``[in, out]`` (Flax, and the library's ``QuantizedArray``).
IN_OUT = "in_out"
#: A kernel stored as ``[out, in]`` (Equinox's ``Linear.weight``, PyTorch's).
OUT_IN = "out_in"


class Layer(NamedTuple):
    """One module of a model, as the core sees it.

    ``kernel_name`` is ``None`` for a module whose matmul the core cannot route (a norm,
    an embedding, a convolution, a container); then ``kernel`` is ``None`` too.
    ``stacked`` are the kernel's leading axes beyond one layer's (a layer made stacked by a
    ``vmap`` of its constructor, run by a ``scan``); ``layout`` is :data:`IN_OUT` or
    :data:`OUT_IN`.
    """

    path: str
    cls: type
    own_dtype: np.dtype | None
    kernel_name: str | None = None
    kernel: Any = None
    stacked: tuple[int, ...] = ()
    layout: str = IN_OUT


class Adapter(Protocol):
    """The operations a framework gives the entry points (see the module docstring)."""

    #: The model's base class in messages (``"eqx.Module"``).
    model_name: str

    def check(self, model: Any) -> None:
        """A ``TypeError`` naming ``model`` when it is not one of the framework's models."""

    def layers(self, model: Any) -> Iterable[Layer]:
        """Every module of ``model``, the root (path ``""``) first, parents before children."""

    def params(self, model: Any) -> Mapping[str, Any]:
        """The model's floating parameters, ``{variable path: array}`` (``explain``'s bytes)."""

    def run(
        self,
        model: Any,
        resolver: Resolver,
        options: Options,
        extensions: tuple[Any, ...],
        call: Callable[[Any], Any],
    ) -> Any:
        """``call(copy)``: runs a copy of ``model`` whose every module call goes through
        :func:`jmp_policy._src.interception.run` with its resolution and ``extensions``,
        its parameters cast to their compute dtypes; ``model`` is left as it is."""

    def kernel_of(self, module: Any) -> Any:
        """The kernel of a layer whose matmul the core may route, as ``[in, out]`` (a float
        array, or a ``QuantizedArray``); ``None`` for any other module. An adapter with
        ``install_matmul`` may answer any other value for a float kernel its layer reads
        itself (the core reads only whether it is a ``QuantizedArray``)."""

    def call_with_matmul(
        self,
        module: Any,
        matmul: Callable[..., Any],
        kernel: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """One call of a routed layer (a :class:`Layer` with a ``kernel_name``) whose matmul
        is ``matmul``, a drop-in ``jax.lax.dot_general``, on ``kernel`` (``[in, out]``, on
        the right)."""

    def split(self, model: Any) -> tuple[Any, Callable[[Any], Any]]:
        """``(arrays, merge)``: the model's arrays as a pytree ``jax.jit`` takes, and the
        function that rebuilds the model from them (``merge(arrays)``)."""

    # Optional: ``class_name(model) -> str``, the model's class in messages (default
    # ``type(model).__name__``; Linen's model is a module with its variables).

    def with_kernels(self, model: Any, kernels: Mapping[str, Any]) -> Any:
        """A new model whose layers at these paths hold these kernels (``[in, out]``
        ``QuantizedArray`` values); ``model`` is left as it is."""


class Routing(Protocol):
    """Optional operations of an adapter, each asked only of an adapter that has it
    (:mod:`jmp_policy._src.framework.routing`, :mod:`jmp_policy._src.framework.state`).

    ``call`` is the hook's :class:`~jmp_policy._src.interception.Call` of the layer.
    """

    def matmul_kind(self, module: Any) -> str:
        """``"dot_general"`` (the default without this method) or ``"einsum"``: the
        drop-in a routed layer's matmul is."""

    def install_matmul(self, call: Any, matmul: Callable[..., Any]) -> Any:
        """A context manager during which the layer of ``call`` runs its own code with
        ``matmul`` as its matmul (instead of ``call_with_matmul``)."""

    def kernel_ahead(self, call: Any) -> Any:
        """The ``QuantizedArray`` kernel dequantized ahead of the layer of ``call`` (a
        stack's that its layer cannot read a slice of), else ``None``."""

    def layer_state(self, call: Any, scheme: Any) -> Any:
        """The per-layer state slot: the state of kind ``scheme.state_kind`` that the
        layer of ``call`` holds for this call (a ``ValueError`` saying how to create it
        when it is missing or does not fit ``scheme``). Without this method a stateful
        scheme is refused by name."""

    def weights(self, model: Any) -> tuple[Any, Any, Callable[[Any], Any]]:
        """``(tree, stacked_axes, rebuild)``: the weights ``quantize`` covers (a tree the
        map resolves by path), their stacked axes (``DTypePolicyMap.quantize``'s
        ``stacked_axes``), and ``rebuild(quantized tree)``, a new model holding them
        (without this method: the routable layers' kernels, put back by
        ``with_kernels``)."""

    def with_sample(self, model: Any, args: tuple[Any, ...], kwargs: Any) -> Any:
        """``model`` told a call's arguments (calibrate's first batch), whose shape-only
        run its ``weights`` may need to find its stacks (Linen's)."""

    def with_states(self, model: Any, states: Mapping[str, Any]) -> Any:
        """A new model whose layers at these paths hold these states (``path ->``
        :class:`~jmp_policy._src.framework.state.Slot`, its value stacked as the layer
        is); ``model`` is left as it is."""


class InstallsMatmuls:
    """A base for adapters whose layers take the core's matmul in an attribute
    (``install_matmul``) and whose ``quantize`` puts back its own ``weights`` (NNX's): the
    core asks them neither ``call_with_matmul`` nor ``with_kernels``."""

    def call_with_matmul(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__}'s layers take `install_matmul`")

    def with_kernels(self, *args: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__}'s quantize puts back `weights`")
