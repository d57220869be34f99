"""float8 delayed scaling on plain arrays (``jmp_policy._src.quantization.float8``), with and without jit.

The amax history and scale sequences are written down by hand first (history newest
first; e4m3's maximum is 448, e5m2's 57344):

history length 3, input amaxes 2, 4, 1, inf, 0.5, 0.5, 0 (the history is the peers' ring:
a step rolls it by -1 and writes index 0, so it holds the last 3 amaxes):

    step  amax   scale used       history after       scale after
    1     2      448/2 = 224 *    [2, 0, 0]           224
    2     4      224              [4, 0, 2]           112
    3     1      112              [1, 2, 4]           112
    4     inf    112              [1, 2, 4] (kept)    112
    5     0.5    112              [0.5, 4, 1]         112
    6     0.5    112              [0.5, 1, 0.5]       448
    7     0      448              [0, 0.5, 0.5]       896

    * the history is empty: the step scales by its own amax (the documented exception).

history length 1, amaxes 2, 4, 1, nan, 0: scales after 224, 112, 448, 448 (nan not
recorded), 448 (a zero maximum keeps the scale); histories [2], [4], [1], [1], [0].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax_examples import measure

import jmp_policy as jp
from jmp_policy._src.quantization import float8, float8_matmul

E4M3, E5M2 = float8.E4M3, float8.E5M2
INF, NAN = float("inf"), float("nan")

SEQ3 = [  # amax, scale used, history after, scale after
    (2.0, 224.0, [2.0, 0.0, 0.0], 224.0),
    (4.0, 224.0, [4.0, 0.0, 2.0], 112.0),
    (1.0, 112.0, [1.0, 2.0, 4.0], 112.0),
    (INF, 112.0, [1.0, 2.0, 4.0], 112.0),
    (0.5, 112.0, [0.5, 4.0, 1.0], 112.0),
    (0.5, 112.0, [0.5, 1.0, 0.5], 448.0),
    (0.0, 448.0, [0.0, 0.5, 0.5], 896.0),
]
SEQ1 = [
    (2.0, [2.0], 224.0),
    (4.0, [4.0], 112.0),
    (1.0, [1.0], 448.0),
    (NAN, [1.0], 448.0),
    (0.0, [0.0], 448.0),
]


STATE_KEYS = tuple(
    f"{t}_{k}" for t in ("input", "kernel", "output_grad") for k in ("scale", "amax_history")
)


# A quantize-dequantize around one tensor, built from the package's scaling (`step_scale`,
# `update`) and the float8 matmul's quantization: the scaling steps tested on one tensor.
def qdq(x, scale, dtype):
    q, applied = float8_matmul._quantize(x, scale, dtype)
    return q.astype(x.dtype) * (1.0 / applied).astype(x.dtype)


@jax.custom_vjp
def in_qdq(x, scale, history):
    """``x`` through e4m3 with delayed scaling; the state's "gradient" is the new state."""
    return _in_fwd(x, scale, history)[0]


def _in_fwd(x, scale, history):
    a = float8.amax(x)
    y = qdq(x, float8.step_scale(scale, history, a, E4M3), E4M3)
    return y, float8.update(scale, history, a, E4M3)


in_qdq.defvjp(_in_fwd, lambda res, g: (g, *res))


@jax.custom_vjp
def out_qdq(y, scale, history):
    """``y`` as it is; the gradient reaching it goes through e5m2 with delayed scaling."""
    return y


def _out_bwd(res, g):
    scale, history = res
    a = float8.amax(g)
    g_q = qdq(g, float8.step_scale(scale, history, a, E5M2), E5M2)
    return (g_q, *float8.update(scale, history, a, E5M2))


out_qdq.defvjp(lambda y, scale, history: (y, (scale, history)), _out_bwd)


def reference_qdq(x, scale, dtype):
    """What a float8 quantize-dequantize is, in numpy and ml_dtypes (float32)."""
    x = np.asarray(x, np.float32)
    fp8_max = float(ml_dtypes.finfo(dtype).max)
    scaled = x * np.float32(scale)
    clipped = np.where(np.isfinite(scaled), np.clip(scaled, -fp8_max, fp8_max), scaled)
    return clipped.astype(dtype).astype(np.float32) * np.float32(1.0 / scale)


def input_with_amax(a):
    # One element at the amax, others small enough to show the scale used.
    if a == 0:
        return jnp.zeros(3, jnp.float32)
    return jnp.array([a, -a / 3 if np.isfinite(a) else 0.01, 0.013], jnp.float32)


def test_init_state_names_shapes_and_dtypes():
    state = float8.init_state(5)
    assert sorted(state) == sorted(STATE_KEYS)
    assert set(state) == {
        "input_scale",
        "input_amax_history",
        "kernel_scale",
        "kernel_amax_history",
        "output_grad_scale",
        "output_grad_amax_history",
    }
    for key, value in state.items():
        assert value.dtype == np.float32
        if key.endswith("_scale"):
            assert value.shape == () and float(value) == 1.0
        else:
            assert value.shape == (5,) and not np.any(np.asarray(value))


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        (0, ValueError, "from 1 to 65536. Received: amax_history_length=0"),
        (2**40, ValueError, "from 1 to 65536. Received: amax_history_length=1099511627776"),
        (True, TypeError, "from 1 to 65536. Received: amax_history_length=True \\(of type bool"),
        (2.0, TypeError, "from 1 to 65536. Received: amax_history_length=2.0 \\(of type float"),
    ],
)
def test_init_state_rejects_bad_lengths(value, error, message):
    with pytest.raises(error, match=message):
        float8.init_state(value)


def test_update_follows_the_hand_written_sequence_history_3(maybe_jit):
    update = maybe_jit(lambda s, h, a: float8.update(s, h, a, E4M3))
    used = maybe_jit(lambda s, h, a: float8.step_scale(s, h, a, E4M3))
    scale, history = jnp.float32(1.0), jnp.zeros(3, jnp.float32)
    for amax, scale_used, history_after, scale_after in SEQ3:
        a = jnp.float32(amax)
        assert float(used(scale, history, a)) == scale_used
        scale, history = update(scale, history, a)
        assert history.tolist() == history_after
        assert float(scale) == scale_after
        assert scale.dtype == history.dtype == np.float32


def test_update_follows_the_hand_written_sequence_history_1(maybe_jit):
    update = maybe_jit(lambda s, h, a: float8.update(s, h, a, E4M3))
    scale, history = jnp.float32(1.0), jnp.zeros(1, jnp.float32)
    for amax, history_after, scale_after in SEQ1:
        scale, history = update(scale, history, jnp.float32(amax))
        assert history.tolist() == history_after
        assert float(scale) == scale_after


def test_e5m2_scales_use_its_own_maximum():
    scale, _ = float8.update(jnp.float32(1.0), jnp.zeros(2, jnp.float32), jnp.float32(4.0), E5M2)
    assert float(scale) == 57344.0 / 4
    assert float8.max_value(E4M3) == 448.0 and float8.max_value(E5M2) == 57344.0


def test_in_qdq_steps_through_the_sequence_with_the_state_as_its_gradient(maybe_jit):
    """``in_qdq``'s forward uses the scale before this step; its state gradient is the new state."""

    def step(x, scale, history):
        y, vjp = jax.vjp(in_qdq, x, scale, history)
        gx, new_scale, new_history = vjp(jnp.ones_like(y))
        return y, gx, new_scale, new_history

    step = maybe_jit(step)
    scale, history = jnp.float32(1.0), jnp.zeros(3, jnp.float32)
    for amax, scale_used, history_after, scale_after in SEQ3:
        x = input_with_amax(amax)
        y, gx, scale, history = step(x, scale, history)
        np.testing.assert_array_equal(y, reference_qdq(x, scale_used, ml_dtypes.float8_e4m3fn))
        np.testing.assert_array_equal(gx, np.ones(3, np.float32))  # straight through
        assert history.tolist() == history_after
        assert float(scale) == scale_after


def test_out_qdq_quantizes_the_gradient_to_e5m2_with_delayed_scaling(maybe_jit):
    def step(g, scale, history):
        y = jnp.full((3,), 7.0)
        out, vjp = jax.vjp(out_qdq, y, scale, history)
        return out, *vjp(g)

    step = maybe_jit(step)
    scale, history = jnp.float32(1.0), jnp.zeros(3, jnp.float32)
    for amax, _, history_after, _ in SEQ3:
        g = input_with_amax(amax)
        out, gy, new_scale, history = step(g, scale, history)
        np.testing.assert_array_equal(out, np.full(3, 7.0, np.float32))  # forward: as is
        used = 57344.0 / amax if scale == 1.0 and np.isfinite(amax) and amax > 0 else scale
        np.testing.assert_array_equal(gy, reference_qdq(g, used, ml_dtypes.float8_e5m2))
        assert history.tolist() == history_after
        top = max(history_after)
        assert float(new_scale) == (57344.0 / top if top > 0 else float(scale))
        scale = new_scale


def test_qdq_saturates_finite_values_and_keeps_non_finite_ones(maybe_jit):
    x = jnp.array([1000.0, -1000.0, 0.3, INF, -INF, NAN], jnp.float32)
    e4 = maybe_jit(lambda x: qdq(x, jnp.float32(1.0), E4M3))(x)
    assert e4[:3].tolist() == [448.0, -448.0, 0.3125]
    assert np.isnan(np.asarray(e4[3:])).all()  # e4m3fn has no inf: nan, never finite
    e5 = maybe_jit(lambda x: qdq(x, jnp.float32(1.0), E5M2))(x * 100)
    assert e5[:2].tolist() == [57344.0, -57344.0]
    assert e5[3:5].tolist() == [INF, -INF] and np.isnan(float(e5[5]))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_qdq_computes_in_the_tensors_dtype_and_converts_only_to_and_from_float8(dtype):
    x = jnp.linspace(-3, 3, 64, dtype=dtype).reshape(8, 8)
    found = measure.converts(lambda x: in_qdq(x, jnp.float32(2.0), jnp.ones(4)), x)
    name = np.dtype(dtype).name
    full = [(a, b) for a, b, shape in found if shape == (8, 8)]
    assert full == [(name, "float8_e4m3fn"), ("float8_e4m3fn", name)]
    y = in_qdq(x, jnp.float32(2.0), jnp.ones(4))
    assert y.dtype == np.dtype(dtype)


def test_dot_general_matches_the_matmul_of_quantized_operands(maybe_jit):
    x = jax.random.normal(jax.random.key(0), (4, 16)) * 1e-3
    w = jax.random.normal(jax.random.key(1), (16, 8))
    state = float8.init_state(4)
    dn = (((1,), (0,)), ((), ()))
    y = maybe_jit(lambda x, w: float8_matmul.dot_general(state)(x, w, dn))(x, w)
    xs = 448.0 / float(jnp.max(jnp.abs(x)))  # first step: the tensors' own amax
    ws = 448.0 / float(jnp.max(jnp.abs(w)))
    xq = reference_qdq(x, xs, ml_dtypes.float8_e4m3fn)
    wq = reference_qdq(w, ws, ml_dtypes.float8_e4m3fn)
    np.testing.assert_allclose(y, xq @ wq, rtol=1e-5, atol=1e-9)
    # Inputs around 1e-3 survive (e4m3's smallest subnormal is 2**-9 ~ 2e-3).
    np.testing.assert_allclose(y, x @ w, rtol=0.1, atol=0.1 * float(jnp.abs(x @ w).max()))


def test_state_gradients_are_new_states_not_sums_of_calls(maybe_jit):
    """Two matmuls on two states: each state's gradient is its own new state."""
    x = jnp.full((2, 3), 0.5)
    w = jnp.full((3, 3), 2.0)
    dn = (((1,), (0,)), ((), ()))

    def loss(states):
        h = float8_matmul.dot_general(states[0])(x, w, dn)
        return float8_matmul.dot_general(states[1])(h, w, dn).sum()

    new = maybe_jit(jax.grad(loss))([float8.init_state(2), float8.init_state(2)])
    assert new[0]["input_amax_history"].tolist() == [0.5, 0.0]
    assert new[1]["input_amax_history"].tolist() == [3.0, 0.0]  # 0.5 * 2 * 3
    assert new[0]["kernel_scale"] == new[1]["kernel_scale"] == 224.0
    assert new[1]["output_grad_amax_history"].tolist() == [1.0, 0.0]
    assert new[0]["output_grad_amax_history"].tolist() == [6.0, 0.0]  # 1 * 2 * 3


def test_a_zeroed_state_reads_as_fresh_never_as_a_division_by_zero(maybe_jit):
    """A layer left out of a differentiated step gets a zero "gradient": its state comes
    back all zeros. The next step neither divides by zero nor loses its values."""
    zero = {k: jnp.zeros_like(v) for k, v in float8.init_state(4).items()}
    x = jnp.array([[0.5, -2.0, 0.0]])
    w = jnp.ones((3, 2))
    dn = (((1,), (0,)), ((), ()))
    y = maybe_jit(lambda x: float8_matmul.dot_general(zero)(x, w, dn))(x)
    np.testing.assert_allclose(y, x @ w)  # its own amax: 0.5, -2 and 1 are exact in e4m3
    y0 = maybe_jit(lambda x: float8_matmul.dot_general(zero)(x, w, dn))(jnp.zeros((1, 3)))
    np.testing.assert_array_equal(y0, np.zeros((1, 2), np.float32))  # not nan


# -- current scaling and the explicit matmul (issue #18) ------------------------------------


def test_current_scaling_scales_each_step_by_its_own_amax(maybe_jit):
    """Current scaling: a step's scale is fp8_max / amax of that step's tensor, whatever
    came before (no state); by hand for the sequence of amaxes 2, 0.5, 1000, 0."""
    scale = maybe_jit(lambda x: float8_matmul._scales(None, "input", x, E4M3)[0])
    for amax, want in ((2.0, 224.0), (0.5, 896.0), (1000.0, 0.448), (0.0, 1.0)):
        x = jnp.array([amax, -amax / 4, 0.0], jnp.float32)
        assert float(scale(x)) == pytest.approx(want, rel=1e-6)
    e5m2 = maybe_jit(lambda g: float8_matmul._scales(None, "output_grad", g, E5M2)[0])
    assert float(e5m2(jnp.array([4.0, -1.0]))) == 57344.0 / 4


def test_current_scaling_matmul_equals_the_hand_computed_float8_product(maybe_jit):
    """Forward: x and w to e4m3 with their own scales, the product divided by both."""
    x = jnp.array([[1.0, -2.0, 0.3], [0.7, 0.1, -0.05]], jnp.float32)
    w = jnp.array([[0.5, -0.25], [0.125, 1.0], [-0.75, 0.2]], jnp.float32)
    sx, sw = 448.0 / 2.0, 448.0 / 1.0
    xq = np.asarray(jnp.asarray(x * sx).astype(E4M3).astype(jnp.float32))
    wq = np.asarray(jnp.asarray(w * sw).astype(E4M3).astype(jnp.float32))
    want = (xq @ wq) / (sx * sw)
    got = maybe_jit(lambda x, w: float8_matmul.matmul(x, w, (((1,), (0,)), ((), ())), None))(x, w)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6)


def test_the_matmul_gradients_are_float8_products_with_the_saved_operands(maybe_jit):
    """Backward, by hand: dx = q5(g) @ q4(w).T / (sg * sw), dw = q4(x).T @ q5(g) / (sx * sg)."""
    x = jax.random.normal(jax.random.key(0), (4, 8))
    w = jax.random.normal(jax.random.key(1), (8, 3))
    g = jax.random.normal(jax.random.key(2), (4, 3))
    dims = (((1,), (0,)), ((), ()))
    _, vjp = jax.vjp(lambda x, w: float8_matmul.matmul(x, w, dims, None), x, w)
    dx, dw = maybe_jit(vjp)(g)

    def q(a, dtype):
        s = float8.max_value(dtype) / float(jnp.abs(a).max())
        return np.asarray((a * s).astype(dtype).astype(jnp.float32)), s

    (xq, sx), (wq, sw), (gq, sg) = q(x, E4M3), q(w, E4M3), q(g, E5M2)
    np.testing.assert_allclose(np.asarray(dx), gq @ wq.T / (sg * sw), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(dw), xq.T @ gq / (sx * sg), rtol=1e-5)


def test_a_kernel_on_the_left_of_einsum_keeps_its_role_and_layout():
    """The routed einsum takes ``(subscripts, input, kernel)`` as Flax's ``Einsum`` calls
    it; an output that puts the kernel's free axis first (where ``jnp.einsum`` would hand
    the kernel to ``dot_general`` as the left operand) keeps the kernel's state the
    kernel's, and the result in einsum's layout."""
    x = jax.random.normal(jax.random.key(0), (2, 5, 3, 4))
    w = jax.random.normal(jax.random.key(1), (3, 4, 7)) * 10.0
    from jmp_policy._src.quantization import matmuls

    policy = jp.get("float8_from_mixed_bfloat16")
    state = float8.init_state(2)
    y = matmuls.pick(policy, "einsum", state=state)("btnh,nhd->dbt", x, w)
    want = jnp.einsum("btnh,nhd->dbt", x, w)
    assert y.shape == want.shape == (7, 2, 5)
    assert float(jnp.abs(y - want).max() / jnp.abs(want).max()) < 0.1
    new = jax.grad(lambda s: matmuls.pick(policy, "einsum", state=s)("btnh,nhd->dbt", x, w).sum())(
        state
    )
    assert float(new["kernel_amax_history"][0]) == float(jnp.abs(w).max())
    assert float(new["input_amax_history"][0]) == float(jnp.abs(x).max())


def test_float8_min_dim_is_the_crossover_measured_on_a_gpu(monkeypatch):
    """float8 paid from width 2048 on an H200 (1.08x bf16's step time at 1024, 0.87x at
    2048): a GEMM with every dimension at least 2048 is recorded plainly and does not warn;
    one dimension below warns once, naming the layer and the measurement."""
    import warnings

    from jmp_policy._src.quantization import matmuls

    monkeypatch.setattr(matmuls, "_WARNED", set())
    assert matmuls.FLOAT8_MIN_DIM == 2048
    with matmuls.recording() as forms, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        matmuls.record_float8("big", 8192, 2048, 8192, "delayed")
        assert caught == []
        matmuls.record_float8("small", 8192, 2047, 8192, "current")
        matmuls.record_float8("smaller", 1024, 1024, 1024, "current")
    assert forms["big"] == "float8 (delayed), e4m3 x e4m3 GEMM 8192x2048x8192"
    assert forms["small"] == (
        "float8 (current), e4m3 x e4m3 GEMM 8192x2047x8192; below 2048: bf16 may be faster; "
        "dims not multiples of 16: XLA pads them"
    )
    assert "below 2048: bf16 may be faster" in forms["smaller"]
    assert len(caught) == 1  # once per process
    message = str(caught[0].message)
    assert "'small' runs a 8192x2047x8192 matmul: below 2048 rows or features" in message
    assert "1.08x bf16's time at width 1024 and 0.87x at 2048" in message
