"""Calibrating a Linen model: GPTQ and AWQ kernels from the inputs each layer sees."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import flax.linen as nn
import jax

from jmp_policy._src import calibration_gather, global_state, quantization
from jmp_policy._src.batch_checks import blaming, check_bool, check_no_nan
from jmp_policy._src.options import as_policy_or_map
from jmp_policy._src.policy_map import DTypePolicyMap, leaf_path
from jmp_policy._src.quantization import calibration, calibration_checks, matmuls
from jmp_policy._src.quantization.awq import DEFAULT_NUM_GRID_POINTS
from jmp_policy._src.quantization.calibration_stats import LayerStats
from jmp_policy._src.quantization.gptq import DEFAULT_HESSIAN_DAMPING
from jmp_policy.linen._modules import check_module, check_params, path_of
from jmp_policy.linen._quantization import routable, run_with
from jmp_policy.linen._quantize import stacks


def _targets(params: Any, policy_tree: Any) -> dict[str, tuple[int, ...]]:
    """Module path -> its kernel's stored shape, for kernels under GPTQ/AWQ policies."""
    flat = jax.tree_util.tree_flatten_with_path(params, is_leaf=quantization.is_quantized)[0]
    policies = jax.tree.leaves(policy_tree, is_leaf=lambda p: not isinstance(p, (dict, list)))
    found = {}
    for (kp, x), policy in zip(flat, policies, strict=True):
        module = calibration.kernel_module(leaf_path(kp))
        if module is not None and calibration.is_calibrated(policy):
            found[module] = tuple(getattr(x, "shape", ()))
    return found


def _collect(
    module: nn.Module,
    targets: Mapping[str, tuple[int, ...]],
    stacked: Mapping[str, int],
    method: Any,
    kwargs: Any,
    unseen: dict[str, str],
) -> Any:
    """``run(variables, stats, args) -> stats``, adding one batch's inputs (jit it);
    ``unseen`` collects, as runs are traced, why a target's inputs were not.
    ``targets``: module path -> one layer's kernel shape; ``stacked``: module path -> the
    leading axes its stacked kernel has (its layers gathered one per loop iteration)."""

    def run(variables: Any, stats: dict[str, LayerStats], args: tuple[Any, ...]) -> Any:
        def intercept(next_fun: Any, a: Any, k: Any, context: Any) -> Any:
            mod = context.module
            path = path_of(mod)
            if context.method_name != "__call__" or path not in targets:
                return next_fun(*a, **k)
            if not routable(mod):
                unseen[path] = (
                    f"its layer is a {type(mod).__name__}, whose matmul calibrate does not see"
                )
                return next_fun(*a, **k)
            capture = calibration_gather.capturing_dot_general(path, targets[path])
            kind = "einsum" if isinstance(mod, nn.Einsum) else "dot_general"
            return run_with(mod, matmuls.of_kind(kind, capture), next_fun, a, k)

        gather = calibration_gather.gathering(stats, stacked, unseen)
        with gather as gathered, nn.intercept_methods(intercept):
            module.apply(variables, *args, method=method, mutable=True, **kwargs)
        return gathered

    return run


def calibrate(
    module: nn.Module,
    policy_or_map: Any,
    variables: Mapping[str, Any],
    batches: Iterable[Any],
    *,
    method: Any = None,
    hessian_damping: float = DEFAULT_HESSIAN_DAMPING,
    num_grid_points: int = DEFAULT_NUM_GRID_POINTS,
    clip_search: bool = True,
    return_report: bool = False,
    progress: Any = False,
    max_statistics_bytes: int | None = None,
    **kwargs: Any,
) -> Any:
    """``variables`` with kernels under GPTQ/AWQ policies calibrated, int8/int4 rounded.

    Runs the unmodified model (``module.apply(variables, *batch, method=method,
    **kwargs)``) on each calibration batch, gathering, for each ``Dense``/``DenseGeneral``
    or ``Einsum`` whose kernel is under a :class:`~jmp_policy.GPTQDTypePolicy` or
    :class:`~jmp_policy.AWQDTypePolicy`, the Gram matrix ``XᵀX`` (float32) and ``mean |x|``
    of the inputs of its matmul; then solves each kernel (GPTQ, or AWQ's scale search,
    each jit-compiled) in the int4/int8 storage the serving matmuls read. Kernels under
    int8/int4 policies are rounded to nearest, as :func:`quantize` does; the rest stay
    float. Each layer sees the float model's inputs (not those of already-quantized
    earlier layers). The layers of an ``nn.scan`` stack are each solved from the inputs
    they see in their own iteration, those of an ``nn.vmap`` stack (``variable_axes=
    {"params": 0}``) from the inputs they see in their own lane (the same inputs for all
    when ``in_axes=None``), and stored stacked as :func:`quantize` stores them
    (``nn.remat`` layers too). A layer under a GPTQ/AWQ policy whose matmul is not seen
    (an ``nn.Einsum`` contracting kernel axes other than its leading ones, such as
    ``"btd,ndh->btnh"``, a custom matmul, a layer inside a transform other than these,
    such as ``shard_map``) is rounded to nearest with a warning naming it. Batches of different
    shapes each compile the run once.

    Args:
        module: a ``flax.linen`` Module instance.
        policy_or_map: a policy (or name), a :class:`~jmp_policy.DTypePolicyMap` or a dict.
        variables: the model's float variables (``{"params": ...}``).
        batches: an iterable of calls' arguments (a tuple per call, or one array).
        method: the method to run (as ``module.apply``'s).
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
        **kwargs: keyword arguments of each call (``rngs=`` when it needs them).

    Returns:
        The variables, their ``"params"`` quantized (and the report if asked).

    Raises:
        TypeError: ``module`` is not a Linen module, ``variables`` not a mapping,
            ``batches`` not iterable (or a string), or ``return_report`` not a bool.
        ValueError: no ``"params"``, no batch, a batch holding NaN, or a batch the model
            fails on (naming ``batches[i]``, the model's error chained).

    Warns:
        UserWarning: a GPTQ/AWQ key of the map chooses the policy of no layer.

    Examples:
        >>> import jax, jax.numpy as jnp, flax.linen as nn
        >>> import jmp_policy as jp
        >>> model = nn.Sequential([nn.Dense(64), nn.relu, nn.Dense(8)])
        >>> x = jax.random.normal(jax.random.key(0), (256, 32))
        >>> variables = model.init(jax.random.key(1), x)
        >>> policies = jp.DTypePolicyMap("float32", {"layers_0": "gptq/4/16_from_float32",
        ...                                          "layers_2": "int8_from_float32"})
        >>> q = jp.linen.calibrate(model, policies, variables, [x[:128], x[128:]])
        >>> q["params"]["layers_0"]["kernel"]
        QuantizedArray(int4/16, shape=(32, 64), original_dtype=float32)
        >>> jp.linen.apply(model, policies)(q, x).shape
        (256, 8)
    """
    check_module(module)
    check_params(variables, "calibrate")
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
    params = variables["params"]
    policy_tree = policies.policy_tree(params)
    calibration_checks.warn_unmatched(policies, params, policy_tree)
    targets = _targets(params, policy_tree)
    with blaming("batches[0]", calls[0], "calibrate"):
        stacked = stacks(module, variables, calls[0], kwargs, method)
    lead = {p: stacked.get(f"{p}/kernel", (0, 0))[0] for p in targets}
    targets = {p: _layer(s, stacked.get(f"{p}/kernel", (0, 0))) for p, s in targets.items()}
    stats: dict[str, LayerStats] = {}
    unseen: dict[str, str] = {}
    if targets:
        stats = calibration_gather.gather(
            lambda some: _collect(module, some, lead, method, kwargs, unseen),
            targets,
            variables,
            calls,
            max_statistics_bytes,
        )
    options = {
        "hessian_damping": hessian_damping,
        "num_grid_points": num_grid_points,
        "clip_search": clip_search,
    }
    new, report = calibration.quantize_calibrated(
        params, policy_tree, stats, stacked, options, unseen, progress
    )
    result = {**variables, "params": new}
    return (result, report) if return_report else result


def _layer(shape: tuple[int, ...], stack: tuple[int, int]) -> tuple[int, ...]:
    """One layer's kernel shape: ``shape`` without its ``n`` stacked axes at ``axis``."""
    n, at = stack
    return shape[:at] + shape[at + n :]
