"""Equinox integration: run an Equinox model per submodule under a policy or a map.

Equinox modules are pytrees: :func:`apply` returns a function with the model's call
signature, and :func:`quantize` returns a new model; nothing is mutated. Module paths are
attribute paths, as the plain-tree functions (``cast_apply``, ``DTypePolicyMap.quantize``)
write them: ``"mlp/layers/0"``, ``"attn/query_proj"``. :func:`explain` says which policy
each submodule gets and why. Equinox is an optional extra: ``pip install
jmp_policy[equinox]``.

Examples:
    >>> import jax
    >>> import jax.numpy as jnp
    >>> import equinox as eqx
    >>> import jmp_policy as jp
    >>> mlp = eqx.nn.MLP(4, 2, 8, depth=2, key=jax.random.key(0))
    >>> run = jp.equinox.apply(mlp, {"layers/2": "float32", "layers/.*": "mixed_bfloat16"})
    >>> run(jnp.ones(4)).dtype
    dtype('float32')
"""

from __future__ import annotations

try:
    import equinox as _equinox  # noqa: F401
except ImportError as _e:  # pragma: no cover - exercised without equinox installed
    raise ImportError(
        "`jmp_policy.equinox` needs Equinox, which is not installed: "
        "`pip install jmp_policy[equinox]` (or `pip install equinox`)."
    ) from _e

from jmp_policy.equinox._api import NORM_FLOAT32 as NORM_FLOAT32
from jmp_policy.equinox._api import apply as apply
from jmp_policy.equinox._api import diagnose as diagnose
from jmp_policy.equinox._api import explain as explain
from jmp_policy.equinox._api import init_float8 as init_float8
from jmp_policy.equinox._api import quantize as quantize
from jmp_policy.equinox._calibrate import calibrate as calibrate
from jmp_policy.equinox._kv_cache import quantize_caches as quantize_caches
from jmp_policy.equinox._search import search_map as search_map
from jmp_policy.equinox._state import Float8State as Float8State
from jmp_policy.equinox._state import split_gradients as split_gradients

__all__ = [
    "NORM_FLOAT32",
    "Float8State",
    "apply",
    "calibrate",
    "diagnose",
    "explain",
    "init_float8",
    "quantize",
    "quantize_caches",
    "search_map",
    "split_gradients",
]


def __dir__() -> list[str]:
    return list(__all__)
