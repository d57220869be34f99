"""Tests for `stochastic_rounding` and `kahan_summation`: 16-bit weights without masters."""

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
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    return ta == tb and all(
        x.dtype == y.dtype and np.array_equal(np.asarray(x), np.asarray(y), equal_nan=True)
        for x, y in zip(la, lb, strict=True)
    )


WRAPPERS = {
    "sr": lambda inner, **kw: jp.stochastic_rounding(inner, key=0, **kw),
    "kahan": lambda inner, **kw: jp.kahan_summation(inner, **kw),
}
both = pytest.mark.parametrize("wrap", list(WRAPPERS.values()), ids=list(WRAPPERS))


def _params():
    return {
        "w": jnp.linspace(-1.0, 1.0, 12, dtype=jnp.bfloat16).reshape(3, 4),
        "norm": jnp.linspace(0.5, 1.5, 4, dtype=jnp.float32),  # a float32 leaf: untouched
    }


def _grads(params, scale=1.0):
    return jax.tree.map(lambda p: (jnp.cos(p.astype(jnp.float32)) * scale).astype(p.dtype), params)


# --- one step ------------------------------------------------------------------------------


@both
def test_update_is_float32_and_lands_next_to_the_float32_sum(wrap, maybe_jit):
    params, inner = _params(), optax.sgd(0.01)
    opt = wrap(inner)
    updates, _ = maybe_jit(opt.update)(_grads(params), opt.init(params), params)
    assert updates["w"].dtype == jnp.float32
    new = optax.apply_updates(params, updates)
    assert new["w"].dtype == jnp.bfloat16 and new["norm"].dtype == jnp.float32
    # The exact sum, from the float32 update of the same inner optimizer.
    exact = params["w"].astype(jnp.float32) - 0.01 * jnp.cos(params["w"].astype(jnp.float32))
    down = jnp.nextafter(new["w"], jnp.asarray(-jnp.inf, jnp.bfloat16)).astype(jnp.float32)
    up = jnp.nextafter(new["w"], jnp.asarray(jnp.inf, jnp.bfloat16)).astype(jnp.float32)
    assert bool(jnp.all((down <= exact) & (exact <= up)))
    # apply_updates lands exactly on the value the update was computed for.
    np.testing.assert_array_equal(
        np.asarray(params["w"].astype(jnp.float32) + updates["w"]), np.asarray(new["w"], float)
    )


@both
def test_float32_parameters_get_the_inner_update_unchanged(wrap, maybe_jit):
    params = _params()
    inner = optax.adamw(0.1, weight_decay=0.1)
    opt = wrap(inner)
    state = opt.init(params)
    plain = inner.init(jax.tree.map(lambda p: p.astype(jnp.float32), params))
    for _ in range(3):
        grads = _grads(params)
        updates, state = maybe_jit(opt.update)(grads, state, params)
        up32 = jax.tree.map(lambda p: p.astype(jnp.float32), params)
        expected, plain = maybe_jit(inner.update)(
            jax.tree.map(lambda g: g.astype(jnp.float32), grads), plain, up32
        )
        # The same values (under `jit`, XLA may fuse the two programs differently).
        np.testing.assert_allclose(updates["norm"], expected["norm"], rtol=1e-6, atol=0)
        params = optax.apply_updates(params, updates)


def test_kahan_buffer_is_in_the_parameters_dtype_and_none_for_float32_leaves():
    params = {**_params(), "h": jnp.ones(2, jnp.float16)}
    state = jp.kahan_summation(optax.sgd(0.1)).init(params)
    assert state.compensation["w"].dtype == jnp.bfloat16
    assert state.compensation["h"].dtype == jnp.float16
    assert state.compensation["norm"] is None


@pytest.mark.parametrize("name", ["stochastic_rounding", "kahan_summation"])
def test_update_without_params_is_a_value_error(name):
    opt = WRAPPERS["sr" if name == "stochastic_rounding" else "kahan"](optax.sgd(0.1))
    params = _params()
    with pytest.raises(ValueError, match=rf"`{name}`'s `update` needs `params`.*params=None"):
        opt.update(_grads(params), opt.init(params))


# --- moments -------------------------------------------------------------------------------


@both
@pytest.mark.parametrize("moment_dtype", ["float32", "bfloat16", jnp.float16])
def test_moments_of_16bit_parameters_stay_in_moment_dtype(wrap, moment_dtype, maybe_jit):
    params = _params()
    opt = wrap(optax.adam(0.01), moment_dtype=moment_dtype)
    state = opt.init(params)
    step = maybe_jit(opt.update)
    for _ in range(2):
        updates, state = step(_grads(params), state, params)
        params = optax.apply_updates(params, updates)
        adam_state = state.inner_state[0]
        for moment in (adam_state.mu, adam_state.nu):
            assert moment["w"].dtype == np.dtype(moment_dtype)
            assert moment["norm"].dtype == jnp.float32  # float32 parameters' moments: theirs
        assert adam_state.count.dtype == jnp.int32


def test_bfloat16_moments_halve_the_state_bytes():
    params = {"w": jnp.ones((64, 64), jnp.bfloat16)}
    f32 = jp.tree_bytes(jp.kahan_summation(optax.adam(1e-3)).init(params))
    bf16 = jp.tree_bytes(jp.kahan_summation(optax.adam(1e-3), moment_dtype="bf16").init(params))
    assert f32 == {"float32": 2 * 64 * 64 * 4, "bfloat16": 64 * 64 * 2, "int32": 4}
    assert bf16 == {"bfloat16": 3 * 64 * 64 * 2, "int32": 4}


# --- the key, checkpoints ------------------------------------------------------------------


def _run(opt, params, state, steps, jit=True):
    step = jax.jit(opt.update) if jit else opt.update
    for _ in range(steps):
        updates, state = step(_grads(params, 1e-3), state, params)
        params = optax.apply_updates(params, updates)
    return params, state


def test_key_advances_every_step_and_rounds_differently():
    params = {"w": jnp.ones(1000, jnp.bfloat16)}
    opt = jp.stochastic_rounding(optax.sgd(1.0), key=jax.random.key(7))
    state = opt.init(params)
    np.testing.assert_array_equal(state.rng_key, jax.random.key_data(jax.random.key(7)))
    grads = {"w": jnp.full(1000, -(2.0**-8), jnp.bfloat16)}  # half a unit of 1.0
    u1, s1 = opt.update(grads, state, params)
    u2, s2 = opt.update(grads, s1, params)
    assert not np.array_equal(s1.rng_key, state.rng_key)
    assert not np.array_equal(s2.rng_key, s1.rng_key)
    assert not np.array_equal(u1["w"], u2["w"])
    np.testing.assert_array_equal(u1["w"], opt.update(grads, state, params)[0]["w"])
    assert 0.4 < float(jnp.mean(u1["w"] > 0)) < 0.6  # up half the time


@pytest.mark.parametrize("key", [3, np.int64(3), jax.random.key(3), jax.random.PRNGKey(3)])
def test_key_may_be_a_seed_a_key_or_a_raw_key(key):
    state = jp.stochastic_rounding(optax.sgd(1.0), key=key).init({"w": jnp.ones(2)})
    np.testing.assert_array_equal(state.rng_key, jax.random.key_data(jax.random.key(3)))
    assert state.rng_key.dtype == jnp.uint32


@both
def test_checkpoint_resumes_bit_identically(wrap):
    params = _params()
    opt = wrap(optax.adam(1e-3), moment_dtype="bfloat16")
    straight = _run(opt, params, opt.init(params), 6)
    half = _run(opt, params, opt.init(params), 3)
    saved = flax.serialization.to_bytes(half)  # msgpack: a plain-array state
    fresh = (params, opt.init(params))
    restored = flax.serialization.from_bytes(fresh, saved)
    assert _tree_equal(restored, half)
    resumed = _run(opt, *restored, 3)
    assert _tree_equal(resumed, straight)


@both
def test_state_round_trips_through_tree_map_and_jit(wrap):
    params = _params()
    opt = wrap(optax.adam(1e-3))
    state = opt.init(params)
    assert _tree_equal(jax.tree.map(lambda x: x, state), state)
    assert _tree_equal(jax.jit(lambda s: s)(state), state)
    assert type(jax.jit(lambda s: s)(state)) is type(state)
    assert optax.tree.get(state, "count") == 0


# --- inner optimizers, loss scaling --------------------------------------------------------


@both
@pytest.mark.parametrize(
    "inner",
    [
        optax.sgd(0.01, momentum=0.9),
        optax.adamw(1e-3, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p)),
        optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)),
        optax.MultiSteps(optax.adam(1e-3), every_k_schedule=2),
        optax.inject_hyperparams(optax.adam)(learning_rate=1e-3),
    ],
    ids=["sgd-momentum", "adamw-masked", "chain", "multisteps", "inject"],
)
def test_any_inner_optimizer_trains_under_jit(wrap, inner):
    params = _params()
    opt = wrap(inner)
    state = opt.init(params)
    dtypes = jax.tree.map(lambda x: x.dtype, state)
    new_params, new_state = _run(opt, params, state, 4)
    assert jax.tree.map(lambda x: x.dtype, new_state) == dtypes
    assert new_params["w"].dtype == jnp.bfloat16
    assert not np.array_equal(new_params["norm"], params["norm"])


@both
def test_extra_args_reach_the_inner_transformation(wrap):
    params = _params()
    opt = wrap(optax.chain(optax.sgd(0.1), optax.contrib.reduce_on_plateau(patience=0)))
    state = opt.init(params)
    _, state = jax.jit(opt.update)(_grads(params), state, params, value=jnp.float32(1.0))
    assert float(optax.tree.get(state, "best_value")) == 1.0


@both
def test_chains_with_loss_scaling_inside(wrap):
    params = {"w": jnp.linspace(0.5, 1.0, 8, dtype=jnp.float16)}
    opt = wrap(jp.loss_scaling(optax.sgd(1e-3), jp.StaticLossScale(2.0**10)))
    plain = wrap(optax.sgd(1e-3))
    state, plain_state = opt.init(params), plain.init(params)
    grads = {"w": jnp.full(8, 3e-3, jnp.float16)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no float16 warning: loss_scaling sees float32
        scaled = jax.tree.map(lambda g: g * jnp.float16(2.0**10), grads)
        updates, state = jax.jit(opt.update)(scaled, state, params)
    expected, _ = plain.update(grads, plain_state, params)
    np.testing.assert_array_equal(updates["w"], expected["w"])  # a power of 2: exact
    assert float(jp.get_loss_scale(state).loss_scale) == 2.0**10
    # A non-finite step: skipped, the parameters unchanged.
    bad = {"w": grads["w"].at[0].set(jnp.inf)}
    updates, state = jax.jit(opt.update)(bad, state, params)
    np.testing.assert_array_equal(optax.apply_updates(params, updates)["w"], params["w"])
    assert int(optax.tree.get(state, "total_skipped")) == 1


@both
def test_loss_scaling_outside_keeps_parameters_on_a_skipped_step(wrap):
    params = _params()
    opt = jp.loss_scaling(wrap(optax.adam(1e-3)), "dynamic")
    state = opt.init(params)
    bad = jax.tree.map(lambda g: g.at[0].set(jnp.nan), _grads(params))
    updates, new_state = jax.jit(opt.update)(bad, state, params)
    assert _tree_equal(optax.apply_updates(params, updates), params)
    assert _tree_equal(new_state.inner_state, state.inner_state)


# --- devices -------------------------------------------------------------------------------


@both
def test_sharded_parameters_train_as_unsharded_ones(wrap):
    mesh = jax.make_mesh((8,), ("d",))
    params = {"w": jnp.linspace(-1, 1, 16 * 8, dtype=jnp.bfloat16).reshape(16, 8)}
    sharded = jax.device_put(params, NamedSharding(mesh, P("d")))
    opt = wrap(optax.adam(1e-3))
    plain_params, plain_state = _run(opt, params, opt.init(params), 3)
    new_params, new_state = _run(opt, sharded, opt.init(sharded), 3)
    assert _tree_equal(jax.device_get(new_params), jax.device_get(plain_params))
    assert _tree_equal(jax.device_get(new_state), jax.device_get(plain_state))
    sharding = NamedSharding(mesh, P("d"))
    assert new_params["w"].sharding.is_equivalent_to(sharding, 2)
    if isinstance(new_state, jp.KahanSummationState):
        assert new_state.compensation["w"].sharding.is_equivalent_to(sharding, 2)


@both
def test_data_parallel_replicas_round_alike_under_shard_map(wrap):
    mesh = jax.make_mesh((8,), ("d",))
    params = {"w": jnp.ones(64, jnp.bfloat16)}
    opt = wrap(optax.sgd(0.5))
    state = opt.init(params)

    def step(params, state, x):
        grads = jax.grad(lambda p: jnp.mean(p["w"].astype(jnp.float32) * x))(params)
        grads = jax.lax.pmean(grads, "d")
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    run = jax.jit(
        jax.shard_map(
            step, mesh=mesh, in_specs=(P(), P(), P("d")), out_specs=(P(), P()), check_vma=False
        )
    )
    x = jnp.arange(8 * 64, dtype=jnp.float32).reshape(8, 64) / 100
    x = jax.device_put(x, NamedSharding(mesh, P("d")))
    for _ in range(3):
        params, state = run(params, state, x)
    shards = [np.asarray(s.data) for s in params["w"].addressable_shards]
    assert all(np.array_equal(shards[0], s) for s in shards[1:])
    assert not np.array_equal(shards[0], np.ones(64))


# --- training: what the wrappers are for ---------------------------------------------------


def _regression():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((256, 64)), jnp.float32)
    y = x @ jnp.asarray(1 + 0.05 * rng.standard_normal(64), jnp.float32)
    return lambda w: 0.5 * jnp.mean((x @ w.astype(jnp.float32) - y) ** 2)


def _train(opt, dtype, loss, steps=1000):
    def body(carry, _):
        w, s = carry
        updates, s = opt.update(jax.grad(loss)(w), s, w)
        return (optax.apply_updates(w, updates), s), None

    w = jnp.ones(64, dtype)
    (w, _), _ = jax.jit(lambda c: jax.lax.scan(body, c, None, length=steps))((w, opt.init(w)))
    assert w.dtype == dtype
    return float(loss(w))


@pytest.mark.heavy(10)
@pytest.mark.parametrize("moment_dtype", ["float32", "bfloat16"])
def test_training_reaches_float32_masters_loss_where_nearest_stalls(moment_dtype):
    # Adam at lr 3e-4 on weights near 1.0, whose bfloat16 half unit is 0.0039: every update
    # rounds away to nearest.
    loss = _regression()
    initial = float(loss(jnp.ones(64)))
    adam = optax.adam(3e-4)
    masters = _train(adam, jnp.float32, loss)
    nearest = _train(adam, jnp.bfloat16, loss)
    sr = _train(jp.stochastic_rounding(adam, 0, moment_dtype=moment_dtype), jnp.bfloat16, loss)
    kahan = _train(jp.kahan_summation(adam, moment_dtype=moment_dtype), jnp.bfloat16, loss)
    assert masters < 0.001 * initial
    assert nearest == initial  # stalled: not one weight moved
    # Within 0.5% of the initial loss of the float32 masters' (bfloat16's own grid costs
    # 0.13%: the best bfloat16 weights' loss).
    assert abs(sr - masters) < 0.005 * initial, (sr, masters, initial)
    assert abs(kahan - masters) < 0.005 * initial, (kahan, masters, initial)


# --- bad arguments -------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["stochastic_rounding", "kahan_summation"])
@pytest.mark.parametrize("inner", ["adam", optax.adam, 3])
def test_inner_not_a_transformation_is_a_type_error(name, inner):
    make = getattr(jp, name)
    args = (inner, 0) if name == "stochastic_rounding" else (inner,)
    with pytest.raises(
        TypeError, match=r"`inner` must be an optax GradientTransformation.*Received: inner="
    ):
        make(*args)


@pytest.mark.parametrize(
    "moment_dtype, error, quoted",
    [
        ("int8", ValueError, "'int8'"),
        ("float8_e4m3fn", ValueError, "'float8_e4m3fn'"),
        (jnp.int32, ValueError, "int32"),
        ("flot32", ValueError, "'flot32'"),
        (3.5, TypeError, "3.5"),
        (None, TypeError, "None"),
        (jnp.ones(2), TypeError, "Array"),
    ],
)
def test_bad_moment_dtype_names_the_argument_and_quotes_it(moment_dtype, error, quoted):
    for make in (
        lambda: jp.kahan_summation(optax.sgd(1.0), moment_dtype=moment_dtype),
        lambda: jp.stochastic_rounding(optax.sgd(1.0), 0, moment_dtype=moment_dtype),
    ):
        with pytest.raises(error, match=r"`moment_dtype` of `\w+` must be a float dtype") as e:
            make()
        assert f"moment_dtype={quoted}" in str(e.value) or quoted in str(e.value)
    with pytest.raises(ValueError, match="Did you mean 'float32'"):
        jp.kahan_summation(optax.sgd(1.0), moment_dtype="flot32")


@pytest.mark.parametrize("key", ["0", 1.5, True, None, jnp.zeros(3, jnp.uint32)])
def test_key_that_is_no_key_is_a_type_error(key):
    with pytest.raises(TypeError, match=r"`key` of `stochastic_rounding` must be a PRNG key.*key="):
        jp.stochastic_rounding(optax.sgd(1.0), key)


def test_several_keys_are_a_value_error():
    with pytest.raises(ValueError, match=r"must be one key, of shape \(\); .*shape \(2,\)"):
        jp.stochastic_rounding(optax.sgd(1.0), jax.random.split(jax.random.key(0)))


# --- bytes ---------------------------------------------------------------------------------


def test_tree_bytes_counts_parameters_and_state_per_dtype():
    params = {"w": jnp.ones((8, 8), jnp.bfloat16), "n": jnp.ones(8)}
    opt = jp.stochastic_rounding(optax.adam(1e-3), jax.random.key(0))
    got = jp.tree_bytes((params, opt.init(params)))
    assert got == {"float32": 3 * 8 * 4 + 2 * 64 * 4, "bfloat16": 128, "uint32": 8, "int32": 4}
    assert list(got) == ["float32", "bfloat16", "uint32", "int32"]  # largest first
    shapes = jax.eval_shape(lambda: (params, opt.init(params)))
    assert jp.tree_bytes(shapes) == got
    assert jp.tree_bytes({"k": jax.random.key(0)}) == {"uint32": 8}
    assert jp.tree_bytes({"step": 3, "none": None}) == {}  # not arrays
    mesh = jax.make_mesh((8,), ("d",))
    sharded = jax.device_put(jnp.ones((16, 4)), NamedSharding(mesh, P("d")))
    assert jp.tree_bytes(sharded) == {"float32": 256}  # the global array's
