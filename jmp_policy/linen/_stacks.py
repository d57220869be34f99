"""What a shape-only run of a Linen model shows (:class:`Seen`, watching every module call):
where its stacked layers keep their stacked axes (``nn.scan``'s ``variable_axes``, else the
shapes each layer sees its parameters at), and the kernel shape each routable layer sees
(how a quantized kernel reaches it: whole, or its layer's slice)."""

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
from jmp_policy.linen._quantization import routable


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


class Seen:
    """What a shape-only run of the model shows while :meth:`watching`: ``shapes``,
    parameter path -> the shape of lowest rank a module saw it at (inside ``nn.scan`` a
    layer sees a slice of its stacked kernel); ``scans``, module path -> the parameters'
    axis of each ``nn.scan`` met; ``kernels``, routable layer path -> the kernel shape that
    layer's call sees (the stored kernel's, or its slice inside ``nn.scan``)."""

    def __init__(self) -> None:
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.scans: dict[str, int] = {}
        self.kernels: dict[str, tuple[int, ...]] = {}
        self._running: list[str] = [""]  # the paths of the module calls in progress

    def watching(self) -> Any:
        """The block's module calls are watched (``nn.intercept_methods``)."""
        return nn.intercept_methods(self._intercept)

    def _intercept(self, next_fun: Any, a: Any, k: Any, context: Any) -> Any:
        mod, name = context.module, context.method_name
        if (axis := scan_axis(mod)) is not None and isinstance(mod.name, str):
            # Flax hands the interceptor a scan module off the model's tree (no path):
            # its path is its name under the module that calls it.
            self.scans.setdefault("/".join(p for p in (self._running[-1], mod.name) if p), axis)
        if name == "setup":
            return next_fun(*a, **k)
        try:
            params = mod.variables.get("params", {})
        except Exception:  # an unbound module: nothing to see
            params = {}
        for tail, leaf in by_path(params).items():
            path = "/".join(p for p in (path_of(mod), tail) if p)
            shape = tuple(getattr(leaf, "shape", ()))
            if path not in self.shapes or len(shape) < len(self.shapes[path]):
                self.shapes[path] = shape
            if tail == "kernel" and routable(mod):
                self.kernels[path_of(mod)] = shape
        if name is None or not _bound(mod):
            return next_fun(*a, **k)
        self._running.append(path_of(mod))
        try:
            return next_fun(*a, **k)
        finally:
            self._running.pop()


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
    seen = Seen()

    def run(v: Any) -> Any:  # kernels already quantized: run on their float shapes
        v = with_params(v, lambda p: jax.tree.map(_float, p, is_leaf=quantization.is_quantized))
        with seen.watching():
            return module.apply(v, *args, method=method, mutable=True, **kwargs)

    jax.eval_shape(run, variables)
    shapes = {
        path: tuple(getattr(leaf, "shape", ()))
        for path, leaf in by_path(variables["params"]).items()
    }
    return stacked_axes(shapes, seen.shapes, seen.scans)
