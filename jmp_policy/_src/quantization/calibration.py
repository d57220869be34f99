"""From gathered input statistics to quantized parameters: the part of ``calibrate`` that
both glues share (they gather :class:`~jmp_policy._src.quantization.calibration_stats.LayerStats` per
layer path; this picks, per kernel, GPTQ, AWQ, round-to-nearest or nothing).

A kernel under a GPTQ or AWQ policy whose layer was seen on the calibration batches is
solved (:func:`~jmp_policy._src.quantization.gptq.gptq_quantize`,
:func:`~jmp_policy._src.quantization.awq.awq_quantize`); one whose layer was not seen (a matmul the glue
cannot see) is rounded to nearest in the same storage, with a warning naming it. A
stacked kernel (``[depth, ...]``, an ``nn.scan``/``nnx.scan`` layer stack) whose
statistics were gathered per layer (``[depth, in, in]``) is solved layer by layer, each
from its own statistics, and stored stacked as ``quantize`` stores a stack. Kernels under
int8/int4 policies are rounded to nearest, as ``quantize`` does; the rest stay float.
Nothing here knows Flax.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
import warnings
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jmp_policy._src.quantization import awq, kernel_leaves
from jmp_policy._src.quantization import quantized_array as quantization
from jmp_policy._src.quantization.calibrated_schemes import CalibratedScheme
from jmp_policy._src.quantization.calibration_stats import LayerStats
from jmp_policy._src.quantization.quantized_tree import replace
from jmp_policy._src.tree_paths import leaf_path


@dataclasses.dataclass(frozen=True)
class LayerReport:
    """One calibrated kernel: its method, the relative output error on the calibration
    inputs, ``|XW - XŴ| / |XW|``, of round-to-nearest and of the method, and seconds.

    ``calibrate(..., return_report=True)`` (Linen, NNX) returns a list of them, one per
    calibrated kernel; ``explain(..., calibration=report)`` prints it under its table.

    Examples:
        >>> import jmp_policy as jp
        >>> row = jp.LayerReport("up/kernel", "gptq", rtn_error=0.0812, error=0.0413, seconds=1.2)
        >>> f"{row.path} ({row.method}): {row.rtn_error:.1%} -> {row.error:.1%}"
        'up/kernel (gptq): 8.1% -> 4.1%'
    """

    path: str
    method: str
    rtn_error: float
    error: float
    seconds: float


def calibrated_scheme(policy: Any) -> CalibratedScheme | None:
    """The GPTQ or AWQ scheme of ``policy``; ``None`` for other policies."""
    scheme = getattr(policy, "scheme", None)
    return scheme if isinstance(scheme, CalibratedScheme) else None


def is_calibrated(policy: Any) -> bool:
    """Whether ``policy`` is a GPTQ or AWQ policy."""
    return calibrated_scheme(policy) is not None


def kernel_module(path: str) -> str | None:
    """The module path of a ``".../kernel"`` parameter path; ``None`` for other leaves."""
    module, _, name = path.rpartition("/")
    return module if name == "kernel" else None


def _relative(w: jax.Array, w_hat: jax.Array, gram: jax.Array) -> float:
    w = w.reshape(gram.shape[0], -1)
    w_hat = w_hat.reshape(gram.shape[0], -1)
    err = awq.output_error(w, w_hat, gram)
    ref = awq.output_error(w, jnp.zeros_like(w), gram)
    return float(jnp.sqrt(err / jnp.maximum(ref, 1e-30)))


def quantize_calibrated(
    params: Any,
    policy_tree: Any,
    stats: Mapping[str, LayerStats],
    stacked: Mapping[str, Any],
    options: Mapping[str, Any],
    unseen_reason: Mapping[str, str] | None = None,
    progress: Any = False,
) -> tuple[Any, list[LayerReport]]:
    """``params`` with every kernel quantized as its policy says (see the module docstring).

    Args:
        params: the float parameter tree.
        policy_tree: the policy of each leaf (``DTypePolicyMap.policy_tree(params)``).
        stats: module path -> the statistics its layer's matmul inputs gave.
        stacked: parameter path -> its leading stacked axes (absent: 0), or a pair
            ``(n, axis)``: ``n`` stacked axes starting at ``axis``.
        options: ``hessian_damping``, ``num_grid_points`` and ``clip_search``.
        unseen_reason: module path -> why its layer's inputs were not gathered.
        progress: see :func:`check_progress`.

    Returns:
        The quantized tree and a report per calibrated kernel.
    """
    unseen_reason = unseen_reason or {}
    policies = jax.tree.leaves(policy_tree, is_leaf=lambda p: not isinstance(p, (dict, list)))
    flat, treedef = jax.tree_util.tree_flatten_with_path(params, is_leaf=quantization.is_quantized)
    reports: list[LayerReport] = []
    out = []
    total = sum(
        is_calibrated(p) and kernel_module(leaf_path(kp)) is not None
        for (kp, _), p in zip(flat, policies, strict=True)
    )
    tell, close = _progress(progress, total)
    for (kp, x), policy in zip(flat, policies, strict=True):
        path = leaf_path(kp)
        stack = stacked.get(path, 0)
        k, at = stack if isinstance(stack, tuple) else (stack, 0)
        if not kernel_leaves.quantizable_layers(x, k, path):
            out.append(x)
        elif is_calibrated(policy):
            done = len(reports)

            def solve(front: Any, n: int, path: str = path, policy: Any = policy) -> Any:
                args = (stats, options, unseen_reason, reports)
                return _calibrated_leaf(path, front, n, policy, *args)

            out.append(kernel_leaves.quantize_stacked(solve, x, k, at, path))
            tell(path, reports[done:])
        elif getattr(policy, "scheme", None) is not None and policy.scheme.stores_weights:
            out.append(kernel_leaves.quantize_stacked(policy.scheme.quantize, x, k, at, path))
        else:
            out.append(x)
    close()
    return jax.tree_util.tree_unflatten(treedef, out), reports


def _progress(progress: Any, total: int) -> tuple[Any, Any]:
    """``(tell(path, reports), close())`` for :func:`check_progress`'s values (``reports``:
    the kernel's, one per layer of a stack; none where it was rounded to nearest)."""
    if progress is False:
        return (lambda path, reports: None), (lambda: None)
    if progress is not True:

        def call(path: str, reports: list[LayerReport]) -> None:
            for report in reports:
                progress(report)

        return call, (lambda: None)
    try:
        from tqdm.auto import tqdm  # optional: not a dependency of jmp_policy
    except ImportError:
        done = [0]

        def line(path: str, reports: list[LayerReport]) -> None:
            done[0] += 1
            what = "\n  ".join(map(_row, reports)) or f"{path} rounded to nearest"
            print(f"calibrate [{done[0]}/{total}] {what}", file=sys.stderr)

        return line, (lambda: None)
    bar = tqdm(total=total, desc="calibrate", unit="layer")

    def step(path: str, reports: list[LayerReport]) -> None:
        bar.set_postfix_str(path)
        bar.update(1)

    return step, bar.close


def _row(r: LayerReport) -> str:
    return f"{r.path:40s} {r.method:6s} {r.rtn_error:8.4f} {r.error:8.4f} {r.seconds:6.2f}"


def _calibrated_leaf(
    path: str,
    x: Any,
    k: int,
    policy: Any,
    stats: Mapping[str, LayerStats],
    options: Mapping[str, Any],
    unseen_reason: Mapping[str, str],
    reports: list[LayerReport],
) -> Any:
    module = kernel_module(path)
    scheme = policy.scheme
    if module is None:  # not a kernel (DenseGeneral's 2-D bias): rounded as quantize does
        return scheme.round_to_nearest(x, k)
    layer = stats.get(module)
    lead = tuple(x.shape[:k])
    why = unseen_reason.get(module or "", "no calibration batch reached its matmul")
    if layer is not None and tuple(layer.gram.shape[:-2]) != lead:
        why = (
            f"its {lead} stacked layers were not seen one per iteration of a scan or lane "
            "of a vmap (nn.scan/nnx.scan, nn.vmap/nnx.vmap)"
        )
        layer = None
    if layer is None or bool(jnp.any(layer.count == 0)):
        block = scheme.block_size
        warnings.warn(
            f"calibrate: {path!r} is under {policy.name!r} but is rounded to nearest "
            f"({scheme.storage_mode}{'' if block is None else f'/{block}'}) because {why}. "
            "Give it an 'int4/<block>' or 'int8' policy in the map to say so, or make its "
            "layer a Dense/DenseGeneral (Linen) or Linear/LinearGeneral (NNX) with its own "
            "matmul.",
            stacklevel=4,
        )
        return scheme.round_to_nearest(x, k)
    if not k:
        return _solve_layer(path, x, scheme, layer, options, reports)
    solved = []
    for index in np.ndindex(*lead):  # each layer of the stack from its own statistics
        one = jax.tree.map(lambda a, index=index: a[index], layer)
        name = f"{path}[{','.join(map(str, index))}]"
        solved.append(_solve_layer(name, x[index], scheme, one, options, reports))
    return stack_layers(solved, tuple(x.shape), k)


def _solve_layer(
    path: str,
    x: Any,
    scheme: Any,
    layer: LayerStats,
    options: Mapping[str, Any],
    reports: list[LayerReport],
) -> Any:
    """One (unstacked) kernel solved from its layer's statistics, its report appended."""
    start = time.perf_counter()
    in_axes = input_axes(tuple(x.shape), layer.features)
    q = scheme.solve(x, layer.gram, layer.mean_abs, options, in_axes, abs_max=layer.abs_max)
    jax.block_until_ready(q.values)
    seconds = time.perf_counter() - start
    w = jnp.asarray(x, jnp.float32)
    rtn = scheme.round_to_nearest(x).dequantize(jnp.float32)
    rtn_error = _relative(w, rtn, layer.gram)
    error = _relative(w, q.dequantize(jnp.float32), layer.gram)
    reports.append(LayerReport(path, scheme.mode, rtn_error, error, seconds))
    return q


def stack_layers(layers: list[Any], shape: tuple[int, ...], k: int) -> Any:
    """The solved kernels of a stack's layers (in ``np.ndindex`` order of its ``k`` leading
    axes, of ``shape[:k]``) as one stacked kernel of ``shape``: the layout
    ``quantize(x, stacked=k)`` gives (values, scales and an AWQ input scale with the
    leading axes)."""
    lead = shape[:k]

    def stacked(name: str) -> Any:
        parts = [jnp.asarray(getattr(q, name)) for q in layers]
        return jnp.stack(parts).reshape(*lead, *parts[0].shape)

    fields: dict[str, Any] = {
        "values": stacked("values"), "scale": stacked("scale"), "shape": shape, "stacked": k
    }  # fmt: skip
    if isinstance(layers[0], awq.InputScaledArray):
        fields["input_scale"] = stacked("input_scale")
    return replace(layers[0], **fields)


def format_report(reports: list[LayerReport]) -> str:
    """The report as a table: one row per calibrated kernel."""
    rows = [f"{'layer':40s} {'method':6s} {'RTN err':>8s} {'err':>8s} {'s':>6s}"]
    rows.extend(_row(r) for r in reports)
    return "\n".join(rows)


def rows_for_kernel(lhs: Any, rhs_shape: tuple[int, ...], dims: Any) -> jax.Array | None:
    """The matmul input as rows of the kernel's input features when the kernel's leading
    axes ``0..k-1`` are contracted with no batch axes (Dense, DenseGeneral: attention's
    output projection contracts ``[heads, head_dim]``), flattened in the kernel's axis
    order; ``None`` for other layouts."""
    (lc, rc), (lb, rb) = dims
    k = len(rc)
    if sorted(int(r) for r in rc) != list(range(k)) or lb or rb or k >= len(rhs_shape):
        return None
    lhs = jnp.asarray(lhs)
    axes = [int(lc[list(rc).index(j)]) for j in range(k)]  # lhs axis of kernel axis j
    moved = jnp.moveaxis(lhs, axes, list(range(lhs.ndim - k, lhs.ndim)))
    return moved.reshape(-1, math.prod(int(d) for d in rhs_shape[:k]))


def input_axes(shape: tuple[int, ...], features: int) -> int:
    """How many leading axes of a kernel of ``shape`` its layer's ``features`` inputs span
    (1 for a Dense kernel; 2 for attention's output projection ``[heads, head_dim, out]``)."""
    total = 1
    for k, d in enumerate(shape[:-1], start=1):
        total *= int(d)
        if total == features:
            return k
    return 1
