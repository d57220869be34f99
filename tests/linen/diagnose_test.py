"""`jmp_policy.linen.diagnose` and `jmp_policy.nnx.diagnose`: the report on real float16 models."""

import re
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jmp_policy as jp

B, D = 8, 16


class Block(nn.Module):
    kernel_scale: float = 1.0

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.variance_scaling(self.kernel_scale**2, "fan_in", "normal")
        h = nn.Dense(D, name="attn")(x)
        return nn.Dense(D, kernel_init=init, name="mlp")(nn.relu(h)) + x


class Encoder(nn.Module):
    kernel_scale: float = 1.0

    @nn.compact
    def __call__(self, x):
        x = Block(name="layers_0")(x)
        x = Block(self.kernel_scale, name="layers_1")(x)
        return Block(name="layers_2")(x)


class Model(nn.Module):
    """`encoder/layers_1/mlp` overflows float16 when `kernel_scale` is large; the `aux`
    branch enters the output scaled by 1e-4, so its gradients underflow float16."""

    kernel_scale: float = 1.0

    @nn.compact
    def __call__(self, x):
        h = Encoder(self.kernel_scale, name="encoder")(x)
        return nn.Dense(D, name="head")(h) + 1e-4 * nn.Dense(D, name="aux")(h)


X = jax.random.normal(jax.random.key(1), (B, D))


def _variables(model):
    return model.init(jax.random.key(0), X)


def test_overflowing_submodule_is_named_first_non_finite_forward(maybe_jit):
    model = Model(kernel_scale=3e4)
    variables = _variables(model)
    plain = jp.linen.apply(model, "float16")(variables, X)
    assert not np.isfinite(np.asarray(plain, np.float32)).all()  # the model does overflow
    out, report = maybe_jit(jp.linen.diagnose(model, "float16"))(variables, X)
    np.testing.assert_array_equal(out, plain)  # diagnose computes what apply computes
    lines = jp.format_report(report).splitlines()
    assert lines[0] == "first non-finite: encoder/layers_1/mlp (forward output)"
    mlp = report.outputs["encoder/layers_1/mlp"]
    assert int(mlp.non_finite) > 0
    assert int(report.inputs["encoder/layers_1/mlp"].non_finite) == 0
    assert int(report.outputs["encoder/layers_1/attn"].non_finite) == 0
    # rows with non-finite values first, in execution order: where it started, then spread
    assert [line.split()[:3] for line in lines[2:5]] == [
        ["encoder/layers_1/mlp", "float16", "output"],
        ["encoder/layers_1", "float16", "output"],
        ["encoder/layers_2", "float16", "input"],
    ]
    assert max(len(line) for line in lines) <= 100


def test_finite_model_reports_none_and_keeps_paths_in_execution_order(maybe_jit):
    model = Model()
    out, report = maybe_jit(jp.linen.diagnose(model, "mixed_float16"))(_variables(model), X)
    assert out.dtype == jnp.float16
    paths = [p.path for p in report.paths]
    assert paths[:5] == [
        "",
        "encoder",
        "encoder/layers_0",
        "encoder/layers_0/attn",
        "encoder/layers_0/mlp",
    ]
    assert paths[-2:] == ["head", "aux"]
    assert {p.dtype for p in report.paths} == {"float16"}
    assert jp.format_report(report).splitlines()[0] == "first non-finite: none"
    assert int(report.inputs["head"].size) == B * D
    # inputs as the module receives them: cast to its compute dtype
    assert float(report.inputs[""].max_abs) == float(jnp.abs(X.astype(jnp.float16)).max())


def _loss(diag, params, probe):
    out, report = diag({"params": params}, X, probe=probe)
    return out.astype(jnp.float32).sum() / B, report


@pytest.mark.parametrize("scale", [1.0, 2.0**10])
def test_gradient_underflow_of_one_submodule_shows_without_loss_scaling(maybe_jit, scale):
    model = Model()
    variables = _variables(model)
    diag = jp.linen.diagnose(model, "mixed_float16")
    probe = diag.probe(variables, X)
    grad = jp.scaled_value_and_grad(lambda p, q: _loss(diag, p, q), argnums=(0, 1), has_aux=True)
    (_, report), (_, probe_grad) = maybe_jit(grad)(
        jp.StaticLossScale(scale), variables["params"], probe
    )
    report = report.with_gradients(probe_grad)
    aux = float(report.gradients["aux"].underflow_fraction)
    head = float(report.gradients["head"].underflow_fraction)
    # the cotangent reaching aux's output is 1e-4 / B (times the loss scale): float16
    # subnormal without loss scaling, normal with it
    if scale == 1.0:
        assert aux == 1.0
        assert jp.format_report(report).splitlines()[2].split()[:3] == [
            "aux",
            "float16",
            "gradient",
        ]
    else:
        assert aux == 0.0
    assert head == 0.0
    assert int(report.gradients["aux"].size) == B * D


def test_non_finite_gradient_is_named_in_backward_order():
    model = Model()
    variables = _variables(model)
    diag = jp.linen.diagnose(model, "float16")

    def loss(params, probe):
        out, report = diag({"params": params}, X, probe=probe)
        return out.astype(jnp.float32).sum() * 1e6, report  # 1e6 overflows float16

    probe_grad, report = jax.grad(loss, argnums=1, has_aux=True)(
        variables["params"], diag.probe(variables, X)
    )
    report = report.with_gradients(probe_grad)
    # the backward pass reaches the root's output first, then aux and head
    assert (
        jp.format_report(report).splitlines()[0] == "first non-finite: (root) (backward gradient)"
    )


def test_plain_apply_has_no_taps():
    model = Model()
    variables = _variables(model)
    plain = jax.make_jaxpr(lambda v: jp.linen.apply(model, "mixed_float16")(v, X))(variables)
    diagnosed = jax.make_jaxpr(lambda v: jp.linen.diagnose(model, "mixed_float16")(v, X))(variables)
    assert "custom_vjp" not in str(plain) and "is_finite" not in str(plain)
    assert "is_finite" in str(diagnosed)


def test_linen_diagnose_keeps_apply_keywords_and_checks_arguments():
    model = nn.Sequential([nn.Dense(4), nn.BatchNorm(use_running_average=False)])
    variables = model.init(jax.random.key(0), X)
    (_, state), report = jp.linen.diagnose(model, "mixed_float16")(
        variables, X, mutable=["batch_stats"]
    )
    assert state["batch_stats"]["layers_1"]["mean"].dtype == jnp.float32
    assert [p.path for p in report.paths] == ["", "layers_0", "layers_1"]
    with pytest.raises(TypeError, match=r"`module` must be a flax\.linen Module"):
        jp.linen.diagnose(lambda x: x, "float16")
    with pytest.raises(TypeError, match="`probe` must be None or a probe"):
        jp.linen.diagnose(Model(), "float16")(_variables(Model()), X, probe=jnp.zeros(6))


def test_linen_scan_body_is_listed_as_skipped():
    class Cell(nn.Module):
        @nn.compact
        def __call__(self, c, x):
            return nn.Dense(D, name="dense")(c) + x, None

    class Scanned(nn.Module):
        @nn.compact
        def __call__(self, x):
            scan = nn.scan(Cell, variable_broadcast="params", split_rngs={"params": False})
            c, _ = scan(name="cell")(x, jnp.ones((3, *x.shape), x.dtype))
            return nn.Dense(2, name="head")(c)

    model = Scanned()
    variables = model.init(jax.random.key(0), X)
    _, report = jp.linen.diagnose(model, "mixed_float16")(variables, X)
    assert "cell/dense" in report.skipped
    assert "head" in report.outputs
    assert "cell/dense" in jp.format_report(report).splitlines()[-1]


class NnxModel(nnx.Module):
    def __init__(self, kernel_scale, rngs):
        self.body = nnx.Linear(D, D, rngs=rngs)
        self.mlp = nnx.Linear(D, D, rngs=rngs)
        self.mlp.kernel.set_value(self.mlp.kernel.get_value() * kernel_scale)
        self.head = nnx.Linear(D, D, rngs=rngs)

    def __call__(self, x):
        return self.head(self.mlp(nnx.relu(self.body(x))))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_nnx_report_names_the_overflowing_submodule(jit):
    model = NnxModel(3e4, nnx.Rngs(0))

    def run(model, x):
        return jp.nnx.diagnose(model, "float16")(x)

    _, report = (nnx.jit(run) if jit else run)(model, X)
    assert jp.format_report(report).splitlines()[0] == "first non-finite: mlp (forward output)"
    assert [p.path for p in report.paths] == ["", "body", "mlp", "head"]
    assert int(report.outputs["body"].non_finite) == 0
    assert model.mlp.kernel.get_value().dtype == jnp.float32  # the model is unchanged


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_nnx_gradient_statistics_through_the_probe(jit):
    model = NnxModel(1.0, nnx.Rngs(0))
    diag = jp.nnx.diagnose(model, "mixed_float16")
    probe = diag.probe(X)
    assert {k: v.shape for k, v in probe.items()} == {
        "": (1, 6), "body": (1, 6), "mlp": (1, 6), "head": (1, 6)
    }  # fmt: skip

    def loss(model, probe):
        out, report = jp.nnx.diagnose(model, "mixed_float16")(X, probe=probe)
        return out.astype(jnp.float32).sum() * 1e-6, report

    grad = nnx.grad(loss, argnums=(0, 1), has_aux=True)
    (grads, probe_grad), report = (nnx.jit(grad) if jit else grad)(model, probe)
    report = report.with_gradients(probe_grad)
    assert float(report.gradients["head"].underflow_fraction) == 1.0  # 1e-6 in float16
    assert grads.head.kernel.get_value().dtype == jnp.float32
    assert "gradient" in jp.format_report(report)


def test_nnx_diagnose_checks_its_model():
    with pytest.raises(TypeError, match=r"`model` must be an `nnx\.Module`"):
        jp.nnx.diagnose(object(), "float16")


def test_diagnose_under_scan_of_training_steps():
    model = Model()
    variables = _variables(model)
    diag = jp.linen.diagnose(model, "mixed_float16")

    def step(carry, x):
        _, report = diag(variables, x)
        return carry, report

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, reports = jax.lax.scan(step, 0, jnp.stack([X, X * 1e5, X]))
    assert reports.outputs["head"].non_finite.shape == (3,)
    assert int(reports.outputs["head"].non_finite[1]) > 0
    assert jp.format_report(reports).splitlines()[0].startswith("first non-finite: ")


def _reductions(fn, *args):
    """The reduce and reduce-window ops of ``fn``'s compiled (CPU) program."""
    text = jax.jit(fn).lower(*args).compile().as_text()
    return len(re.findall(r"\breduce(?:-window)?\(", text))


def test_compiled_step_has_at_most_one_reduction_per_tapped_tensor():
    model = Model()
    variables = _variables(model)
    plain = jp.linen.apply(model, "mixed_float16")
    diag = jp.linen.diagnose(model, "mixed_float16")
    probe = diag.probe(variables, X)

    def step_apply(params, probe):
        return jax.grad(lambda p: plain({"params": p}, X).astype(jnp.float32).sum())(params)

    def step_diagnose(params, probe):
        (_, report), grads = jax.value_and_grad(
            lambda p, q: _loss(diag, p, q), argnums=(0, 1), has_aux=True
        )(params, probe)
        return grads[0], report.with_gradients(grads[1])

    # every submodule here takes one array and returns one: an input, an output and the
    # cotangent of the output are tapped per path
    tapped = 3 * len(probe)
    extra = _reductions(step_diagnose, variables["params"], probe) - _reductions(
        step_apply, variables["params"], probe
    )
    assert 0 < extra <= tapped, (extra, tapped)


def _stat_values(report):
    return {
        (site, path): {k: np.asarray(v).item() for k, v in vars(stats).items()}
        for site in ("inputs", "outputs", "gradients")
        for path, stats in getattr(report, site).items()
    }


def test_every_computes_the_statistics_on_one_step_in_n(maybe_jit):
    model = Model(kernel_scale=3e4)
    variables = _variables(model)
    _, full = jp.linen.diagnose(model, "float16")(variables, X)
    diag = maybe_jit(jp.linen.diagnose(model, "float16", every=3))
    for step in (0, 3, 6):  # sampled: the same report as without `every`
        _, report = diag(variables, X, step=step)
        assert bool(report.sampled)
        assert _stat_values(report) == _stat_values(full)
        assert jp.format_report(report).splitlines()[0] == (
            "first non-finite: encoder/layers_1/mlp (forward output)"
        )
    for step in (1, 2, 4):  # not sampled: zeros (size too), and the table says so
        out, report = diag(variables, X, step=jnp.int32(step))
        np.testing.assert_array_equal(out, jp.linen.apply(model, "float16")(variables, X))
        assert not bool(report.sampled)
        assert all(v == 0 for stats in _stat_values(report).values() for v in stats.values())
        lines = jp.format_report(report).splitlines()
        assert lines[0] == "first non-finite: not measured (no step sampled; every=3)"
        assert "sampled: 0 of 1 step(s) (statistics on one step in 3)" in lines


def test_every_in_a_jitted_training_loop_compiles_once_and_samples_gradients():
    model = Model()
    variables = _variables(model)
    diag = jp.linen.diagnose(model, "mixed_float16", every=2)
    probe = diag.probe(variables, X)

    @jax.jit
    def step_fn(params, step):
        def loss(p, q):
            out, report = diag({"params": p}, X, probe=q, step=step)
            return out.astype(jnp.float32).sum() * 1e-6, report

        (_, report), (grads, probe_grad) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(
            params, probe
        )
        return grads, report.with_gradients(probe_grad)

    reports = [step_fn(variables["params"], jnp.int32(s))[1] for s in range(4)]
    assert step_fn._cache_size() == 1  # the step is traced: no recompilation
    assert [bool(r.sampled) for r in reports] == [True, False, True, False]
    assert float(reports[2].gradients["head"].underflow_fraction) == 1.0  # 1e-6 in float16
    assert int(reports[3].gradients["head"].size) == 0

    def body(step, _):
        _, report = step_fn(variables["params"], step)
        return step + 1, report

    _, stacked = jax.lax.scan(body, jnp.int32(0), length=5)
    assert stacked.sampled.tolist() == [True, False, True, False, True]
    assert stacked.gradients["head"].size.tolist() == [B * D, 0, B * D, 0, B * D]
    text = jp.format_report(stacked)
    assert "sampled: 3 of 5 step(s) (statistics on one step in 2)" in text
    assert "gradient" in text


def test_paths_filter_taps_only_the_named_submodules_and_lists_the_others(maybe_jit):
    model = Model(kernel_scale=3e4)
    variables = _variables(model)
    keys = ["head", r"encoder/layers_1(/.*)?"]  # an exact key and a regular expression
    diag = jp.linen.diagnose(model, "float16", paths=keys)
    _, report = maybe_jit(diag)(variables, X)
    tapped = ["encoder/layers_1", "encoder/layers_1/attn", "encoder/layers_1/mlp", "head"]
    assert [p.path for p in report.paths] == tapped
    assert set(report.outputs) == set(tapped)
    assert report.untapped[:4] == ("", "encoder", "encoder/layers_0", "encoder/layers_0/attn")
    assert "aux" in report.untapped and not set(report.untapped) & set(tapped)
    assert set(diag.probe(variables, X)) == set(tapped)
    _, full = jp.linen.diagnose(model, "float16")(variables, X)
    assert _stat_values(report) == {k: v for k, v in _stat_values(full).items() if k[1] in tapped}
    lines = jp.format_report(report).splitlines()
    assert lines[0] == "first non-finite: encoder/layers_1/mlp (forward output)"
    n = len(report.untapped)
    assert f"not tapped (left out by `paths`): {n} path(s)" in lines
    assert lines[-1] == f"  ... {n - 8} more"


def test_paths_filter_that_names_nothing_warns():
    model = Model()
    with pytest.warns(UserWarning, match=r"`paths=\['encoder/layer_1'\]` named none"):
        jp.linen.diagnose(model, "float16", paths=["encoder/layer_1"])(_variables(model), X)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"every": 0}, ValueError, r"`every` must be an integer from 1 to 2147483647.*every=0"),
        ({"every": 2**63}, ValueError, r"from 1 to 2147483647.*every=9223372036854775808"),
        ({"every": 2.5}, TypeError, r"`every` must be an integer from 1.*2\.5 \(of type float\)"),
        ({"every": True}, TypeError, r"every=True \(of type bool\)"),
        ({"paths": 5}, TypeError, r"`paths` must be None.*paths=5"),
        ({"paths": ["head", 3]}, TypeError, r"paths=\['head', 3\]"),
        ({"paths": []}, ValueError, r"`paths` is empty.*paths=\[\]"),
        ({"paths": "enc[oder"}, ValueError, r"Entry 'enc\[oder' of `paths` is not a valid regular"),
    ],
)
def test_diagnose_rejects_bad_every_and_paths(kwargs, error, match):
    with pytest.raises(error, match=match):
        jp.linen.diagnose(Model(), "float16", **kwargs)
    with pytest.raises(error, match=match):
        jp.nnx.diagnose(NnxModel(1.0, nnx.Rngs(0)), "float16", **kwargs)


def test_diagnose_with_every_requires_an_integer_step():
    model = Model()
    variables = _variables(model)
    diag = jp.linen.diagnose(model, "float16", every=4)
    with pytest.raises(ValueError, match=r"`step` is required with `every=4`"):
        diag(variables, X)
    with pytest.raises(TypeError, match=r"`step` must be the training step.*step=1\.5"):
        diag(variables, X, step=1.5)
    with pytest.raises(TypeError, match=r"`step` must be the training step"):
        diag(variables, X, step=jnp.zeros(3, jnp.int32))
    with pytest.raises(ValueError, match=r"`step` must fit in an int32.*step=1099511627776"):
        diag(variables, X, step=2**40)
    _, report = diag(variables, X, step=2**31 - 1)  # the largest step still runs
    assert not bool(report.sampled)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_nnx_every_and_paths(jit):
    model = NnxModel(3e4, nnx.Rngs(0))

    def run(model, x, step):
        return jp.nnx.diagnose(model, "float16", every=2, paths=["mlp", "head"])(x, step=step)

    run = nnx.jit(run) if jit else run
    _, report = run(model, X, jnp.int32(0))
    assert [p.path for p in report.paths] == ["mlp", "head"]
    assert report.untapped == ("", "body")
    assert jp.format_report(report).splitlines()[0] == "first non-finite: mlp (forward output)"
    _, report = run(model, X, jnp.int32(1))
    assert not bool(report.sampled) and int(report.outputs["mlp"].size) == 0
    probe = jp.nnx.diagnose(model, "float16", every=2, paths=["mlp", "head"]).probe(X)
    assert set(probe) == {"mlp", "head"}
