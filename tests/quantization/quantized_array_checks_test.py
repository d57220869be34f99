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


@pytest.mark.parametrize(
    ("stacked", "error"), [(-1, ValueError), (True, TypeError), (1.0, TypeError), (None, TypeError)]
)
def test_check_stacked_rejects_anything_but_a_non_negative_int(stacked, error):
    with pytest.raises(
        error, match=rf"`stacked` must be a non-negative integer.*stacked={stacked}"
    ):
        checks.check_stacked(stacked)


@pytest.mark.parametrize("stacked", [0, 2, np.int64(2)])
def test_check_stacked_returns_a_python_int(stacked):
    assert checks.check_stacked(stacked) == stacked
    assert type(checks.check_stacked(stacked)) is int


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


F32 = np.dtype("float32")
VALUES = jnp.array([[1, -2], [3, 4]], jnp.int8)


@pytest.mark.parametrize(
    ("scale", "where", "shown"),
    [
        ([1.0, -1.0], "1", "-1.0"),  # would dequantize to sign-flipped weights
        ([np.inf, 1.0], "0", "inf"),
        ([1.0, -np.inf], "1", "-inf"),
        ([0.0, 1.0], "0", "0.0"),  # nonzero values: every weight of the channel lost
    ],
)
def test_scale_must_be_finite_and_positive(scale, where, shown):
    with pytest.raises(ValueError, match=r"`scale` must be finite and positive") as info:
        jp.QuantizedArray(VALUES, jnp.array(scale, jnp.float32), "int8", None, (2, 2), F32)
    assert f"Received: scale[{where}]={shown} (1 of 2 scales bad)" in str(info.value)


def test_bad_int4_scale_is_located_in_its_block():
    values = jnp.ones((4, 2), jnp.int4)
    scale = jnp.array([[1.0, 1.0], [1.0, -0.5]])
    with pytest.raises(ValueError, match=r"Received: scale\[1, 1\]=-0.5 \(1 of 4 scales bad\)"):
        jp.QuantizedArray(values, scale, "int4", 2, (4, 2), F32)


def test_nan_scale_is_kept_as_a_non_finite_kernel_makes_it():
    kernel = jnp.array([[1.0, jnp.nan], [2.0, 3.0]])
    q = jp.QuantizedDTypePolicy("int8", "float32").quantize({"kernel": kernel})["kernel"]
    assert np.isnan(np.asarray(q.scale)[1]) and np.asarray(q.scale)[0] > 0
    rebuilt = jax.tree.map(lambda x: x, q)  # tree operations keep it as it is
    assert np.isnan(np.asarray(rebuilt.dequantize())[:, 1]).all()
    assert rebuilt == q  # NaN scales compare equal where both are NaN


@pytest.mark.parametrize("scale", [[1.0, np.nan], [np.nan, np.nan]])
def test_a_users_nan_scale_is_refused_naming_scale(scale):
    # Only `quantize` marks a non-finite kernel's channel with a NaN scale (#46).
    values = jnp.ones((2, 2), jnp.int8)
    with pytest.raises(ValueError, match=r"`scale` must be finite and positive.*=nan"):
        jp.QuantizedArray(values, jnp.asarray(scale, jnp.float32), "int8", None, (2, 2), F32)


def test_zero_scale_is_accepted_in_an_all_zero_array():
    q = jp.QuantizedDTypePolicy("int4/2", "float32").quantize({"k": jnp.ones((4, 3))})["k"]
    zeros = jax.tree.map(jnp.zeros_like, q)  # optimizers' and autodiff's zero trees
    np.testing.assert_array_equal(np.asarray(zeros.dequantize()), 0.0)


def test_a_cotangent_scale_of_any_sign_is_accepted():
    q = jp.QuantizedDTypePolicy("int8", "float32").quantize({"k": jnp.ones((4, 3))})["k"]
    grad = jax.grad(lambda q: -jnp.sum(q.dequantize()), allow_int=True)(q)
    assert grad.values.dtype == jax.dtypes.float0
    assert (np.asarray(grad.scale) < 0).all()


def test_quantize_never_makes_a_zero_scale_from_an_underflowing_amax():
    # 1e-44 / 127 underflows to 0 in float32: the scale is 1 (values 0), not 0.
    tiny = jnp.full((4, 2), 1e-44, jnp.float32)
    for name in ("int8", "int4", "int4/2"):
        q = jp.QuantizedDTypePolicy(name, "float32").quantize({"k": tiny})["k"]
        assert (np.asarray(q.scale) > 0).all()
        np.testing.assert_allclose(np.asarray(q.dequantize()), 0.0, atol=1e-44)


def test_scale_values_are_checked_when_concrete_not_under_tracing():
    def build(scale):
        return jp.QuantizedArray(VALUES, scale, "int8", None, (2, 2), F32).scale

    bad = jnp.array([1.0, -1.0])
    with pytest.raises(ValueError, match="finite and positive"):
        build(bad)
    np.testing.assert_array_equal(np.asarray(jax.jit(build)(bad)), [1.0, -1.0])
