"""Tests for `loss_scaling`, `get_loss_scale` and `scaled_value_and_grad`."""

from __future__ import annotations

import warnings

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jmp_policy as jp


def _tree_equal(a, b):
    return all(
        np.array_equal(np.asarray(x), np.asarray(y), equal_nan=True)
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def _all_finite_np(tree):
    return all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(tree))


# --- the basic step ------------------------------------------------------------------------


def test_keras_sgd_sequence(maybe_jit):
    opt = jp.loss_scaling(optax.sgd(0.5), jp.DynamicLossScale(2.0**15))
    params = jnp.array([1.0, 2.0, 3.0, 4.0])
    state = opt.init(params)
    grads = jnp.array([1.0, 6.0, 7.0, 2.0]) * 2**15
    updates, state = maybe_jit(opt.update)(grads, state, params)
    np.testing.assert_array_equal(optax.apply_updates(params, updates), [0.5, -1.0, -0.5, 3.0])
    assert int(state.total_skipped) == 0 and int(state.consecutive_skipped) == 0


def test_unscales_with_the_scale_the_grads_were_computed_with(maybe_jit):
    # On a growth step, mpx divides by the new scale and halves the gradient. Not here.
    opt = jp.loss_scaling(optax.sgd(1.0), jp.DynamicLossScale(8.0, period=1))
    state = opt.init(jnp.zeros(2))
    update = maybe_jit(opt.update)
    for scale in [8.0, 16.0, 32.0]:
        assert float(jp.get_loss_scale(state).loss_scale) == scale
        updates, state = update(jnp.array([1.0, -2.0]) * scale, state)
        np.testing.assert_array_equal(updates, [-1.0, 2.0])


def test_non_finite_step_gives_zero_updates_and_unchanged_inner_state(maybe_jit):
    opt = jp.loss_scaling(optax.adam(0.1), jp.DynamicLossScale(2.0**10, period=100))
    params = {"w": jnp.ones(3), "b": jnp.zeros(2)}
    state = opt.init(params)
    update = maybe_jit(opt.update)
    good = {"w": jnp.ones(3) * 2.0**10, "b": jnp.ones(2) * 2.0**10}
    _, state = update(good, state, params)
    before = state
    for i, bad_value in enumerate([np.nan, np.inf, -np.inf]):
        bad = {"w": jnp.array([1.0, bad_value, 1.0]), "b": jnp.ones(2)}
        updates, state = update(bad, state, params)
        assert _tree_equal(updates, jax.tree.map(jnp.zeros_like, params))
        assert _tree_equal(state.inner_state, before.inner_state)
        assert int(state.total_skipped) == i + 1 and int(state.consecutive_skipped) == i + 1
        assert float(state.loss_scale.loss_scale) == 2.0 ** (9 - i)
    _, state = update(good, state, params)
    assert int(state.total_skipped) == 3 and int(state.consecutive_skipped) == 0
    assert int(state.inner_state[0].count) == 2


def test_hundreds_of_consecutive_non_finite_steps_never_update():
    opt = jp.loss_scaling(optax.adam(0.1))
    guarded = optax.apply_if_finite(optax.adam(0.1), max_consecutive_errors=5)
    params = {"w": jnp.ones((4, 3)), "b": jnp.zeros(3)}
    bad = {"w": jnp.full((4, 3), jnp.nan), "b": jnp.full(3, jnp.inf)}

    def run(tx):
        def body(carry, _):
            p, s = carry
            u, s = tx.update(bad, s, p)
            return (optax.apply_updates(p, u), s), jnp.max(
                jnp.abs(jnp.stack([jnp.max(jnp.abs(x)) for x in jax.tree.leaves(u)]))
            )

        return jax.jit(lambda p, s: jax.lax.scan(body, (p, s), None, length=300))(
            params, tx.init(params)
        )

    (new_params, state), largest_update = run(opt)
    np.testing.assert_array_equal(largest_update, np.zeros(300))
    assert _tree_equal(new_params, params)
    assert _all_finite_np(state)
    assert int(state.total_skipped) == 300 and int(state.consecutive_skipped) == 300
    assert float(state.loss_scale.loss_scale) == jp.DynamicLossScale().min_loss_scale
    # optax.apply_if_finite, the defect to beat, lets a NaN through after 5 errors.
    (guarded_params, _), _ = run(guarded)
    assert not _all_finite_np(guarded_params)


def test_fault_injection_matches_a_loop_that_skips_those_steps():
    key = jax.random.key(0)
    x = jax.random.normal(key, (32, 4))
    y = x @ jnp.array([1.0, -2.0, 0.5, 3.0]) + 1.0
    params = {"w": jnp.zeros(4), "b": jnp.zeros(())}

    def loss_fn(p):
        return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)

    opt = jp.loss_scaling(optax.adam(0.05), jp.DynamicLossScale(2.0**12, period=3))
    ref = optax.adam(0.05)
    rng = np.random.default_rng(1)
    poisoned = rng.random(60) < 0.3
    poisons = rng.choice([np.nan, np.inf, -np.inf], size=60)

    @jax.jit
    def step(p, s, poison):
        _, g = jp.scaled_value_and_grad(loss_fn)(jp.get_loss_scale(s), p)
        g = dict(g, w=g["w"].at[1].add(poison))
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s

    @jax.jit
    def ref_step(p, s):
        u, s = ref.update(jax.grad(loss_fn)(p), s, p)
        return optax.apply_updates(p, u), s

    p, s = params, opt.init(params)
    rp, rs = params, ref.init(params)
    for bad, poison in zip(poisoned, poisons, strict=True):
        p, s = step(p, s, jnp.float32(poison if bad else 0.0))
        assert _all_finite_np(p) and _all_finite_np(s)
        if not bad:
            rp, rs = ref_step(rp, rs)
    assert int(s.total_skipped) == poisoned.sum() > 10
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6), p, rp)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6), s.inner_state, rs
    )


def test_changing_scale_does_not_recompile_the_step():
    traces = []
    opt = jp.loss_scaling(optax.sgd(0.1), jp.DynamicLossScale(4.0, period=1))

    @jax.jit
    def step(p, s, g):
        traces.append(None)
        return opt.update(g, s, p)

    p = jnp.ones(3)
    s = opt.init(p)
    for v in [1.0, 1.0, np.nan, 1.0, np.inf]:
        _, s = step(p, s, jnp.full(3, v))
    assert len(traces) == 1
    assert float(s.loss_scale.loss_scale) == 8.0  # 4 -> 8 -> 16 -> 8 -> 16 -> 8


# --- extra args, strings, get_loss_scale -----------------------------------------------------


def test_forwards_extra_args_to_inner_that_accepts_them():
    def init(params):
        return optax.EmptyState()

    def update(updates, state, params=None, *, value=1.0, **extra):
        return jax.tree.map(lambda u: u * value, updates), state

    inner = optax.GradientTransformationExtraArgs(init, update)
    opt = jp.loss_scaling(inner, 2.0)
    updates, _ = jax.jit(opt.update)(jnp.ones(2) * 2.0, opt.init(jnp.ones(2)), value=3.0)
    np.testing.assert_array_equal(updates, [3.0, 3.0])
    # A plain transformation ignores extra args.
    opt = jp.loss_scaling(optax.sgd(1.0), 2.0)
    updates, _ = opt.update(jnp.ones(2) * 2.0, opt.init(jnp.ones(2)), value=3.0)
    np.testing.assert_array_equal(updates, [-1.0, -1.0])


def test_loss_scale_argument_forms():
    state = jp.loss_scaling(optax.sgd(1.0)).init(jnp.ones(1))
    assert isinstance(state.loss_scale, jp.DynamicLossScale)
    assert float(state.loss_scale.loss_scale) == 2.0**15
    assert isinstance(
        jp.loss_scaling(optax.sgd(1.0), "none").init(1.0).loss_scale, jp.NoOpLossScale
    )
    static = jp.loss_scaling(optax.sgd(1.0), 128).init(1.0).loss_scale
    assert isinstance(static, jp.StaticLossScale) and float(static.loss_scale) == 128.0
    given = jp.DynamicLossScale(4.0, period=5)
    assert jp.loss_scaling(optax.sgd(1.0), given).init(1.0).loss_scale is given


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        ("float32", jp.NoOpLossScale),
        ("mixed_bfloat16", jp.NoOpLossScale),
        ("mixed_float16", jp.DynamicLossScale),
        ("float16", jp.DynamicLossScale),
    ],
)
def test_auto_is_dynamic_only_for_float16_compute(policy, expected):
    with jp.policy_scope(policy):
        opt = jp.loss_scaling(optax.sgd(1.0), "auto")
    assert type(opt.init(jnp.ones(1)).loss_scale) is expected


def test_none_still_skips_non_finite_steps():
    opt = jp.loss_scaling(optax.sgd(1.0), "none")
    updates, state = opt.update(jnp.array([jnp.nan, 1.0]), opt.init(jnp.ones(2)))
    np.testing.assert_array_equal(updates, [0.0, 0.0])
    assert int(state.total_skipped) == 1


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        (
            "dinamic",
            ValueError,
            r"Unknown `loss_scale` 'dinamic'; expected one of 'dynamic', 'auto', 'none'",
        ),
        (-1.0, ValueError, r"`loss_scale` must be a finite number > 0. Received: loss_scale=-1.0"),
        (0, ValueError, r"`loss_scale` must be a finite number > 0"),
        (True, TypeError, r"Invalid `loss_scale` argument.*Received: loss_scale=True"),
        (
            [2.0],
            TypeError,
            r"Invalid `loss_scale` argument.*Received: loss_scale=\[2.0\] \(of type list\)",
        ),
    ],
)
def test_bad_loss_scale_arguments(value, error, message):
    with pytest.raises(error, match=message):
        jp.loss_scaling(optax.sgd(1.0), value)


def test_get_loss_scale_finds_it_in_any_state():
    params = {"w": jnp.ones(2)}
    wrapped = jp.loss_scaling(optax.adam(1e-3), 64.0)
    for tx in [
        wrapped,
        optax.chain(optax.clip_by_global_norm(1.0), wrapped),
        optax.MultiSteps(wrapped, every_k_schedule=2),
        optax.inject_hyperparams(
            lambda learning_rate: jp.loss_scaling(optax.sgd(learning_rate), 64.0)
        )(learning_rate=0.1),
        jp.loss_scaling(optax.inject_hyperparams(optax.adam)(learning_rate=0.1), 64.0),
        optax.multi_transform({"a": wrapped}, {"w": "a"}),
    ]:
        assert float(jp.get_loss_scale(tx.init(params)).loss_scale) == 64.0
    assert optax.tree.get(wrapped.init(params), "total_skipped") == 0
    with pytest.raises(ValueError, match=r"exactly one LossScalingState.*found 0"):
        jp.get_loss_scale(optax.adam(1e-3).init(params))
    with pytest.raises(ValueError, match="found 2"):
        jp.get_loss_scale(optax.chain(wrapped, wrapped).init(params))


def test_state_round_trips_through_jit_and_tree_map():
    opt = jp.loss_scaling(optax.adam(1e-3), jp.DynamicLossScale(8.0, period=7, min_loss_scale=0.5))
    state = opt.init({"w": jnp.ones(2)})
    for transform in [jax.jit(lambda s: s), lambda s: jax.tree.map(lambda x: x, s)]:
        out = transform(state)
        assert isinstance(out, jp.LossScalingState)
        assert out.loss_scale.period == 7 and out.loss_scale.min_loss_scale == 0.5
        assert _tree_equal(out, state)


# --- scaled_value_and_grad -----------------------------------------------------------------


def test_scaled_value_and_grad_returns_unscaled_value_and_scaled_grads(maybe_jit):
    def loss_fn(w, x, *, bias):
        return jnp.sum(w * x) + bias, {"pred": w * x}

    g = maybe_jit(jp.scaled_value_and_grad(loss_fn, argnums=(0, 1), has_aux=True))
    (loss, aux), (gw, gx) = g(
        jp.StaticLossScale(8.0), jnp.array([1.0, 2.0]), jnp.array([3.0, 4.0]), bias=1.0
    )
    assert float(loss) == 12.0
    np.testing.assert_array_equal(aux["pred"], [3.0, 8.0])
    np.testing.assert_array_equal(gw, [24.0, 32.0])
    np.testing.assert_array_equal(gx, [8.0, 16.0])


def test_scaled_value_and_grad_with_float16_loss_scales_in_float32():
    def loss_fn(w):
        return jnp.sum(w.astype(jnp.float16) ** 2) * jnp.float16(1e-3)

    loss, grads = jp.scaled_value_and_grad(loss_fn)(jp.DynamicLossScale(2.0**14), jnp.ones(2))
    assert loss.dtype == jnp.float16
    np.testing.assert_allclose(grads, [2e-3 * 2**14] * 2, rtol=1e-3)


def test_scaled_value_and_grad_rejects_non_loss_scale():
    state = jp.loss_scaling(optax.sgd(1.0)).init(jnp.ones(1))
    with pytest.raises(
        TypeError, match=r"must be a loss scale.*get_loss_scale.*Received: loss_scale=LossScaling"
    ):
        jp.scaled_value_and_grad(jnp.sum)(state, jnp.ones(1))


# --- gradient accumulation and checkpoints ---------------------------------------------------


def test_multisteps_outside_accumulates_scaled_grads_and_skips_bad_windows():
    opt = optax.MultiSteps(jp.loss_scaling(optax.sgd(1.0), jp.DynamicLossScale(4.0)), 2)
    params = jnp.zeros(2)
    state = opt.init(params)
    update = jax.jit(opt.update)
    u, state = update(jnp.array([1.0, 2.0]) * 4, state, params)
    np.testing.assert_array_equal(u, [0.0, 0.0])
    u, state = update(jnp.array([3.0, 4.0]) * 4, state, params)
    np.testing.assert_array_equal(u, [-2.0, -3.0])  # -mean of the unscaled gradients
    u, state = update(jnp.array([1.0, jnp.nan]), state, params)
    u, state = update(jnp.array([1.0, 1.0]), state, params)
    np.testing.assert_array_equal(u, [0.0, 0.0])  # the window had a NaN: skipped
    assert float(jp.get_loss_scale(state).loss_scale) == 2.0
    assert int(optax.tree.get(state, "total_skipped")) == 1


def test_multisteps_inside_skips_bad_mini_steps():
    opt = jp.loss_scaling(optax.MultiSteps(optax.sgd(1.0), 2), jp.DynamicLossScale(4.0))
    params = jnp.zeros(2)
    state = opt.init(params)
    update = jax.jit(opt.update)
    u, state = update(jnp.array([1.0, 2.0]) * 4, state, params)
    np.testing.assert_array_equal(u, [0.0, 0.0])
    u, state = update(jnp.array([jnp.inf, 2.0]), state, params)  # skipped, scale 4 -> 2
    np.testing.assert_array_equal(u, [0.0, 0.0])
    u, state = update(jnp.array([3.0, 4.0]) * 2, state, params)
    np.testing.assert_array_equal(u, [-2.0, -3.0])
    assert int(state.total_skipped) == 1 and float(state.loss_scale.loss_scale) == 2.0


def test_checkpoint_restore_mid_training_continues_identically():
    x = jnp.linspace(-1, 1, 16).reshape(8, 2)
    y = jnp.sum(x, axis=1)
    params = {"w": jnp.zeros(2), "b": jnp.zeros(())}
    opt = jp.loss_scaling(
        optax.adam(0.1), jp.DynamicLossScale(2.0**8, period=2, min_loss_scale=1.0)
    )

    @jax.jit
    def step(p, s, poison):
        _, g = jp.scaled_value_and_grad(lambda p: jnp.mean((x @ p["w"] + p["b"] - y) ** 2))(
            jp.get_loss_scale(s), p
        )
        u, s = opt.update(jax.tree.map(lambda v: v + poison, g), s, p)
        return optax.apply_updates(p, u), s

    poisons = [0.0, 0.0, np.nan, 0.0, 0.0, 0.0, np.inf, 0.0, 0.0, 0.0]
    p, s = params, opt.init(params)
    for poison in poisons[:5]:
        p, s = step(p, s, poison)
    blob = flax.serialization.msgpack_serialize(
        {"params": p, "opt_state": [np.asarray(v) for v in jax.tree.leaves(s)]}
    )
    for poison in poisons[5:]:
        p, s = step(p, s, poison)

    restored = flax.serialization.msgpack_restore(blob)
    template = opt.init(params)
    rp = jax.tree.map(jnp.asarray, restored["params"])
    rs = (
        jax.tree.unflatten(
            jax.tree.structure(template),
            [restored["opt_state"][str(i)] for i in range(len(restored["opt_state"]))],
        )
        if isinstance(restored["opt_state"], dict)
        else jax.tree.unflatten(jax.tree.structure(template), restored["opt_state"])
    )
    assert rs.loss_scale.period == 2 and rs.loss_scale.min_loss_scale == 1.0
    for poison in poisons[5:]:
        rp, rs = step(rp, rs, poison)
    assert _tree_equal(rp, p) and _tree_equal(rs, s)
    assert int(s.total_skipped) == 2


# --- devices ---------------------------------------------------------------------------------


@pytest.mark.parametrize("axis_name", ["d", None])
def test_shard_map_one_device_nan_makes_all_skip(axis_name):
    mesh = jax.make_mesh((8,), ("d",))
    opt = jp.loss_scaling(optax.sgd(1.0), jp.DynamicLossScale(4.0), axis_name=axis_name)

    def step(params, grads):
        updates, state = opt.update(grads, opt.init(params), params)
        return updates, state.loss_scale.loss_scale[None], state.total_skipped[None]

    f = jax.jit(
        jax.shard_map(
            step, mesh=mesh, in_specs=(P("d"), P("d")), out_specs=(P("d"), P("d"), P("d"))
        )
    )
    sharding = NamedSharding(mesh, P("d"))
    params = jax.device_put(jnp.zeros(16), sharding)
    # Only device 3 holds the NaN.
    grads = jax.device_put((jnp.ones(16) * 4).at[6].set(jnp.nan), sharding)
    updates, scales, skipped = f(params, grads)
    if axis_name is None:  # without agreement the devices diverge: what axis_name prevents
        assert float(np.abs(np.asarray(updates)).sum()) > 0
        assert len(set(np.asarray(scales).tolist())) == 2
        return
    np.testing.assert_array_equal(updates, np.zeros(16))
    np.testing.assert_array_equal(scales, np.full(8, 2.0))
    np.testing.assert_array_equal(skipped, np.ones(8))
    # All finite: every device applies its update.
    updates, scales, skipped = f(params, jax.device_put(jnp.ones(16) * 4, sharding))
    np.testing.assert_array_equal(updates, -np.ones(16))
    np.testing.assert_array_equal(skipped, np.zeros(8))


def test_jit_over_sharded_grads_one_shard_nan_makes_all_skip():
    mesh = jax.make_mesh((8,), ("d",))
    sharding = NamedSharding(mesh, P("d"))
    opt = jp.loss_scaling(optax.adam(0.1), jp.DynamicLossScale(4.0))
    params = jax.device_put(jnp.ones((16, 4)), sharding)
    state = opt.init(params)
    update = jax.jit(opt.update)
    grads = jax.device_put((jnp.ones((16, 4)) * 4).at[13, 2].set(jnp.inf), sharding)
    updates, new_state = update(grads, state, params)
    assert updates.sharding.is_equivalent_to(sharding, 2)
    np.testing.assert_array_equal(updates, np.zeros((16, 4)))
    assert _tree_equal(new_state.inner_state, state.inner_state)
    assert float(new_state.loss_scale.loss_scale) == 2.0
    updates, _ = update(jax.device_put(jnp.ones((16, 4)) * 4, sharding), state, params)
    assert float(np.abs(np.asarray(updates)).min()) > 0


# --- float16 training ------------------------------------------------------------------------


def test_float16_training_with_dynamic_scaling_matches_float32_and_without_underflows():
    policy = jp.DTypePolicy("mixed_float16")
    kx, kw, kn, k1, k2 = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(kx, (256, 8))
    y = jnp.sin(x @ jax.random.normal(kw, (8,))) + 0.1 * jax.random.normal(kn, (256,))
    params = {
        "w1": jax.random.normal(k1, (8, 32)) / jnp.sqrt(8.0),
        "b1": jnp.zeros(32),
        "w2": jax.random.normal(k2, (32,)) / jnp.sqrt(32.0),
    }
    loss_weight = 2.0**-14  # e.g. a per-token average over a big batch: tiny gradients

    def mse(p, x):
        pred = jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"]
        return jnp.mean((pred.astype(jnp.float32) - y) ** 2)

    def loss16(p):
        return loss_weight * mse(policy.cast_to_compute(p), policy.cast_to_compute(x))

    def loss32(p):
        return loss_weight * mse(p, x)

    def train(loss_fn, loss_scale):
        opt = jp.loss_scaling(optax.adam(1e-2), loss_scale)

        def body(carry, _):
            p, s = carry
            _, g = jp.scaled_value_and_grad(loss_fn)(jp.get_loss_scale(s), p)
            u, s = opt.update(g, s, p)
            zero = sum(jnp.sum(v == 0) for v in jax.tree.leaves(g)) / sum(
                v.size for v in jax.tree.leaves(g)
            )
            return (optax.apply_updates(p, u), s), zero

        (p, s), zeros = jax.jit(lambda p: jax.lax.scan(body, (p, opt.init(p)), None, length=300))(
            params
        )
        return float(mse(p, x)), float(jnp.mean(zeros)), s

    loss_f32, _, _ = train(loss32, "none")
    loss_dyn, zeros_dyn, state = train(loss16, "dynamic")
    loss_raw, zeros_raw, _ = train(loss16, "none")
    initial = float(mse(params, x))
    assert loss_f32 < 0.5 * initial
    assert abs(loss_dyn - loss_f32) / loss_f32 < 0.05
    assert zeros_dyn < 0.01
    # Without loss scaling float16 gradients underflow to zero and training stalls: a fifth
    # or more of the gradients are flushed to zero (under 1% with loss scaling) and the loss
    # ends at least twice float32's and dynamic scaling's. Measured: float32 0.0094, float16 +
    # dynamic 0.0095 on jax 0.10.2 and 0.12.0.1; float16 alone 0.051 on 0.10.2 and 0.027 on
    # 0.12.0.1, with the same compiled program: how far a stalled run ends hangs on the last
    # bits of float16 arithmetic, and XLA's CPU backend changed those. jax 0.10.2's kept float32
    # between the float16 operations of a fusion (`(a * b) * c` rounded once), 0.12's rounds
    # each to float16 as IEEE arithmetic does (18,580 of the 63,488 finite float16 values of
    # `a` give another result; checked against NumPy's float16). The library's program is
    # the same on both; the stall is the property, not its depth.
    assert zeros_raw > 0.2
    assert loss_raw > 2 * loss_f32
    assert loss_raw > 2 * loss_dyn
    assert _all_finite_np(state)


@pytest.mark.filterwarnings("ignore:`loss_scaling` got float16 gradients")
def test_skips_when_unscaling_below_one_overflows_the_gradient_dtype():
    # float16 gradients of 40000 are finite, but unscaled by 0.5 they overflow float16.
    opt = jp.loss_scaling(optax.sgd(1.0), jp.DynamicLossScale(0.5, min_loss_scale=2.0**-4))
    params = jnp.zeros(2, jnp.float16)
    state = opt.init(params)
    updates, state = jax.jit(opt.update)(jnp.array([40000.0, 1.0], jnp.float16), state, params)
    np.testing.assert_array_equal(updates, [0.0, 0.0])
    assert int(state.total_skipped) == 1 and float(state.loss_scale.loss_scale) == 0.25
    updates, state = jax.jit(opt.update)(jnp.array([4000.0, 1.0], jnp.float16), state, params)
    np.testing.assert_array_equal(updates, [-16000.0, -4.0])


def test_update_under_strict_dtype_promotion():
    with jax.numpy_dtype_promotion("strict"):
        # (optax.adam itself is not strict-promotion clean; sgd is.)
        opt = jp.loss_scaling(optax.sgd(0.1), jp.DynamicLossScale(4.0, min_loss_scale=0.25))
        params = {"w": jnp.ones(2), "h": jnp.ones(2, jnp.bfloat16)}
        state = opt.init(params)
        grads = {"w": jnp.ones(2) * 4, "h": jnp.ones(2, jnp.bfloat16) * 4}
        updates, state = jax.jit(opt.update)(grads, state, params)
        assert updates["h"].dtype == jnp.bfloat16
        assert int(state.total_skipped) == 0


# --- what a jmp / Keras / PyTorch user expects of the wrapper ---------------------------------


def test_loss_scale_argument_accepts_a_jax_scalar():
    for value in [jnp.float32(128.0), jnp.array(128.0, jnp.float16), np.float32(128.0)]:
        state = jp.loss_scaling(optax.sgd(1.0), value).init(jnp.ones(1))
        assert isinstance(state.loss_scale, jp.StaticLossScale)
        assert float(state.loss_scale.loss_scale) == 128.0
    with pytest.raises(ValueError, match="must be a finite number > 0"):
        jp.loss_scaling(optax.sgd(1.0), jnp.float32(0.0))
    with pytest.raises(TypeError, match="Invalid `loss_scale`"):
        jp.loss_scaling(optax.sgd(1.0), jnp.ones(2))


def test_optimizer_state_round_trips_through_flax_to_bytes_and_continues():
    opt = jp.loss_scaling(
        optax.adam(0.1), jp.DynamicLossScale(2.0**4, period=2, min_loss_scale=0.5, hysteresis=2)
    )
    params = {"w": jnp.ones(3)}
    update = jax.jit(opt.update)
    state = opt.init(params)
    for g in [1.0, np.nan, 2.0]:
        _, state = update({"w": jnp.full(3, g) * jp.get_loss_scale(state).loss_scale}, state)
    state_dict = flax.serialization.to_state_dict(state)
    assert set(state_dict["loss_scale"]) == {"loss_scale", "counter", "overflows"}
    restored = flax.serialization.from_bytes(opt.init(params), flax.serialization.to_bytes(state))
    assert isinstance(restored, jp.LossScalingState)
    assert restored.loss_scale == state.loss_scale and restored.loss_scale.period == 2
    assert _tree_equal(restored, state)
    for g in [np.inf, 1.0, 1.0]:
        grads = {"w": jnp.full(3, g) * 8.0}
        u1, state = update(grads, state)
        u2, restored = update(grads, restored)
        assert _tree_equal(u1, u2)
    assert _tree_equal(restored, state) and int(restored.total_skipped) == 2


@pytest.mark.filterwarnings("ignore:`loss_scaling` got float16 gradients")
def test_mixed_dtype_integer_and_none_leaves_in_the_gradient_tree(maybe_jit):
    opt = jp.loss_scaling(optax.sgd(0.5), jp.DynamicLossScale(2.0**10))
    params = {
        "h": jnp.ones(2, jnp.float16),
        "b": jnp.ones(2, jnp.bfloat16),
        "f": jnp.ones(2),
        "none": None,
    }
    state = opt.init(params)
    grads = {
        "h": jnp.full(2, 2.0**10, jnp.float16),
        "b": jnp.full(2, 2.0**11, jnp.bfloat16),
        "f": jnp.full(2, 2.0**12),
        "none": None,
    }
    unscaled = state.loss_scale.unscale({**grads, "i": jnp.array([3, 4], jnp.int32)})
    assert {k: v.dtype for k, v in unscaled.items() if v is not None} == {
        "h": jnp.float16,
        "b": jnp.bfloat16,
        "f": jnp.float32,
        "i": jnp.int32,
    }
    np.testing.assert_array_equal(unscaled["i"], [3, 4])  # integers are not unscaled
    updates, state = maybe_jit(opt.update)(grads, state, params)
    assert updates["none"] is None
    assert {k: (v.dtype, float(v[0])) for k, v in updates.items() if v is not None} == {
        "h": (jnp.float16, -0.5),
        "b": (jnp.bfloat16, -1.0),
        "f": (jnp.float32, -2.0),
    }
    updates, state = maybe_jit(opt.update)({**grads, "b": grads["b"].at[0].set(jnp.inf)}, state)
    assert all(float(jnp.abs(v).sum()) == 0 for v in jax.tree.leaves(updates))
    assert updates["h"].dtype == jnp.float16 and int(state.total_skipped) == 1


def test_empty_parameter_tree(maybe_jit):
    opt = jp.loss_scaling(optax.adam(0.1), jp.DynamicLossScale(4.0, period=1))
    state = opt.init({})
    updates, state = maybe_jit(opt.update)({}, state, {})
    assert updates == {} and float(state.loss_scale.loss_scale) == 8.0
    assert int(state.total_skipped) == 0


def test_clipping_inside_the_wrapper_sees_unscaled_gradients(maybe_jit):
    inner = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1.0))
    opt = jp.loss_scaling(inner, jp.DynamicLossScale(2.0**10))
    params = jnp.zeros(2)
    state = opt.init(params)
    update = maybe_jit(opt.update)
    # Unscaled norm 5 > 1: clipped to norm 1.
    updates, state = update(jnp.array([3.0, 4.0]) * 2**10, state, params)
    np.testing.assert_allclose(updates, [-0.6, -0.8], rtol=1e-6)
    # Unscaled norm 0.5 < 1 (the scaled norm is 512): not clipped.
    updates, state = update(jnp.array([0.3, 0.4]) * 2**10, state, params)
    np.testing.assert_allclose(updates, [-0.3, -0.4], rtol=1e-6)


def test_inject_hyperparams_learning_rate_changes_and_schedules(maybe_jit):
    opt = jp.loss_scaling(optax.inject_hyperparams(optax.sgd)(learning_rate=1.0), 4.0)
    params = jnp.zeros(2)
    state = opt.init(params)
    update = maybe_jit(opt.update)
    state.inner_state.hyperparams["learning_rate"] = jnp.array(0.5)
    updates, state = update(jnp.array([4.0, 8.0]), state, params)
    np.testing.assert_array_equal(updates, [-0.5, -1.0])
    updates, state = update(jnp.array([jnp.nan, 8.0]), state, params)
    np.testing.assert_array_equal(updates, [0.0, 0.0])
    assert float(state.inner_state.hyperparams["learning_rate"]) == 0.5
    # A schedule advances on applied steps only (the inner state of a skipped step is kept).
    sched = optax.inject_hyperparams(optax.sgd)(learning_rate=optax.linear_schedule(1.0, 0.0, 4))
    opt = jp.loss_scaling(sched, "none")
    state = opt.init(jnp.zeros(1))
    update = maybe_jit(opt.update)
    seen = []
    for g in [1.0, np.nan, 1.0, 1.0]:
        updates, state = update(jnp.array([g]), state)
        seen.append(float(updates[0]))
    assert seen == [-1.0, 0.0, -0.75, -0.5]
    assert int(state.inner_state.count) == 3


def test_training_steps_under_lax_scan():
    opt = jp.loss_scaling(optax.sgd(0.5), jp.DynamicLossScale(8.0, period=2))

    def step(carry, poison):
        p, s = carry
        loss, g = jp.scaled_value_and_grad(lambda p: jnp.sum(p**2))(jp.get_loss_scale(s), p)
        u, s = opt.update(g + poison, s, p)
        return (optax.apply_updates(p, u), s), (loss, s.loss_scale.loss_scale)

    params = jnp.array([4.0, -8.0])
    poisons = jnp.array([0.0, 0.0, jnp.nan, 0.0, 0.0])
    (p, s), (losses, scales) = jax.jit(lambda p: jax.lax.scan(step, (p, opt.init(p)), poisons))(
        params
    )
    # sgd(0.5) on sum(p**2) zeroes p in one applied step.
    np.testing.assert_array_equal(losses, [80.0, 0.0, 0.0, 0.0, 0.0])
    np.testing.assert_array_equal(scales, [8.0, 16.0, 8.0, 8.0, 16.0])
    np.testing.assert_array_equal(p, [0.0, 0.0])
    assert int(s.total_skipped) == 1 and s.loss_scale.period == 2


@pytest.mark.parametrize(
    "loss_scale",
    ["dynamic", "none", 8.0, jp.DynamicLossScale(0.5, min_loss_scale=2.0**-4, hysteresis=2)],
)
def test_jitted_step_makes_no_host_transfers(loss_scale):
    opt = jp.loss_scaling(optax.adam(0.1), loss_scale)
    params = {"w": jnp.ones(3)}
    grads = {"w": jnp.ones(3)}
    bad = {"w": jnp.full(3, jnp.nan)}
    state = opt.init(params)
    update = jax.jit(opt.update)
    update(grads, state, params)  # compile outside the guard
    with jax.transfer_guard("disallow"):
        _, state = update(grads, state, params)
        _, state = update(bad, state, params)
        loss, g = jax.jit(jp.scaled_value_and_grad(lambda p: jnp.sum(p["w"] ** 2)))(
            jp.get_loss_scale(state), params
        )
    assert int(state.total_skipped) == 1
    assert float(loss) == 3.0 and g["w"].shape == (3,)


def test_scaled_value_and_grad_argnums_tuple_with_aux_and_float16(maybe_jit):
    def loss_fn(a, b, c):
        return jnp.sum(a * b * c), {"ab": a * b}

    g = maybe_jit(jp.scaled_value_and_grad(loss_fn, argnums=(2, 0), has_aux=True))
    a, b, c = jnp.ones(2), jnp.full(2, 2.0), jnp.full(2, 3.0, jnp.float16)
    (loss, aux), (gc, ga) = g(jp.DynamicLossScale(2.0**10), a, b, c)
    assert float(loss) == 12.0 and loss.dtype == jnp.float32
    np.testing.assert_array_equal(aux["ab"], [2.0, 2.0])
    assert gc.dtype == jnp.float16 and ga.dtype == jnp.float32
    np.testing.assert_array_equal(gc, [2.0**11] * 2)
    np.testing.assert_array_equal(ga, [6.0 * 2**10] * 2)
    # The gradients are ready for `update`: unscaled they are the true gradients.
    unscaled = jp.DynamicLossScale(2.0**10).unscale((gc, ga))
    np.testing.assert_array_equal(unscaled[0], [2.0, 2.0])
    assert unscaled[0].dtype == jnp.float16


def test_multisteps_inside_nan_in_the_middle_of_a_window_over_several_windows():
    opt = jp.loss_scaling(optax.MultiSteps(optax.sgd(1.0), 3), jp.DynamicLossScale(4.0))
    params = jnp.zeros(2)
    state = opt.init(params)
    update = jax.jit(opt.update)
    seen = []
    for g in [1.0, np.nan, 2.0, 3.0, 4.0, 5.0, 6.0]:
        scale = jp.get_loss_scale(state).loss_scale
        updates, state = update(jnp.array([g, 1.0]) * scale, state, params)
        params = optax.apply_updates(params, updates)
        seen.append(float(updates[0]))
    # The NaN mini-step is dropped; windows (1, 2, 3) and (4, 5, 6) apply their means.
    assert seen == [0.0, 0.0, 0.0, -2.0, 0.0, 0.0, -5.0]
    np.testing.assert_array_equal(params, [-7.0, -2.0])
    assert int(state.total_skipped) == 1 and float(state.loss_scale.loss_scale) == 2.0


def test_optax_apply_if_finite_sequence_but_never_applies_a_non_finite_update(maybe_jit):
    # optax's `apply_if_finite(sgd(1.), 2)` test, with our counters; where optax applies the
    # third NaN update in a row, we keep skipping.
    opt = jp.loss_scaling(optax.sgd(1.0), "none")
    params = jnp.array([1.0])
    state = opt.init(params)
    update = maybe_jit(opt.update)

    def step(params, state, x):
        grads = jax.grad(lambda p: jnp.sum(p * x) + 0.0 * jnp.sum(p))(params)
        updates, state = update(grads, state, params)
        return optax.apply_updates(params, updates), state

    params, state = step(params, state, 2.0)
    assert float(params[0]) == -1.0 and int(state.consecutive_skipped) == 0
    for i in range(1, 6):
        params, state = step(params, state, jnp.nan)
        assert float(params[0]) == -1.0
        assert int(state.consecutive_skipped) == i and int(state.total_skipped) == i
    params, state = step(params, state, 1.0)
    assert float(params[0]) == -2.0
    assert int(state.consecutive_skipped) == 0 and int(state.total_skipped) == 5


# --- wrong inner transformations -------------------------------------------------------------


@pytest.mark.parametrize(
    ("inner", "message"),
    [
        (
            optax.adam,
            r"`inner` must be an optax GradientTransformation \(such as `optax\.adam\(1e-3\)`\)\. "
            r"Received: inner=<function adam at .*> \(of type function\); did you mean to call "
            r"it, `adam\(learning_rate\)`\?",
        ),
        (
            "adam",
            r"`inner` must be an optax GradientTransformation .* Received: inner='adam' "
            r"\(of type str\)",
        ),
        (None, r"Received: inner=None \(of type NoneType\)"),
        ((lambda p: p, lambda u, s, p: (u, s)), r"Received: inner=\(<function"),
    ],
)
def test_inner_that_is_not_a_transformation_is_a_type_error_at_wrap_time(inner, message):
    with pytest.raises(TypeError, match=message):
        jp.loss_scaling(inner)


def test_any_object_with_init_and_update_is_accepted_as_inner():
    sgd = optax.sgd(1.0)

    class Custom:  # duck-typed, as optax itself accepts
        init = staticmethod(sgd.init)
        update = staticmethod(sgd.update)

    opt = jp.loss_scaling(Custom(), 4.0)
    state = opt.init(jnp.ones(2))
    updates, _ = opt.update(jnp.full(2, 8.0), state)
    np.testing.assert_array_equal(updates, [-2.0, -2.0])


# --- float16 parameters without float32 master weights ---------------------------------------


def test_float16_gradients_warn_once_at_trace_time_and_point_to_mixed_float16():
    opt = jp.loss_scaling(optax.sgd(1.0))
    params = {"w": jnp.ones(2, jnp.float16), "b": jnp.ones(2)}
    state = opt.init(params)
    grads = {"w": jnp.full(2, 0.4 * 2**15, jnp.float16), "b": jnp.ones(2)}
    with pytest.warns(UserWarning, match=r"float16.*'w'.*\"mixed_float16\"") as record:
        _, state = jax.jit(opt.update)(grads, state, params)
        # A second trace (new shapes) and eager calls do not warn again.
        jax.jit(opt.update)(grads, state)
        opt.update(grads, state, params)
    assert len([w for w in record if issubclass(w.category, UserWarning)]) == 1
    assert record[0].filename == __file__  # stacklevel: the user's call, not jmp_policy


@pytest.mark.parametrize(
    "loss_scale", ["dynamic", 8.0, jp.DynamicLossScale(4.0, min_loss_scale=1.0), "none"]
)
def test_float32_and_bfloat16_gradients_do_not_warn(loss_scale):
    opt = jp.loss_scaling(optax.sgd(1.0), loss_scale)
    params = {"w": jnp.ones(2), "h": jnp.ones(2, jnp.bfloat16), "i": jnp.int32(1)}
    state = opt.init(params)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jax.jit(opt.update)(params, state, params)
    if loss_scale == "none":  # no unscaling, nothing to underflow: no warning even for float16
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            jax.jit(opt.update)(jnp.ones(2, jnp.float16), opt.init(jnp.ones(2, jnp.float16)))


# --- cost: one code path, no conditional -----------------------------------------------------


def _compiled(opt, grads, params):
    return jax.jit(opt.update).lower(grads, opt.init(params), params).compile()


def _bytes(compiled):
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return cost["bytes accessed"]


def test_default_update_has_no_conditional_and_costs_what_a_floor_of_one_costs():
    # Scales below 1 are handled arithmetically, not by a second code path: the default
    # (floor 2**-14) compiles to the same program size, and XLA's byte count, as a floor of 1.
    params = {"w": jnp.ones((64, 256)), "b": jnp.ones(256), "h": jnp.ones(32, jnp.bfloat16)}
    grads = jax.tree.map(lambda x: x * 1024, params)
    default = _compiled(jp.loss_scaling(optax.adam(1e-3)), grads, params)
    floor_one = _compiled(
        jp.loss_scaling(optax.adam(1e-3), jp.DynamicLossScale(min_loss_scale=1.0)), grads, params
    )
    for compiled in (default, floor_one):
        text = compiled.as_text()
        assert "conditional(" not in text and "while(" not in text
    assert _bytes(default) == _bytes(floor_one)
