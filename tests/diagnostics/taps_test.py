"""Diagnostics core (no flax): statistics, the report pytree, the taps in the hook, the table."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_policy as jp
from jmp_policy._src import interception
from jmp_policy._src.diagnostics import taps as diagnostics
from jmp_policy._src.diagnostics.report import Report
from jmp_policy._src.diagnostics.stats import Stats, stats_of
from jmp_policy._src.options import Options
from jmp_policy._src.resolution import Resolver

F16_TINY = float(jnp.finfo(jnp.float16).tiny)  # 6.1e-05
F16_MAX = float(jnp.finfo(jnp.float16).max)  # 65504


def _values(stats):
    return {f.name: np.asarray(getattr(stats, f.name)).item() for f in dataclasses.fields(stats)}


def test_stats_count_each_kind_of_value(maybe_jit):
    x = jnp.array([0.0, 1e-6, -3e-5, 1.0, -40000.0, jnp.inf, jnp.nan, 2.0], jnp.float32)
    y = jnp.array([[0.5, 60000.0]], jnp.float16)
    stats = maybe_jit(lambda a, b: stats_of([a, b], "float16"))(x, y)
    assert _values(stats) == {
        "max_abs": 60000.0,  # the largest finite value, inf and nan aside
        "non_finite": 2,
        "underflow": 2,  # 1e-6 and 3e-5: nonzero, below float16's smallest normal
        "near_overflow": 2,  # 40000 and 60000 are within a factor 2 of 65504
        "zeros": 1,
        "size": 10,
    }
    assert stats.underflow_fraction == pytest.approx(0.2)
    assert stats.near_overflow_fraction == pytest.approx(0.2)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
def test_stats_of_one_pass_equal_a_numpy_reference(maybe_jit, dtype):
    rng = np.random.default_rng(0)
    values = rng.standard_normal((3, 5, 7)) * 10.0 ** rng.integers(
        -30, 38, (3, 5, 7)
    )  # no float32 subnormals
    values.flat[:6] = [0.0, np.inf, -np.inf, np.nan, 0.0, 3e38]
    x = jnp.asarray(values, jnp.float32).astype(dtype)
    leaves = [x, x[0, 0] * 2]
    stats = maybe_jit(lambda *a: stats_of(list(a), "float16"))(*leaves)
    a = np.abs(np.concatenate([np.asarray(x, np.float32).ravel() for x in leaves]))
    finite = np.isfinite(a)
    assert _values(stats) == {
        "max_abs": float(a[finite].max()),
        "non_finite": int((~finite).sum()),
        "underflow": int(((a > 0) & (a < F16_TINY)).sum()),
        "near_overflow": int((finite & (a >= F16_MAX / 2)).sum()),
        "zeros": int((a == 0).sum()),
        "size": a.size,
    }


def test_stats_thresholds_follow_the_compute_dtype():
    x = jnp.array([1e-6, 40000.0], jnp.float32)
    assert _values(stats_of([x], "float32"))["underflow"] == 0
    assert _values(stats_of([x], "float32"))["near_overflow"] == 0
    assert _values(stats_of([x], "bfloat16"))["underflow"] == 0  # bf16 tiny is 1.2e-38
    assert _values(stats_of([x], "float16"))["underflow"] == 1


def test_stats_of_nothing_are_zero():
    assert _values(stats_of([], "float16")) == dict.fromkeys(
        ["max_abs", "non_finite", "underflow", "near_overflow", "zeros", "size"], 0
    )


def test_stats_row_round_trip_and_merge():
    a = stats_of([jnp.array([1.0, jnp.inf])], "float16")
    b = stats_of([jnp.array([3.0, 1e-6, 0.0])], "float16")
    assert _values(Stats.from_row(a.row())) == _values(a)
    assert _values(a.merge(b)) == {
        "max_abs": 3.0,
        "non_finite": 1,
        "underflow": 1,
        "near_overflow": 0,
        "zeros": 1,
        "size": 5,
    }


def _policy(name):
    return jp.get_policy(name)


def _run_model(x, probe=None, scale=1.0):
    """A plain-function 'model' run through the hook: root -> "body" -> "head"."""
    options = Options(extensions=(diagnostics.Taps(),))
    resolver = Resolver(_policy("float16"), options)

    def call(path, fn, *args):
        c = interception.Call(path, None, resolver.module(path))
        return interception.run(c, fn, args, {}, extensions=options.extensions)

    def head(v):  # times `scale`, in float16, in two steps that each stay finite
        s = (jnp.asarray(scale, jnp.float32) ** 0.5).astype(v.dtype)
        return v * s * s

    def root(x):
        h = call("body", lambda v: v * 2.0, x)
        return call("head", head, h)

    with diagnostics.collecting(probe) as collector:
        out = call("", root, x)
        report = collector.report()
    return out, report


def test_taps_record_paths_in_execution_order_with_their_dtype(maybe_jit):
    out, report = maybe_jit(_run_model)(jnp.ones((2, 3), jnp.float32))
    assert out.dtype == jnp.float16
    assert [(p.path, p.dtype, p.calls) for p in report.paths] == [
        ("", "float16", 1),
        ("body", "float16", 1),
        ("head", "float16", 1),
    ]
    seqs = {p.path: (p.input_seq, p.output_seq) for p in report.paths}
    assert seqs == {"": (0, 5), "body": (1, 2), "head": (3, 4)}
    assert float(report.outputs["head"].max_abs) == 2.0
    assert int(report.inputs["body"].size) == 6
    assert report.gradients == {}


def test_taps_do_nothing_outside_a_diagnose_run():
    taps = diagnostics.Taps()
    resolver = Resolver(_policy("float16"), Options(extensions=(taps,)))
    c = interception.Call("a", None, resolver.module("a"))
    out = interception.run(c, lambda v: v + 1, (jnp.ones(2),), {}, extensions=(taps,))
    assert out.tolist() == [2.0, 2.0]


def test_first_non_finite_is_the_first_in_execution_order(maybe_jit):
    _, report = maybe_jit(lambda x: _run_model(x, scale=1e5))(jnp.ones((2, 3)))
    text = jp.format_report(report)
    assert text.splitlines()[0] == "first non-finite: head (forward output)"
    # the root's output is non-finite too, but later in execution order
    assert int(report.outputs[""].non_finite) == 6


def test_backward_statistics_come_back_through_the_probe_gradient(maybe_jit):
    x = jnp.ones((2, 3), jnp.float32)
    _, report = _run_model(x)
    probe = report.probe()
    assert {k: v.shape for k, v in probe.items()} == {"": (1, 6), "body": (1, 6), "head": (1, 6)}

    def loss(x, probe):
        out, report = _run_model(x, probe)
        return out.astype(jnp.float32).sum() * 1e-6, report

    grad = maybe_jit(jax.grad(loss, argnums=1, has_aux=True))
    probe_grad, report = grad(x, probe)
    report = report.with_gradients(probe_grad)
    # 1e-6 reaches every output in float16: nonzero, below its smallest normal
    for path in ("", "body", "head"):
        assert _values(report.gradients[path])["underflow"] == 6
        assert float(report.gradients[path].underflow_fraction) == 1.0
    assert "head" in jp.format_report(report)


def test_report_is_a_pytree_that_keeps_its_metadata():
    _, report = _run_model(jnp.ones((2, 3)))
    copy = jax.tree.map(lambda v: v, report)
    jitted = jax.jit(lambda r: r)(report)
    for other in (copy, jitted):
        assert other.paths == report.paths
        assert other.skipped == report.skipped
        assert _values(other.outputs["head"]) == _values(report.outputs["head"])


def test_a_report_is_packed_into_a_few_arrays(maybe_jit):
    """Six statistics per tapped tensor, each a scalar output of a jitted step, were each
    an output buffer (on a GPU, a kernel each): the pytree holds two arrays per direction
    and ``sampled``, and reading it gives the same statistics, with their dtypes."""
    _, report = maybe_jit(lambda x: _run_model(x))(jnp.ones((2, 3)))
    leaves = jax.tree.leaves(report)
    assert len(leaves) == 6  # max_abs and counts for inputs, outputs, gradients (None: no leaf)
    assert [a.dtype for a in leaves] == [jnp.float32, jnp.int32] * 3
    paths = len(report.outputs)
    assert leaves[2].shape == (paths,) and leaves[3].shape == (paths, 5)
    assert leaves[4].shape == (0,) and leaves[5].shape == (0, 5)  # no gradients yet
    head = report.outputs["head"]
    assert head.max_abs.dtype == np.float32 and head.size.dtype == np.int32
    assert int(head.size) == 6 and float(head.max_abs) == 2.0  # ones, doubled by "body"
    with pytest.raises(dataclasses.FrozenInstanceError):
        report.every = 2
    assert repr(report).startswith("Report(inputs: ")


def test_a_packed_report_pickles_copies_and_names_its_leaves():
    import copy
    import pickle

    _, report = _run_model(jnp.ones((2, 3)))
    for other in (pickle.loads(pickle.dumps(report)), copy.copy(report), copy.deepcopy(report)):
        assert other.paths == report.paths
        assert _values(other.outputs["head"]) == _values(report.outputs["head"])
    names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(report)[0]]
    assert names[:2] == [".inputs_max_abs", ".inputs_counts"]


def test_statistics_read_inside_a_branch_do_not_outlive_it():
    """Read under a `lax.cond` branch's trace, then outside it: no leaked tracer."""
    _, report = _run_model(jnp.ones((2, 3)))

    def step(report, p):
        y = jax.lax.cond(p, lambda: report.outputs["head"].max_abs, lambda: 0.0)
        return y + report.outputs["head"].max_abs

    assert float(jax.jit(step)(report, True)) == 4.0


def test_a_report_from_eval_shape_has_the_statistics_shapes():
    _, report = jax.eval_shape(lambda x: _run_model(x), jnp.ones((2, 3)))
    head = report.outputs["head"]
    assert (head.max_abs.shape, head.max_abs.dtype) == ((), jnp.float32)
    assert (head.size.shape, head.size.dtype) == ((), jnp.int32)


def test_a_report_stacked_on_its_last_axis_is_a_clear_error():
    def run(scale):
        return _run_model(jnp.ones((2, 3)), scale=scale)[1]

    stacked = jax.vmap(run, out_axes=0)(jnp.arange(1.0, 4.0))
    assert stacked.outputs["head"].size.tolist() == [6, 6, 6]
    wrong = jax.vmap(run, out_axes=-1)(jnp.arange(1.0, 6.0))
    with pytest.raises(ValueError, match=r"stacked \(scan, vmap\) on leading axes only"):
        wrong.outputs  # noqa: B018


def test_report_stacked_by_scan_is_summarised():
    def step(carry, scale):
        _, report = _run_model(jnp.ones((2, 3)), scale=scale)
        return carry, report

    _, reports = jax.lax.scan(step, 0, jnp.array([1.0, 1e5, 1.0]))
    assert reports.outputs["head"].non_finite.tolist() == [0, 6, 0]
    assert jp.format_report(reports).splitlines()[0] == "first non-finite: head (forward output)"


def test_with_gradients_rejects_a_probe_of_another_model():
    _, report = _run_model(jnp.ones((2, 3)))
    with pytest.raises(ValueError, match=r"does not know: \['other'\]"):
        report.with_gradients({"other": jnp.zeros((1, 6))})
    with pytest.raises(ValueError, match=r"has shape \(2, 6\); expected \(1, 6\)"):
        report.with_gradients({"head": jnp.zeros((2, 6))})
    with pytest.raises(TypeError, match="must be the gradient with respect to a probe"):
        report.with_gradients(jnp.zeros(3))


def test_collecting_rejects_a_probe_that_is_not_a_mapping():
    with (
        pytest.raises(TypeError, match="`probe` must be None or a probe"),
        diagnostics.collecting(jnp.zeros(6)),
    ):
        pass


def test_probe_naming_paths_the_run_did_not_call_is_an_error():
    with pytest.raises(ValueError, match=r"did not call: \['gone'\]"):
        _run_model(jnp.ones(2), probe={"gone": jnp.zeros((1, 6))})


def test_format_report_sorts_by_risk_within_100_columns():
    long = "encoder/" + "very_long_block_name/" * 4 + "mlp"
    inputs = {
        "": stats_of([jnp.ones(4)], "float16"),
        long: stats_of([jnp.array([1e-6, 1.0])], "float16"),
        "head": stats_of([jnp.array([50000.0, 1.0])], "float16"),
    }
    report = Report(
        inputs=inputs,
        outputs={},
        gradients={"head": stats_of([jnp.array([jnp.nan])], "float16")},
        paths=tuple(diagnostics.PathInfo(p, "float16", 1, i, i + 10) for i, p in enumerate(inputs)),
        skipped=("encoder/scan",),
    )
    lines = jp.format_report(report).splitlines()
    assert lines[0] == "first non-finite: head (backward gradient)"
    assert lines[1].split() == [
        "path", "dtype", "where", "max|x|", "non-finite", "underflow", "near-max"
    ]  # fmt: skip
    assert lines[2].split()[:3] == ["head", "float16", "gradient"]  # non-finite first
    assert lines[2].split()[3:5] == ["none", "1"]  # no finite value: no largest one
    assert lines[3].split()[:3] == ["head", "float16", "input"]  # then near-overflow
    assert lines[3].split()[-1] == "50.00%"
    assert lines[4].startswith("...") and lines[4].split()[-2] == "50.00%"  # underflow
    assert lines[5].split()[0] == "(root)"
    assert lines[6:] == [
        "not collected (called inside a transform of their own):",
        "  encoder/scan",
    ]
    assert max(len(line) for line in lines) <= 100
    assert jp.format_report(report, max_rows=1).splitlines()[-3] == "... 3 more row(s)"


def test_format_report_shows_a_largest_value_only_where_some_value_is_finite():
    def row(values):
        report = Report(
            inputs={"layer": stats_of([jnp.asarray(values)], "float16")},
            outputs={},
            gradients={},
            paths=(diagnostics.PathInfo("layer", "float16", 1, 0, 1),),
            skipped=(),
        )
        return jp.format_report(report).splitlines()[2].split()

    assert row([jnp.inf] * 64)[3:5] == ["none", "64"]
    assert row([jnp.inf, 3.0])[3:5] == ["3", "1"]
    assert row([0.0, 0.0])[3:5] == ["0", "0"]


def test_format_report_rejects_other_values():
    with pytest.raises(TypeError, match="must be the report of a `diagnose` function"):
        jp.format_report({"head": 1})
    _, report = _run_model(jnp.ones(2))
    with pytest.raises(TypeError, match="`max_rows` must be None or an int"):
        jp.format_report(report, max_rows="5")
