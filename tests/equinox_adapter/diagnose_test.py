"""``jp.equinox.diagnose``: per-submodule statistics of an Equinox model written per example,
the first non-finite submodule named, gradients through the probe; eager and ``jit``."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_policy as jp
from equinox_adapter.models import Transformer, tokens


class Model(eqx.Module):
    body: eqx.nn.Linear
    mlp: eqx.nn.MLP
    head: eqx.nn.Linear
    scale: float = eqx.field(static=True, default=1.0)

    def __call__(self, x):
        return self.head(self.mlp(self.body(x)) * self.scale)


def _model(scale=1.0):
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    return Model(
        eqx.nn.Linear(4, 8, key=k1),
        eqx.nn.MLP(8, 8, 16, depth=1, key=k2),
        eqx.nn.Linear(8, 2, key=k3),
        scale,
    )


X = jnp.linspace(-1.0, 1.0, 4)


def _maybe_jit(fn, jit):
    return eqx.filter_jit(fn) if jit else fn


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_names_the_first_non_finite_submodule_in_execution_order(jit):
    fn = jp.equinox.diagnose(_model(scale=1e6), "float16")
    out, report = _maybe_jit(fn, jit)(X)
    assert not np.isfinite(np.asarray(out)).all()
    assert jp.format_report(report).splitlines()[0] == "first non-finite: head (forward input)"
    assert [p.path for p in report.paths] == [
        "",
        "body",
        "mlp",
        "mlp/layers/0",
        "mlp/layers/1",
        "head",
    ]
    assert {p.dtype for p in report.paths} == {"float16"}
    assert int(report.outputs["mlp"].non_finite) == 0
    assert int(report.inputs["head"].non_finite) == 8  # all of its 8 inputs overflowed


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_finite_run_reports_the_values_it_saw(jit):
    model = _model()
    out, report = _maybe_jit(jp.equinox.diagnose(model, "float32"), jit)(X)
    np.testing.assert_allclose(out, model(X), rtol=1e-6)
    np.testing.assert_allclose(report.outputs["body"].max_abs, jnp.abs(model.body(X)).max())
    assert jp.format_report(report).splitlines()[0] == "first non-finite: none"


def test_gradient_statistics_come_back_through_the_probe():
    model = _model()
    fn = jp.equinox.diagnose(model, "bfloat16")
    probe = fn.probe(X)
    assert set(probe) == {"", "body", "mlp", "mlp/layers/0", "mlp/layers/1", "head"}

    def loss(probe):
        out, report = fn(X, probe=probe)
        return out.astype(jnp.float32).sum(), report

    probe_grad, report = jax.jit(jax.grad(loss, has_aux=True))(probe)
    report = report.with_gradients(probe_grad)
    # d(sum)/d(head's outputs) is 1 for each of its 2 outputs.
    assert float(report.gradients["head"].max_abs) == 1.0
    assert int(report.gradients["head"].size) == 2


def test_layers_inside_a_scanned_stack_are_listed_as_skipped():
    model = Transformer(jax.random.key(0))
    _, report = jp.equinox.diagnose(model, "mixed_bfloat16")(tokens())
    assert "blocks/attn" in report.skipped and "blocks" in report.skipped
    assert "" in [p.path for p in report.paths]


def test_an_invalid_every_is_refused_naming_it():
    with pytest.raises((TypeError, ValueError), match="every"):
        jp.equinox.diagnose(_model(), "float32", every=0)
