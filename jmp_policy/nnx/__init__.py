"""Flax NNX integration: run an NNX model per submodule under a policy or a map.

:func:`apply` makes a function that runs an NNX model with each submodule's inputs and
parameters in its own compute dtype, without changing the model's stored parameters;
:func:`explain` says which policy each submodule gets and why. The rules are the ones
:mod:`jmp_policy.linen` and :mod:`jmp_policy.equinox` share. ``NORM_FLOAT32`` is a ready
``type_policies`` mapping that computes NNX's normalisation layers in float32 and returns
their outputs in the caller's compute dtype. float8 training: :func:`init_float8`,
:class:`Float8State`, :func:`split_gradients`; quantized weights: :func:`quantize`,
:func:`calibrate`, :func:`search_map`.

Examples:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import jmp_policy as jp
    >>> sorted(cls.__name__ for cls in jp.nnx.NORM_FLOAT32)
    ['BatchNorm', 'GroupNorm', 'InstanceNorm', 'LayerNorm', 'RMSNorm']
    >>> norm, x = nnx.LayerNorm(4, rngs=nnx.Rngs(0)), jnp.ones((2, 4))
    >>> jp.nnx.apply(norm, "bfloat16")(x).dtype
    dtype(bfloat16)
    >>> jp.nnx.apply(norm, "bfloat16", type_policies={nnx.LayerNorm: "float32"})(x).dtype
    dtype('float32')
"""

from __future__ import annotations

from jmp_policy._src import state_pytree as _state_pytree
from jmp_policy.nnx._apply import apply as apply
from jmp_policy.nnx._diagnose import diagnose as diagnose
from jmp_policy.nnx._explain import explain as explain
from jmp_policy.nnx._init import init_float8 as init_float8
from jmp_policy.nnx._modules import NORM_FLOAT32 as NORM_FLOAT32
from jmp_policy.nnx._quantization import Float8State as Float8State
from jmp_policy.nnx._quantization import split_gradients as split_gradients
from jmp_policy.nnx._quantize import calibrate as calibrate
from jmp_policy.nnx._quantize import quantize as quantize
from jmp_policy.nnx._quantize import search_map as search_map

__all__ = [
    "NORM_FLOAT32",
    "Float8State",
    "apply",
    "calibrate",
    "diagnose",
    "explain",
    "init_float8",
    "quantize",
    "search_map",
    "split_gradients",
]

# flax is loaded now: teach flax.serialization jmp_policy's pytree classes (QuantizedArray,
# the loss scales), which the core registers lazily, never importing flax itself.
_state_pytree.register_with_flax_serialization()


def __dir__() -> list[str]:
    return list(__all__)
