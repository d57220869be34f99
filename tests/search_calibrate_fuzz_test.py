"""Fuzzed arguments of the calibration and search entry points (#30 item 7): every bad
value is a ``ValueError``/``TypeError`` naming the argument and quoting the value, nothing
the caller passed is mutated, and a good value goes through. Derandomized, bounded."""

import copy
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jmp_policy as jp

FUZZ = settings(max_examples=60, deadline=None, derandomize=True)

MODEL = nn.Sequential([nn.Dense(8), nn.relu, nn.Dense(4)])
X = jnp.ones((4, 8))
VARIABLES = MODEL.init(jax.random.key(0), X)
BATCHES = [X]  # search_map: each batch is the model's input (its `inputs=` default)
CALIBRATION = [(X,)]  # calibrate: each batch is the model's call arguments


def loss_fn(out, batch):
    return jnp.mean(out.astype(jnp.float32) ** 2)


scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
)
budgets = st.one_of(
    scalars,
    st.lists(scalars, max_size=2),
    st.dictionaries(
        st.one_of(
            st.sampled_from(["effective_bits", "weight_bytes", "loss_increase"]),
            st.text(max_size=6),
        ),
        scalars,
        max_size=2,
    ),
)


def _good_budget(budget):
    if not isinstance(budget, dict) or len(budget) != 1:
        return False
    ((kind, value),) = budget.items()
    return (
        kind in ("effective_bits", "weight_bytes", "loss_increase")
        and not isinstance(value, bool)
        and isinstance(value, (int, float))
        and 0 < value < math.inf
    )


@FUZZ
@given(budget=budgets)
def test_search_map_budget_is_checked_and_quoted(budget):
    before = copy.deepcopy(budget)
    if _good_budget(budget):
        return  # good budgets run in map_search_test; here only what is refused
    with pytest.raises((ValueError, TypeError)) as info:
        jp.linen.search_map(MODEL, VARIABLES, BATCHES, loss_fn, budget=budget)
    assert f"budget={budget!r}" in str(info.value), str(info.value)
    assert repr(budget) == repr(before)  # not mutated


names = st.one_of(
    st.sampled_from(["int8_from_mixed_bfloat16", "int4/128_from_mixed_bfloat16", "float32"]),
    st.text(max_size=12),
    st.integers(),
)


@FUZZ
@given(candidates=st.one_of(st.lists(names, max_size=3), names))
def test_search_map_candidates_are_checked_and_quoted(candidates):
    before = copy.deepcopy(candidates)
    try:
        jp.linen.search_map(
            MODEL,
            VARIABLES,
            BATCHES,
            loss_fn,
            budget={"effective_bits": 1e-3},  # below every candidate: refused after the checks
            candidates=candidates,
        )
    except (ValueError, TypeError) as e:
        message = str(e)
        assert "candidates" in message or "budget" in message, message
        if "budget" not in message:
            assert repr(candidates) in message or any(
                repr(c) in message for c in (candidates if isinstance(candidates, list) else [])
            ), message
    else:  # pragma: no cover - a budget of 0.001 bits cannot be met
        raise AssertionError("an impossible budget was met")
    assert repr(candidates) == repr(before)


@FUZZ
@given(damping=scalars, grid=scalars)
def test_calibrate_settings_are_checked_and_quoted(damping, grid):
    policy_map = jp.DTypePolicyMap("float32", {"layers_0": "gptq/4/-1_from_float32"})
    good_damping = (
        not isinstance(damping, bool)
        and isinstance(damping, (int, float))
        and 0 <= damping < math.inf
    )
    good_grid = not isinstance(grid, bool) and isinstance(grid, int) and 1 <= grid <= 10_000
    try:
        calibrated = jp.linen.calibrate(
            MODEL,
            policy_map,
            VARIABLES,
            CALIBRATION,
            hessian_damping=damping,
            num_grid_points=grid,
        )
    except (ValueError, TypeError) as e:
        message = str(e)
        assert "hessian_damping=" in message or "num_grid_points=" in message, message
        assert not (good_damping and good_grid), message
        return
    kernel = calibrated["params"]["layers_0"]["kernel"]
    assert isinstance(kernel, jp.QuantizedArray)


def test_search_map_runs_on_the_fuzz_model():
    """The model the fuzz tests use searches fine with good arguments (the checks, not
    the model, refuse the fuzzed values)."""
    result = jp.linen.search_map(MODEL, VARIABLES, BATCHES, loss_fn, budget={"effective_bits": 8.0})
    assert result.effective_bits <= 8.0
