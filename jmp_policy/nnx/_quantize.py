"""``quantize``, ``calibrate`` (GPTQ, AWQ) and ``search_map`` for NNX: the core's entry
points (:mod:`jmp_policy._src.framework`) with the NNX adapter, each returning a copy of
the model (or a map for it) and never modifying it."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

from flax import nnx

from jmp_policy._src import map_search
from jmp_policy._src.framework import entry_points
from jmp_policy._src.framework.calibrate import calibrate_call
from jmp_policy._src.framework.search import search_call
from jmp_policy._src.framework.shared_docs import fill
from jmp_policy._src.options import Options
from jmp_policy._src.quantization.awq import DEFAULT_NUM_GRID_POINTS
from jmp_policy._src.quantization.gptq import DEFAULT_HESSIAN_DAMPING
from jmp_policy.nnx._adapter import ADAPTER
from jmp_policy.nnx._apply import apply_with
from jmp_policy.nnx._modules import check_model, prepare

M = TypeVar("M", bound=nnx.Module)


@fill
def quantize(model: M, policy_or_map: Any) -> M:
    """A copy of ``model`` whose kernels under int8 or int4 policies are quantized.

    What ``policy_or_map.quantize(nnx.state(model, nnx.Param))`` does, with the leading
    stacked axes of each layer found from the model.
    {quantize_description}
    A layer is stacked when it is created stacked (``nnx.vmap`` of its constructor): an
    ``nnx.Linear``, ``nnx.LinearGeneral``, ``nnx.Einsum`` or ``nnx.Conv`` whose kernel has
    more axes than the layer's own.

    Args:
        model: an ``nnx.Module``; never modified (the copy is made with ``nnx.clone``).
        {quantize_policy_or_map}

    Returns:
        The quantized copy of ``model``.

    Raises:
        TypeError: ``model`` is not an ``nnx.Module``.
        {quantize_error}

    Examples:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import jmp_policy as jp
        >>> class Stack(nnx.Module):
        ...     def __init__(self, rngs):
        ...         @nnx.split_rngs(splits=4)
        ...         @nnx.vmap
        ...         def make(rngs):
        ...             return nnx.Linear(8, 8, rngs=rngs)
        ...         self.layers = make(rngs)   # kernels [4, 8, 8]
        ...     def __call__(self, x):
        ...         @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        ...         def body(x, layer):
        ...             return layer(x)
        ...         return body(x, self.layers)
        >>> model = Stack(nnx.Rngs(0))
        >>> q = jp.nnx.quantize(model, "int8_from_float32")
        >>> q.layers.kernel.get_value()
        QuantizedArray(int8, shape=(4, 8, 8), original_dtype=float32, stacked=1)
        >>> q.layers.kernel.get_value().scale.shape   # a scale per layer and channel
        (4, 8)
        >>> q.layers.bias.get_value().dtype   # the stacked bias stays float
        dtype('float32')
        >>> jp.nnx.apply(q, "int8_from_float32")(jnp.ones((2, 8))).shape
        (2, 8)
    """
    return entry_points.quantize(ADAPTER, model, policy_or_map)  # type: ignore[no-any-return]


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


@fill
def search_map(
    model: nnx.Module,
    batches: Sequence[Any],
    loss_fn: Callable[[Any, Any], Any],
    *,
    budget: Mapping[str, float],
    candidates: Sequence[str] = map_search.DEFAULT_CANDIDATES,
    base: str = "mixed_bfloat16",
    inputs: Callable[[Any], tuple[Any, ...]] | None = None,
    progress: Callable[[str], None] | None = None,
    **options: Any,
) -> map_search.SearchResult:
    """Chooses a policy per layer under ``budget``, by each format's measured effect.

    {search_description}
    The layers are the ``nnx.Param`` kernels of rank >= 2 (``nnx.Linear``,
    ``nnx.LinearGeneral``, ``nnx.Einsum``, ``nnx.Conv``); the candidates run on quantized
    copies. The passes run eagerly (call it outside ``nnx.jit``). A function that
    ``nnx.remat`` or ``nnx.vmap`` wraps while the model runs is seen into; one wrapped
    before (at import) is not.

    Args:
        model: an ``nnx.Module`` with float parameters.
        {search_args}

    {search_tail}

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from flax import nnx
        >>> import jmp_policy as jp
        >>> model = nnx.Sequential(nnx.Linear(128, 256, rngs=nnx.Rngs(0)), nnx.relu,
        ...                        nnx.Linear(256, 4, rngs=nnx.Rngs(1)))
        >>> x = jax.random.normal(jax.random.key(0), (16, 128))
        >>> loss = lambda out, batch: (out.astype(jnp.float32) ** 2).mean()
        >>> result = jp.nnx.search_map(model, [x], loss, budget={"effective_bits": 8})
        >>> result.effective_bits <= 8
        True
    """
    check_model(model)

    def apply(runner: nnx.Module, policy_map: Any, taps: tuple[Any, ...]) -> Any:
        return apply_with(runner, *prepare(runner, policy_map, dict(options)), "__call__", taps)

    return search_call(ADAPTER, locals(), options=Options())
