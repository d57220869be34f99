"""The NNX adapter of the framework protocol (:mod:`jmp_policy._src.framework`).

It answers what the core's entry points ask of an NNX model: its modules (root first, then
in ``nnx.iter_modules``' order, as NNX's resolver records them), its ``nnx.Param`` values,
and a run of a policy-running copy (``nnx.split``, cast, ``nnx.merge``, each module
re-classed to run through the hook; nothing written back, so a traced run leaves the model
as it was). NNX routes its layers' matmuls itself (:mod:`jmp_policy.nnx._quantization`),
so no module is handed to the core's matmul routing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from flax import nnx

from jmp_policy._src.framework.protocol import Layer
from jmp_policy._src.options import Options
from jmp_policy._src.resolution import Resolver
from jmp_policy.nnx._copy import cast_copy
from jmp_policy.nnx._hook import dress, original_class
from jmp_policy.nnx._modules import check_model, own_dtype, path_of
from jmp_policy.nnx._quantization import quantized_run


class NnxAdapter:
    """The adapter protocol (:class:`jmp_policy._src.framework.protocol.Adapter`) for NNX."""

    model_name = "nnx.Module"

    def check(self, model: Any) -> None:
        check_model(model)

    def layers(self, model: Any) -> Iterator[Layer]:
        modules = sorted(nnx.iter_modules(model), key=lambda item: len(item[0]) > 0)
        for parts, module in modules:  # the root first (NNX lists children before parents)
            yield Layer(path_of(parts), original_class(module), own_dtype(module))

    def params(self, model: Any) -> Mapping[str, Any]:
        return nnx.to_pure_dict(nnx.state(model, nnx.Param))  # type: ignore[no-any-return]

    def kernel_of(self, module: Any) -> Any:
        return None  # NNX's layers route their own matmuls (nnx._quantization)

    def call_with_matmul(
        self,
        module: Any,
        matmul: Callable[..., Any],
        kernel: Any,
        args: tuple[Any, ...],
        kwargs: Any,
    ) -> Any:
        raise NotImplementedError("NNX layers route their own matmuls")

    def run(
        self,
        model: Any,
        resolver: Resolver,
        options: Options,
        extensions: tuple[Any, ...],
        call: Callable[[Any], Any],
    ) -> Any:
        copy, casts = cast_copy(model, resolver)
        dress(copy, resolver, ("__call__",), extensions)
        with quantized_run(casts.whole, casts.ahead, casts.sliced):
            return call(copy)

    def split(self, model: Any) -> tuple[Any, Callable[[Any], Any]]:
        graphdef, state = nnx.split(model)
        return state, lambda s: nnx.merge(graphdef, s)

    def with_kernels(self, model: Any, kernels: Mapping[str, Any]) -> Any:
        raise NotImplementedError("jp.nnx.quantize places NNX kernels itself")


ADAPTER = NnxAdapter()
