"""Calibrating an NNX model: GPTQ and AWQ kernels from the inputs each layer sees."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

import jax
from flax import nnx

from jmp_policy._src import calibration_gather, global_state, user_warnings
from jmp_policy._src.batch_checks import check_bool, check_no_nan
from jmp_policy._src.options import as_policy_or_map
from jmp_policy._src.policy_map import DTypePolicyMap, leaf_path
from jmp_policy._src.quantization import calibration, calibration_checks, matmuls
from jmp_policy._src.quantization.awq import DEFAULT_NUM_GRID_POINTS
from jmp_policy._src.quantization.calibration_stats import LayerStats
from jmp_policy._src.quantization.gptq import DEFAULT_HESSIAN_DAMPING
from jmp_policy.nnx._modules import check_model, path_of
from jmp_policy.nnx._quantization import (
    kind_of,
    replacement,
    routable,
    stacked,
)
from jmp_policy.nnx._stack_axes import ambiguous_stack, stack_axes

M = TypeVar("M", bound=nnx.Module)


def _stacked_params(model: nnx.Module, params: Any) -> dict[str, tuple[int, int]]:
    """Parameter path -> ``(n, axis)``: the stacked axes of its layer (``nnx.vmap``-created)
    and where they start; a layer whose axis cannot be told is left whole, with a warning."""
    lead = {}
    axes = stack_axes(model)
    for parts, m in nnx.iter_modules(model):
        if n := len(stacked(m)):
            if (at := axes[path_of(parts)]) is None:
                user_warnings.warn(ambiguous_stack(path_of(parts), m))
                continue
            lead[path_of(parts)] = (n, at)
    found = {}
    for kp, _ in jax.tree_util.tree_flatten_with_path(params)[0]:
        path = leaf_path(kp)
        if (stack := lead.get(path.rpartition("/")[0])) is not None:
            found[path] = stack
    return found


def _targets(
    model: nnx.Module, params: Any, policy_tree: Any, stacked_params: Mapping[str, Any]
) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """``(targets, unseen)``: module path -> kernel shape of each GPTQ/AWQ layer whose
    matmul calibrate sees; module path -> why it does not see the others'."""
    modules = {path_of(parts): m for parts, m in nnx.iter_modules(model)}
    targets, unseen = {}, {}
    for kp, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        path = leaf_path(kp)
        module = calibration.kernel_module(path)
        policy = policy_tree_leaf(policy_tree, kp)
        if module is None or not calibration.is_calibrated(policy):
            continue
        if routable(modules.get(module)):  # its matmul one calibrate can replace
            n, at = stacked_params.get(path, (0, 0))
            targets[module] = tuple(x.shape)[:at] + tuple(x.shape)[at + n :]  # one layer's
        else:
            name = type(modules.get(module)).__name__
            unseen[module] = f"its layer is a {name}, whose matmul calibrate does not see"
    return targets, unseen


def _gather(
    model: nnx.Module,
    targets: Mapping[str, tuple[int, ...]],
    unseen: dict[str, str],
    stacked_params: Mapping[str, tuple[int, int]],
    calls: list[tuple[Any, ...]],
    kwargs: Mapping[str, Any],
    max_bytes: int | None,
) -> dict[str, LayerStats]:
    """Each target's statistics over the calls (one jit-compiled run per batch shape, per
    group of layers under ``max_bytes``); a stacked layer's per layer, gathered in each
    iteration of its ``nnx.scan`` or lane of its ``nnx.vmap``."""
    if not targets:
        return {}
    graphdef, whole = nnx.split(model)
    lead = {p: stacked_params.get(f"{p}/kernel", (0, 0))[0] for p in targets}

    def make_run(some: Mapping[str, tuple[int, ...]]) -> Any:
        def run(whole: Any, stats: Mapping[str, LayerStats], args: tuple[Any, ...]) -> Any:
            live = nnx.merge(graphdef, whole)
            for parts, m in nnx.iter_modules(live):
                path, name = path_of(parts), replacement(m)  # "dot_general", "einsum_op"
                if path in some and name is not None:  # targets are routable
                    capture = calibration_gather.capturing_dot_general(path, some[path])
                    setattr(m, name, matmuls.of_kind(kind_of(name), capture))
            with calibration_gather.gathering(stats, lead, unseen) as gathered:
                live(*args, **kwargs)
            return gathered

        return run

    return calibration_gather.gather(make_run, targets, whole, calls, max_bytes)


def calibrate(
    model: M,
    policy_or_map: Any,
    batches: Iterable[Any],
    *,
    hessian_damping: float = DEFAULT_HESSIAN_DAMPING,
    num_grid_points: int = DEFAULT_NUM_GRID_POINTS,
    clip_search: bool = True,
    return_report: bool = False,
    progress: Any = False,
    max_statistics_bytes: int | None = None,
    **kwargs: Any,
) -> Any:
    """A copy of ``model`` with kernels under GPTQ/AWQ policies calibrated, int8/int4 rounded.

    Runs a copy of the unmodified model (``model(*batch, **kwargs)``, jit-compiled, one
    compilation per batch shape) on each calibration batch, gathering, for each
    ``nnx.Linear``/``nnx.LinearGeneral``/``nnx.Einsum`` whose kernel is under a
    :class:`~jmp_policy.GPTQDTypePolicy` or :class:`~jmp_policy.AWQDTypePolicy`, the Gram
    matrix ``XᵀX`` (float32) and ``mean |x|`` of its matmul's inputs; then solves each
    kernel (GPTQ, or AWQ's scale search, each jit-compiled) in the int4/int8 storage the
    serving matmuls read. Kernels under int8/int4 policies are rounded to nearest, as
    :func:`quantize` does; the rest stay float. Each layer sees the float model's inputs.
    The layers of a stack (created with ``nnx.vmap``) are each solved from the inputs
    they see in their own iteration when run with ``nnx.scan``, in their own lane when run
    with ``nnx.vmap`` (the same inputs for all when they are broadcast, ``in_axes=None``),
    and stored stacked as :func:`quantize` stores them (layers called through
    ``nnx.remat`` too). A layer under a GPTQ/AWQ policy whose matmul is not seen (an
    ``nnx.Einsum`` contracting kernel axes other than its leading ones, such as
    ``"btd,ndh->btnh"``, or with its own ``einsum_op``, a custom ``dot_general``, a layer inside a transform other than
    these, or an ``nnx.vmap`` function made before calibrate ran, at import) is rounded to
    nearest with a warning naming it.

    Args:
        model: an ``nnx.Module``; never modified (the copy is made with ``nnx.clone``).
        policy_or_map: a policy (or name), a :class:`~jmp_policy.DTypePolicyMap` or a dict.
        batches: an iterable of calls' arguments (a tuple per call, or one array).
        hessian_damping: GPTQ's damping, a fraction of the mean Hessian diagonal.
        num_grid_points: AWQ's exponent grid ``0, 1/n, ..., 1``.
        clip_search: choose each int4/int8 group's scale by a clipping search (GPTQ's
            reference ``mse=True`` grid on the weights; AWQ's ``auto_clip`` by the group's
            output error on the calibration inputs) instead of abs-max; ``False`` for
            abs-max scales, as Keras 3.15.
        return_report: also return the per-layer report (a list of ``LayerReport``: per
            calibrated kernel, the relative output error of round-to-nearest and of the
            method on the calibration inputs, and seconds).
        progress: ``True`` shows a progress bar over the calibrated layers (``tqdm`` when
            installed, else a line per layer on stderr); a callable is given each
            ``LayerReport`` as its layer is solved; ``False`` (default) is quiet.
        max_statistics_bytes: bounds the device memory the gathered statistics take
            (each layer's ``XᵀX`` and ``mean |x|``, float32): the layers are gathered in
            groups that fit, one pass over the batches per group, each group's moved to
            host memory before the next (a layer larger than the bound alone). ``None``
            (default): every layer in one pass. The result is the same.
        **kwargs: keyword arguments of each call.

    Returns:
        The calibrated copy (and the report if asked).

    Raises:
        TypeError: ``model`` is not an ``nnx.Module``, ``batches`` not iterable (or a
            string), ``progress`` neither a bool nor a callable, or ``return_report`` not
            a bool.
        ValueError: no batch, a batch holding NaN, or a batch the model fails on (naming
            ``batches[i]``, the model's error chained).

    Warns:
        UserWarning: a GPTQ/AWQ key of the map chooses the policy of no layer.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from flax import nnx
        >>> import jmp_policy as jp
        >>> class MLP(nnx.Module):
        ...     def __init__(self, rngs):
        ...         self.up, self.head = nnx.Linear(32, 64, rngs=rngs), nnx.Linear(64, 8, rngs=rngs)
        ...     def __call__(self, x):
        ...         return self.head(nnx.relu(self.up(x)))
        >>> x = jax.random.normal(jax.random.key(0), (256, 32))
        >>> policies = jp.DTypePolicyMap("float32", {"up": "gptq/4/16_from_float32",
        ...                                          "head": "int8_from_float32"})
        >>> q = jp.nnx.calibrate(MLP(nnx.Rngs(0)), policies, [x[:128], x[128:]])
        >>> q.up.kernel.get_value()
        QuantizedArray(int4/16, shape=(32, 64), original_dtype=float32)
        >>> jp.nnx.apply(q, policies)(x).shape
        (256, 8)
    """
    check_model(model)
    calibration_checks.check_settings(hessian_damping, num_grid_points, clip_search)
    calibration_gather.check_max_bytes(max_statistics_bytes)
    calls = calibration_checks.check_batches(batches)
    progress = calibration_checks.check_progress(progress)
    check_bool(return_report, "return_report", "also return the per-layer report")
    check_no_nan(calls, "calibrate")
    policies = as_policy_or_map(policy_or_map)
    if policies is None:
        policies = global_state.dtype_policy()
    if not isinstance(policies, DTypePolicyMap):
        policies = DTypePolicyMap(policies)
    copy = nnx.clone(model)
    state = nnx.state(copy, nnx.Param)
    params = nnx.to_pure_dict(state)
    policy_tree = policies.policy_tree(params)
    calibration_checks.warn_unmatched(policies, params, policy_tree)
    stacked_params = _stacked_params(copy, params)
    targets, unseen = _targets(copy, params, policy_tree, stacked_params)
    stats = _gather(copy, targets, unseen, stacked_params, calls, kwargs, max_statistics_bytes)
    options = {
        "hessian_damping": hessian_damping,
        "num_grid_points": num_grid_points,
        "clip_search": clip_search,
    }
    new, report = calibration.quantize_calibrated(
        params, policy_tree, stats, stacked_params, options, unseen, progress
    )
    nnx.replace_by_pure_dict(state, new)
    nnx.update(copy, state)
    return (copy, report) if return_report else copy


def policy_tree_leaf(policy_tree: Any, key_path: Any) -> Any:
    """The policy at ``key_path`` of a policy tree shaped as the parameters."""
    node = policy_tree
    for key in key_path:
        node = node[getattr(key, "key", getattr(key, "idx", key))]
    return node
