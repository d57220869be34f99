"""The Linen adapter of the framework protocol (:mod:`jmp_policy._src.framework`).

A Linen module holds no variables: the core's "model" is a :class:`Bound`, the module
with one call's variables and keywords. Its modules are the ones met by a shape-only run
(:meth:`LinenAdapter.learn`); a run goes through :mod:`jmp_policy.linen._trace`. A
``Dense``/``DenseGeneral`` gets its routed matmul in ``dot_general`` for the call, an
``nn.Einsum`` its ``jnp.einsum``; float8's per-call state is the variable ``float8_<i>``
of ``"_overwrite_with_gradient"`` (:mod:`jmp_policy.linen._quantization`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import flax.linen as nn

from jmp_policy._src.framework import run_kernels
from jmp_policy._src.framework.entry_points import routed_matmuls
from jmp_policy._src.framework.params_tree import restore_params
from jmp_policy._src.framework.protocol import InstallsMatmuls, Layer
from jmp_policy._src.framework.search import param_kernels
from jmp_policy._src.options import Options
from jmp_policy._src.resolution import ModuleInfo, Resolver
from jmp_policy.linen._modules import check_module
from jmp_policy.linen._quantization import installed, kernel, layer_state
from jmp_policy.linen._reads import kv_caches
from jmp_policy.linen._stacks import stacks
from jmp_policy.linen._trace import method_for, run_traced


class Bound(NamedTuple):
    """A Linen model as the core sees it.

    ``apply_kwargs``: ``module.apply``'s keywords (``rngs``, ``mutable``,
    ``capture_intermediates``). ``known``: the modules met so far (kept by the wrapper
    across its calls). ``report``: told each run's resolver (the wrapper's warnings), also
    when the run fails. ``sample``: ``() -> (args, kwargs)`` of a call, whose shape-only
    run tells the stacked axes of ``nn.scan``/``nn.vmap`` layers (``weights``).
    """

    module: nn.Module
    variables: Mapping[str, Any]
    known: dict[str, ModuleInfo]
    method: Any = None
    apply_kwargs: Mapping[str, Any] = {}
    report: Callable[[Resolver], None] | None = None
    sample: Callable[[], tuple[tuple[Any, ...], Mapping[str, Any]]] | None = None


class LinenAdapter(InstallsMatmuls):
    """The adapter protocol (:class:`jmp_policy._src.framework.protocol.Adapter`) for Linen,
    with the routing operations (:class:`~jmp_policy._src.framework.protocol.Routing`)."""

    model_name = "nn.Module"

    def check(self, model: Any) -> None:
        check_module(model.module if isinstance(model, Bound) else model)

    def class_name(self, model: Bound) -> str:
        return type(model.module).__name__

    def layers(self, model: Bound) -> Iterator[Layer]:
        for path, info in list(model.known.items()):  # in the order they were met
            yield Layer(path, info.cls or object, info.own_dtype)

    def params(self, model: Bound) -> Mapping[str, Any]:
        return model.variables.get("params", {})  # type: ignore[no-any-return]

    def learn(self, model: Bound, policies: Any, options: Options, args: Any, kwargs: Any) -> None:
        """Meets the modules of ``model``'s call on ``args`` (call it inside a shape-only
        trace: the run is traced, nothing else)."""
        resolver = Resolver(policies, options, {})
        self.run(model, resolver, options, (), lambda m: m(*args, **kwargs))

    def run(
        self,
        model: Bound,
        resolver: Resolver,
        options: Options,
        extensions: tuple[Any, ...],
        call: Callable[[Any], Any],
    ) -> Any:
        # The hook reads them from the options: the core's, the user's, the routed
        # matmuls innermost (in every run, init's and learning runs too).
        routed = routed_matmuls(self)
        extra = tuple(e for e in extensions if e is not routed)
        options = dataclasses.replace(options, extensions=(*extra, *options.extensions, routed))
        module, method = model.module, model.method

        def traced(cast_variables: Any, run_resolver: Resolver) -> Any:
            def bound(*args: Any, **kwargs: Any) -> Any:
                method_run = method_for(run_resolver, method)
                with kv_caches(run_resolver.options.kv_cache):
                    return module.apply(
                        cast_variables, *args, method=method_run, **model.apply_kwargs, **kwargs
                    )

            return call(bound)

        result, learnt, cast_variables = run_traced(
            module,
            resolver.policy_or_map,
            options,
            model.known,
            model.variables,
            traced,
            method,
            model.report,
        )
        resolver.infos.update(learnt.infos)
        resolver.used_keys |= learnt.used_keys
        if model.report is not None:
            model.report(learnt)
        given = model.apply_kwargs
        if given.get("mutable", False) is False and not given.get("capture_intermediates"):
            return result
        out, state = result
        variables = model.variables
        if isinstance(state, Mapping) and "params" in state and "params" in variables:
            state = dict(state)
            state["params"] = restore_params(
                state["params"], cast_variables["params"], variables["params"], learnt
            )
        return out, state

    kernel_of, install_matmul = staticmethod(kernel), staticmethod(installed)
    layer_state = staticmethod(layer_state)

    def matmul_kind(self, module: Any) -> str:
        return "einsum" if isinstance(module, nn.Einsum) else "dot_general"

    def kernel_ahead(self, call: Any) -> Any:
        return run_kernels.kernels().ahead.get(call.path)

    def stacks(self, model: Bound) -> dict[str, tuple[int, int]]:
        """Parameter path -> ``(n, axis)`` of each stacked parameter (``model.sample``'s
        shape-only run; none without a sample)."""
        if model.sample is None:
            return {}
        args, kwargs = model.sample()
        return stacks(model.module, model.variables, args, kwargs, model.method)

    def weights(self, model: Bound) -> tuple[Any, Any, Callable[[Any], Any]]:
        # The whole "params" collection, each stacked parameter's axes where its stack
        # keeps them; put back beside the other collections.
        stacked_axes = {re.escape(path): stack for path, stack in self.stacks(model).items()}

        def rebuild(params: Any) -> Bound:
            return model._replace(variables={**model.variables, "params": params})

        return model.variables["params"], stacked_axes, rebuild

    def search_kernels(self, model: Bound) -> tuple[dict[str, Any], Callable[[], Any]]:
        # Every floating "kernel" of rank >= 2; where a stack's layers start, once the
        # sample (the first batch) is checked.
        kernels = param_kernels(self.params(model))

        def stacked_at() -> dict[str, int]:
            found = self.stacks(model).items()
            return {
                path[: -len("/kernel")]: at for path, (_, at) in found if path.endswith("/kernel")
            }

        return kernels, stacked_at

    def with_sample(self, model: Bound, args: tuple[Any, ...], kwargs: Any) -> Bound:
        return model._replace(sample=lambda: (args, kwargs))

    def split(self, model: Bound) -> tuple[Any, Callable[[Any], Any]]:
        return dict(model.variables), lambda v: model._replace(variables=v)


ADAPTER = LinenAdapter()
