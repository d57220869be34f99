"""int32 counters saturate at 2**31 - 1 instead of wrapping (#30): the loss-scaling state's
`total_skipped` and `consecutive_skipped`, and a dynamic loss scale's `overflows`."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_policy as jp

MAX = 2**31 - 1
BAD = {"w": jnp.array([jnp.inf, 1.0])}
GOOD = {"w": jnp.array([1.0, 1.0])}


def _state_near_max(total, consecutive):
    opt = jp.loss_scaling(optax.sgd(0.1), "none")
    state = opt.init({"w": jnp.zeros(2)})
    near = state._replace(
        total_skipped=jnp.asarray(total, jnp.int32),
        consecutive_skipped=jnp.asarray(consecutive, jnp.int32),
    )
    return opt, near


def test_total_and_consecutive_skipped_stop_at_the_int32_max(maybe_jit):
    opt, state = _state_near_max(MAX - 1, MAX - 1)
    update = maybe_jit(opt.update)
    seen = []
    for _ in range(3):
        updates, state = update(BAD, state)
        np.testing.assert_array_equal(updates["w"], [0.0, 0.0])  # still skipped
        seen.append((int(state.total_skipped), int(state.consecutive_skipped)))
    assert seen == [(MAX, MAX), (MAX, MAX), (MAX, MAX)]  # was -2147483648 on the second
    assert state.total_skipped.dtype == jnp.int32
    updates, state = update(GOOD, state)
    np.testing.assert_allclose(updates["w"], [-0.1, -0.1])
    assert (int(state.total_skipped), int(state.consecutive_skipped)) == (MAX, 0)


def test_below_the_max_counters_still_count(maybe_jit):
    opt, state = _state_near_max(5, 2)
    _, state = maybe_jit(opt.update)(BAD, state)
    assert (int(state.total_skipped), int(state.consecutive_skipped)) == (6, 3)


@pytest.mark.parametrize("hysteresis", [2, 2**20])
def test_dynamic_loss_scale_overflows_never_wrap(maybe_jit, hysteresis):
    scale = jp.DynamicLossScale(64.0, period=10, hysteresis=hysteresis, overflows=MAX)
    adjusted = maybe_jit(lambda s: s.adjust(jnp.array(False)))(scale)
    # At or past the tolerance: it backs off, and the count stays at the tolerance.
    assert int(adjusted.overflows) == hysteresis
    assert float(adjusted.loss_scale) == 32.0
