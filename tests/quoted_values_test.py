"""Bad arguments quoted (#30): `diagnose(probe=...)`, `get_loss_scale`, the function
`scaled_value_and_grad` returns, and `format_report` name the argument and quote the value;
a probe without rows for a tapped path is an error, not lost gradient statistics."""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import jmp_policy as jp

X = jnp.ones((2, 4))


class Linen(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3, name="head")(nn.Dense(4, name="body")(x))


class Nnx(nnx.Module):
    def __init__(self, rngs):
        self.body = nnx.Linear(4, 4, rngs=rngs)
        self.head = nnx.Linear(4, 3, rngs=rngs)

    def __call__(self, x):
        return self.head(self.body(x))


def _linen_diagnose():
    model = Linen()
    variables = model.init(jax.random.key(0), X)
    diag = jp.linen.diagnose(model, "mixed_float16")
    return (lambda probe: diag(variables, X, probe=probe)), diag.probe(variables, X)


def _nnx_diagnose():
    diag = jp.nnx.diagnose(Nnx(nnx.Rngs(0)), "mixed_float16")
    return (lambda probe: diag(X, probe=probe)), diag.probe(X)


DIAGNOSES = [_linen_diagnose, _nnx_diagnose]


@pytest.mark.parametrize("make", DIAGNOSES, ids=["linen", "nnx"])
@pytest.mark.parametrize("bad", [5, "probe", [1.0]])
def test_a_probe_that_is_no_dict_is_quoted(make, bad):
    run, _ = make()
    with pytest.raises(TypeError, match="`probe` must be None or a probe") as info:
        run(bad)
    assert str(info.value).endswith(f"Received: probe={bad!r} (of type {type(bad).__name__})")


@pytest.mark.parametrize("make", DIAGNOSES, ids=["linen", "nnx"])
def test_an_empty_probe_is_rejected_not_silently_ignored(make, maybe_jit):
    run, _ = make()
    with pytest.raises(ValueError) as info:
        maybe_jit(run)({})
    assert re.fullmatch(
        r"`probe` has no rows for '[^']*', which this run taps: make the probe from a report "
        r"of the same model and call \(`fn.probe\(...\)`, `Report.probe\(\)`\), or pass "
        r"probe=None. Received: probe=\{\}",
        str(info.value),
    )


@pytest.mark.parametrize("make", DIAGNOSES, ids=["linen", "nnx"])
def test_a_probe_missing_a_tapped_path_names_it(make, maybe_jit):
    run, probe = make()
    del probe["head"]
    with pytest.raises(ValueError, match=r"`probe` has no rows for 'head'.*Received: probe with"):
        maybe_jit(run)(probe)


@pytest.mark.parametrize("make", DIAGNOSES, ids=["linen", "nnx"])
def test_the_probe_made_for_the_call_and_none_still_work(make, maybe_jit):
    run, probe = make()
    for given in (probe, None):
        out, report = maybe_jit(run)(given)
        assert out.shape == (2, 3) and "head" in report.outputs


def test_get_loss_scale_quotes_the_state():
    for bad in ({}, 5):
        with pytest.raises(ValueError, match="exactly one LossScalingState") as info:
            jp.get_loss_scale(bad)
        assert str(info.value).endswith(f"Received: opt_state={bad!r}")


@pytest.mark.parametrize(
    ("bad", "hint"),
    [(2.0, " (a number: `StaticLossScale(2.0)`)"), (8, " (a number: `StaticLossScale(8)`)"),
     ("dynamic", ""), (None, "")],
)  # fmt: skip
def test_scaled_value_and_grad_quotes_a_loss_scale_that_is_none(maybe_jit, bad, hint):
    g = jp.scaled_value_and_grad(lambda w: jnp.sum(w**2))
    with pytest.raises(TypeError) as info:
        maybe_jit(g, static_argnums=0)(bad, jnp.ones(2))
    assert str(info.value) == (
        "`loss_scale`, the first argument of the function returned by `scaled_value_and_grad`, "
        f"must be a loss scale (NoOpLossScale, StaticLossScale, DynamicLossScale){hint}. With "
        "an optimizer state, pass `jmp_policy.get_loss_scale(opt_state)`. Received: "
        f"loss_scale={bad!r} (of type {type(bad).__name__})"
    )


def test_scaled_value_and_grad_with_a_state_still_points_to_get_loss_scale():
    state = jp.loss_scaling(optax.sgd(1.0)).init(jnp.ones(1))
    with pytest.raises(TypeError, match=r"get_loss_scale\(opt_state\)`. Received: loss_scale="):
        jp.scaled_value_and_grad(jnp.sum)(state, jnp.ones(1))


@pytest.mark.parametrize("bad", [5, None, {"head": 1}])
def test_format_report_quotes_what_is_no_report(bad):
    with pytest.raises(TypeError) as info:
        jp.format_report(bad)
    assert str(info.value) == (
        "`report` must be the report of a `diagnose` function. Received: "
        f"report={bad!r} (of type {type(bad).__name__})"
    )


@pytest.mark.parametrize("bad", ["5", -1, True, 2.0])
def test_format_report_quotes_a_bad_max_rows(bad):
    run, _ = _linen_diagnose()
    _, report = run(None)
    with pytest.raises(TypeError) as info:
        jp.format_report(report, max_rows=bad)
    assert str(info.value) == (
        f"`max_rows` must be None or an int >= 0. Received: max_rows={bad!r}"
    )
