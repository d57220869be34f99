"""jmp_policy: mixed precision for JAX and Flax, the functional way.

Examples:
    >>> import jax.numpy as jnp
    >>> import jmp_policy as jp
    >>> policy = jp.get_policy("p=f32,c=bf16,o=f32")
    >>> policy.cast_to_compute({"w": jnp.ones(3)})["w"].dtype
    dtype(bfloat16)
"""

import importlib as _importlib

# --- policies ---
from jmp_policy._src.policy import DTypePolicy as DTypePolicy
from jmp_policy._src.policy import FloatDTypePolicy as FloatDTypePolicy
from jmp_policy._src.policy import Policy as Policy
from jmp_policy._src.policy_names import get_policy as get_policy
from jmp_policy._src.calibrated_policy import AWQDTypePolicy as AWQDTypePolicy
from jmp_policy._src.calibrated_policy import GPTQDTypePolicy as GPTQDTypePolicy
from jmp_policy._src.calibrated_policy import SmoothQuantDTypePolicy as SmoothQuantDTypePolicy
from jmp_policy._src.quantized_policy import Int4DTypePolicy as Int4DTypePolicy
from jmp_policy._src.quantized_policy import QuantizedDTypePolicy as QuantizedDTypePolicy
from jmp_policy._src.quantized_policy import (
    QuantizedFloat8DTypePolicy as QuantizedFloat8DTypePolicy,
)
from jmp_policy._src.casting import cast_to_full as cast_to_full
from jmp_policy._src.casting import cast_to_half as cast_to_half
from jmp_policy._src.casting import half_dtype as half_dtype

# --- global policy ---
from jmp_policy._src.global_state import dtype_policy as dtype_policy
from jmp_policy._src.global_state import global_policy as global_policy
from jmp_policy._src.global_state import policy_scope as policy_scope
from jmp_policy._src.global_state import set_dtype_policy as set_dtype_policy
from jmp_policy._src.global_state import set_global_policy as set_global_policy

# --- policy maps and applying policies ---
from jmp_policy._src.apply import cast_apply as cast_apply
from jmp_policy._src.global_state import current_policy as current_policy
from jmp_policy._src.policy_map import DTypePolicyMap as DTypePolicyMap
from jmp_policy._src.kv_cache import QuantizedKVCache as QuantizedKVCache
from jmp_policy._src.quantization import QuantizedArray as QuantizedArray
from jmp_policy._src.quantization.checkpoints import quantized_metadata as quantized_metadata
from jmp_policy._src.quantization.checkpoints import rebuild_quantized as rebuild_quantized
from jmp_policy._src.serving_layouts import compile_for_serving as compile_for_serving
from jmp_policy._src.schemes import Scheme as Scheme
from jmp_policy._src.schemes import register as register
from jmp_policy._src.schemes import unregister as unregister
from jmp_policy._src.quantization.calibration import LayerReport as LayerReport
from jmp_policy._src.map_search import SearchResult as SearchResult

# --- serialization ---
from jmp_policy._src.serialization import deserialize as deserialize
from jmp_policy._src.identifiers import get as get
from jmp_policy._src.serialization import serialize as serialize

# --- loss scaling ---
from jmp_policy._src.loss_scale import DynamicLossScale as DynamicLossScale
from jmp_policy._src.loss_scale import NoOpLossScale as NoOpLossScale
from jmp_policy._src.loss_scale import StaticLossScale as StaticLossScale
from jmp_policy._src.numerics import all_finite as all_finite
from jmp_policy._src.numerics import select_tree as select_tree
from jmp_policy._src.optax_wrapper import LossScalingState as LossScalingState
from jmp_policy._src.optax_wrapper import get_loss_scale as get_loss_scale
from jmp_policy._src.optax_wrapper import loss_scaling as loss_scaling
from jmp_policy._src.optax_wrapper import scaled_value_and_grad as scaled_value_and_grad

# --- 16-bit weights without float32 masters ---
from jmp_policy._src.rounded_updates import KahanSummationState as KahanSummationState
from jmp_policy._src.rounded_updates import StochasticRoundingState as StochasticRoundingState
from jmp_policy._src.rounded_updates import kahan_summation as kahan_summation
from jmp_policy._src.rounded_updates import stochastic_rounding as stochastic_rounding

# --- diagnostics ---
from jmp_policy._src.diagnostics.table import format_report as format_report
from jmp_policy._src.diagnostics.dtype_profile import dtype_profile as dtype_profile
from jmp_policy._src.diagnostics.tree_bytes import tree_bytes as tree_bytes

__version__ = "0.1.0"

__all__ = [
    # policies
    "DTypePolicy",
    "FloatDTypePolicy",
    "Int4DTypePolicy",
    "GPTQDTypePolicy",
    "AWQDTypePolicy",
    "SmoothQuantDTypePolicy",
    "Policy",
    "QuantizedDTypePolicy",
    "QuantizedFloat8DTypePolicy",
    "get",
    "get_policy",
    "cast_to_full",
    "cast_to_half",
    "half_dtype",
    # global policy
    "dtype_policy",
    "global_policy",
    "policy_scope",
    "set_dtype_policy",
    "set_global_policy",
    # policy maps and applying policies
    "DTypePolicyMap",
    "cast_apply",
    "current_policy",
    # quantization
    "LayerReport",
    "SearchResult",
    "QuantizedArray",
    "Scheme",
    "QuantizedKVCache",
    "compile_for_serving",
    "quantized_metadata",
    "rebuild_quantized",
    "register",
    "unregister",
    # serialization
    "deserialize",
    "serialize",
    # loss scaling
    "DynamicLossScale",
    "LossScalingState",
    "NoOpLossScale",
    "StaticLossScale",
    "all_finite",
    "get_loss_scale",
    "loss_scaling",
    "scaled_value_and_grad",
    "select_tree",
    # 16-bit weights without float32 masters
    "KahanSummationState",
    "StochasticRoundingState",
    "kahan_summation",
    "stochastic_rounding",
    # diagnostics
    "dtype_profile",
    "format_report",
    "tree_bytes",
]

_LAZY_SUBMODULES = ("linen", "nnx", "equinox")


def __getattr__(name: str) -> object:
    # `jmp_policy.linen` / `nnx` / `equinox` import their framework only when first used.
    if name in _LAZY_SUBMODULES:
        return _importlib.import_module(f"jmp_policy.{name}")
    raise AttributeError(f"module 'jmp_policy' has no attribute {name!r}")


def __dir__() -> list[str]:
    # The public names and the lazy integrations (without importing flax), no helpers.
    dunders = [n for n in globals() if n.startswith("__") and n.endswith("__")]
    return sorted({*__all__, *_LAZY_SUBMODULES, *dunders})
