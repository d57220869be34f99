"""Fuzzed loss-scale settings (issue 20): scales and bounds are finite positive float32
values, counters non-negative int32s, the floor never reaches 0, and tracers under ``jit``
are never checked as concrete values."""

import copy
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jmp_policy as jp

FUZZ = settings(max_examples=60, deadline=None, derandomize=True)  # the same examples every run
F32 = np.finfo(np.float32)


def _assert_names(error, argument, value):
    assert f"`{argument}`" in str(error), str(error)
    assert f"{argument}={value!r}" in str(error), str(error)


# -- the examples -------------------------------------------------------------------


@pytest.mark.parametrize("cls", [jp.StaticLossScale, jp.DynamicLossScale])
@pytest.mark.parametrize("value", [1e-50, 1e39, 1e-40, 10**400])
def test_scales_that_float32_cannot_hold_are_value_errors(cls, value):
    with pytest.raises(ValueError, match="must be a finite number > 0") as info:
        cls(value)
    _assert_names(info.value, "loss_scale", value)


@pytest.mark.parametrize("cls", [jp.StaticLossScale, jp.DynamicLossScale])
@pytest.mark.parametrize("value", ["x", None, [1.0], 1 + 1j, np.complex64(1), np.True_, object()])
def test_scales_of_other_types_are_type_errors(cls, value):
    with pytest.raises(TypeError) as info:
        cls(value)
    _assert_names(info.value, "loss_scale", value)


@pytest.mark.parametrize("cls", [jp.StaticLossScale, jp.DynamicLossScale])
def test_scales_must_be_scalars(cls):
    value = np.ones(2)
    with pytest.raises(ValueError, match=r"must be a scalar, not an array of shape \(2,\)"):
        cls(value)
    np.testing.assert_array_equal(value, np.ones(2))


@pytest.mark.parametrize(
    ("counter", "error"),
    [
        (np.int64(2**31), ValueError),
        (2**40, ValueError),
        (-1, ValueError),
        (1.5, TypeError),
        (float("nan"), TypeError),
        (2.0, TypeError),
        ("x", TypeError),
        (None, TypeError),
        ([1.0], TypeError),
        (1 + 1j, TypeError),
        (True, TypeError),
        (np.ones(2, np.int32), ValueError),
    ],
)
def test_counters_are_non_negative_int32s(counter, error):
    with pytest.raises(error) as info:
        jp.DynamicLossScale(counter=counter)
    assert "`counter`" in str(info.value)


def test_counter_at_the_int32_limit_is_kept_exactly():
    assert int(jp.DynamicLossScale(counter=np.int64(2**31 - 1)).counter) == 2**31 - 1


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        (dict(min_loss_scale=1e-50), "min_loss_scale"),
        (dict(min_loss_scale=1e-40), "min_loss_scale"),
        (dict(max_loss_scale=1e39), "max_loss_scale"),
        (dict(factor=1 + 1e-10), "factor"),
    ],
)
def test_bounds_and_factor_must_hold_in_float32(kwargs, argument):
    with pytest.raises(ValueError) as info:
        jp.DynamicLossScale(**kwargs)
    _assert_names(info.value, argument, kwargs[argument])


def test_the_floor_never_reaches_zero_after_many_overflows(maybe_jit):
    loss_scale = jp.DynamicLossScale(loss_scale=1.0, min_loss_scale=float(F32.tiny))
    adjust = maybe_jit(lambda s: s.adjust(jnp.array(False)))
    for _ in range(200):
        loss_scale = adjust(loss_scale)
    assert float(loss_scale.loss_scale) == float(F32.tiny) > 0
    grown = maybe_jit(lambda s: s.adjust(jnp.array(True)))(
        jp.DynamicLossScale(float(F32.tiny), period=1, min_loss_scale=float(F32.tiny))
    )
    assert float(grown.loss_scale) == 2 * float(F32.tiny)


def test_loss_scaling_axis_name_is_checked():
    with pytest.raises(TypeError, match=r"`axis_name` must be None") as info:
        jp.loss_scaling(optax.sgd(0.1), axis_name=5)
    assert "axis_name=5" in str(info.value)
    for bad in [("batch", 3), (), b"batch"]:
        with pytest.raises(TypeError, match=r"`axis_name`"):
            jp.loss_scaling(optax.sgd(0.1), axis_name=bad)


def test_unbound_axis_name_under_plain_jit_names_axis_name():
    opt = jp.loss_scaling(optax.sgd(0.1), axis_name="batch")
    params = {"w": jnp.ones(2)}
    state = opt.init(params)
    with pytest.raises(ValueError, match=r"`axis_name`='batch' of `loss_scaling` names no axis"):
        jax.jit(opt.update)(params, state)


def test_bound_axis_name_works_under_shard_map():
    mesh = jax.make_mesh((len(jax.devices()),), ("batch",))
    opt = jp.loss_scaling(optax.sgd(0.1), axis_name=["batch"])
    params = {"w": jnp.ones(2)}
    state = opt.init(params)

    def step(grads):
        return opt.update(grads, state)[1].total_skipped

    spec = jax.sharding.PartitionSpec()
    run = jax.shard_map(step, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)
    assert int(run({"w": jnp.ones(2)})) == 0


def test_checkpoint_restore_rejects_a_non_scalar_scale():
    flax = pytest.importorskip("flax")
    target = jp.DynamicLossScale()
    state = flax.serialization.to_state_dict(target)
    state["loss_scale"] = np.array([1.0, 2.0], np.float32)
    with pytest.raises(ValueError, match=r"`loss_scale` has shape \(\), the checkpoint's \(2,\)"):
        flax.serialization.from_state_dict(target, state)
    state["loss_scale"] = np.float32(-1.0)
    with pytest.raises(ValueError, match=r"`loss_scale` must be a finite number > 0"):
        flax.serialization.from_state_dict(target, state)


def test_pytrees_under_jit_are_never_checked_concretely():
    # Unflattening under jit holds tracers (and tree utilities put placeholders): unchecked.
    loss_scale = jp.DynamicLossScale(8.0, period=2)
    out = jax.jit(lambda s: jax.tree.map(lambda x: x * -1, s))(loss_scale)
    assert float(out.loss_scale) == -8.0
    built = jax.jit(lambda x, c: jp.DynamicLossScale(x, c).counter)(
        jnp.float32(-1.0), jnp.int32(-3)
    )
    assert int(built) == -3


# -- fuzzed -------------------------------------------------------------------------------


@FUZZ
@given(value=st.one_of(st.floats(), st.integers(-(2**70), 2**70)))
def test_any_number_is_a_float32_scale_or_a_value_error_quoting_it(value):
    try:
        loss_scale = jp.StaticLossScale(value)
    except ValueError as e:
        _assert_names(e, "loss_scale", value)
        with np.errstate(over="ignore"):
            stored = np.float32(value) if abs(value) < 1e300 else np.float32(np.inf)
        assert not (math.isfinite(value) and value > 0 and F32.tiny <= stored < np.inf)
    else:
        stored = float(loss_scale.loss_scale)
        assert math.isfinite(stored) and stored >= F32.tiny
        assert loss_scale.loss_scale.dtype == jnp.float32 and loss_scale.loss_scale.shape == ()


@FUZZ
@given(
    counter=st.one_of(
        st.integers(-(2**40), 2**40), st.integers(0, 2**31 - 1), st.floats(allow_nan=True)
    ),
    period=st.integers(1, 5000),
)
def test_any_counter_is_an_int32_or_an_error_naming_it(counter, period):
    try:
        loss_scale = jp.DynamicLossScale(counter=counter, period=period)
    except TypeError as e:
        assert isinstance(counter, float)
        _assert_names(e, "counter", counter)
    except ValueError as e:
        assert not 0 <= counter < 2**31
        _assert_names(e, "counter", counter)
    else:
        assert int(loss_scale.counter) == counter
        assert loss_scale.counter.dtype == jnp.int32
        # A counter past the period grows on the next finite step.
        adjusted = loss_scale.adjust(jnp.array(True))
        assert int(adjusted.counter) in (0, counter + 1)


@FUZZ
@given(
    low=st.floats(1e-45, 1e39),
    high=st.floats(1e-45, 1e39),
    scale=st.floats(1e-45, 1e39),
    factor=st.floats(0.5, 1e39),
)
def test_any_settings_are_valid_or_a_value_error_naming_one(low, high, scale, factor):
    kwargs = dict(loss_scale=scale, min_loss_scale=low, max_loss_scale=high, factor=factor)
    original = copy.deepcopy(kwargs)
    try:
        loss_scale = jp.DynamicLossScale(**kwargs)
    except ValueError as e:
        assert any(f"`{name}`" in str(e) for name in kwargs), str(e)
    else:
        for non_finite in (True, False):
            adjusted = loss_scale
            for _ in range(3):
                adjusted = adjusted.adjust(jnp.array(non_finite))
            value = float(adjusted.loss_scale)
            assert np.float32(low) <= value <= np.float32(high)
            assert math.isfinite(value) and value > 0
    assert kwargs == original
