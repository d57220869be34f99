"""The clipping search (GPTQ's mse grid, AWQ's auto_clip) against a brute-force NumPy
search over the same ratios, with and without jit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmp_policy._src.quantization import clipping


def _weights(rows, cols, seed, outliers=True):
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(rows, cols))
    if outliers:  # heavy tails: a few large weights per column, where clipping pays
        w = w * np.exp(0.8 * rng.normal(size=(rows, cols)))
    return w.astype(np.float32)


def _errors(w, rest, qmax, gram=None, norm=2.4):
    """Brute force in float64: every ratio's error per scale index ``[ratios, n]``."""
    w64 = w.astype(np.float64)
    n = rest[-1]
    amax = np.abs(w64).max(axis=0).reshape(-1, n).max(axis=0)
    ratios = 1.0 - np.arange(80) / 100.0
    out = []
    for r in ratios:
        s = np.broadcast_to(amax * r / qmax, rest).reshape(-1)
        d = w64 - np.clip(np.round(w64 / s), -qmax, qmax) * s
        e = (np.abs(d) ** norm).sum(0) if gram is None else (d * (gram @ d)).sum(0)
        out.append(e.reshape(-1, n).sum(0))
    return np.array(out), amax, ratios


def _error_of(w, scale, rest, qmax, gram=None, norm=2.4):
    w64 = w.astype(np.float64)
    s = np.broadcast_to(np.asarray(scale, np.float64), rest).reshape(-1)
    d = w64 - np.clip(np.round(w64 / s), -qmax, qmax) * s
    e = (np.abs(d) ** norm).sum(0) if gram is None else (d * (gram @ d)).sum(0)
    return e.reshape(-1, rest[-1]).sum(0)


@pytest.mark.parametrize("objective", ["weights", "outputs"])
@pytest.mark.parametrize("rest", [(12,), (3, 4)])  # (3, 4): one scale shared by 3 heads
def test_search_scale_finds_the_brute_force_best_ratio(objective, rest, maybe_jit):
    cols = int(np.prod(rest))
    w = _weights(32, cols, seed=0)
    gram = None
    if objective == "outputs":
        x = np.random.default_rng(1).normal(size=(256, 32)) * np.exp(
            np.random.default_rng(2).normal(size=32)
        )
        gram = (x.T @ x).astype(np.float32)
    fn = maybe_jit(lambda w, g: clipping.search_scale(w, rest, 7.0, g))
    scale = np.asarray(fn(jnp.asarray(w), None if gram is None else jnp.asarray(gram)))
    errors, amax, _ = _errors(w, rest, 7.0, None if gram is None else gram.astype(np.float64))
    assert scale.shape == (rest[-1],)
    # ours is the brute-force minimum (float32 against float64: equal to a tie's precision)
    ours = _error_of(w, scale, rest, 7.0, None if gram is None else gram.astype(np.float64))
    np.testing.assert_allclose(ours, errors.min(0), rtol=1e-5)
    # and a ratio of the grid (1 - i/100, i < 80) times the abs-max
    r = scale * 7.0 / amax
    assert np.all(np.abs(r * 100 - np.round(r * 100)) < 1e-3) and np.all((r > 0.2) & (r <= 1))
    assert np.any(r < 1)  # heavy tails: clipping pays for some scale


def test_search_scale_keeps_abs_max_when_clipping_cannot_help():
    w = jnp.asarray(np.tile([[7.0], [-7.0], [3.0], [1.0]], (1, 3)) * 0.1, jnp.float32)
    scale = clipping.search_scale(w, (3,), 7.0)  # every weight on the abs-max grid
    np.testing.assert_allclose(np.asarray(scale), [0.1, 0.1, 0.1], rtol=1e-6)


def test_search_scale_of_zero_and_non_finite_groups():
    w = jnp.asarray([[0.0, 1.0, np.nan], [0.0, 0.5, 1.0]], jnp.float32)
    scale = np.asarray(clipping.search_scale(w, (3,), 7.0))
    assert scale[0] == 1.0 and np.isfinite(scale[1]) and np.isnan(scale[2])


@pytest.mark.parametrize("with_gram", [False, True])
def test_quantize_groups_clips_each_group_on_its_own(with_gram, maybe_jit):
    w = _weights(40, 6, seed=3)  # groups of 16: the last is short (8 rows)
    gram = None
    if with_gram:
        x = np.random.default_rng(4).normal(size=(200, 40))
        gram = jnp.asarray(x.T @ x, jnp.float32)
    fn = maybe_jit(lambda w, g: clipping.quantize_groups(w, (6,), 7.0, 16, g))
    values, scales = fn(jnp.asarray(w), gram)
    assert values.shape == (40, 6) and scales.shape == (3, 6)
    for g, (a, b) in enumerate([(0, 16), (16, 32), (32, 40)]):
        block = None if gram is None else gram[a:b, a:b]
        want = clipping.search_scale(jnp.asarray(w[a:b]), (6,), 7.0, block)
        np.testing.assert_allclose(np.asarray(scales[g]), np.asarray(want), rtol=1e-6)
        q = np.clip(np.round(w[a:b] / np.asarray(want)), -7, 7)
        assert np.mean(np.asarray(values[a:b]) != q) < 0.02  # a rare tie may round apart
    assert np.all(np.abs(np.asarray(values)) <= 7)


@pytest.mark.parametrize("with_gram", [False, True])
def test_a_group_longer_than_the_kernel_is_one_group_of_its_rows(with_gram):
    w = _weights(40, 6, seed=5)
    gram = None
    if with_gram:
        x = np.random.default_rng(6).normal(size=(200, 40))
        gram = jnp.asarray(x.T @ x, jnp.float32)
    values, scales = clipping.quantize_groups(jnp.asarray(w), (6,), 7.0, 128, gram)
    assert values.shape == (40, 6) and scales.shape == (1, 6)
    want = clipping.search_scale(jnp.asarray(w), (6,), 7.0, gram)
    np.testing.assert_allclose(np.asarray(scales[0]), np.asarray(want), rtol=1e-6)
    q = np.clip(np.round(w / np.asarray(want)), -7, 7)
    assert np.mean(np.asarray(values) != q) < 0.02  # a rare tie may round apart


def test_clip_ratios_are_the_reference_grid():
    r = np.asarray(clipping.clip_ratios())
    assert r.shape == (80,) and r[0] == 1.0 and np.isclose(r[-1], 0.21)
    np.testing.assert_allclose(np.asarray(clipping.clip_ratios(20, 0.5)), 1 - np.arange(10) / 20)


def test_search_scale_does_not_mutate_its_input():
    w = _weights(16, 4, seed=5)
    before = w.copy()
    jax.block_until_ready(clipping.search_scale(w, (4,), 7.0))
    np.testing.assert_array_equal(w, before)


@pytest.mark.parametrize("use_jit", [False, True])
def test_best_ratio_takes_any_grid_and_skips_nan_errors(use_jit):
    rows = jnp.asarray(_weights(16, 3, 7))
    ratios = clipping.clip_ratios()
    # A "grid" that rounds to multiples of 0.05 · r: the best ratio by brute force.
    real = lambda r: jnp.round(rows / (0.05 * r)) * (0.05 * r)  # noqa: E731
    run = jax.jit(lambda: clipping.best_ratio(rows, (3,), real)) if use_jit else None
    got = run() if use_jit else clipping.best_ratio(rows, (3,), real)
    errs = np.stack([np.sum(np.abs(np.asarray(rows - real(r))) ** 2.4, axis=0) for r in ratios])
    np.testing.assert_array_equal(got, np.asarray(ratios)[np.argmin(errs, axis=0)])
    # An error that is NaN at r = 1 never wins: the best finite one does.
    nan_first = lambda r: jnp.where(r == 1.0, jnp.nan, real(r))  # noqa: E731
    got = clipping.best_ratio(rows, (3,), nan_first)
    assert np.all(np.asarray(got) < 1.0)


# -- int4's full range: the ratios go above 1, to 7.5 / 7 ----------------------------------


def test_clip_ratios_widen_above_one_after_the_reference_grid():
    r = np.asarray(clipping.clip_ratios(widen=7.5 / 7))
    assert r.shape == (88,) and r[0] == 1.0
    np.testing.assert_allclose(r[:80], np.asarray(clipping.clip_ratios()))
    np.testing.assert_allclose(r[80:], [1.01, 1.02, 1.03, 1.04, 1.05, 1.06, 1.07, 7.5 / 7])
    np.testing.assert_array_equal(np.asarray(clipping.clip_ratios(widen=1.0)), r[:80])


def _full_range_errors(w, rest, gram=None, norm=2.4):
    """Brute force on int4's full range (``r · amax / 7.5``, codes -8..7), float64."""
    w64, n = w.astype(np.float64), rest[-1]
    amax = np.abs(w64).max(axis=0).reshape(-1, n).max(axis=0)
    ratios = np.asarray(clipping.clip_ratios(widen=7.5 / 7), np.float64)
    out = []
    for r in ratios:
        s = np.broadcast_to(amax * r / 7.5, rest).reshape(-1)
        t = w64 / s
        t = np.where(np.abs(t + 7.5) < 1e-5, -7.5, t)
        d = w64 - np.clip(np.round(t), -8, 7) * s
        e = (np.abs(d) ** norm).sum(0) if gram is None else (d * (gram @ d)).sum(0)
        out.append(e.reshape(-1, n).sum(0))
    return np.array(out), amax, ratios


@pytest.mark.parametrize("objective", ["weights", "outputs"])
def test_search_scale_on_the_full_range_is_the_brute_force_best_of_the_wider_ratios(
    objective, maybe_jit
):
    from jmp_policy._src.quantization.symmetric_grid import INT4

    w = _weights(32, 12, seed=3)
    gram = None
    if objective == "outputs":
        x = np.random.default_rng(4).normal(size=(256, 32))
        gram = (x.T @ x).astype(np.float32)
    fn = maybe_jit(lambda w, g: clipping.search_scale(w, (12,), INT4, g))
    scale = np.asarray(fn(jnp.asarray(w), None if gram is None else jnp.asarray(gram)))
    errors, amax, ratios = _full_range_errors(w, (12,), None if gram is None else gram)
    best = ratios[np.argmin(errors, axis=0)]
    np.testing.assert_allclose(scale, amax * best / 7.5, rtol=1e-5)


def test_the_full_range_search_finds_the_narrow_scale_where_it_is_exact(maybe_jit):
    """Weights on the narrow grid's codes (multiples of amax / 7): only a ratio above 1
    reaches that scale; the search takes it, error 0 (ratio 1 leaves +amax half a step off)."""
    from jmp_policy._src.quantization.symmetric_grid import INT4

    codes = np.array([-7, -5, -2, 0, 1, 3, 6, 7], np.float32)[:, None]
    w = np.concatenate([codes * 0.1, codes[::-1] * 0.3], axis=1)  # two columns
    scale = np.asarray(maybe_jit(lambda w: clipping.search_scale(w, (2,), INT4))(w))
    np.testing.assert_allclose(scale, [0.1, 0.3], rtol=1e-6)
    values, _ = clipping.quantize_groups(jnp.asarray(w), (2,), INT4, 8)
    np.testing.assert_array_equal(np.asarray(values), np.concatenate([codes, codes[::-1]], 1))
    # The narrow grid and int8 keep the reference ratios (none above 1).
    narrow = np.asarray(clipping.search_scale(w, (2,), 7.0))
    np.testing.assert_allclose(narrow, [0.1, 0.3], rtol=1e-6)
