"""Quantization: weight storage, the matmuls that read it, float8, the built-in formats.

A private package, one module per concept; none knows Flax or a policy class (the policies
that name a format are :mod:`jmp_policy._src.quantized_policy`; the registry of formats,
which the name grammar reads, is :mod:`jmp_policy._src.schemes`, below this package):

* ``quantized_array``: :class:`QuantizedArray` (int8/int4 weight storage) and ``quantize``;
  ``quantized_array_checks``: its field checks; ``quantized_tree``: it as a pytree
  (unflatten of any leaves, value equality, the library's checked construction, flax
  state dicts); ``checkpoints``: QuantizedArrays rebuilt from checkpoints restored
  without a target;
* ``int4_layout``: int4 blocks and the packed checkpoints of earlier versions;
* ``stacked_axes``: the stacked axes of stacked (scanned) layers, per path;
  ``kernel_leaves``: which leaves are kernels (biases are not), quantized per layer;
  ``stack_layers``: a stacked kernel read one layer at a time inside its stack's loop;
* ``matmuls``: the one place that picks a layer's matmul, for both glues;
  ``einsum_plan``: an einsum as one ``dot_general``;
* ``quantized_matmul``: int8 matmuls (QAT, int8 x int8);
  ``kernel_matmul``: the matmul of a ``QuantizedArray`` kernel;
* ``float8``: float8 scaling and its state (delayed, current);
  ``float8_matmul``: the explicit float8 matmul;
* ``int_schemes``, ``float8_scheme``: the built-in formats (int8, int4; float8).
* ``gptq``, ``awq``: the calibrated int4/int8 solves of one kernel; ``calibration_stats``:
  the statistics they need; ``calibration``: a model's layers calibrated from them;
  ``calibrated_schemes``: the GPTQ and AWQ formats.

The package hands on the storage API that the rest of ``_src`` and the glue read as
``quantization.quantize``, ``quantization.QuantizedArray``, ...
"""

from jmp_policy._src.quantization.kernel_leaves import (
    quantizable_layers as quantizable_layers,
)
from jmp_policy._src.quantization.kernel_leaves import quantize_stacked as quantize_stacked
from jmp_policy._src.quantization.kernel_leaves import quantize_tree as quantize_tree
from jmp_policy._src.quantization.quantized_array import QuantizedArray as QuantizedArray
from jmp_policy._src.quantization.quantized_array import is_quantizable as is_quantizable
from jmp_policy._src.quantization.quantized_array import is_quantized as is_quantized
from jmp_policy._src.quantization.quantized_array import quantize as quantize
from jmp_policy._src.quantization.stacked_axes import stack_of as stack_of
from jmp_policy._src.quantization.stacked_axes import stacked_axes_of as stacked_axes_of
from jmp_policy._src.quantization.stacked_axes import (
    warn_maybe_stacked as warn_maybe_stacked,
)

__all__ = [
    "QuantizedArray",
    "is_quantizable",
    "is_quantized",
    "quantizable_layers",
    "quantize",
    "quantize_stacked",
    "quantize_tree",
    "stack_of",
    "stacked_axes_of",
    "warn_maybe_stacked",
]
