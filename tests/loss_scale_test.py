"""Tests for the loss scales (`NoOpLossScale`, `StaticLossScale`, `DynamicLossScale`)."""

from __future__ import annotations

import io
import math

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_policy as jp

FLOAT_DTYPES = [jnp.float16, jnp.bfloat16, jnp.float32]


def _run_adjust(maybe_jit, loss_scale, pattern):
    adjust = maybe_jit(lambda s, f: s.adjust(f))
    scales = []
    for finite in pattern:
        loss_scale = adjust(loss_scale, jnp.array(finite))
        scales.append(float(loss_scale.loss_scale))
    return loss_scale, scales


# --- the peers' sequences -------------------------------------------------------------------


def test_keras_backoff_sequence_400_to_25(maybe_jit):
    loss_scale, scales = _run_adjust(maybe_jit, jp.DynamicLossScale(400.0), [False] * 4)
    assert scales == [200.0, 100.0, 50.0, 25.0]
    assert int(loss_scale.counter) == 0


def test_keras_growth_sequence_2_to_32(maybe_jit):
    loss_scale, scales = _run_adjust(maybe_jit, jp.DynamicLossScale(2.0, period=2), [True] * 8)
    assert scales == [2.0, 4.0, 4.0, 8.0, 8.0, 16.0, 16.0, 32.0]
    assert int(loss_scale.counter) == 0


def test_min_loss_scale_survives_jit_unlike_jmp(maybe_jit):
    # jmp 0.0.4 gives 32, 16, 8, 4, 2, 1 under jit: it drops min_loss_scale when flattening.
    start = jp.DynamicLossScale(64.0, min_loss_scale=4.0)
    loss_scale, scales = _run_adjust(maybe_jit, start, [False] * 6)
    assert scales == [32.0, 16.0, 8.0, 4.0, 4.0, 4.0]
    assert loss_scale.min_loss_scale == 4.0


@pytest.mark.parametrize(("period", "factor"), [(20, 2), (30, 3)])
def test_adjust_grows_on_period_th_finite_step_jmp_sequence(maybe_jit, period, factor):
    adjust = maybe_jit(lambda s: s.adjust(jnp.array(True)))
    loss_scale = jp.DynamicLossScale(10.0, 0, period, factor)
    for i in range(1, period):
        loss_scale = adjust(loss_scale)
        assert float(loss_scale.loss_scale) == 10.0
        assert int(loss_scale.counter) == i
    loss_scale = adjust(loss_scale)
    assert float(loss_scale.loss_scale) == 10.0 * factor
    assert int(loss_scale.counter) == 0
    assert (loss_scale.period, loss_scale.factor) == (period, factor)


@pytest.mark.parametrize(("period", "factor", "minimum"), [(20, 2, 0.3125), (30, 3, 0.37)])
def test_adjust_halves_scale_on_non_finite_step_down_to_min_jmp_sequence(
    maybe_jit, period, factor, minimum
):
    adjust = maybe_jit(lambda s: s.adjust(jnp.array(False)))
    loss_scale = jp.DynamicLossScale(10.0, 5, period, factor, min_loss_scale=minimum)
    for i in range(40):
        loss_scale = adjust(loss_scale)
        np.testing.assert_allclose(
            float(loss_scale.loss_scale), max(minimum, 10.0 / factor ** (i + 1)), rtol=1e-6
        )
        assert int(loss_scale.counter) == 0


def test_non_finite_step_resets_counter(maybe_jit):
    loss_scale, _ = _run_adjust(maybe_jit, jp.DynamicLossScale(8.0, period=3), [True, True])
    assert int(loss_scale.counter) == 2
    loss_scale, scales = _run_adjust(maybe_jit, loss_scale, [False, True, True, True])
    assert scales == [4.0, 4.0, 4.0, 8.0]


def test_growth_stops_at_max_and_never_reaches_inf(maybe_jit):
    _, scales = _run_adjust(
        maybe_jit, jp.DynamicLossScale(4.0, period=1, max_loss_scale=16.0), [True] * 5
    )
    assert scales == [8.0, 16.0, 16.0, 16.0, 16.0]
    big = jp.DynamicLossScale(
        float(np.finfo(np.float32).max), period=1, max_loss_scale=float(np.finfo(np.float32).max)
    )
    big, scales = _run_adjust(maybe_jit, big, [True] * 3)
    assert all(math.isfinite(s) for s in scales)


def test_default_bounds_are_finite_and_below_one():
    loss_scale = jp.DynamicLossScale()
    assert float(loss_scale.loss_scale) == 2.0**15
    assert (loss_scale.period, loss_scale.factor) == (2000, 2.0)
    assert loss_scale.min_loss_scale == 2.0**-14  # below tf.keras's floor of 1, which stalls
    assert loss_scale.max_loss_scale == 2.0**24
    adjust = jax.jit(lambda s: s.adjust(jnp.array(False)))
    for _ in range(100):
        loss_scale = adjust(loss_scale)
    assert float(loss_scale.loss_scale) == 2.0**-14
    assert np.isfinite(float(1 / loss_scale.loss_scale))


def test_hysteresis_backs_off_after_n_overflows_since_growth(maybe_jit):
    start = jp.DynamicLossScale(64.0, period=2, hysteresis=3)
    loss_scale, scales = _run_adjust(maybe_jit, start, [False, False, False, False, True, True])
    assert scales == [64.0, 64.0, 32.0, 16.0, 16.0, 32.0]
    # Growth resets the tolerance.
    _, scales = _run_adjust(maybe_jit, loss_scale, [False, False, False])
    assert scales == [32.0, 32.0, 16.0]


def test_float16_initial_scale_works_jmp_issue_47(maybe_jit):
    loss_scale = jp.DynamicLossScale(jnp.float16(2**15))
    assert loss_scale.loss_scale.dtype == jnp.float32
    loss_scale, scales = _run_adjust(maybe_jit, loss_scale, [False, True])
    assert scales == [2.0**14, 2.0**14]
    assert loss_scale.loss_scale.dtype == jnp.float32


def test_min_and_max_accept_arrays():
    loss_scale = jp.DynamicLossScale(
        8.0, min_loss_scale=jnp.float32(2.0), max_loss_scale=np.float64(32)
    )
    assert loss_scale.min_loss_scale == 2.0 and isinstance(loss_scale.min_loss_scale, float)
    assert loss_scale.max_loss_scale == 32.0


# --- scale / unscale -----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("cls", [jp.StaticLossScale, jp.DynamicLossScale])
def test_scale_computes_in_float32_and_unscale_keeps_dtype(maybe_jit, cls, dtype):
    loss_scale = cls(2.0**16)
    scaled = maybe_jit(lambda s, x: s.scale(x))(loss_scale, jnp.asarray(3.0, dtype))
    assert scaled.dtype == jnp.float32
    assert float(scaled) == 3.0 * 2**16  # finite even for float16 (max 65504)
    grads = {"a": jnp.asarray([2.0**15, 2.0**14], dtype), "step": jnp.int32(7), "x": None}
    unscaled = maybe_jit(lambda s, g: s.unscale(g))(cls(2.0**14), grads)
    assert unscaled["a"].dtype == dtype
    np.testing.assert_array_equal(np.asarray(unscaled["a"], np.float32), [2.0, 1.0])
    assert int(unscaled["step"]) == 7 and unscaled["x"] is None


def test_unscale_of_float16_computes_in_float32():
    # 60000 * 2**-8 in float16 arithmetic is fine, but 60000 * 4 / 4 would overflow: check the
    # unscale by a scale below 1 goes through float32.
    loss_scale = jp.StaticLossScale(0.25)
    out = loss_scale.unscale(jnp.asarray([1000.0], jnp.float16))
    assert out.dtype == jnp.float16 and float(out[0]) == 4000.0


def test_no_op_returns_the_same_tree():
    loss_scale = jp.NoOpLossScale()
    tree = {"a": jnp.ones(2)}
    assert loss_scale.scale(tree) is tree
    assert loss_scale.unscale(tree) is tree
    assert loss_scale.adjust(jnp.array(False)) is loss_scale
    assert jax.tree.leaves(loss_scale) == []


def test_static_scale_never_changes(maybe_jit):
    loss_scale = maybe_jit(lambda s: s.adjust(jnp.array(False)))(jp.StaticLossScale(128))
    assert float(loss_scale.loss_scale) == 128.0


# --- pytree behaviour ----------------------------------------------------------------------


def _fields(loss_scale):
    return (
        float(loss_scale.loss_scale),
        int(loss_scale.counter),
        int(loss_scale.overflows),
        loss_scale.period,
        loss_scale.factor,
        loss_scale.min_loss_scale,
        loss_scale.max_loss_scale,
        loss_scale.hysteresis,
    )


CUSTOM = dict(period=7, factor=3.0, min_loss_scale=0.5, max_loss_scale=2.0**20, hysteresis=2)


def test_dynamic_leaves_are_arrays_and_settings_static():
    loss_scale = jp.DynamicLossScale(16.0, 3, **CUSTOM)
    leaves = jax.tree.leaves(loss_scale)
    assert [x.dtype for x in leaves] == [jnp.float32, jnp.int32, jnp.int32]
    assert [float(x) for x in leaves] == [16.0, 3.0, 0.0]


@pytest.mark.parametrize(
    "transform",
    [
        lambda s: jax.tree.map(lambda x: x, s),
        jax.jit(lambda s: s),
        lambda s: jax.tree.unflatten(jax.tree.structure(s), jax.tree.leaves(s)),
        lambda s: jax.lax.scan(lambda c, _: (c, None), s, None, length=3)[0],
    ],
    ids=["tree_map", "jit", "unflatten", "scan"],
)
def test_round_trip_keeps_every_field(transform):
    loss_scale = jp.DynamicLossScale(16.0, 3, **CUSTOM)
    assert _fields(transform(loss_scale)) == _fields(loss_scale)
    assert float(transform(jp.StaticLossScale(5.0)).loss_scale) == 5.0
    assert isinstance(transform(jp.NoOpLossScale()), jp.NoOpLossScale)


def test_adjust_inside_scan_keeps_settings():
    def body(s, finite):
        s = s.adjust(finite)
        return s, s.loss_scale

    start = jp.DynamicLossScale(64.0, min_loss_scale=4.0)
    final, scales = jax.lax.scan(body, start, jnp.zeros(6, bool))
    np.testing.assert_array_equal(scales, [32, 16, 8, 4, 4, 4])
    assert final.min_loss_scale == 4.0


def test_checkpoint_round_trip_via_msgpack_keeps_every_field():
    loss_scale = jp.DynamicLossScale(16.0, 3, **CUSTOM).adjust(jnp.array(False))
    payload = flax.serialization.msgpack_serialize(
        [np.asarray(x) for x in jax.tree.leaves(loss_scale)]
    )
    template = jp.DynamicLossScale(**CUSTOM)
    restored = jax.tree.unflatten(
        jax.tree.structure(template), flax.serialization.msgpack_restore(io.BytesIO(payload).read())
    )
    assert _fields(restored) == _fields(loss_scale)


def test_changing_scale_does_not_retrace():
    traces = []

    @jax.jit
    def step(s, x):
        traces.append(None)
        return s.adjust(jp.all_finite(x)), s.scale(x)

    loss_scale = jp.DynamicLossScale(2.0**15, period=1)
    for x in [1.0, 2.0, jnp.inf, 3.0, jnp.nan]:
        loss_scale, _ = step(loss_scale, jnp.asarray(x))
    assert len(traces) == 1
    # x2, x2, /2 (inf), x2, /2 (nan)
    assert float(loss_scale.loss_scale) == 2.0**16


# --- errors --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (dict(period=0), ValueError, r"`period` must be an int >= 1. Received: period=0"),
        (dict(period=2.5), TypeError, r"`period` must be an int >= 1. Received: period=2.5"),
        (dict(factor=1), ValueError, r"`factor` must be a finite number > 1. Received: factor=1"),
        (dict(factor="2"), TypeError, r"`factor` must be a number > 1. Received: factor='2'"),
        (
            dict(loss_scale=0.0),
            ValueError,
            r"`loss_scale` must be a finite number > 0. Received: loss_scale=0.0",
        ),
        (
            dict(loss_scale=-2),
            ValueError,
            r"`loss_scale` must be a finite number > 0. Received: loss_scale=-2",
        ),
        (dict(loss_scale=np.inf), ValueError, r"`loss_scale` must be a finite number > 0"),
        (
            dict(min_loss_scale=0.0),
            ValueError,
            r"`min_loss_scale` must be a finite number > 0. Received: min_loss_scale=0.0",
        ),
        (
            dict(max_loss_scale=np.inf),
            ValueError,
            r"`max_loss_scale` must be a finite number > 0. Received: max_loss_scale=inf",
        ),
        (
            dict(min_loss_scale=8.0, max_loss_scale=4.0, loss_scale=4.0),
            ValueError,
            r"`min_loss_scale` must be <= `max_loss_scale`. Received: min_loss_scale=8.0, max_loss_scale=4.0",
        ),
        (
            dict(loss_scale=2.0**30),
            ValueError,
            r"`loss_scale` must lie within \[min_loss_scale, max_loss_scale\]",
        ),
        (
            dict(hysteresis=0),
            ValueError,
            r"`hysteresis` must be an int >= 1. Received: hysteresis=0",
        ),
        (
            dict(loss_scale=True),
            TypeError,
            r"`loss_scale` must be a number or a scalar array, not a bool",
        ),
    ],
)
def test_dynamic_loss_scale_rejects_bad_settings(kwargs, error, message):
    with pytest.raises(error, match=message):
        jp.DynamicLossScale(**kwargs)


def test_static_loss_scale_rejects_non_positive():
    with pytest.raises(
        ValueError, match=r"`loss_scale` must be a finite number > 0. Received: loss_scale=-1.0"
    ):
        jp.StaticLossScale(-1.0)


def test_traced_scale_is_not_validated_under_jit():
    out = jax.jit(lambda x: jp.DynamicLossScale(x).loss_scale)(jnp.float32(-3.0))
    assert float(out) == -3.0  # traced values are not checked (checking would need the value)


def test_adjust_rejects_non_scalar_predicate():
    with pytest.raises(ValueError, match="`grads_finite` must be a scalar bool array"):
        jp.DynamicLossScale().adjust(jnp.ones(3, bool))


def test_adjust_scale_and_unscale_under_strict_dtype_promotion():
    with jax.numpy_dtype_promotion("strict"):
        loss_scale = jp.DynamicLossScale(8.0, period=1)
        loss_scale = jax.jit(lambda s: s.adjust(jnp.array(True)))(loss_scale)
        assert float(loss_scale.loss_scale) == 16.0
        grads = {"h": jnp.ones(2, jnp.bfloat16) * 16, "f": jnp.ones(2) * 16}
        out = loss_scale.unscale(grads)
        assert out["h"].dtype == jnp.bfloat16 and float(out["f"][0]) == 1.0
        assert loss_scale.scale(jnp.float16(1.0)).dtype == jnp.float32


# --- jmp's own expectations ----------------------------------------------------------------


def test_dynamic_leaves_are_jmps_scale_and_counter_without_hysteresis():
    scale = jnp.ones([])
    counter = jnp.zeros([], jnp.int32)
    loss_scale = jp.DynamicLossScale(scale, counter, 2000, 2)
    leaves = jax.tree_util.tree_leaves(loss_scale)
    assert len(leaves) == 2
    assert leaves[0].dtype == jnp.float32 and float(leaves[0]) == 1.0
    assert leaves[1].dtype == jnp.int32 and int(leaves[1]) == 0
    assert loss_scale.overflows is None
    assert len(jax.tree_util.tree_leaves(jp.DynamicLossScale(hysteresis=2))) == 3


@pytest.mark.parametrize(
    "make",
    [
        lambda: jp.NoOpLossScale(),
        lambda: jp.StaticLossScale(8.0),
        lambda: jp.DynamicLossScale(2.0**10, 3, period=7),
        lambda: jp.DynamicLossScale(2.0**10, hysteresis=3),
    ],
)
def test_loss_scales_compare_by_value_after_tree_map(make):
    loss_scale = make()
    assert jax.tree_util.tree_map(lambda x: x, loss_scale) == loss_scale
    assert jax.jit(lambda s: s)(loss_scale) == loss_scale
    assert loss_scale != "not a loss scale"


def test_dynamic_equality_sees_values_and_settings():
    a = jp.DynamicLossScale(2.0**10, period=7)
    assert a != jp.DynamicLossScale(2.0**11, period=7)
    assert a != jp.DynamicLossScale(2.0**10, period=8)
    assert a.adjust(jnp.array(False)) == jp.DynamicLossScale(2.0**9, period=7)
    assert jp.StaticLossScale(2.0) != jp.DynamicLossScale(2.0)


def test_integral_float_period_is_accepted_as_in_jmps_tests():
    loss_scale = jp.DynamicLossScale(jnp.asarray(10.0), jnp.int32(0), 5.0, 2.0)
    assert loss_scale.period == 5
    assert isinstance(loss_scale.period, int)
    with pytest.raises(TypeError, match="`period` must be an int >= 1"):
        jp.DynamicLossScale(period=2.5)


@pytest.mark.parametrize(
    ("cls", "scale"),
    [
        (jp.StaticLossScale, 2),
        (jp.StaticLossScale, 3),
        (jp.StaticLossScale, 4),
        (jp.DynamicLossScale, 2.0),
        (jp.DynamicLossScale, 3.0),
        (jp.DynamicLossScale, 4.0),
    ],
)
def test_jmp_static_loss_scale_scales_and_unscales(cls, scale):
    loss_scale = cls(scale)
    assert loss_scale.scale({"a": jnp.array(1.0)}) == {"a": jnp.array(1.0 * scale)}
    assert loss_scale.unscale({"a": jnp.array(1.0 * scale)}) == {"a": jnp.array(1.0)}


# --- flax.serialization and placeholder trees ----------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        lambda: jp.NoOpLossScale(),
        lambda: jp.StaticLossScale(8.0),
        lambda: jp.DynamicLossScale(2.0**10, 3, period=7, min_loss_scale=0.5),
        lambda: jp.DynamicLossScale(16.0, 3, **CUSTOM).adjust(jnp.array(False)),
    ],
)
def test_flax_serialization_round_trip_keeps_every_field(make):
    loss_scale = make()
    state_dict = flax.serialization.to_state_dict(loss_scale)
    assert isinstance(state_dict, dict)
    leaves = jax.tree.leaves(loss_scale)
    assert len(jax.tree.leaves(state_dict)) == len(leaves)
    template = jax.tree.map(jnp.zeros_like, loss_scale)
    restored = flax.serialization.from_state_dict(template, state_dict)
    assert restored == loss_scale
    restored = flax.serialization.from_bytes(template, flax.serialization.to_bytes(loss_scale))
    assert type(restored) is type(loss_scale) and restored == loss_scale
    if isinstance(loss_scale, jp.DynamicLossScale) and loss_scale.hysteresis > 1:
        assert _fields(restored) == _fields(loss_scale)


@pytest.mark.parametrize(
    "make",
    [
        lambda: jp.StaticLossScale(4.0),
        lambda: jp.DynamicLossScale(8.0),
        lambda: jp.DynamicLossScale(8.0, hysteresis=3),
    ],
)
def test_tree_utilities_may_put_placeholders_in_leaf_positions(make):
    # vmap/pmap `in_axes` trees, masks, `np.zeros_like` templates: neither rejected as a bad
    # scale nor cast to float32, and the structure is kept.
    loss_scale = make()
    structure = jax.tree.structure(loss_scale)
    for placeholder in [0, None, True, np.zeros_like, jnp.isfinite]:
        f = placeholder if callable(placeholder) else (lambda _, v=placeholder: v)
        mapped = jax.tree.map(f, loss_scale)
        assert type(mapped) is type(loss_scale)
        if placeholder is not None:
            assert jax.tree.structure(mapped) == structure
            for got, leaf in zip(jax.tree.leaves(mapped), jax.tree.leaves(loss_scale), strict=True):
                assert np.asarray(got).dtype == np.asarray(f(leaf)).dtype
    assert jax.tree.map(lambda _: None, loss_scale).loss_scale is None
    # e.g. a batch of loss scales under vmap, with an `in_axes` tree built by tree.map.
    batch = jax.tree.map(lambda x: jnp.stack([x, x]), loss_scale)
    adjusted = jax.vmap(lambda s, f: s.adjust(f), in_axes=(jax.tree.map(lambda _: 0, batch), 0))(
        batch, jnp.array([True, False])
    )
    expected = float(loss_scale.loss_scale) / (
        1 if isinstance(loss_scale, jp.StaticLossScale) else 2
    )
    if getattr(loss_scale, "hysteresis", 1) > 1:
        expected = float(loss_scale.loss_scale)
    np.testing.assert_array_equal(adjusted.loss_scale, [float(loss_scale.loss_scale), expected])


# --- settings given as NumPy or JAX scalars are validated like Python numbers ---------------


@pytest.mark.parametrize("cls", [jp.StaticLossScale, jp.DynamicLossScale])
@pytest.mark.parametrize(
    ("value", "quoted"),
    [
        (jnp.float32(-1.0), r"Array\(-1\., dtype=float32\)"),
        (jnp.float32(0.0), r"Array\(0\., dtype=float32\)"),
        (jnp.float32(jnp.inf), r"Array\(inf, dtype=float32\)"),
        (jnp.float32(jnp.nan), r"Array\(nan, dtype=float32\)"),
        # 2**16 is beyond float16's range: inf, with which every step would skip.
        (lambda: jnp.float16(2**16), r"Array\(inf, dtype=float16\)"),
        (np.float32(-1.0), r"np\.float32\(-1\.0\)"),
        (jnp.array(0, jnp.int32), r"Array\(0, dtype=int32\)"),
    ],
)
def test_array_scales_are_validated_like_python_floats(cls, value, quoted):
    if callable(value):
        with np.errstate(over="ignore"):
            value = value()
    with pytest.raises(
        ValueError,
        match=rf"`loss_scale` must be a finite number > 0. Received: loss_scale={quoted}",
    ):
        cls(value)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            dict(loss_scale=jnp.float32(2.0**25)),
            r"`loss_scale` must lie within \[min_loss_scale, max_loss_scale\] = \[6\.1035.*, "
            r"16777216\.0\]\. Received: loss_scale=Array\(3\.3554432e\+07, dtype=float32\); widen",
        ),
        (
            dict(loss_scale=jnp.float32(1.0), min_loss_scale=jnp.float32(2.0)),
            r"`loss_scale` must lie within .* Received: loss_scale=Array\(1\., dtype=float32\)",
        ),
        (
            dict(min_loss_scale=jnp.float32(-1.0)),
            r"`min_loss_scale` must be a finite number > 0. Received: min_loss_scale=Array\(-1\., dtype=float32\)",
        ),
        (
            dict(max_loss_scale=jnp.float32(jnp.inf)),
            r"`max_loss_scale` must be a finite number > 0. Received: max_loss_scale=Array\(inf, dtype=float32\)",
        ),
        (
            dict(loss_scale=4.0, min_loss_scale=jnp.float32(8.0), max_loss_scale=np.float64(4.0)),
            r"`min_loss_scale` must be <= `max_loss_scale`. Received: min_loss_scale=8\.0, "
            r"max_loss_scale=4\.0",
        ),
        (dict(factor=jnp.float32(1.0)), r"`factor` must be a finite number > 1. Received: factor="),
        (dict(factor=np.float32(0.5)), r"`factor` must be a finite number > 1. Received: factor="),
        (dict(factor=jnp.float32(jnp.inf)), r"`factor` must be a finite number > 1"),
        (dict(period=jnp.int32(0)), r"`period` must be an int >= 1. Received: period="),
        (
            dict(period=2**31 + 5),
            r"`period` must fit the int32 counter \(at most 2147483648\). Received: "
            r"period=2147483653",
        ),
        (dict(period=np.int64(2**40)), r"`period` must fit the int32 counter"),
    ],
)
def test_dynamic_array_settings_are_validated_like_python_numbers(kwargs, message):
    with pytest.raises(ValueError, match=message):
        jp.DynamicLossScale(**kwargs)


def test_jax_scalar_settings_are_accepted_when_valid(maybe_jit):
    loss_scale = jp.DynamicLossScale(
        jnp.float16(2.0**15),
        period=jnp.int32(2),
        factor=jnp.float32(4.0),
        min_loss_scale=jnp.float32(1.0),
        max_loss_scale=np.float32(2.0**20),
    )
    assert (loss_scale.period, loss_scale.factor) == (2, 4.0)
    assert type(loss_scale.period) is int and type(loss_scale.factor) is float
    assert loss_scale.max_loss_scale == 2.0**20
    loss_scale, scales = _run_adjust(maybe_jit, loss_scale, [True, True, False])
    assert scales == [2.0**15, 2.0**17, 2.0**15]
    # The largest period the int32 counter can count to.
    assert jp.DynamicLossScale(period=2**31).period == 2**31


def test_traced_scales_and_counters_construct_inside_jit_unchecked(maybe_jit):
    @jax.jit
    def build(scale, counter):
        static = jp.StaticLossScale(scale)
        dynamic = jp.DynamicLossScale(scale, counter, period=4, min_loss_scale=1.0)
        return static.loss_scale, dynamic.adjust(jnp.array(True))

    # Values that would be rejected when concrete: under tracing nothing is checked.
    static, dynamic = build(jnp.float32(-3.0), jnp.int32(3))
    assert float(static) == -3.0
    assert float(dynamic.loss_scale) == -6.0 and int(dynamic.counter) == 0
    static, dynamic = build(jnp.float32(8.0), jnp.int32(0))
    assert float(dynamic.loss_scale) == 8.0 and int(dynamic.counter) == 1
