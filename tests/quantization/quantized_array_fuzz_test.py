"""Fuzzed quantized weights (issue 20): a QuantizedArray checks its fields, a non-finite
kernel stays non-finite when quantized, zero-size kernels quantize to zero-size arrays."""

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jmp_policy as jp

FUZZ = settings(max_examples=60, deadline=None, derandomize=True)  # the same examples every run
GOOD = dict(
    values=jnp.zeros((4, 3), jnp.int8),
    scale=jnp.ones(3, jnp.float32),
    mode="int8",
    block_size=None,
    shape=(4, 3),
    original_dtype=np.dtype("float32"),
)


def test_the_issues_quantized_array_is_rejected_naming_the_field():
    with pytest.raises(ValueError, match=r"`mode` must be one of .*mode='int9'"):
        jp.QuantizedArray("x", None, "int9", 0, (2,), "float32")


@FUZZ
@given(
    field=st.sampled_from(sorted(GOOD)),
    value=st.one_of(
        st.sampled_from(["x", "int9", None, 0, -3, 1.5, True, (2,), (4, 3, 1), "int32"]),
        st.builds(lambda s: jnp.zeros(s, jnp.int8), st.sampled_from([(2, 3), (4,), (4, 3)])),
        st.builds(lambda s: jnp.ones(s, jnp.float32), st.sampled_from([(2,), (3,), (1, 3)])),
    ),
)
def test_every_bad_field_is_an_error_naming_it(field, value):
    fields = dict(GOOD, **{field: value})
    try:
        q = jp.QuantizedArray(**fields)
    except (TypeError, ValueError) as e:
        assert f"`{field}`" in str(e), (field, value, str(e))
        return
    # Accepted: a valid int8 kernel of shape (4, 3) that dequantizes, or a None leaf where
    # an array goes (what tree operations such as optax's masks build).
    if q.values is None or q.scale is None:
        return
    assert q.dequantize().shape == q.shape


def test_a_quantized_array_survives_jit_and_tree_map():
    q = jp.get("int4/2_from_float32").quantize(jnp.arange(12.0).reshape(4, 3))
    again = jax.tree.map(lambda a: a, q)
    assert again == q or again.mode == q.mode
    np.testing.assert_array_equal(jax.jit(lambda q: q.dequantize())(q), q.dequantize())
    zeros = jax.tree.map(jnp.zeros_like, q)  # what an optimizer's tree ops make
    assert zeros.shape == q.shape


@FUZZ
@given(
    mode=st.sampled_from(["int8", "int4", "int4/2"]),
    row=st.integers(0, 3),
    col=st.integers(0, 2),
    bad=st.sampled_from([np.nan, np.inf, -np.inf]),
)
def test_a_non_finite_kernel_value_stays_non_finite(mode, row, col, bad):
    kernel = np.random.default_rng(0).normal(size=(4, 3)).astype(np.float32)
    kernel[row, col] = bad
    original = kernel.copy()
    q = jp.get(f"{mode}_from_float32").quantize(kernel)
    np.testing.assert_array_equal(kernel, original)  # nothing written
    out = np.asarray(q.dequantize())
    assert not np.isfinite(out[row, col])
    # The other channels are untouched by it.
    others = [c for c in range(3) if c != col]
    assert np.all(np.isfinite(out[:, others]))


@pytest.mark.parametrize("mode", ["int8", "int4", "int4/2"])
@pytest.mark.parametrize("shape", [(0, 4), (4, 0), (0, 0), (0, 2, 3)])
def test_zero_size_kernels_quantize_to_zero_size_arrays(mode, shape):
    tree = {"kernel": jnp.zeros(shape)}
    before = copy.deepcopy(tree)
    q = jp.get(f"{mode}_from_float32").quantize(tree, stacked_axes=0)["kernel"]
    assert isinstance(q, jp.QuantizedArray) and q.shape == shape and q.nbytes >= 0
    assert q.dequantize().shape == shape
    np.testing.assert_array_equal(tree["kernel"], before["kernel"])
