"""Flax Linen integration: run a Linen model under a policy or a map, per submodule.

A user keeps the model as it is and writes one policy or one
:class:`~jmp_policy.DTypePolicyMap`; :func:`apply` and :func:`init` wrap ``module.apply``
and ``module.init`` so that every submodule computes in its own dtype, with float32 master
weights and float32 gradients; :func:`explain` says which policy each submodule got and why.
The rules are the ones :mod:`jmp_policy.nnx` and :mod:`jmp_policy.equinox` share; a module's
own ``dtype=`` wins over the policy unless ``module_dtype="override"``. ``NORM_FLOAT32`` is
a ready ``type_policies`` mapping that computes Linen's normalisation layers in float32.

Examples:
    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> import jmp_policy as jp
    >>> model = nn.Sequential([nn.Dense(8), nn.LayerNorm(), nn.Dense(2)])
    >>> x = jnp.ones((4, 3))
    >>> variables = jp.linen.init(model, "mixed_bfloat16")(jax.random.key(0), x)
    >>> variables["params"]["layers_0"]["kernel"].dtype
    dtype('float32')
    >>> policy_map = jp.DTypePolicyMap("mixed_bfloat16", {"layers_2": "float32"})
    >>> fn = jp.linen.apply(model, policy_map, type_policies=jp.linen.NORM_FLOAT32)
    >>> fn(variables, x).dtype   # the float32 head's logits
    dtype('float32')
"""

from __future__ import annotations

from jmp_policy._src import state_pytree as _state_pytree
from jmp_policy.linen._apply import apply as apply
from jmp_policy.linen._diagnose import diagnose as diagnose
from jmp_policy.linen._explain import explain as explain
from jmp_policy.linen._init import init as init
from jmp_policy.linen._modules import NORM_FLOAT32 as NORM_FLOAT32
from jmp_policy.linen._quantization import split_gradients as split_gradients
from jmp_policy.linen._quantize import calibrate as calibrate
from jmp_policy.linen._quantize import quantize as quantize
from jmp_policy.linen._quantize import search_map as search_map

__all__ = [
    "NORM_FLOAT32",
    "apply",
    "calibrate",
    "diagnose",
    "explain",
    "init",
    "quantize",
    "search_map",
    "split_gradients",
]

# flax is loaded now: teach flax.serialization jmp_policy's pytree classes (QuantizedArray,
# the loss scales), which the core registers lazily, never importing flax itself.
_state_pytree.register_with_flax_serialization()


def __dir__() -> list[str]:
    return list(__all__)
