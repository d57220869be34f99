"""int4 with a zero point per group (``"int4/<block>/asym"``, Keras's ``symmetric=False``)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_policy as jp
from jmp_policy._src.quantization.kernel_matmul import quantized_kernel_dot_general
from jmp_policy._src.quantization.zero_point import quantize_asymmetric

DIMS = (((1,), (0,)), ((), ()))


def _kernel(shape=(256, 48), shift=0.3, seed=0):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32) + shift


def test_values_use_all_16_codes_and_dequantize_within_half_a_step():
    w = _kernel()
    q = quantize_asymmetric(w, 128)
    assert (
        type(q) is jp.QuantizedArray
        and q.zero_point is not None
        and q.mode == "int4"
        and q.block_size == 128
    )
    assert q.values.dtype == jnp.int4 and q.scale.dtype == jnp.float32
    assert q.zero_point.dtype == jnp.int8 and q.zero_point.shape == q.scale.shape == (2, 48)
    v = np.asarray(q.values).astype(int)
    assert v.min() == -8 and v.max() == 7
    blocks = np.asarray(w).reshape(2, 128, 48)
    low = np.minimum(blocks.min(axis=1), 0)
    high = np.maximum(blocks.max(axis=1), 0)
    np.testing.assert_allclose(q.scale, (high - low) / 15, rtol=1e-6)
    step = np.repeat(np.asarray(q.scale), 128, axis=0)
    assert np.all(np.abs(np.asarray(q.dequantize()) - np.asarray(w)) <= step / 2 + 1e-6)


def test_zero_is_exact_and_a_skewed_group_is_rounded_finer_than_symmetric():
    w = jnp.abs(_kernel(shift=0.0)).at[0, 0].set(0.0)
    asym = jp.get("int4/128/asym_from_float32").quantize({"kernel": w})["kernel"]
    sym = jp.get("int4/128_from_float32").quantize({"kernel": w})["kernel"]
    assert float(asym.dequantize()[0, 0]) == 0.0
    err_asym = float(jnp.mean(jnp.abs(asym.dequantize() - w)))
    err_sym = float(jnp.mean(jnp.abs(sym.dequantize() - w)))
    assert err_asym < 0.6 * err_sym  # all-positive groups: 16 codes on [0, max] vs 8


def test_bytes_count_values_scales_and_zero_points():
    q = quantize_asymmetric(_kernel(), 128)
    assert q.nbytes == 256 * 48 // 2 + 2 * 48 * 4 + 2 * 48
    sym = jp.get("int4/128_from_float32").quantize({"kernel": _kernel()})["kernel"]
    assert q.nbytes - sym.nbytes == 2 * 48


def test_per_channel_stacked_ragged_and_empty():
    w = _kernel((3, 100, 8))
    q = quantize_asymmetric(w, 64, stacked=1)
    assert q.stacked == 1 and q.zero_point.shape == q.scale.shape == (3, 2, 8)
    for i in range(3):
        one = quantize_asymmetric(w[i], 64)
        np.testing.assert_array_equal(q.dequantize()[i], one.dequantize())
    pc = quantize_asymmetric(_kernel((10, 4)), -1)
    assert pc.scale.shape == (1, 4)
    empty = quantize_asymmetric(jnp.zeros((0, 4)), 128)
    assert empty.dequantize().shape == (0, 4)


def test_nonfinite_kernel_stays_nonfinite():
    w = _kernel((8, 4)).at[2, 1].set(jnp.nan)
    d = np.asarray(quantize_asymmetric(w, -1).dequantize())
    assert np.isnan(d[:, 1]).all() and np.isfinite(np.delete(d, 1, axis=1)).all()


@pytest.mark.parametrize("use_jit", [False, True])
@pytest.mark.parametrize("block", [128, 100, -1])
@pytest.mark.parametrize("rows", [1, 5, 70])
def test_matmul_folds_the_zero_point_and_equals_the_dequantized_reference(use_jit, block, rows):
    q = quantize_asymmetric(_kernel(), block)
    x = jax.random.normal(jax.random.key(1), (rows, 256), jnp.float32)
    forms = []
    dot = quantized_kernel_dot_general(q, record=forms.append)
    run = (lambda a: dot(a, jnp.zeros((256, 48)), DIMS)) if not use_jit else None
    if use_jit:
        run = jax.jit(lambda a: dot(a, jnp.zeros((256, 48)), DIMS))
    y = run(x)
    ref = x @ q.dequantize(jnp.float32)
    np.testing.assert_allclose(y, ref, rtol=2e-5, atol=2e-4)
    if block == -1:
        assert forms[-1] == "weight-only, scale after, zero point folded"
    elif rows < 64:
        assert forms[-1] == "int4 blocks, zero point folded"
    else:
        assert forms[-1] == "dequantized, one GEMM"


def test_weight_only_form_reads_no_float_copy_of_the_weights():
    q = quantize_asymmetric(_kernel(), 128)
    dot = quantized_kernel_dot_general(q)
    x = jnp.ones((4, 256), jnp.bfloat16)
    text = jax.jit(lambda a: dot(a, jnp.zeros((256, 48), jnp.bfloat16), DIMS)).lower(x).as_text()
    assert "s4" in text or "i4" in text
    assert "tensor<256x48xf32>" not in text  # the kernel is never dequantized to float32


def test_policy_names_configs_and_round_trips():
    p = jp.get("int4/128/asym_from_mixed_bfloat16")
    assert type(p) is jp.Int4DTypePolicy and p.scheme.symmetric is False
    assert p.name == "int4/128/asym_from_mixed_bfloat16"
    config = p.get_config()
    assert config == {"mode": "int4/128", "source_name": "mixed_bfloat16", "symmetric": False}
    assert jp.Int4DTypePolicy.from_config(config) == p
    assert jp.deserialize(jp.serialize(p)) == p
    assert p != jp.get("int4/128_from_mixed_bfloat16")
    assert jp.Int4DTypePolicy("int4", "mixed_bfloat16", 128, symmetric=False) == p
    assert jp.get("int4/-1/asym_from_float32").block_size == -1
    # Configs from before (no `symmetric`) read as symmetric, and write as they did.
    old = {"mode": "int4/128", "source_name": "mixed_bfloat16"}
    assert jp.Int4DTypePolicy.from_config(old).scheme.symmetric is True
    assert jp.get("int4/128_from_mixed_bfloat16").get_config() == old
    q = jp.QuantizedDTypePolicy("int4/64/asym", "float32")
    assert jp.deserialize(jp.serialize(q)) == q
    assert p.with_compute_dtype("float32").scheme.symmetric is False


@pytest.mark.parametrize("bad", ["yes", 1, None, 0.0])
def test_bad_symmetric_is_a_type_error_naming_it(bad):
    if bad is None:  # None: as the mode says
        assert jp.Int4DTypePolicy("int4", "float32", symmetric=None).scheme.symmetric
        return
    with pytest.raises(TypeError, match="symmetric"):
        jp.Int4DTypePolicy("int4", "float32", symmetric=bad)


def test_symmetric_true_contradicting_an_asym_mode_is_a_value_error():
    with pytest.raises(ValueError, match="symmetric"):
        jp.Int4DTypePolicy("int4/128/asym", "float32", symmetric=True)
    with pytest.raises(ValueError, match="asym"):
        jp.get("int4/128/sym_from_float32")


def test_checks_of_a_users_zero_point_field():
    q = quantize_asymmetric(_kernel((8, 4)), -1)
    fields = dict(
        values=q.values, scale=q.scale, mode="int4", block_size=-1, shape=(8, 4),
        original_dtype=jnp.float32,
    )  # fmt: skip
    with pytest.raises(ValueError, match="zero_point"):
        jp.QuantizedArray(**fields, zero_point=jnp.zeros((2, 4), jnp.int8))
    with pytest.raises(TypeError, match="zero_point"):
        jp.QuantizedArray(**fields, zero_point=jnp.zeros((1, 4), jnp.float32))
    ok = jp.QuantizedArray(**fields, zero_point=q.zero_point)
    assert ok == q and "QuantizedArray(int4/-1" in repr(ok) and "zero_point=int8" in repr(ok)


def test_tree_jit_and_checkpoint_rebuild():
    q = quantize_asymmetric(_kernel(), 128)
    leaves, _ = jax.tree.flatten(q)
    assert len(leaves) == 3
    back = jax.jit(lambda t: t)(q)
    assert back == q
    fields = {"values": q.values, "scale": q.scale, "zero_point": q.zero_point}
    rebuilt = jp.rebuild_quantized({"k": fields}, jp.quantized_metadata({"k": q}))["k"]
    assert type(rebuilt) is jp.QuantizedArray and rebuilt.zero_point is not None and rebuilt == q
