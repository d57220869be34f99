"""AWQ on one kernel: the scale search against a brute-force reference on the inputs
themselves, against round-to-nearest, stacked, and its errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmp_policy._src import quantization
from jmp_policy._src.quantization import awq, calibration_stats, kernel_matmul


def _salient(rows, features, seed):
    """Inputs with a few channels far larger than the rest (AWQ's case)."""
    rng = np.random.default_rng(seed)
    magnitude = np.exp(1.5 * rng.normal(size=features))
    return (rng.normal(size=(rows, features)) * magnitude).astype(np.float32)


def _kernel(rows, cols, seed=1):
    return np.random.default_rng(seed).normal(size=(rows, cols)).astype(np.float32)


def _stats(x):
    stats = calibration_stats.LayerStats.zeros(x.shape[-1]).update(x)
    return stats.mean_abs, stats.gram


def _brute_force(w, x, group, n=20):
    """Every exponent of the grid, scored by the output error on the inputs themselves."""
    m = np.abs(x).mean(0)
    m = np.where(m < 1e-8, 1.0, m)
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    losses, scales = [], []
    for i in range(n + 1):
        s = np.maximum(m ** (i / n), 1e-4)
        s = s / np.sqrt(s.max() * s.min())
        q = quantization.quantize(jnp.asarray(w * s[:, None]), "int4", group)
        w_hat = np.asarray(q.dequantize(), np.float64) / s[:, None]
        losses.append(np.sum((x64 @ w64 - x64 @ w_hat) ** 2))
        scales.append(s)
    return np.array(losses), scales


def _loss(w, x, q):
    w_hat = np.asarray(q.dequantize(), np.float64)
    return np.sum((x.astype(np.float64) @ (w.astype(np.float64) - w_hat)) ** 2)


@pytest.mark.parametrize("group", [32, -1])
def test_awq_finds_the_brute_force_best_exponent(group, maybe_jit):
    x, w = _salient(1024, 128, seed=0), _kernel(128, 16)
    mean_abs, gram = _stats(x)
    q = maybe_jit(lambda w, m, g: awq.awq_quantize(w, m, g, group_size=group))(
        jnp.asarray(w), mean_abs, gram
    )
    losses, scales = _brute_force(w, x, group)
    best = int(np.argmin(losses))
    assert 0 < best < 20  # an interior optimum: the test would notice a wrong grid
    # float32 Gram against float64 inputs: the chosen exponent is the best or ties with it
    assert _loss(w, x, q) <= losses.min() * (1 + 1e-4)
    s = q.input_scale
    np.testing.assert_allclose(np.asarray(s), scales[best], rtol=1e-4)
    assert s.dtype == jnp.float32 and s.shape == (128,)
    assert q.mode == "int4" and q.block_size == group and q.values.dtype == jnp.int4


def _brute_force_clip(w, x, s, group, bound=7.5, lo=-8.0, qmax=7.0):
    """AWQ's auto_clip by brute force: for the scaled kernel ``diag(s) w`` and inputs
    ``x / s``, each group's and column's ratio ``1 - i/100`` (``i < 80``) of the abs-max
    with the least output error of that group's rows, in float64. On the full-range grid,
    int4's default since #49 (``amax / 7.5``, ``-8..7``, a division within 1e-5 of the tie
    ``-7.5`` rounded to ``-8``; was ``amax / 7``, ``-7..7``), the ratios also
    ``1.01, ..., 1.07`` and ``7.5 / 7`` (up to the scale ``amax / 7``)."""
    ws = w.astype(np.float64) * s[:, None]
    xs = x.astype(np.float64) / s[None, :]
    rows = w.shape[0]
    size = rows if group == -1 else group
    w_hat = np.zeros_like(ws)
    for a in range(0, rows, size):
        wg, xg = ws[a : a + size], xs[:, a : a + size]
        amax = np.abs(wg).max(0)
        best, best_err = None, np.full(amax.shape, np.inf)
        wider = [1 + i / 100 for i in range(1, 8)] + [bound / qmax] if bound > qmax else []
        for r in [1 - i / 100 for i in range(80)] + wider:
            sc = amax * r / bound
            t = wg / sc
            dq = np.clip(np.round(np.where(np.abs(t + bound) < 1e-5, -bound, t)), lo, qmax) * sc
            err = ((xg @ (wg - dq)) ** 2).sum(0)
            better = err < best_err
            best = dq if best is None else np.where(better, dq, best)
            best_err = np.where(better, err, best_err)
        w_hat[a : a + size] = best
    return w_hat / s[:, None]


@pytest.mark.parametrize("group", [32, -1])
def test_awq_clipping_search_is_the_brute_force_auto_clip(group, maybe_jit):
    x, w = _salient(1024, 128, seed=0), _kernel(128, 16)
    mean_abs, gram = _stats(x)
    fn = maybe_jit(lambda w, m, g: awq.awq_quantize(w, m, g, group_size=group, clip_search=True))
    q = fn(jnp.asarray(w), mean_abs, gram)
    plain = awq.awq_quantize(jnp.asarray(w), mean_abs, gram, group_size=group)
    s = np.asarray(q.input_scale, np.float64)
    np.testing.assert_allclose(s, np.asarray(plain.input_scale), rtol=1e-6)  # same s
    w_hat = _brute_force_clip(w, x, s, group)
    want = np.sum((x.astype(np.float64) @ (w - w_hat)) ** 2)
    # float32 Gram against float64 inputs: the same minimum up to a near-tie's precision
    np.testing.assert_allclose(_loss(w, x, q), want, rtol=1e-3)
    assert _loss(w, x, q) < _loss(w, x, plain)
    assert q.values.dtype == jnp.int4 and q.scale.shape == plain.scale.shape
    assert q.mode == "int4" and q.block_size == group


@pytest.mark.parametrize("clip", [False, True])
def test_awq_over_two_input_axes_is_awq_of_the_2d_kernel(clip, maybe_jit):
    """Attention's output projection [heads, head_dim, out]: ``s`` per (head, head_dim)."""
    x, w = _salient(1024, 64, seed=3), _kernel(64, 16, seed=4)
    mean_abs, gram = _stats(x)
    w3 = jnp.asarray(w.reshape(4, 16, 16))
    fn = maybe_jit(
        lambda w, m, g: awq.awq_quantize(w, m, g, group_size=2, in_axes=2, clip_search=clip)
    )
    q = fn(w3, mean_abs, gram)
    flat = awq.awq_quantize(jnp.asarray(w), mean_abs, gram, group_size=32, clip_search=clip)
    rtn = quantization.quantize(w3, "int4", 2)
    assert q.shape == (4, 16, 16) and q.input_scale.shape == (4, 16)
    assert q.values.shape == rtn.values.shape and q.scale.shape == rtn.scale.shape == (2, 16)
    np.testing.assert_allclose(
        np.asarray(q.input_scale).reshape(64), np.asarray(flat.input_scale), rtol=1e-6
    )
    np.testing.assert_array_equal(np.asarray(q.values).reshape(64, 16), np.asarray(flat.values))
    np.testing.assert_allclose(
        np.asarray(q.dequantize()).reshape(64, 16), np.asarray(flat.dequantize()), rtol=1e-5
    )


def test_awq_beats_round_to_nearest_on_held_out_inputs():
    x = _salient(3072, 256, seed=1)
    w = _kernel(256, 32)
    q = awq.awq_quantize(jnp.asarray(w), *_stats(x[:2048]), group_size=128)
    rtn = quantization.quantize(jnp.asarray(w), "int4", 128)
    held_out = x[2048:]
    ours = _loss(w, held_out, q)
    theirs = _loss(w, held_out, rtn)
    assert ours < 0.8 * theirs


def test_uniform_inputs_give_a_scale_of_one_and_round_to_nearest():
    x = np.ones((8, 16), np.float32)
    w = _kernel(16, 4)
    q = awq.awq_quantize(jnp.asarray(w), *_stats(x), group_size=-1)
    np.testing.assert_array_equal(np.asarray(q.input_scale), np.ones(16, np.float32))
    rtn = quantization.quantize(jnp.asarray(w), "int4", -1)
    np.testing.assert_array_equal(np.asarray(q.values), np.asarray(rtn.values))


def test_candidate_scales_are_normalised_and_floored():
    m = jnp.asarray([0.0, 1e-9, 4.0, 16.0])
    s = awq.candidate_scales(m, jnp.float32(0.5))
    # zero and tiny magnitudes count as 1; sqrt(max * min) = sqrt(4 * 1) = 2
    np.testing.assert_allclose(np.asarray(s), [0.5, 0.5, 1.0, 2.0], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(awq.candidate_scales(m, jnp.float32(0.0))), 1.0)


def test_awq_int8_per_channel():
    x, w = _salient(512, 64, seed=2), _kernel(64, 8)
    q = awq.awq_quantize(jnp.asarray(w), *_stats(x), weight_bits=8, group_size=-1)
    assert q.mode == "int8" and q.values.dtype == jnp.int8 and q.scale.shape == (8,)
    rtn = quantization.quantize(jnp.asarray(w), "int8")
    assert _loss(w, x, q) <= _loss(w, x, rtn) * (1 + 1e-5)


def test_awq_searches_each_stacked_layer_on_its_own(maybe_jit):
    xs = [_salient(512, 32, seed=s) for s in (3, 4)]
    ws = np.stack([_kernel(32, 8, seed=5), _kernel(32, 8, seed=6)])
    stats = [_stats(x) for x in xs]
    mean_abs = jnp.stack([m for m, _ in stats])
    gram = jnp.stack([g for _, g in stats])
    q = maybe_jit(lambda w, m, g: awq.awq_quantize(w, m, g, group_size=16, stacked=1))(
        jnp.asarray(ws), mean_abs, gram
    )
    s = q.input_scale
    assert q.stacked == 1 and q.scale.shape == (2, 2, 8) and s.shape == (2, 32)
    for i in range(2):
        one = awq.awq_quantize(jnp.asarray(ws[i]), *stats[i], group_size=16)
        np.testing.assert_allclose(np.asarray(s[i]), np.asarray(one.input_scale), rtol=1e-6)
        np.testing.assert_allclose(
            np.asarray(q.dequantize()[i]), np.asarray(one.dequantize()), rtol=1e-6
        )
        np.testing.assert_array_equal(np.asarray(q.values[i]), np.asarray(one.values))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"weight_bits": 3}, r"`weight_bits` must be 4 or 8 for AWQ.*weight_bits=3"),
        ({"group_size": 0}, r"`group_size` must be -1.*group_size=0"),
        ({"weight_bits": 8, "group_size": 64}, r"8-bit AWQ.*use group_size=-1"),
        ({"num_grid_points": 0}, r"`num_grid_points` must be a positive.*num_grid_points=0"),
    ],
)
def test_awq_rejects_bad_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        awq.awq_quantize(jnp.ones((8, 4)), jnp.ones(8), jnp.eye(8), **kwargs)


def test_awq_rejects_bad_arrays():
    with pytest.raises(ValueError, match=r"`mean_abs` must have shape \(8,\).*\(4,\)"):
        awq.awq_quantize(jnp.ones((8, 4)), jnp.ones(4), jnp.eye(8))
    with pytest.raises(ValueError, match=r"`gram` must have shape \(8, 8\)"):
        awq.awq_quantize(jnp.ones((8, 4)), jnp.ones(8), jnp.eye(4))
    with pytest.raises(TypeError, match=r"`kernel` must be a floating array"):
        awq.awq_quantize(np.ones((8, 4), np.int8), jnp.ones(8), jnp.eye(8))


def test_layer_stats_sum_over_batches_of_any_rows(maybe_jit):
    rng = np.random.default_rng(7)
    a, b = rng.normal(size=(2, 3, 5)), rng.normal(size=(7, 5))
    update = maybe_jit(lambda st, x: st.update(x))
    stats = update(update(calibration_stats.LayerStats.zeros(5), a), b)
    rows = np.concatenate([a.reshape(-1, 5), b])
    np.testing.assert_allclose(np.asarray(stats.gram), rows.T @ rows, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(stats.mean_abs), np.abs(rows).mean(0), rtol=1e-5)
    assert float(stats.count) == 13.0
    with pytest.raises(ValueError, match=r"end in the layer's 5 input features.*\(2, 4\)"):
        stats.update(np.ones((2, 4)))
    leaves = jax.tree.leaves(jax.tree.map(lambda x: x, stats))
    assert len(leaves) == 4  # gram, abs_sum, count and (SmoothQuant's) abs_max
    np.testing.assert_allclose(np.asarray(stats.abs_max), np.abs(rows).max(0), rtol=1e-6)


def test_input_scaled_array_is_a_pytree_that_keeps_its_scale_and_checks_its_shape(maybe_jit):
    x, w = _salient(256, 32, seed=8), _kernel(32, 8)
    q = awq.awq_quantize(jnp.asarray(w), *_stats(x), group_size=-1)
    back = maybe_jit(lambda q: jax.tree.map(lambda a: a, q))(q)
    assert isinstance(back, awq.InputScaledArray) and isinstance(back, quantization.QuantizedArray)
    np.testing.assert_array_equal(np.asarray(back.input_scale), np.asarray(q.input_scale))
    assert back.nbytes == quantization.quantize(jnp.asarray(w), "int4", -1).nbytes + 32 * 4
    with pytest.raises(ValueError, match=r"`input_scale` must have shape \(32,\).*\(31,\)"):
        awq.InputScaledArray(
            q.values, q.scale, "int4", -1, (32, 8), np.dtype("float32"), 0, jnp.ones(31)
        )


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_an_awq_kernel_outside_its_scheme_matmul_is_dequantized_by_its_type(jit):
    """The kernel matmul knows an AWQ kernel by its class (it cannot divide the inputs by
    ``s``), so it multiplies by ``W``'s estimate; the plain ``Q(diag(s) W)`` runs fast."""
    x, w = _salient(64, 16, 0), _kernel(16, 8)
    q = awq.awq_quantize(jnp.asarray(w), *_stats(x), group_size=-1)
    dims = (((1,), (0,)), ((), ()))
    assert kernel_matmul.kernel_form(q, dims, 64, False) == "dequantized"
    plain = q.scaled_kernel()
    assert kernel_matmul.kernel_form(plain, dims, 64, False) == "weight-only, scale after"
    forms = []
    dot = kernel_matmul.quantized_kernel_dot_general(q, record=forms.append)
    call = lambda x: dot(x, jnp.zeros(q.shape), dims)  # noqa: E731
    got = (jax.jit(call) if jit else call)(jnp.asarray(x))
    assert forms == ["dequantized"]
    np.testing.assert_allclose(
        np.asarray(got), x @ np.asarray(q.dequantize()), rtol=1e-5, atol=1e-4
    )
    # handed reshaped by its layer (two input axes), it is still dequantized, not reshaped
    dims3 = (((1, 2), (0, 1)), ((), ()))
    got3 = dot(jnp.asarray(x).reshape(64, 4, 4), jnp.zeros((4, 4, 8)), dims3)
    assert forms[-1] == "dequantized"
    np.testing.assert_allclose(np.asarray(got3), np.asarray(got), rtol=1e-5, atol=1e-4)
