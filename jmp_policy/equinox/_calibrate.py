"""Calibrating an Equinox model (GPTQ, AWQ): the core's ``calibrate`` with the adapter."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from jmp_policy._src.framework.calibrate import calibrate_call
from jmp_policy._src.framework.shared_docs import fill
from jmp_policy._src.quantization.awq import DEFAULT_NUM_GRID_POINTS
from jmp_policy._src.quantization.gptq import DEFAULT_HESSIAN_DAMPING
from jmp_policy.equinox._api import ADAPTER


@fill
def calibrate(
    model: Any,
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
    """A new model with weights under GPTQ/AWQ policies calibrated, int8/int4 rounded.

    Runs the model in float32 on each calibration batch (``model(*batch, **kwargs)``,
    jit-compiled); a layer's statistics are over every row a ``jax.vmap`` of it sees, and
    the weights are stored in the ``[in, out]`` ``QuantizedArray`` storage :func:`quantize`
    makes. ``model`` is not modified.
    {calibrate_description}

    Args:
        model: an ``eqx.Module``.
        {policy_or_map}
        {batches}
        {calibrate_options}

    {calibrate_tail}

    Examples:
        >>> import jax
        >>> import equinox as eqx
        >>> import jmp_policy as jp
        >>> class Batched(eqx.Module):   # an MLP on a batch of rows
        ...     mlp: eqx.nn.MLP
        ...     def __call__(self, x):
        ...         return jax.vmap(self.mlp)(x)
        >>> model = Batched(eqx.nn.MLP(32, 8, 64, depth=1, key=jax.random.key(0)))
        >>> x = jax.random.normal(jax.random.key(1), (256, 32))
        >>> policies = {"mlp/layers/0": "gptq/4/16_from_float32",
        ...             "mlp/layers/1": "int8_from_float32"}
        >>> q = jp.equinox.calibrate(model, policies, [x[:128], x[128:]])
        >>> q.mlp.layers[0].weight
        QuantizedArray(int4/16, shape=(32, 64), original_dtype=float32)
        >>> jp.equinox.apply(q, policies)(x).shape
        (256, 8)
    """
    return calibrate_call(ADAPTER, locals())
