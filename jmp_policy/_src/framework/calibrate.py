"""``calibrate`` (GPTQ, AWQ), written once against the adapter protocol.

The model runs in float32 on each batch (jit-compiled, one compilation per batch shape),
each GPTQ/AWQ layer's matmul replaced for the run by one that gathers its inputs'
statistics (:mod:`jmp_policy._src.calibration_gather`: a stack's per layer, in its loop);
then :func:`jmp_policy._src.quantization.calibration.quantize_calibrated` solves each
kernel, int8/int4 kernels rounded to nearest, and the adapter puts them in a new model.
Kernels are handed to the solver as ``[in, out]`` under the name ``kernel`` (the layout
and name the solvers read), whatever the framework calls them. An adapter with the
optional ``weights`` operation (:class:`~jmp_policy._src.framework.protocol.Routing`)
hands its own weight tree instead (NNX: every ``nnx.Param``), as ``quantize`` takes it;
a calibrated kernel of a layer whose matmul the core does not route is rounded to
nearest, with a warning naming it.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax

from jmp_policy._src import calibration_gather, global_state
from jmp_policy._src.batch_checks import blaming, check_bool, check_no_nan
from jmp_policy._src.framework.entry_points import canonical
from jmp_policy._src.framework.protocol import Adapter
from jmp_policy._src.framework.routing import call_routed, matmul_kind
from jmp_policy._src.identifiers import get as get_policy
from jmp_policy._src.options import Options, as_policy_or_map
from jmp_policy._src.policy_map import DTypePolicyMap
from jmp_policy._src.quantization import calibration, calibration_checks, is_quantized, matmuls
from jmp_policy._src.resolution import Resolver
from jmp_policy._src.tree_paths import leaf_path, parent_path

KERNEL = "kernel"  # the name the calibration solvers read a kernel under
SETTINGS = ("hessian_damping", "num_grid_points", "clip_search")  # the solvers' settings


def _kernels(adapter: Adapter, model: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(tree, stacked)``: every routable float kernel as ``[in, out]`` in a module tree
    (``{"blocks": {"attn": {"query_proj": {"kernel": ...}}}}``), and the stacked axes of
    each stacked one (``"path/kernel" -> (n, 0)``)."""
    tree: dict[str, Any] = {}
    stacked: dict[str, Any] = {}
    for layer in adapter.layers(model):
        if layer.kernel_name is None or is_quantized(layer.kernel):
            continue
        parts = [*(layer.path.split("/") if layer.path else []), KERNEL]
        node = tree
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[KERNEL] = canonical(layer.kernel, layer)
        if layer.stacked:
            stacked["/".join(parts)] = (len(layer.stacked), 0)
    return tree, stacked


def _weights(adapter: Adapter, model: Any) -> tuple[Any, dict[str, Any], Callable[[Any], Any]]:
    """``(tree, stacked, rebuild)``: the weights calibrate covers, the stacked axes of each
    stacked one (``"path/kernel" -> (n, axis)``), and ``rebuild(new tree)``, the new model:
    the adapter's ``weights`` (its stacked axes keyed by pattern: ``(n, axis)`` or ``n``
    leading axes), else the routable layers' kernels (:func:`_kernels`), put back by
    ``with_kernels``."""
    weights = getattr(adapter, "weights", None)
    if weights is not None:
        tree, axes, rebuild = weights(model)
        stacked = {}
        for key_path, _ in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_quantized)[0]:
            path = leaf_path(key_path)
            found = [at for pattern, at in (axes or {}).items() if re.fullmatch(pattern, path)]
            if found:
                stacked[path] = found[0] if isinstance(found[0], tuple) else (found[0], 0)
        return tree, stacked, rebuild
    tree, stacked = _kernels(adapter, model)

    def with_kernels(new: Any) -> Any:
        kernels = {
            parent_path(leaf_path(kp)) or "": q
            for kp, q in jax.tree_util.tree_flatten_with_path(new, is_leaf=is_quantized)[0]
            if is_quantized(q)
        }
        return adapter.with_kernels(model, kernels)

    return tree, stacked, with_kernels


def _gather(
    adapter: Adapter,
    model: Any,
    targets: Mapping[str, tuple[int, ...]],
    lead: Mapping[str, int],
    unseen: dict[str, str],
    calls: list[tuple[Any, ...]],
    kwargs: Mapping[str, Any],
    max_bytes: int | None,
) -> Any:
    """Each target's statistics over the calls (the model run in float32)."""
    if not targets:
        return {}
    arrays, rebuild = adapter.split(model)
    options = Options()

    def make_run(some: Mapping[str, tuple[int, ...]]) -> Any:
        def capturing(call: Any, next_fn: Any, args: Any, kw: Any) -> Any:
            kernel = None if call.path not in some else adapter.kernel_of(call.module)
            if kernel is None:
                if call.path in some and call.module is not None:
                    unseen[call.path] = (
                        f"its layer is a {type(call.module).__name__}, whose matmul "
                        "calibrate does not see"
                    )
                return next_fn(*args, **kw)
            capture = calibration_gather.capturing_dot_general(call.path, some[call.path])
            matmul = matmuls.of_kind(matmul_kind(adapter, call.module), capture)
            return call_routed(adapter, call, matmul, kernel, next_fn, args, kw)

        def run(arrays: Any, stats: Any, args: tuple[Any, ...]) -> Any:
            live = rebuild(arrays)
            resolver = Resolver(get_policy("float32"), options)
            with calibration_gather.gathering(stats, lead, unseen) as gathered:
                adapter.run(live, resolver, options, (capturing,), lambda m: m(*args, **kwargs))
            return gathered

        return run

    return calibration_gather.gather(make_run, targets, arrays, calls, max_bytes)


def calibrate(
    adapter: Adapter,
    model: Any,
    policy_or_map: Any,
    batches: Iterable[Any],
    settings: Mapping[str, Any],
    return_report: bool,
    progress: Any,
    max_statistics_bytes: int | None,
    kwargs: Mapping[str, Any],
) -> Any:
    """A new model with its GPTQ/AWQ kernels calibrated and int8/int4 ones rounded."""
    adapter.check(model)
    calibration_checks.check_settings(
        settings["hessian_damping"], settings["num_grid_points"], settings["clip_search"]
    )
    max_bytes = calibration_gather.check_max_bytes(max_statistics_bytes)
    calls = calibration_checks.check_batches(batches)
    progress = calibration_checks.check_progress(progress)
    check_bool(return_report, "return_report", "also return the per-layer report")
    check_no_nan(calls, "calibrate")
    policies = as_policy_or_map(policy_or_map)
    if policies is None:
        policies = global_state.dtype_policy()
    if not isinstance(policies, DTypePolicyMap):
        policies = DTypePolicyMap(policies)
    # The weights the adapter's quantize covers (a run on a batch may find its stacks: the
    # first call handed to an adapter with the optional ``with_sample``).
    if (with_sample := getattr(adapter, "with_sample", None)) is not None:
        model = with_sample(model, calls[0], kwargs)
    blame = blaming("batches[0]", calls[0], "calibrate") if hasattr(adapter, "weights") else None
    with blame or contextlib.nullcontext():
        tree, stacked, rebuild = _weights(adapter, model)
    policy_tree = policies.policy_tree(tree)
    calibration_checks.warn_unmatched(policies, tree, policy_tree)
    targets: dict[str, tuple[int, ...]] = {}
    unseen: dict[str, str] = {}
    found = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_quantized)[0]
    policy_leaves = jax.tree.leaves(policy_tree, is_leaf=lambda p: not isinstance(p, dict))
    for (key_path, kernel), policy in zip(found, policy_leaves, strict=True):
        path = leaf_path(key_path)
        module = calibration.kernel_module(path)  # a kernel's (the solvers read no other)
        if module is not None and calibration.is_calibrated(policy):
            # A layer whose matmul the core does not route is said in `unseen` as it runs.
            n, at = stacked.get(path, (0, 0))
            shape = tuple(kernel.shape)
            targets[module] = shape[:at] + shape[at + n :]  # one layer's
    lead = {p: stacked.get(f"{p}/{KERNEL}" if p else KERNEL, (0, 0))[0] for p in targets}
    stats = _gather(adapter, model, targets, lead, unseen, calls, kwargs, max_bytes)
    new, report = calibration.quantize_calibrated(
        tree, policy_tree, stats, stacked, dict(settings), unseen, progress
    )
    calibrated = rebuild(new)
    return (calibrated, report) if return_report else calibrated


def calibrate_call(adapter: Adapter, arguments: Mapping[str, Any]) -> Any:
    """:func:`calibrate` with a framework's public ``calibrate``'s arguments by name (its
    ``locals()``: ``model``, ``policy_or_map``, ``batches``, ``hessian_damping``,
    ``num_grid_points``, ``clip_search``, ``return_report``, ``progress``,
    ``max_statistics_bytes`` and ``kwargs``, the call's keywords)."""
    given = dict(arguments)
    settings = {name: given.pop(name) for name in SETTINGS}
    return calibrate(adapter, settings=settings, **given)
