"""jp.nnx.calibrate: GPTQ and AWQ kernels of an unmodified NNX model, int8 beside them,
served through the weight-only matmul, with and without jit."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from quantization import calibrate_reference as ref
from quantization.calibrate_reference import correlated_inputs as _inputs
from quantization.calibrate_reference import int4_converts_into_dots

import jmp_policy as jp
from jmp_policy._src.quantization import awq


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(32, 64, rngs=rngs)
        self.mid = nnx.Linear(64, 64, rngs=rngs)
        self.head = nnx.Linear(64, 8, rngs=rngs)

    def __call__(self, x):
        return self.head(nnx.relu(self.mid(nnx.relu(self.up(x)))))


MAP = jp.DTypePolicyMap(
    "float32",
    {"up": "awq/4/16_from_float32", "mid": "gptq/4/16_from_float32", "head": "int8_from_float32"},
)


@pytest.fixture(scope="module")
def calibrated():
    model, x = MLP(nnx.Rngs(0)), _inputs(512)
    before = np.asarray(model.up.kernel.get_value())
    q, report = jp.nnx.calibrate(model, MAP, [x[:256], x[256:]], return_report=True)
    np.testing.assert_array_equal(np.asarray(model.up.kernel.get_value()), before)  # untouched
    return model, q, report


def test_explain_lists_the_calibration_report_under_the_table(calibrated):
    _, q, report = calibrated
    head = "calibrated (output error on the calibration inputs: round to nearest -> method):"
    for args in ((), (_inputs(4),)):  # with the matmuls listed, and without
        lines = jp.nnx.explain(q, MAP, *args, calibration=report).splitlines()
        assert lines[-1 - len(report)] == head
        for line, r in zip(lines[-len(report) :], report, strict=True):
            assert line.split()[:5] == [
                r.path, r.method, f"{r.rtn_error:.2%}", "->", f"{r.error:.2%}"
            ]  # fmt: skip
        assert head not in jp.nnx.explain(q, MAP, *args)
    with pytest.raises(TypeError, match=r"`calibration` must be the report .*calibration=\[1"):
        jp.nnx.explain(q, MAP, calibration=[1, 2])


def test_the_map_chooses_gptq_awq_and_int8_per_layer(calibrated):
    _, q, report = calibrated
    up, mid, head = (getattr(q, n).kernel.get_value() for n in ("up", "mid", "head"))
    assert (mid.mode, mid.block_size, mid.values.dtype) == ("int4", 16, jnp.int4)
    assert isinstance(up, awq.InputScaledArray) and up.input_scale.shape == (32,)
    assert (head.mode, head.values.dtype) == ("int8", jnp.int8)
    assert q.up.bias.get_value().dtype == jnp.float32
    assert [(r.path, r.method) for r in report] == [("mid/kernel", "gptq"), ("up/kernel", "awq")]
    for r in report:  # on the calibration inputs, each beats round-to-nearest
        assert r.error < r.rtn_error


def test_deterministic_for_fixed_batches(calibrated):
    model, q, _ = calibrated
    x = _inputs(512)
    again = jp.nnx.calibrate(model, {"mid": "gptq/4/16_from_float32"}, [x[:256], x[256:]])
    np.testing.assert_array_equal(
        np.asarray(again.mid.kernel.get_value().values),
        np.asarray(q.mid.kernel.get_value().values),
    )


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "nnx_jit"])
def test_calibrated_model_serves_close_to_float(calibrated, jit):
    model, q, _ = calibrated
    x = _inputs(128, seed=1)
    want = model(x)
    run = (
        (lambda m, x: jp.nnx.apply(m, MAP)(x))
        if not jit
        else nnx.jit(lambda m, x: jp.nnx.apply(m, MAP)(x))
    )
    got = run(q, x)
    rel = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
    rtn_map = {"up|mid": "int4/16_from_float32", "head": "int8_from_float32"}
    rtn = jp.nnx.quantize(model, jp.DTypePolicyMap("float32", rtn_map))
    rtn_rel = float(jnp.linalg.norm(run(rtn, x) - want) / jnp.linalg.norm(want))
    assert rel < rtn_rel and rel < 0.15


# Below 64 rows each int4 block kernel reaches its dot as int4; from 64 rows it is
# dequantized once and multiplied by one GEMM (faster there on an H200).
@pytest.mark.parametrize("rows, int4_dots", [(32, 2), (63, 2), (64, 0)])
def test_calibrated_int4_kernels_reach_the_dot_as_int4(calibrated, rows, int4_dots):
    _, q, _ = calibrated
    graphdef, state = nnx.split(q)

    def serve(state, x):
        return jp.nnx.apply(nnx.merge(graphdef, state), MAP)(x)

    jaxpr = jax.make_jaxpr(serve)(state, _inputs(rows, seed=2))
    assert int4_converts_into_dots(jaxpr.jaxpr) == int4_dots  # GPTQ's and AWQ's kernels


class EinsumBlock(nnx.Module):
    """An MLP of two ``nnx.Einsum`` layers (``dense=True``: ``LinearGeneral`` ones, the
    same parameters): ``[d] -> [heads, head_dim] -> [d]``."""

    def __init__(self, rngs, dense=False):
        if dense:
            self.up = nnx.LinearGeneral(32, (4, 16), rngs=rngs)
            self.down = nnx.LinearGeneral((4, 16), 32, axis=(-2, -1), rngs=rngs)
        else:
            self.up = nnx.Einsum("btd,dnh->btnh", (32, 4, 16), (4, 16), rngs=rngs)
            self.down = nnx.Einsum("btnh,nhd->btd", (4, 16, 32), (32,), rngs=rngs)

    def __call__(self, x):
        return self.down(nnx.gelu(self.up(x)))


EINSUM_MAP = {"up": "gptq/4/16_from_float32", "down": "awq/4/16_from_float32"}


@pytest.mark.parametrize("jit", [False, True])
def test_an_einsum_is_calibrated_as_the_linear_general_of_its_kernel(jit):
    x = _inputs(256).reshape(8, 32, 32)
    model, twin = EinsumBlock(nnx.Rngs(0)), EinsumBlock(nnx.Rngs(1), dense=True)
    for name in ("up", "down"):  # the same parameters (LinearGeneral's kernel: flat axes)
        for p in ("kernel", "bias"):
            var = getattr(getattr(twin, name), p)
            var.set_value(getattr(getattr(model, name), p).get_value().reshape(var.shape))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # both layers seen: no rounding to nearest
        q = jp.nnx.calibrate(model, EINSUM_MAP, [x[:4], x[4:]])
        want = jp.nnx.calibrate(twin, EINSUM_MAP, [x[:4], x[4:]])
    assert type(q.up.kernel.get_value()) is jp.QuantizedArray
    assert type(q.down.kernel.get_value()) is awq.InputScaledArray  # AWQ's input scale
    for name in ("up", "down"):
        assert getattr(q, name).kernel.get_value().block_size == 16
        got = getattr(q, name).kernel.get_value().dequantize(jnp.float32)
        expected = getattr(want, name).kernel.get_value().dequantize(jnp.float32)
        np.testing.assert_array_equal(got, expected.reshape(got.shape))
    apply = jp.nnx.apply(q, EINSUM_MAP)
    served = (jax.jit(apply) if jit else apply)(x)
    np.testing.assert_allclose(served, jp.nnx.apply(want, EINSUM_MAP)(x), rtol=1e-5, atol=1e-5)
    rtn_map = jp.DTypePolicyMap("float32", {"up|down": "int4/16_from_float32"})
    rtn = jp.nnx.apply(jp.nnx.quantize(model, rtn_map), rtn_map)(x)
    float_out = model(x)
    assert np.linalg.norm(served - float_out) < 0.9 * np.linalg.norm(rtn - float_out)


class WithEinsum(nnx.Module):
    def __init__(self, rngs):
        self.dense = nnx.Linear(32, 16, rngs=rngs)
        self.einsum = nnx.Einsum("bi,oi->bo", (8, 16), rngs=rngs)  # kernel [out, in]

    def __call__(self, x):
        return self.einsum(self.dense(x))


def test_a_layer_whose_matmul_is_not_seen_is_rounded_to_nearest_with_a_warning():
    model, x = WithEinsum(nnx.Rngs(0)), _inputs(64)
    with pytest.warns(
        UserWarning, match=r"'einsum/kernel'.*rounded to nearest.*layout GPTQ/AWQ do not read"
    ):
        q, report = jp.nnx.calibrate(model, "gptq/4/-1_from_float32", [x], return_report=True)
    assert q.einsum.kernel.get_value().mode == "int4"
    assert [r.path for r in report] == ["dense/kernel"]


class ScanMLP(nnx.Module):
    """int8 ``up`` and ``head`` around three layers created stacked (``nnx.vmap``) and run
    with ``nnx.scan`` over layers (``scan=False``: run by ``nnx.vmap`` on one input, or
    ``vmap=`` a function of ``(layers, x)`` made beforehand; ``remat=True``: each layer
    called through ``nnx.remat``)."""

    def __init__(self, rngs, scan=True, remat=False, vmap=None):
        @nnx.split_rngs(splits=3)
        @nnx.vmap
        def make(rngs):
            return nnx.Linear(32, 32, rngs=rngs)

        self.up = nnx.Linear(32, 32, rngs=rngs)
        self.layers = make(rngs)
        self.head = nnx.Linear(32, 8, rngs=rngs)
        self.scan, self.remat, self.vmap = scan, remat, vmap

    def __call__(self, x):
        x = nnx.relu(self.up(x))
        if self.scan:

            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            def body(x, layer):
                call = nnx.remat(lambda layer, x: layer(x)) if self.remat else type(layer).__call__
                return nnx.relu(call(layer, x))

            x = body(x, self.layers)
        else:
            run = self.vmap or nnx.vmap(lambda layer, x: layer(x), in_axes=(0, None))
            x = nnx.relu(run(self.layers, x)).mean(0)
        return self.head(x)


def _scan_layer_inputs(model, x):
    """The inputs each layer of the stack sees, run unrolled with the float parameters."""
    up = (model.up.kernel.get_value(), model.up.bias.get_value())
    stack = (model.layers.kernel.get_value(), model.layers.bias.get_value())
    return ref.stack_inputs(x, up, stack)


def _stack_map(method):
    return jp.DTypePolicyMap(
        "float32", {"layers": f"{method}/4/16_from_float32", "up|head": "int8_from_float32"}
    )


def _broadcast_layer_inputs(model, x):
    """The inputs each layer of the stack sees when ``nnx.vmap`` broadcasts ``x``
    (``in_axes=None``): every layer sees ``up``'s output."""
    h = jax.nn.relu(x @ model.up.kernel.get_value() + model.up.bias.get_value())
    return [h] * 3


# The stack run in a loop (`nnx.scan`) or in parallel (`nnx.vmap`, one input for every
# layer): (whether ScanMLP scans, the inputs each layer sees with the float parameters).
STACKS = {"nnx.scan": (True, _scan_layer_inputs), "nnx.vmap": (False, _broadcast_layer_inputs)}


@pytest.mark.parametrize("transform", sorted(STACKS))
@pytest.mark.parametrize("method", ["gptq", "awq"])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "nnx_jit"])
def test_stack_layers_are_each_calibrated_on_their_own_inputs(transform, method, jit):
    scan, layer_inputs = STACKS[transform]
    model, x = ScanMLP(nnx.Rngs(0), scan=scan), _inputs(256)
    policy = _stack_map(method)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no layer of the stack falls back to round-to-nearest
        q, report = jp.nnx.calibrate(model, policy, [x], return_report=True)
    kernel = q.layers.kernel.get_value()
    rtn_policy = jp.DTypePolicyMap(
        "float32", {"layers": "int4/16_from_float32", "up|head": "int8_from_float32"}
    )
    rtn = jp.nnx.quantize(model, rtn_policy)
    rtn_kernel = rtn.layers.kernel.get_value()
    # the layout quantize gives a stack: stacked=1, scales [depth, blocks, out]
    assert (kernel.shape, kernel.stacked, kernel.block_size) == ((3, 32, 32), 1, 16)
    assert kernel.scale.shape == rtn_kernel.scale.shape == (3, 2, 32)
    assert kernel.values.dtype == jnp.int4 and q.up.kernel.get_value().mode == "int8"
    bias = q.layers.bias.get_value()
    assert (bias.shape, bias.dtype) == ((3, 32), jnp.float32)  # float, stacked
    paths = [f"layers/kernel[{i}]" for i in range(3)]
    assert [(r.path, r.method) for r in report] == [(p, method) for p in paths]
    assert all(r.error < r.rtn_error for r in report)  # each layer, on its own inputs
    ref.assert_each_layer_solved_alone(
        method,
        kernel,
        rtn_kernel,
        model.layers.kernel.get_value(),
        layer_inputs(model, x),
        layer_inputs(model, _inputs(128, seed=1)),  # held out
    )
    # the calibrated stack serves as a round-to-nearest stack does, as its dequantized
    # kernels (a float stack beside the same int8 layers)
    held = _inputs(128, seed=1)

    def run(m, policy, x):
        serve = lambda m, x: jp.nnx.apply(m, policy)(x)  # noqa: E731
        return (nnx.jit(serve) if jit else serve)(m, x)

    got = run(q, policy, held)
    floats = nnx.clone(q)
    floats.layers.kernel.set_value(kernel.dequantize())
    int8_only = jp.DTypePolicyMap("float32", {"up|head": "int8_from_float32"})
    np.testing.assert_allclose(
        np.asarray(got), np.asarray(run(floats, int8_only, held)), rtol=2e-4, atol=2e-4
    )
    rel = lambda y: float(jnp.linalg.norm(y - model(held)) / jnp.linalg.norm(model(held)))  # noqa: E731
    assert rel(got) < rel(run(rtn, rtn_policy, held))


def test_a_scan_stack_under_nnx_remat_gets_the_same_per_layer_kernels():
    x = _inputs(256)
    got = {}
    for remat in (False, True):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            q, report = jp.nnx.calibrate(
                ScanMLP(nnx.Rngs(0), remat=remat), _stack_map("gptq"), [x], return_report=True
            )
        assert [r.path for r in report] == [f"layers/kernel[{i}]" for i in range(3)]
        got[remat] = q.layers.kernel.get_value()
    np.testing.assert_array_equal(np.asarray(got[True].values), np.asarray(got[False].values))
    np.testing.assert_allclose(np.asarray(got[True].scale), np.asarray(got[False].scale))


class RolledMLP(ScanMLP):
    """``ScanMLP`` whose ``nnx.vmap`` lanes each see their own inputs (``in_axes=0``)."""

    def __call__(self, x):
        h = nnx.relu(self.up(x))
        lanes = jnp.stack([jnp.roll(h, i, axis=-1) for i in range(3)])
        run = nnx.vmap(lambda layer, x: layer(x), in_axes=(0, 0))
        return self.head(nnx.relu(run(self.layers, lanes)).mean(0))


def test_nnx_vmap_lanes_with_their_own_inputs_are_each_calibrated_on_them():
    model, x = RolledMLP(nnx.Rngs(0)), _inputs(128)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        q = jp.nnx.calibrate(model, {"layers": "gptq/4/16_from_float32"}, [x])
    kernel = q.layers.kernel.get_value()
    h = jax.nn.relu(x @ model.up.kernel.get_value() + model.up.bias.get_value())
    for i in range(3):
        want = ref.solve_alone("gptq", model.layers.kernel.get_value()[i], jnp.roll(h, i, -1), 16)
        np.testing.assert_allclose(np.asarray(kernel.scale[i]), np.asarray(want.scale), rtol=1e-5)


def test_a_stack_run_by_an_nnx_vmap_made_at_import_is_rounded_to_nearest_with_a_warning():
    run = nnx.vmap(lambda layer, x: layer(x), in_axes=(0, None))  # made before calibrate
    model, x = ScanMLP(nnx.Rngs(0), scan=False, vmap=run), _inputs(64)
    with pytest.warns(
        UserWarning,
        match=r"'layers/kernel'.*rounded to nearest.*a jax.vmap/nnx.vmap function made "
        r"before calibrate ran",
    ):
        q = jp.nnx.calibrate(model, _stack_map("gptq"), [x])
    kernel = q.layers.kernel.get_value()
    assert kernel.stacked == 1 and kernel.scale.shape == (3, 2, 32)
    assert q.layers.bias.get_value().dtype == jnp.float32


def test_progress_tells_each_layer_and_a_bad_progress_is_a_type_error(capsys):
    model, x = MLP(nnx.Rngs(0)), _inputs(64)
    seen = []
    _, report = jp.nnx.calibrate(model, MAP, [x], progress=seen.append, return_report=True)
    assert seen == report and len(seen) == 2
    jp.nnx.calibrate(model, MAP, [x], progress=True)
    assert "calibrate" in capsys.readouterr().err
    with pytest.raises(TypeError, match=r"`progress` must be True.*Received: progress='yes'"):
        jp.nnx.calibrate(model, MAP, [x], progress="yes")


def test_bad_arguments_are_clear_errors():
    model, x = MLP(nnx.Rngs(0)), _inputs(8)
    with pytest.raises(ValueError, match=r"`batches` holds no batch"):
        jp.nnx.calibrate(model, MAP, [])
    with pytest.raises(TypeError, match=r"`batches` must be an iterable.*int"):
        jp.nnx.calibrate(model, MAP, 3)
    with pytest.raises(TypeError, match=r"nnx.Module"):
        jp.nnx.calibrate({"a": 1}, MAP, [x])


def test_quantize_of_a_gptq_map_points_to_calibrate():
    with pytest.raises(ValueError, match=r"calibration inputs.*jmp_policy.nnx.calibrate"):
        jp.nnx.quantize(MLP(nnx.Rngs(0)), MAP)


def test_batches_of_different_shapes_add_up():
    model, x = MLP(nnx.Rngs(0)), _inputs(96)
    policy = {"up": "gptq/4/16_from_float32"}
    a = jp.nnx.calibrate(model, policy, [x[:32], x[32:96].reshape(2, 32, 32)])
    b = jp.nnx.calibrate(model, policy, [x])
    np.testing.assert_array_equal(
        np.asarray(a.up.kernel.get_value().values), np.asarray(b.up.kernel.get_value().values)
    )


class Attention(nnx.Module):
    def __init__(self, rngs):
        self.attn = nnx.MultiHeadAttention(4, 32, decode=False, rngs=rngs)  # out: [4, 8, 32]

    def __call__(self, x):
        return self.attn(x)


@pytest.mark.parametrize("method", ["gptq", "awq"])
@pytest.mark.parametrize("jit", [False, True])
def test_attention_output_projection_is_calibrated_over_its_two_input_axes(method, jit):
    model = Attention(nnx.Rngs(0))
    x = _inputs(512).reshape(16, 32, 32)
    policy = jp.DTypePolicyMap("float32", {"attn": f"{method}/4/2_from_float32"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no layer falls back to round-to-nearest
        q, report = jp.nnx.calibrate(model, policy, [x[:8], x[8:]], return_report=True)
    out = q.attn.out.kernel.get_value()
    assert out.shape == (4, 8, 32) and out.block_size == 2 and out.scale.shape == (2, 32)
    if method == "awq":
        assert isinstance(out, awq.InputScaledArray) and out.input_scale.shape == (4, 8)
    assert "attn/out/kernel" in [r.path for r in report] and len(report) == 4
    assert all(r.error < r.rtn_error for r in report)
    held = _inputs(256, seed=1).reshape(8, 32, 32)
    want = model(held)
    fn = jp.nnx.apply(q, policy)
    got = nnx.jit(lambda m, x: jp.nnx.apply(m, policy)(x))(q, held) if jit else fn(held)
    rtn_policy = jp.DTypePolicyMap("float32", {"attn": "int4/2_from_float32"})
    rtn = jp.nnx.quantize(model, rtn_policy)
    rel = lambda y: float(jnp.linalg.norm(y - want) / jnp.linalg.norm(want))  # noqa: E731
    assert rel(got) < rel(jp.nnx.apply(rtn, rtn_policy)(held))


@pytest.mark.parametrize("scan", [None, True])
def test_a_bound_on_the_statistics_bytes_gathers_layers_in_groups_to_the_same_result(scan):
    # max_statistics_bytes=1: every layer (a stack as one) gathered in a pass of its own,
    # its statistics moved to the host before the next; the kernels are the same.
    model = MLP(nnx.Rngs(0)) if scan is None else ScanMLP(nnx.Rngs(0), scan=scan)
    policies = MAP if scan is None else _stack_map("awq")
    x = _inputs(256)
    q, report = jp.nnx.calibrate(model, policies, [x[:128], x[128:]], return_report=True)
    grouped, grouped_report = jp.nnx.calibrate(
        model, policies, [x[:128], x[128:]], return_report=True, max_statistics_bytes=1
    )
    assert [r.path for r in grouped_report] == [r.path for r in report] != []
    want = nnx.to_pure_dict(nnx.state(q, nnx.Param))
    got = nnx.to_pure_dict(nnx.state(grouped, nnx.Param))
    is_q = jp.QuantizedArray.__instancecheck__
    pairs = zip(
        jax.tree.leaves(want, is_leaf=is_q), jax.tree.leaves(got, is_leaf=is_q), strict=True
    )
    for a, b in pairs:
        if isinstance(a, jp.QuantizedArray):
            np.testing.assert_array_equal(b.dequantize(), a.dequantize())


def test_a_bad_bound_on_the_statistics_bytes_is_refused_before_any_run():
    with pytest.raises(TypeError, match=r"`max_statistics_bytes` must be .*=2.0 \(of type float"):
        jp.nnx.calibrate(MLP(nnx.Rngs(0)), MAP, [_inputs(16)], max_statistics_bytes=2.0)
