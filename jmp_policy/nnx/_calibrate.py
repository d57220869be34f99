"""Calibrating an NNX model (GPTQ, AWQ): the core's ``calibrate`` with the NNX adapter."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, TypeVar

from flax import nnx

from jmp_policy._src.framework.calibrate import calibrate_call
from jmp_policy._src.framework.shared_docs import fill
from jmp_policy._src.quantization.awq import DEFAULT_NUM_GRID_POINTS
from jmp_policy._src.quantization.gptq import DEFAULT_HESSIAN_DAMPING
from jmp_policy.nnx._adapter import ADAPTER

M = TypeVar("M", bound=nnx.Module)


@fill
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

    Runs a copy of the unmodified model (``model(*batch, **kwargs)``, jit-compiled) on each
    calibration batch.
    {calibrate_description}
    Unseen: an ``nnx.Einsum`` contracting kernel axes other than its leading ones
    (``"btd,ndh->btnh"``) or with its own ``einsum_op``, a custom ``dot_general``, a layer
    inside a transform other than ``nnx.scan``, ``nnx.vmap`` and ``nnx.remat``, or an
    ``nnx.vmap`` function made before calibrate ran (at import).

    Args:
        model: an ``nnx.Module``; never modified (the copy is made with ``nnx.clone``).
        {policy_or_map}
        {batches}
        {calibrate_options}

    {calibrate_tail}

    Examples:
        >>> import jax
        >>> from flax import nnx
        >>> import jmp_policy as jp
        >>> model = nnx.Sequential(nnx.Linear(32, 64, rngs=nnx.Rngs(0)), nnx.relu,
        ...                        nnx.Linear(64, 8, rngs=nnx.Rngs(1)))
        >>> x = jax.random.normal(jax.random.key(0), (256, 32))
        >>> policies = jp.DTypePolicyMap("float32", {"layers/0": "gptq/4/16_from_float32",
        ...                                          "layers/2": "int8_from_float32"})
        >>> q = jp.nnx.calibrate(model, policies, [x[:128], x[128:]])
        >>> q.layers[0].kernel.get_value()
        QuantizedArray(int4/16, shape=(32, 64), original_dtype=float32)
        >>> jp.nnx.apply(q, policies)(x).shape
        (256, 8)
    """
    return calibrate_call(ADAPTER, locals())
