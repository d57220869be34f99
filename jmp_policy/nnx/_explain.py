"""``explain``: which policy every submodule of an NNX model runs under, and why."""

from __future__ import annotations

from typing import Any

from flax import nnx

from jmp_policy._src.framework import entry_points
from jmp_policy._src.kv_cache import report as kv_report
from jmp_policy._src.kv_cache.hook import CACHE_NAMES
from jmp_policy.nnx._adapter import ADAPTER
from jmp_policy.nnx._modules import prepare


def explain(
    model: nnx.Module,
    policy_or_map: Any,
    *args: Any,
    **options: Any,
) -> str:
    """A table of the policy every submodule of ``model`` runs under, and why.

    One row per module path (and one per variable that a key of the map names itself),
    in the order of ``nnx.iter_modules``: the module's class, the policy resolved for it,
    its source (``key '<key>'``, ``type <Class>`` or ``default``), the module's own
    ``dtype`` when set, the stored and compute dtypes of its ``nnx.Param`` values and
    their bytes stored and in compute. Nothing is run (NNX modules exist before they are
    called); ``jax.eval_shape``-made models (``nnx.eval_shape``) work too. Given the
    model's positional ``args`` (arrays or ``jax.ShapeDtypeStruct``), the model is also
    traced shape-only and the table is followed by the matmul each quantized or float8
    layer runs (its form and shape).

    Args:
        model: an ``nnx.Module``.
        policy_or_map: as in :func:`apply`.
        *args: the model's positional arguments, to list the layers' matmuls (optional).
        **options: the options of :func:`apply` (``type_policies``, ``module_dtype``,
            ``autocast_exclude``); ``calibration=``, the report of :func:`calibrate`
            (``return_report=True``), listed under the table (per calibrated kernel:
            its method, round-to-nearest's and its output error on the calibration
            inputs, seconds).

    Returns:
        The table as a string.

    Examples:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import jmp_policy as jp
        >>> class Model(nnx.Module):
        ...     def __init__(self, rngs):
        ...         self.body = nnx.Linear(3, 4, rngs=rngs)
        ...         self.norm = nnx.LayerNorm(4, rngs=rngs)
        ...         self.head = nnx.Linear(4, 2, dtype=jnp.float32, rngs=rngs)
        >>> model = Model(nnx.Rngs(0))
        >>> print(jp.nnx.explain(model, "mixed_bfloat16", type_policies=jp.nnx.NORM_FLOAT32))
        path    class      policy          source          own  dtype     bytes  c.bytes
        <root>  Model      mixed_bfloat16  default
        body    Linear     mixed_bfloat16  default              f32→bf16     64       32
        head    Linear     mixed_bfloat16  default         f32  f32          40       40
        norm    LayerNorm  float32         type LayerNorm       f32          32       32
        total                                                               136      104
        bytes: as stored; c.bytes: as the compute reads them (K = 1024, M = 1024 K)
    """
    report = options.pop("calibration", None)
    policies, opts = prepare(model, policy_or_map, options)
    text = entry_points.explain(ADAPTER, model, policies, opts, (), args, report)
    caches = nnx.to_pure_dict(nnx.state(model, nnx.Cache))
    return text + kv_report.format_caches(kv_report.cache_rows(caches, opts.kv_cache, CACHE_NAMES))
