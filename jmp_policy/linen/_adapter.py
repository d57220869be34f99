"""The Linen adapter of the framework protocol (:mod:`jmp_policy._src.framework`).

A Linen module holds no variables: the core's "model" is a :class:`Bound`, the module with
the variables of one call and how to call it (``method``, and ``module.apply``'s other
keywords). Its modules are the ones the wrapper has met (Linen modules exist only while
they run): :meth:`LinenAdapter.learn` meets them by a shape-only run. A run goes through
the interceptor of :mod:`jmp_policy.linen._trace` (parameters cast as they are read, the
model traced again when a module met late changes a cast), and ``"params"`` handed back
under ``mutable=`` come back in their stored dtypes. Linen's layers route their own
matmuls (:mod:`jmp_policy.linen._quantization`: float8's per-call state, kernels of
``nn.scan`` stacks read a slice per layer), so no module is handed to the core's routing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import flax.linen as nn
import jax

from jmp_policy._src import casting, quantization
from jmp_policy._src.framework.entry_points import routed_matmuls
from jmp_policy._src.framework.protocol import Layer, RoutesOwnMatmuls
from jmp_policy._src.options import Options
from jmp_policy._src.policy_map import leaf_path
from jmp_policy._src.quantization import stack_layers
from jmp_policy._src.resolution import ModuleInfo, Resolver
from jmp_policy.linen._kv_cache import kv_caches
from jmp_policy.linen._modules import check_module
from jmp_policy.linen._reads import PARAM_READS
from jmp_policy.linen._trace import flat_params, method_for, run_traced


class Bound(NamedTuple):
    """A Linen model as the core sees it.

    ``apply_kwargs``: ``module.apply``'s keywords (``rngs``, ``mutable``,
    ``capture_intermediates``). ``known``: the modules met so far (kept by the wrapper
    across its calls). ``report``: told each run's resolver (the wrapper's warnings), also
    when the run fails.
    """

    module: nn.Module
    variables: Mapping[str, Any]
    known: dict[str, ModuleInfo]
    method: Any = None
    apply_kwargs: Mapping[str, Any] = {}
    report: Callable[[Resolver], None] | None = None


class LinenAdapter(RoutesOwnMatmuls):
    """The adapter protocol (:class:`jmp_policy._src.framework.protocol.Adapter`) for Linen."""

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
        routed = routed_matmuls(self)  # a pass-through here: the core routes no Linen layer
        extra = tuple(e for e in extensions if e is not routed)
        if extra:  # the hook reads them from the options, the user's after the core's
            options = dataclasses.replace(options, extensions=(*extra, *options.extensions))
        module, method = model.module, model.method

        def traced(cast_variables: Any, run_resolver: Resolver) -> Any:
            def bound(*args: Any, **kwargs: Any) -> Any:
                method_run = method_for(run_resolver, method)
                with kv_caches(run_resolver.options.kv_cache, PARAM_READS):
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
            state["params"] = _restore_params(
                state["params"], cast_variables["params"], variables["params"], learnt
            )
        return out, state

    def split(self, model: Bound) -> tuple[Any, Callable[[Any], Any]]:
        return dict(model.variables), lambda v: model._replace(variables=v)


ADAPTER = LinenAdapter()


def _restore_params(returned: Any, passed: Any, stored: Any, resolver: Resolver) -> Any:
    """``mutable`` "params" back in their stored dtypes (the stored leaf when unchanged; a
    quantized kernel as stored, the scales a stack's loop sliced beside it dropped)."""

    def by_path(tree: Any) -> dict[str, Any]:
        return {leaf_path(key_path): leaf for key_path, leaf in flat_params(tree)[0]}

    passed_leaves, stored_leaves = by_path(passed), by_path(stored)
    flat, treedef = flat_params(_without_layer_leaves(returned))
    leaves = []
    for key_path, leaf in flat:
        path = leaf_path(key_path)
        if path in stored_leaves and (
            leaf is passed_leaves[path] or quantization.is_quantized(stored_leaves[path])
        ):
            leaves.append(stored_leaves[path])
        elif path in stored_leaves and hasattr(stored_leaves[path], "dtype"):
            leaves.append(casting.cast_leaf(leaf, stored_leaves[path].dtype))
        else:
            leaves.append(casting.cast_leaf(leaf, resolver.variable_dtype(path)))
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _without_layer_leaves(tree: Any) -> Any:
    """``tree`` without the leaves a stacked quantized kernel's scales were passed in
    (:mod:`jmp_policy._src.quantization.stack_layers`)."""
    if not isinstance(tree, Mapping):
        return tree
    return type(tree)(  # type: ignore[call-arg]
        {
            name: _without_layer_leaves(value)
            for name, value in tree.items()
            if not stack_layers.is_extra_leaf(str(name))
        }
    )
