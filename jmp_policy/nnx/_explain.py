"""``explain``: which policy every submodule of an NNX model runs under, and why."""

from __future__ import annotations

from typing import Any

from flax import nnx

from jmp_policy._src.framework import entry_points
from jmp_policy._src.framework.shared_docs import fill
from jmp_policy._src.kv_cache import report as kv_report
from jmp_policy._src.kv_cache.hook import CACHE_NAMES
from jmp_policy.nnx._adapter import ADAPTER
from jmp_policy.nnx._modules import prepare


@fill
def explain(
    model: nnx.Module,
    policy_or_map: Any,
    *args: Any,
    **options: Any,
) -> str:
    """A table of the policy every submodule of ``model`` runs under, and why.

    Rows in the order of ``nnx.iter_modules``; without ``args`` nothing is run (NNX modules
    exist before they are called; ``nnx.eval_shape``-made models work too).
    {explain_rows}

    Args:
        model: an ``nnx.Module``.
        policy_or_map: as in :func:`apply`.
        *args: the model's positional arguments, to list the layers' matmuls (optional).
        **options: the options of :func:`apply`, and
            {explain_calibration}

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
