"""Where a Linen model's stacked layers keep their stacked axes: ``nn.scan``'s
``variable_axes``, else the shapes each layer sees its parameters at (a shape-only run)."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
from flax.core import lift
from flax.core.scope import in_filter
from flax.linen.module import TestScope

from jmp_policy._src import quantization
from jmp_policy._src.framework.params_tree import by_path, with_params
from jmp_policy._src.framework.stack_axes import stacked_axes
from jmp_policy.linen._modules import path_of


def scan_axis(module: nn.Module) -> int | None:
    """The axis an ``nn.scan`` module slices its ``"params"`` along (its ``variable_axes``
    as the scan was built with it), or ``None`` (not a scan, or its parameters are not
    sliced). Read from the lifted ``__call__`` that ``nn.scan`` makes for the class."""
    for cls in type(module).__mro__:
        fn = cls.__dict__.get("__call__")
        if fn is None or getattr(fn, "__code__", None) is None:
            continue
        try:
            lifted = inspect.getclosurevars(fn).nonlocals
        except (TypeError, ValueError):  # pragma: no cover - not a Python function
            continue
        transform, kwargs = lifted.get("transform"), lifted.get("trafo_kwargs")
        if transform is None or not isinstance(kwargs, Mapping):
            continue
        if transform is not lift.scan:
            return None  # an outer transform (nn.remat of a scan is read from its own)
        for collections, axis in dict(kwargs.get("variable_axes") or {}).items():
            axis = getattr(axis, "axis", axis)  # `partitioning.ScanIn(1)`, as big_vision's
            if in_filter(collections, "params") and isinstance(axis, int):
                return axis
        return None
    return None


def _bound(module: nn.Module) -> bool:
    """A module of the model's tree: bound, not the clone Flax checks ``setup`` on."""
    return module.scope is not None and not isinstance(module.parent, TestScope)


def _seen_shapes(
    module: nn.Module,
    variables: Mapping[str, Any],
    args: Any,
    kwargs: Any,
    method: Any,
    scans: dict[str, int],
) -> dict[str, tuple[int, ...]]:
    """Parameter path -> the shape of lowest rank a module of the model saw it at, by a
    shape-only run (inside ``nn.scan`` a layer sees a slice of its stacked kernel); into
    ``scans``, module path -> the parameters' axis of each ``nn.scan`` it met."""
    seen: dict[str, tuple[int, ...]] = {}
    running: list[str] = [""]  # the paths of the module calls in progress

    def intercept(next_fun: Any, a: Any, k: Any, context: Any) -> Any:
        mod, name = context.module, context.method_name
        if (axis := scan_axis(mod)) is not None and isinstance(mod.name, str):
            # Flax hands the interceptor a scan module off the model's tree (no path):
            # its path is its name under the module that calls it.
            scans.setdefault("/".join(p for p in (running[-1], mod.name) if p), axis)
        if name == "setup":
            return next_fun(*a, **k)
        try:
            params = mod.variables.get("params", {})
        except Exception:  # an unbound module: nothing to see
            params = {}
        for tail, leaf in by_path(params).items():
            path = "/".join(p for p in (path_of(mod), tail) if p)
            shape = tuple(getattr(leaf, "shape", ()))
            if path not in seen or len(shape) < len(seen[path]):
                seen[path] = shape
        if name is None or not _bound(mod):
            return next_fun(*a, **k)
        running.append(path_of(mod))
        try:
            return next_fun(*a, **k)
        finally:
            running.pop()

    def run(v: Any) -> Any:  # kernels already quantized: run on their float shapes
        v = with_params(v, lambda p: jax.tree.map(_float, p, is_leaf=quantization.is_quantized))
        with nn.intercept_methods(intercept):
            return module.apply(v, *args, method=method, mutable=True, **kwargs)

    jax.eval_shape(run, variables)
    return seen


def _float(x: Any) -> Any:
    return x.dequantize() if quantization.is_quantized(x) else x


def stacks(
    module: nn.Module, variables: Mapping[str, Any], args: Any, kwargs: Any, method: Any
) -> dict[str, tuple[int, int]]:
    """Parameter path -> ``(n, axis)``: its ``n`` stacked axes, starting at ``axis``
    (:func:`~jmp_policy._src.framework.stack_axes.stacked_axes`: the ``nn.scan`` stacks'
    ``variable_axes``, else shapes). A parameter whose scans put their axes apart (nested
    scans on different axes) has none: it is quantized whole and runs dequantized ahead
    of its stack."""
    scans: dict[str, int] = {}
    seen = _seen_shapes(module, variables, args, kwargs, method, scans)
    shapes = {
        path: tuple(getattr(leaf, "shape", ()))
        for path, leaf in by_path(variables["params"]).items()
    }
    return stacked_axes(shapes, seen, scans)
