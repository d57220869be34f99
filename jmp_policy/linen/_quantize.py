"""``quantize``, ``calibrate`` and ``search_map`` for Linen: the core's entry points
(:mod:`jmp_policy._src.framework`) on a :class:`~jmp_policy.linen._adapter.Bound` holding
the user's variables, whose stacked axes a shape-only run of a call tells."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import flax.linen as nn

from jmp_policy._src import map_search
from jmp_policy._src.framework import calibrate as core_calibrate
from jmp_policy._src.framework import entry_points
from jmp_policy._src.framework import search as core_search
from jmp_policy._src.framework.shared_docs import fill
from jmp_policy._src.options import Options
from jmp_policy._src.quantization.awq import DEFAULT_NUM_GRID_POINTS
from jmp_policy._src.quantization.gptq import DEFAULT_HESSIAN_DAMPING
from jmp_policy.linen._adapter import ADAPTER, Bound
from jmp_policy.linen._apply import apply_with
from jmp_policy.linen._modules import check_module, check_params, prepare


@fill
def quantize(
    module: nn.Module,
    policy_or_map: Any,
    variables: Mapping[str, Any],
    *args: Any,
    method: Any = None,
    **kwargs: Any,
) -> dict[str, Any]:
    """``variables`` with the kernels under int8 or int4 policies quantized, per layer.

    {quantize_description}
    The stacked axes are learnt by a shape-only run of ``module.apply(variables, *args,
    method=method, **kwargs)``: a kernel stored with more axes than its layer sees (an
    ``nn.scan`` or ``nn.vmap`` stack: stored ``[depth, in, out]``, or ``[in, depth, out]``
    for ``variable_axes={"params": 1}``) is a stack's. Other collections are returned as
    they are.

    Args:
        module: a ``flax.linen`` Module instance.
        {quantize_policy_or_map}
        variables: the model's variables (``{"params": ...}``) in float.
        *args: arguments of a call of the model (arrays or ``jax.ShapeDtypeStruct``: only
            their shapes are used).
        method: the method to run (as ``module.apply``'s ``method``).
        **kwargs: keyword arguments of the call (``rngs=`` when it needs them).

    Returns:
        The variables, their ``"params"`` quantized.

    Raises:
        TypeError: ``module`` is not a Linen module, or ``variables`` is not a mapping.
        {quantize_error}
        ValueError: ``variables`` has no ``"params"``.

    Examples:
        >>> import jax, jax.numpy as jnp, flax.linen as nn
        >>> import jmp_policy as jp
        >>> class Block(nn.Module):
        ...     @nn.compact
        ...     def __call__(self, x, _):
        ...         return nn.relu(nn.Dense(8)(x)), None
        >>> class Stack(nn.Module):
        ...     @nn.compact
        ...     def __call__(self, x):
        ...         layers = nn.scan(Block, variable_axes={"params": 0},
        ...                          split_rngs={"params": True}, length=4)
        ...         return layers(name="layers")(x, None)[0]
        >>> model, x = Stack(), jnp.ones((2, 8))
        >>> variables = model.init(jax.random.key(0), x)
        >>> q = jp.linen.quantize(model, "int8_from_float32", variables, x)
        >>> q["params"]["layers"]["Dense_0"]["kernel"]
        QuantizedArray(int8, shape=(4, 8, 8), original_dtype=float32, stacked=1)
        >>> q["params"]["layers"]["Dense_0"]["kernel"].scale.shape   # per layer
        (4, 8)
        >>> jp.linen.apply(model, "int8_from_float32")(q, x).shape
        (2, 8)
    """
    check_module(module)
    check_params(variables, "quantize")
    model = Bound(module, variables, {}, method, sample=lambda: (args, kwargs))
    return entry_points.quantize(ADAPTER, model, policy_or_map).variables  # type: ignore[no-any-return]


@fill
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

    Runs the unmodified model (``module.apply(variables, *batch, method=method, **kwargs)``)
    on each calibration batch.
    {calibrate_description}
    Unseen: an ``nn.Einsum`` contracting kernel axes other than its leading ones
    (``"btd,ndh->btnh"``), a custom matmul, a layer inside a transform other than
    ``nn.scan``, ``nn.vmap`` and ``nn.remat`` (such as ``shard_map``).

    Args:
        module: a ``flax.linen`` Module instance.
        {policy_or_map}
        variables: the model's float variables, a mapping holding ``"params"`` (else a
            ``TypeError``, a ``ValueError``).
        {batches}
        method: the method to run (as ``module.apply``'s).
        {calibrate_options}

    {calibrate_tail}

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
    given = {k: v for k, v in locals().items() if k not in ("module", "variables", "method")}
    model = Bound(module, variables, {}, method, {"mutable": True})
    result = core_calibrate.calibrate_call(ADAPTER, {**given, "model": model})
    return (result[0].variables, result[1]) if return_report else result.variables


@fill
def search_map(
    module: nn.Module,
    variables: Mapping[str, Any],
    batches: Sequence[Any],
    loss_fn: Callable[[Any, Any], Any],
    *,
    budget: Mapping[str, float],
    candidates: Sequence[str] = map_search.DEFAULT_CANDIDATES,
    base: str = "mixed_bfloat16",
    inputs: Callable[[Any], tuple[Any, ...]] | None = None,
    jit: bool = True,
    progress: Callable[[str], None] | None = None,
    **options: Any,
) -> map_search.SearchResult:
    """Chooses a policy per layer under ``budget``, by each format's measured effect.

    {search_description}
    Layers are the modules holding a ``kernel`` (``Dense``, ``DenseGeneral``, ``Conv``,
    ``Einsum``); those under ``nn.remat`` are scored as without it, those inside another
    transform (``shard_map``) are not. The jit-compiled passes are kept for the module,
    ``loss_fn``, ``inputs`` and options given (by identity): searching the same model again
    (new weights, another budget) compiles nothing new for batches of the same shapes.

    Args:
        module: a ``flax.linen`` Module instance.
        variables: its float variables (``{"params": ...}``).
        {search_args}
        jit: compile the passes (``False`` runs them eagerly).

    {search_tail}

    Examples:
        >>> import jax, jax.numpy as jnp, flax.linen as nn
        >>> import jmp_policy as jp
        >>> model = nn.Sequential([nn.Dense(256), nn.relu, nn.Dense(4)])
        >>> x = jax.random.normal(jax.random.key(0), (16, 128))
        >>> variables = model.init(jax.random.key(1), x)
        >>> loss = lambda out, batch: (out.astype(jnp.float32) ** 2).mean()
        >>> result = jp.linen.search_map(model, variables, [x], loss,
        ...                              budget={"effective_bits": 8})
        >>> result.effective_bits <= 8
        True
        >>> sorted(row.path for row in result.table)
        ['layers_0', 'layers_2']
    """
    check_module(module)
    check_params(variables, "search")
    args_of = inputs or (lambda batch: (batch,))
    model = Bound(module, variables, {}, sample=lambda: (args_of(batches[0]), {}))
    # One run per candidate map (kept: its id names it), as `apply` makes it.
    runs: dict[int, tuple[Any, Callable[..., Any]]] = {}

    def run(bound: Bound, policy_map: Any, taps: tuple[Any, ...]) -> Callable[..., Any]:
        if id(policy_map) not in runs:
            policies, opts = prepare(module, policy_map, None, dict(options))
            opts = dataclasses.replace(opts, extensions=(*taps, *opts.extensions))
            runs[id(policy_map)] = (policy_map, apply_with(module, policies, opts, None))
        fn = runs[id(policy_map)][1]
        return lambda *args: fn(bound.variables, *args)

    return core_search.search_map(
        ADAPTER,
        model,
        batches,
        loss_fn,
        budget=budget,
        candidates=candidates,
        base=base,
        inputs=inputs,
        progress=progress,
        options=Options(),
        apply=run,
        jit=jit,
        # Linen modules are immutable: the same module, loss and options make the same
        # passes (their jitted forms kept across calls); options by their text.
        reuse=(module, loss_fn, inputs, repr(sorted(options.items()))),
    )
