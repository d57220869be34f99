"""The checks of a QuantizedArray's fields, and the settings quantize shares with it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_policy as jp
from jmp_policy._src.quantization import quantized_array_checks as checks


@pytest.mark.parametrize("block", [None, -1, 1, 128])
def test_int4_block_accepts_minus_one_none_and_positive_ints(block):
    assert checks.int4_block(block) == (-1 if block is None else block)


@pytest.mark.parametrize("block", [0, -2, True, 2.0, "128"])
def test_int4_block_rejects_other_values_naming_the_argument(block):
    with pytest.raises(ValueError, match=r"`block_size` must be -1 \(per channel\)"):
        checks.int4_block(block)


@pytest.mark.parametrize("stacked", [-1, True, 1.0, None])
def test_check_stacked_rejects_anything_but_a_non_negative_int(stacked):
    with pytest.raises(ValueError, match="`stacked` must be a non-negative int"):
        checks.check_stacked(stacked)


def test_fields_are_checked_in_order_settings_dtype_values_scale():
    values, scale = jnp.zeros((4, 2), jnp.int8), jnp.ones(2, jnp.float32)
    f32 = np.dtype("float32")
    with pytest.raises(ValueError, match="`mode` must be one of"):
        jp.QuantizedArray(values, scale, "int2", None, (4, 2), f32)
    with pytest.raises(ValueError, match="`original_dtype` must be a floating dtype"):
        jp.QuantizedArray(values, scale, "int8", None, (4, 2), np.dtype("int32"))
    with pytest.raises(ValueError, match=r"`values` must have shape \(4, 3\)"):
        jp.QuantizedArray(values, jnp.ones(3), "int8", None, (4, 3), f32)
    with pytest.raises(ValueError, match=r"`scale` must have shape \(2\)"):
        jp.QuantizedArray(values, jnp.ones(3), "int8", None, (4, 2), f32)


def test_traced_values_and_scale_are_left_alone():
    def build(values, scale):
        return jp.QuantizedArray(values, scale, "int8", None, (4, 2), np.dtype("float32")).values

    values, bad_scale = jnp.ones((4, 2), jnp.int8), jnp.ones(3, jnp.float32)
    with pytest.raises(ValueError, match="`scale` must have shape"):
        build(values, bad_scale)
    # Transforms rebuild a QuantizedArray from tracers: those are not checked.
    np.testing.assert_array_equal(np.asarray(jax.jit(build)(values, bad_scale)), 1)
