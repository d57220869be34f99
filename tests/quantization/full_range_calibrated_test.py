"""int4's default full-range grid (#49: ``amax / 7.5``, codes ``-8..7``) under GPTQ, AWQ and
the clipping search, and kernels stored on the old 15-code grid, which still load and serve
(``values * scale`` whatever grid chose them), with and without jit."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import serialization

import jmp_policy as jp
from jmp_policy._src.quantization import awq, calibration_stats, clipping, gptq, symmetric_grid
from jmp_policy._src.quantization import quantized_array as quantization


def _correlated(rows, features, seed):
    rng = np.random.default_rng(seed)
    mix = rng.normal(size=(features, features)) / np.sqrt(features)
    noise = 0.2 * rng.normal(size=(rows, features))
    return (rng.normal(size=(rows, features)) @ mix + noise).astype(np.float32)


def _output_error(w, x, q):
    w_hat = np.asarray(q.dequantize(), np.float64)
    return float(np.sum((x.astype(np.float64) @ (w.astype(np.float64) - w_hat)) ** 2))


@pytest.fixture(scope="module")
def layer():
    """A [128, 32] kernel and 1024 rows of correlated inputs (with a few salient channels)."""
    x = _correlated(1024, 128, seed=0)
    x = x * np.exp(np.random.default_rng(1).normal(size=128)).astype(np.float32)
    w = np.random.default_rng(2).normal(size=(128, 32)).astype(np.float32)
    return w, x, calibration_stats.LayerStats.zeros(128).update(x)


@pytest.mark.parametrize("method", ["gptq", "awq"])
@pytest.mark.parametrize("group", [32, -1])
def test_calibrated_int4_solves_on_the_full_grid_below_round_to_nearest(
    layer, method, group, maybe_jit
):
    w, x, stats = layer
    if method == "gptq":
        fn = lambda w, s: gptq.gptq_quantize(w, s.gram, group_size=group)  # noqa: E731
    else:
        fn = lambda w, s: awq.awq_quantize(w, s.mean_abs, s.gram, group_size=group)  # noqa: E731
    q = maybe_jit(fn)(jnp.asarray(w), stats)
    rtn = quantization.quantize(jnp.asarray(w), "int4", group)  # the same (default) grid
    narrow = quantization.quantize(jnp.asarray(w), "int4", group, grid=symmetric_grid.INT4_NARROW)
    values = np.asarray(q.values.astype(jnp.int32))
    assert q.values.dtype == jnp.int4 and values.min() >= -8 and values.max() <= 7
    assert (values == -8).any()  # the 16th code is used
    assert q.scale.shape == rtn.scale.shape and q.zero_point is None
    assert _output_error(w, x, q) < 0.9 * _output_error(w, x, rtn)
    assert _output_error(w, x, rtn) < _output_error(w, x, narrow)
    if method == "gptq":  # its scales are the grid's: amax / 7.5 of the rows as updated
        assert np.all(np.asarray(q.scale) > 0)


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_the_clipping_search_on_the_full_grid_never_raises_the_output_error(layer, method):
    w, x, stats = layer
    if method == "gptq":
        solve = lambda **kw: gptq.gptq_quantize(jnp.asarray(w), stats.gram, group_size=32, **kw)  # noqa: E731
    else:
        solve = lambda **kw: awq.awq_quantize(  # noqa: E731
            jnp.asarray(w), stats.mean_abs, stats.gram, group_size=32, **kw
        )
    plain, clipped = solve(), solve(clip_search=True)
    assert _output_error(w, x, clipped) <= _output_error(w, x, plain) * 1.02
    values = np.asarray(clipped.values.astype(jnp.int32))
    assert values.min() >= -8 and values.max() <= 7


@pytest.mark.parametrize("grid", [symmetric_grid.INT4, symmetric_grid.INT4_NARROW])
def test_the_clip_search_picks_sensible_ratios_on_either_grid(grid, maybe_jit):
    rng = np.random.default_rng(3)
    gauss = jnp.asarray(rng.normal(size=(128, 64)), jnp.float32)
    heavy = jnp.asarray(rng.standard_t(2.5, size=(128, 64)), jnp.float32)
    amax = lambda w: jnp.max(jnp.abs(w), axis=0)  # noqa: E731
    search = maybe_jit(lambda w: clipping.search_scale(w, (64,), grid))
    ratio_g = np.asarray(search(gauss) * grid.bound / amax(gauss))
    ratio_h = np.asarray(search(heavy) * grid.bound / amax(heavy))
    for ratio in (ratio_g, ratio_h):  # on the full range up to 7.5 / 7 (the scale amax / 7)
        assert np.all((ratio > 0.2) & (ratio <= grid.bound / grid.high + 1e-6))
    # Groups of 128 clip some, not much (measured: medians 0.90-0.92 on either grid).
    assert 0.8 < np.median(ratio_g) < 0.97 and 0.8 < np.median(ratio_h) < 0.97
    # The search never does worse than abs-max on its own objective (Σ |w - ŵ|^2.4).
    for w in (gauss, heavy):
        s = search(w)
        clipped = quantization.round_to_grid(w, s, grid) * s
        plain_s = quantization.abs_max_scale(w, (0,), grid)
        plain = quantization.round_to_grid(w, plain_s, grid) * plain_s
        err = lambda w_hat, w=w: np.sum(np.abs(np.asarray(w - w_hat)) ** 2.4, axis=0)  # noqa: E731
        assert np.all(err(clipped) <= err(plain) * (1 + 1e-5))


class _Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(16, name="down")(nn.relu(nn.Dense(256, name="up")(x)))


@pytest.mark.parametrize("policy", ["int4/128_from_float32", "int4_from_float32"])
def test_a_kernel_stored_on_the_old_grid_still_loads_and_serves(policy, maybe_jit):
    model, x = _Mlp(), jax.random.normal(jax.random.key(1), (5, 64))
    variables = model.init(jax.random.key(0), x)
    block = jp.get(policy).block_size
    old = jax.tree.map(  # what the 15-code default stored before #49
        lambda k: (
            quantization.quantize(k, "int4", block, grid=symmetric_grid.INT4_NARROW)
            if k.ndim == 2
            else k
        ),
        variables,
    )
    kernel = old["params"]["up"]["kernel"]
    assert int(jnp.max(jnp.abs(kernel.values.astype(jnp.int32)))) == 7
    assert int(jnp.min(kernel.values.astype(jnp.int32))) >= -7
    # A checkpoint written then: restored into a tree of the new default grid's arrays.
    target = jp.get(policy).quantize(variables)
    restored = serialization.from_bytes(target, serialization.to_bytes(old))
    for name in ("up", "down"):
        a, b = restored["params"][name]["kernel"], old["params"][name]["kernel"]
        np.testing.assert_array_equal(np.asarray(a.values), np.asarray(b.values))
        np.testing.assert_array_equal(np.asarray(a.scale), np.asarray(b.scale))
    y = maybe_jit(jp.linen.apply(model, policy))(restored, x)
    dense = jax.tree.map(
        lambda k: k.dequantize() if quantization.is_quantized(k) else k,
        old,
        is_leaf=quantization.is_quantized,
    )
    np.testing.assert_allclose(y, model.apply(dense, x), rtol=1e-5, atol=1e-5)
