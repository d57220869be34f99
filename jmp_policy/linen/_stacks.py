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
from jmp_policy._src.policy_map import leaf_path
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
    scans: dict[str, int] | None = None,
) -> dict[str, tuple[int, ...]]:
    """Parameter path -> the shape of lowest rank a module of the model saw it at, by a
    shape-only run (inside ``nn.scan`` a layer sees a slice of its stacked kernel); into
    ``scans``, module path -> the parameters' axis of each ``nn.scan`` it met."""
    seen: dict[str, tuple[int, ...]] = {}
    running: list[str] = [""]  # the paths of the module calls in progress

    def intercept(next_fun: Any, a: Any, k: Any, context: Any) -> Any:
        if scans is not None and (axis := scan_axis(context.module)) is not None:
            # Flax hands the interceptor a scan module off the model's tree (no path):
            # its path is its name under the module that calls it.
            name = getattr(context.module, "name", None)
            if isinstance(name, str):
                scans.setdefault("/".join(p for p in (running[-1], name) if p), axis)
        if context.method_name not in ("setup", None) and _bound(context.module):
            running.append(path_of(context.module))
            try:
                return _seen_call(next_fun, a, k, context)
            finally:
                running.pop()
        return _seen_call(next_fun, a, k, context)

    def _seen_call(next_fun: Any, a: Any, k: Any, context: Any) -> Any:
        if context.method_name != "setup":
            mod = context.module
            try:
                params = mod.variables.get("params", {})
            except Exception:  # an unbound module: nothing to see
                params = {}
            stem = path_of(mod)
            for kp, leaf in jax.tree_util.tree_flatten_with_path(
                params, is_leaf=quantization.is_quantized
            )[0]:
                path = "/".join(p for p in (stem, leaf_path(kp)) if p)
                shape = tuple(getattr(leaf, "shape", ()))
                if path not in seen or len(shape) < len(seen[path]):
                    seen[path] = shape
        return next_fun(*a, **k)

    def run(v: Any) -> Any:
        v = dict(v)
        if "params" in v:  # kernels already quantized: run on their float shapes
            v["params"] = jax.tree.map(
                lambda x: x.dequantize() if quantization.is_quantized(x) else x,
                v["params"],
                is_leaf=quantization.is_quantized,
            )
        with nn.intercept_methods(intercept):
            return module.apply(v, *args, method=method, mutable=True, **kwargs)

    jax.eval_shape(run, variables)
    return seen


def _positions(axes: list[int]) -> list[int]:
    """Where the stacked axes of nested scans (``axes``: each scan's ``variable_axes``,
    outermost first) lie in the stored parameter, outermost first."""
    positions: list[int] = []
    for axis in reversed(axes):  # innermost first: each outer scan inserts its axis
        positions = [p + 1 if p >= axis else p for p in positions] + [axis]
    return positions[::-1]


def stacks(
    module: nn.Module, variables: Mapping[str, Any], args: Any, kwargs: Any, method: Any
) -> dict[str, tuple[int, int]]:
    """Parameter path -> ``(n, axis)``: its ``n`` stacked axes, starting at ``axis``. The
    axes come from the ``variable_axes`` of the ``nn.scan`` stacks around its layer; for
    other stacks (``nn.vmap``) from shapes, leading axes first. A parameter whose scans
    put their axes apart (nested scans on different axes) has none: it is quantized whole
    and runs dequantized ahead of its stack."""
    scans: dict[str, int] = {}
    seen = _seen_shapes(module, variables, args, kwargs, method, scans)
    found = {}
    for kp, leaf in jax.tree_util.tree_flatten_with_path(
        variables["params"], is_leaf=quantization.is_quantized
    )[0]:
        path = leaf_path(kp)
        stored, shape = tuple(getattr(leaf, "shape", ())), seen.get(path)
        if shape is None or (n := len(stored) - len(shape)) <= 0:
            continue
        around = [a for s, a in sorted(scans.items()) if path.startswith(f"{s}/" if s else "")]
        if len(around) == n:  # every stacked axis is a scan's: where the scans put them
            at = _positions(around)[0]
            if _positions(around) == list(range(at, at + n)) and (
                stored[:at] + stored[at + n :] == shape
            ):
                found[path] = (n, at)
            continue
        fits = [a for a in range(len(shape) + 1) if stored[:a] + stored[a + n :] == shape]
        if fits:  # leading axes first, as before scans told their axes
            found[path] = (n, fits[0])
    return found
