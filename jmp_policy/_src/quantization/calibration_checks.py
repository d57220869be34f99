"""What ``calibrate`` (Linen and NNX) checks before it runs a layer: its settings, its
progress, its batches (:mod:`jmp_policy._src.batch_checks` runs them), and whether the
map's GPTQ/AWQ keys name any layer of the model (a typo would leave it all float).
"""

from __future__ import annotations

import warnings
from typing import Any

import jax

from jmp_policy._src import dtypes as dt
from jmp_policy._src.int_arguments import check_int
from jmp_policy._src.quantization import quantized_array as quantization
from jmp_policy._src.quantization.calibration import is_calibrated, kernel_module
from jmp_policy._src.tree_paths import leaf_path

#: The most AWQ grid points ``calibrate`` takes (Keras's default is 20).
MAX_GRID_POINTS = 10_000


def check_settings(hessian_damping: Any, num_grid_points: Any, clip_search: Any = True) -> None:
    """``calibrate``'s solver settings, checked before any layer runs.

    Raises:
        TypeError: ``hessian_damping`` is not a real number, ``num_grid_points`` not an
            int or ``clip_search`` not a bool.
        ValueError: ``hessian_damping`` is negative or not finite; ``num_grid_points`` is
            outside 1 to :data:`MAX_GRID_POINTS`.
    """
    if isinstance(hessian_damping, bool) or not isinstance(hessian_damping, (int, float)):
        raise TypeError(
            "`hessian_damping` must be a number (a fraction of the mean Hessian diagonal, "
            f"Keras's default 0.01). Received: hessian_damping={hessian_damping!r}"
        )
    if not 0 <= hessian_damping < float("inf"):
        raise ValueError(
            "`hessian_damping` must be a finite number >= 0 (Keras's default 0.01). "
            f"Received: hessian_damping={hessian_damping!r}"
        )
    check_int(num_grid_points, "num_grid_points", 1, MAX_GRID_POINTS, why=" (Keras's default 20)")
    if not isinstance(clip_search, bool):
        raise TypeError(
            "`clip_search` must be True (search each group's clipping ratio, the default) "
            f"or False (abs-max scales). Received: clip_search={clip_search!r}"
        )


def check_progress(progress: Any) -> Any:
    """``progress`` of ``calibrate``: ``False`` (quiet), ``True`` (a ``tqdm`` bar over the
    calibrated layers when ``tqdm`` is installed, else a line per layer on stderr) or a
    callable given each layer's :class:`LayerReport` as it is solved.

    Raises:
        TypeError: anything else.
    """
    if isinstance(progress, bool) or callable(progress):
        return progress
    raise TypeError(
        "`progress` must be True (a progress bar over layers), False or a callable given "
        f"each LayerReport. Received: progress={progress!r} (of type {type(progress).__name__})"
    )


def check_batches(batches: Any) -> list[tuple[Any, ...]]:
    """Calibration batches as a list of argument tuples (a non-tuple batch is one argument).

    Raises:
        TypeError: ``batches`` is not iterable.
        ValueError: it holds no batch.
    """
    if isinstance(batches, (str, bytes)):  # iterable, but its items are no call arguments
        raise TypeError(
            "`batches` must be an iterable of the model's call arguments (a tuple per call, "
            f"or one array), such as [x1, x2]. Received: batches={dt.bounded_repr(batches)}"
        )
    try:
        items = list(batches)
    except TypeError:
        raise TypeError(
            "`batches` must be an iterable of the model's call arguments (a tuple per call, "
            f"or one array). Received: batches of type {type(batches).__name__}"
        ) from None
    if not items:
        raise ValueError(
            "`batches` holds no batch: calibration needs at least one. Received: batches=[]"
        )
    return [b if isinstance(b, tuple) else (b,) for b in items]


def warn_unmatched(policy_map: Any, params: Any, policy_tree: Any) -> None:
    """Warns once when a GPTQ/AWQ key of ``policy_map`` chooses the policy of no leaf of
    ``params``, or no kernel is under a GPTQ/AWQ policy at all while the map holds one
    (``DTypePolicyMap.quantize`` warns in the same case): those layers stay float."""
    keys = [k for k, p in policy_map.items() if is_calibrated(p)]
    if not keys and not is_calibrated(policy_map.default_policy):
        return
    unused = [k for k in policy_map.unused_keys(params) if k in keys]
    policies = jax.tree.leaves(policy_tree, is_leaf=lambda p: not isinstance(p, (dict, list)))
    flat = jax.tree_util.tree_flatten_with_path(params, is_leaf=quantization.is_quantized)[0]
    calibrated = any(
        is_calibrated(p) and kernel_module(leaf_path(kp)) is not None
        for (kp, _), p in zip(flat, policies, strict=True)
    )
    if calibrated and not unused:
        return
    what = (
        f"the map's GPTQ/AWQ key(s) {unused} choose the policy of no layer of the model"
        if unused
        else "no kernel of the model is under the map's GPTQ/AWQ policies"
    )
    warnings.warn(
        f"calibrate: {what}, so no layer is calibrated for them and they stay float "
        "(int8/int4 kernels are still rounded to nearest, as `quantize` does). Check the "
        "map's keys against the tree's paths (`map.explain(params)`, "
        "`map.unused_keys(params)`).",
        stacklevel=3,
    )
