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
        {policy_or_map}
        {batches}
        {calibrate_options}
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
        {calibrate_warns}

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
    return calibrate_call(ADAPTER, locals())
