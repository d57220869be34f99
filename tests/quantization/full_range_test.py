"""Symmetric int4 on all 16 codes, qwix's default int4 grid: int4's default since #49
(``"int4/<block>"``; ``"int4/<block>/full"`` a synonym, ``"int4/<block>/narrow"`` the old
15-code grid): values, dtypes, names, configs and round trips, the serving matmul, with and
without jit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_policy as jp
from jmp_policy._src.quantization.int_schemes import Int4Scheme
from jmp_policy._src.quantization.kernel_matmul import quantized_kernel_dot_general
from jmp_policy._src.quantization.quantized_array import quantize


def quantize_full_range(x, block_size=-1, stacked=0):
    """int4 round to nearest on the default grid (was ``full_range.quantize_full_range``)."""
    return quantize(x, "int4", block_size, stacked)


DIMS = (((1,), (0,)), ((), ()))


def _kernel(shape=(256, 48), seed=0):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def test_scale_is_amax_over_7_5_and_values_use_minus_8_to_7(maybe_jit):
    w = _kernel()
    q = maybe_jit(lambda k: jp.get("int4/128/full_from_float32").quantize(k))(w)
    assert type(q) is jp.QuantizedArray and q.zero_point is None
    assert (q.mode, q.block_size, q.values.dtype, q.scale.shape) == ("int4", 128, jnp.int4, (2, 48))
    amax = np.abs(np.asarray(w)).reshape(2, 128, 48).max(axis=1)
    np.testing.assert_allclose(q.scale, amax / 7.5, rtol=1e-6)
    v = np.asarray(q.values).astype(int)
    assert v.min() >= -8 and v.max() <= 7 and (v == -8).any()
    x = np.asarray(w) / np.repeat(np.asarray(q.scale), 128, 0)
    tie = np.abs(np.abs(x) % 1 - 0.5) < 1e-4  # XLA's and NumPy's divisions may differ there
    np.testing.assert_array_equal(v[~tie], np.clip(np.round(x), -8, 7)[~tie])
    assert np.all(np.abs(v - np.clip(np.round(x), -8, 7)) <= 1)
    assert q == quantize_full_range(w, 128)


def test_the_default_grid_is_the_full_range(maybe_jit):
    w = _kernel()
    full = maybe_jit(lambda k: jp.get("int4/128/full_from_float32").quantize(k))(w)
    assert maybe_jit(lambda k: jp.get("int4/128_from_float32").quantize(k))(w) == full
    assert jp.QuantizedDTypePolicy("int4", "float32").quantize(w) == quantize_full_range(w)


def test_a_finer_step_than_the_narrow_grid_at_the_same_bytes():
    # Was "than the default grid": since #49 the 15-code grid is "/narrow", not the default.
    w = _kernel()
    full = jp.get("int4/128/full_from_float32").quantize(w)
    default = jp.get("int4/128/narrow_from_float32").quantize(w)
    assert full.nbytes == default.nbytes
    err = lambda q: float(jnp.mean((q.dequantize() - w) ** 2))  # noqa: E731
    assert err(full) < 0.95 * err(default)  # gaussian weights: the step is 7/7.5 as wide


def test_per_channel_stacked_empty_and_nonfinite():
    w = _kernel((3, 100, 8))
    st = quantize_full_range(w, 64, stacked=1)
    assert st.stacked == 1 and st.scale.shape == (3, 2, 8)
    for i in range(3):
        np.testing.assert_array_equal(
            st.dequantize()[i], quantize_full_range(w[i], 64).dequantize()
        )
    assert quantize_full_range(_kernel((10, 4)), -1).scale.shape == (1, 4)
    assert quantize_full_range(jnp.zeros((0, 4)), 128).dequantize().shape == (0, 4)
    d = np.asarray(quantize_full_range(_kernel((8, 4)).at[2, 1].set(jnp.nan)).dequantize())
    assert np.isnan(d[:, 1]).all() and np.isfinite(np.delete(d, 1, axis=1)).all()


@pytest.mark.parametrize("use_jit", [False, True])
@pytest.mark.parametrize("rows", [1, 5, 70])
def test_serves_as_the_narrow_grid_does(use_jit, rows):
    q = quantize_full_range(_kernel(), 128)
    x = jax.random.normal(jax.random.key(1), (rows, 256), jnp.float32)
    forms = []
    dot = quantized_kernel_dot_general(q, record=forms.append)
    run = lambda a: dot(a, jnp.zeros((256, 48)), DIMS)  # noqa: E731
    y = (jax.jit(run) if use_jit else run)(x)
    np.testing.assert_allclose(y, x @ q.dequantize(jnp.float32), rtol=2e-5, atol=2e-4)
    assert forms[-1] == ("int4 blocks" if rows < 64 else "dequantized, one GEMM")


def test_names_configs_and_round_trips():
    # Since #49 "/full" is the default grid's synonym: its canonical name, repr and config
    # are the default's (were "int4/128/full..."), so old configs read back as the default.
    p = jp.get("int4/128/full_from_mixed_bfloat16")
    assert type(p) is jp.Int4DTypePolicy and p.scheme == Int4Scheme(block_size=128, full_range=True)
    assert repr(p.scheme) == "Int4Scheme(block_size=128, symmetric=True)"
    assert (p.name, p.mode, p.block_size, p.symmetric) == (
        "int4/128_from_mixed_bfloat16", "int4", 128, True,
    )  # fmt: skip
    config = p.get_config()
    assert config == {"mode": "int4/128", "source_name": "mixed_bfloat16"}
    assert jp.Int4DTypePolicy.from_config(config) == p
    assert jp.Int4DTypePolicy.from_config({"mode": "int4/128/full", "source_name": "float32"})
    assert jp.deserialize(jp.serialize(p)) == p and jp.get(str(p)) == p
    assert p == jp.get("int4/128_from_mixed_bfloat16")
    assert p.with_compute_dtype("float32").scheme.full_range
    assert jp.QuantizedDTypePolicy("int4/64/full", "float32").block_size == 64
    assert jp.get("int4/-1/full_from_float32").name == "int4/-1_from_float32"
    # The default is the full range: "int4/128" is the 16-code grid.
    assert jp.get("int4/128_from_float32").scheme.full_range
    assert jp.get("int4_from_float32").scheme.full_range


def test_the_narrow_grid_names_configs_and_round_trips(maybe_jit):
    p = jp.get("int4/128/narrow_from_mixed_bfloat16")
    assert type(p) is jp.Int4DTypePolicy and p.scheme == Int4Scheme(
        block_size=128, full_range=False
    )
    assert repr(p.scheme) == "Int4Scheme(block_size=128, symmetric=True, full_range=False)"
    assert (p.name, p.mode, p.block_size, p.symmetric) == (
        "int4/128/narrow_from_mixed_bfloat16", "int4", 128, True,
    )  # fmt: skip
    config = p.get_config()
    assert config == {"mode": "int4/128/narrow", "source_name": "mixed_bfloat16"}
    assert jp.Int4DTypePolicy.from_config(config) == p
    assert jp.deserialize(jp.serialize(p)) == p and jp.get(str(p)) == p
    assert p != jp.get("int4/128_from_mixed_bfloat16")
    assert not p.with_compute_dtype("float32").scheme.full_range
    assert jp.get("int4/-1/narrow_from_float32").name == "int4/-1/narrow_from_float32"
    w = _kernel()
    q = maybe_jit(lambda k: jp.get("int4/128/narrow_from_float32").quantize(k))(w)
    amax = np.abs(np.asarray(w)).reshape(2, 128, 48).max(axis=1)
    np.testing.assert_allclose(q.scale, amax / 7, rtol=1e-6)
    v = np.asarray(q.values).astype(int)
    assert v.min() >= -7 and v.max() <= 7 and (np.abs(v) == 7).any()


def test_the_narrow_grid_with_a_zero_point_is_refused():
    # Was "/full" with a zero point: since #49 "/full" is the default (zero points take all
    # 16 codes anyway), so the grid a zero point cannot have is the narrow one.
    with pytest.raises(ValueError, match="full_range"):
        jp.Int4DTypePolicy("int4/128/narrow", "float32", symmetric=False)
    with pytest.raises(ValueError, match="full_range"):
        Int4Scheme(block_size=8, full_range=False, symmetric=False)
    with pytest.raises(ValueError, match="block size"):
        jp.get("int4/128/full/asym_from_float32")
    with pytest.raises(ValueError, match="block size"):
        jp.get("int4/128/narrow/asym_from_float32")
    with pytest.raises(TypeError, match="full_range"):
        Int4Scheme(block_size=8, full_range=1)
