"""Tests for `_src/rounding.py`: stochastic rounding and Kahan-compensated 16-bit additions."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jmp_policy._src import rounding

SIXTEEN = [jnp.bfloat16, jnp.float16]


def _ulp_at_one(dtype):
    return float(jnp.finfo(dtype).eps)


@pytest.mark.parametrize("dtype", SIXTEEN, ids=["bfloat16", "float16"])
def test_stochastic_add_is_unbiased_where_nearest_loses_the_update(dtype, maybe_jit):
    n, ulp = 200_000, _ulp_at_one(dtype)
    u = 0.3 * ulp  # below half a unit: rounding to nearest drops it every time
    params = jnp.ones(n, dtype)
    new, _ = maybe_jit(rounding.stochastic_add)(params, jnp.full(n, u), jax.random.key(1))
    values = np.asarray(new, np.float64)
    assert new.dtype == dtype
    # Only the two neighbours of 1 + u.
    assert set(np.unique(values)) == {1.0, 1.0 + ulp}
    # Mean within 4 standard errors of the exact sum; the error bound is a twentieth of u,
    # so round-to-nearest (mean exactly 1) cannot pass.
    se = ulp * np.sqrt(0.3 * 0.7 / n)
    assert abs(values.mean() - (1.0 + u)) < 4 * se < u / 20
    assert abs(float(optax.apply_updates(params, jnp.full(n, u)).astype(float).mean()) - 1) == 0


@pytest.mark.parametrize("dtype", SIXTEEN, ids=["bfloat16", "float16"])
def test_stochastic_round_picks_one_of_the_two_neighbours_at_every_magnitude(dtype, maybe_jit):
    rng = np.random.default_rng(0)
    span = 30 if dtype == jnp.bfloat16 else 12
    x = (rng.standard_normal(50_000) * 2.0 ** rng.integers(-span, span, 50_000)).astype(np.float32)
    got = maybe_jit(rounding.stochastic_round, static_argnums=1)(
        jnp.asarray(x), dtype, jax.random.key(2)
    )
    down = jnp.nextafter(got, jnp.asarray(-jnp.inf, dtype)).astype(jnp.float32)
    up = jnp.nextafter(got, jnp.asarray(jnp.inf, dtype)).astype(jnp.float32)
    g = got.astype(jnp.float32)
    # `got` is on x's side of one of its neighbours: x lies between got and its next value.
    between = ((g <= x) & (x <= up)) | ((down <= x) & (x <= g))
    assert bool(jnp.all(between))
    # Representable values come back as they are.
    exact = jnp.asarray(x).astype(dtype)
    again = rounding.stochastic_round(exact.astype(jnp.float32), dtype, jax.random.key(3))
    np.testing.assert_array_equal(np.asarray(again), np.asarray(exact))


@pytest.mark.parametrize("dtype", SIXTEEN, ids=["bfloat16", "float16"])
def test_stochastic_round_goes_up_with_probability_equal_to_the_distance(dtype):
    n, ulp = 100_000, _ulp_at_one(dtype)
    x = jnp.full(n, -(2.0 + 2 * ulp * 0.75), jnp.float32)  # 3/4 of the way from -2 down
    got = np.asarray(rounding.stochastic_round(x, dtype, jax.random.key(4)), np.float64)
    share_far = np.mean(got == -(2.0 + 2 * ulp))
    assert abs(share_far - 0.75) < 4 * np.sqrt(0.75 * 0.25 / n)


@pytest.mark.parametrize("dtype", SIXTEEN, ids=["bfloat16", "float16"])
def test_stochastic_round_keeps_non_finite_values(dtype):
    x = jnp.array([jnp.inf, -jnp.inf, jnp.nan, 0.0, -0.0], jnp.float32)
    got = np.asarray(rounding.stochastic_round(x, dtype, jax.random.key(5)), np.float32)
    np.testing.assert_array_equal(got, [np.inf, -np.inf, np.nan, 0.0, 0.0])
    assert np.signbit(got[4])


def _random_pairs(dtype, n=1_000_000, seed=0):
    """Random finite 16-bit parameters and new values at every ratio up to 2**20."""
    rng = np.random.default_rng(seed)
    p = rng.standard_normal(n) * 2.0 ** rng.integers(-40, 40, n)
    if dtype == jnp.float16:
        p = rng.standard_normal(n) * 2.0 ** rng.integers(-8, 8, n)
    new = p * rng.choice([-1.0, 1.0], n) * 2.0 ** rng.uniform(-20, 20, n)
    big = float(jnp.finfo(dtype).max)
    p, new = jnp.asarray(p, dtype), jnp.asarray(np.clip(new, -big, big), dtype)
    keep = jnp.isfinite(p) & jnp.isfinite(new) & (p != 0)
    return p[keep], new[keep]


@pytest.mark.parametrize(
    "dtype, bound", [(jnp.bfloat16, 2.0**-16), (jnp.float16, 2.0**-13)], ids=["bf16", "f16"]
)
def test_float32_update_lands_exactly_unless_it_cancels_the_parameter(dtype, bound):
    p, new = _random_pairs(dtype)
    p32, new32 = p.astype(jnp.float32), new.astype(jnp.float32)
    landed = optax.apply_updates(p, new32 - p32)
    assert landed.dtype == dtype
    far = jnp.abs(new32) >= bound * jnp.abs(p32)
    assert int(far.sum()) > 100_000 and int((~far).sum()) > 1000  # both cases seen
    assert bool(jnp.all(jnp.where(far, landed == new, True)))
    # Where the update cancels the parameter: within half a float32 unit of |p| of it.
    error = jnp.abs(landed.astype(jnp.float32) - new32)
    assert bool(jnp.all(error <= 2.0**-24 * jnp.abs(p32)))


def test_a_bfloat16_update_would_miss_the_rounded_value():
    # Why the updates are float32: the 16-bit difference of two values is not always exact.
    p, new = jnp.bfloat16(1.0078125), jnp.bfloat16(-0.00390625)
    assert optax.apply_updates(p, new - p) != new  # lands on -0.0078125
    assert optax.apply_updates(p, new.astype(jnp.float32) - p.astype(jnp.float32)) == new


def _run_kahan(dtype, updates, start=1.0):
    def body(carry, u):
        p, c, p32, nearest = carry
        new, _, c = rounding.kahan_add(p, u, c)
        nearest = (nearest.astype(jnp.float32) + u).astype(dtype)
        return (new, c, p32 + u, nearest), None

    init = (jnp.asarray(start, dtype), jnp.zeros((), dtype), jnp.float32(start))
    init += (jnp.asarray(start, dtype),)
    (p, c, p32, nearest), _ = jax.jit(lambda carry, updates: jax.lax.scan(body, carry, updates))(
        init, updates
    )
    return float(p), float(c), float(p32), float(nearest)


@pytest.mark.parametrize("mean, std, seed", [(2e-5, 1e-4, 0), (1e-5, 1e-5, 1), (0.0, 1e-3, 2)])
def test_kahan_recovers_the_float32_sum_of_1e5_small_updates(mean, std, seed):
    # Updates as training makes them: a drift and noise, most below half a unit of 1.0 in
    # bfloat16 (0.0039), which round-to-nearest loses.
    u = np.random.default_rng(seed).normal(mean, std, 100_000).astype(np.float32)
    p, c, p32, nearest = _run_kahan(jnp.bfloat16, jnp.asarray(u))
    assert abs(p - p32) <= 2.0**-8 * abs(p32), (p, p32)  # bfloat16's relative precision
    assert abs(c) <= 2.0**-8 * abs(p)  # the buffer holds less than half a unit of p
    if mean:
        assert abs(nearest - p32) > 0.25 * abs(p32 - 1)  # nearest lost a quarter of the drift


@pytest.mark.parametrize("u, behind", [(3e-4, 0.08), (-3e-6, 0.25)])
def test_kahan_lags_under_constant_updates_near_its_precision(u, behind):
    # The documented limit: the bfloat16 buffer rounds what it keeps to 8 bits, the same
    # way at every step when the update does not change, so the pair (about 16 bits) lags.
    start = 1.0 if u > 0 else 1.3
    p, _, p32, _ = _run_kahan(jnp.bfloat16, jnp.full(100_000, u, jnp.float32), start)
    assert abs(p - p32) / abs(p32) > behind


def test_kahan_buffer_restarts_after_a_non_finite_update():
    p, c = jnp.ones(2, jnp.bfloat16), jnp.full(2, 0.001, jnp.bfloat16)
    new, update, c = rounding.kahan_add(p, jnp.array([jnp.inf, 1e-3]), c)
    assert float(new[0]) == np.inf and float(c[0]) == 0.0
    assert c.dtype == jnp.bfloat16 and update.dtype == jnp.float32
    assert float(c[1]) == pytest.approx(0.002, rel=2**-7)
