"""jp.linen.calibrate: GPTQ and AWQ kernels of an unmodified Linen model, int8 beside them,
served through the weight-only matmul."""

import functools
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from quantization import calibrate_reference as ref
from quantization.calibrate_reference import correlated_inputs as _inputs
from quantization.calibrate_reference import int4_converts_into_dots

import jmp_policy as jp
from jmp_policy._src import calibration_gather
from jmp_policy._src.quantization import awq


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(64, name="up")(x))
        x = nn.relu(nn.Dense(64, name="mid")(x))
        return nn.Dense(8, name="head")(x)


MAP = jp.DTypePolicyMap(
    "float32",
    {
        "up": "awq/4/16_from_float32",
        "mid": "gptq/4/16_from_float32",
        "head": "int8_from_float32",
    },
)


@pytest.fixture(scope="module")
def calibrated():
    model, x = MLP(), _inputs(512)
    variables = model.init(jax.random.key(0), x)
    q, report = jp.linen.calibrate(model, MAP, variables, [x[:256], x[256:]], return_report=True)
    return model, variables, q, report


def test_the_map_chooses_gptq_awq_and_int8_per_layer(calibrated):
    _, variables, q, report = calibrated
    up, mid, head = (q["params"][n]["kernel"] for n in ("up", "mid", "head"))
    assert (mid.mode, mid.block_size, mid.values.dtype) == ("int4", 16, jnp.int4)
    assert isinstance(up, awq.InputScaledArray) and up.input_scale.shape == (32,)
    assert (head.mode, head.values.dtype) == ("int8", jnp.int8)
    assert q["params"]["up"]["bias"] is variables["params"]["up"]["bias"]
    assert [(r.path, r.method) for r in report] == [("mid/kernel", "gptq"), ("up/kernel", "awq")]
    for r in report:  # on the calibration inputs, each beats round-to-nearest
        assert r.error < r.rtn_error


def test_explain_lists_the_calibration_report_under_the_table(calibrated):
    model, _, q, report = calibrated
    x = _inputs(4)
    table = jp.linen.explain(model, MAP, q, x, calibration=report)
    head = "calibrated (output error on the calibration inputs: round to nearest -> method):"
    lines = table.splitlines()
    assert lines[-3] == head
    for line, r in zip(lines[-2:], report, strict=True):
        assert line.split() == [
            r.path, r.method, f"{r.rtn_error:.2%}", "->", f"{r.error:.2%}",
            f"{r.seconds:.1f}", "s",
        ]  # fmt: skip
    assert head not in jp.linen.explain(model, MAP, q, x)  # only when given
    with pytest.raises(
        TypeError, match=r"`calibration` must be the report .*Received: calibration=\{"
    ):
        jp.linen.explain(model, MAP, q, x, calibration={"up/kernel": 0.1})


def test_calibrated_model_serves_close_to_float_with_and_without_jit(calibrated):
    model, variables, q, _ = calibrated
    x = _inputs(128, seed=1)
    want = model.apply(variables, x)
    fn = jp.linen.apply(model, MAP)
    got, got_jit = fn(q, x), jax.jit(fn)(q, x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(got_jit), rtol=1e-5, atol=1e-5)
    rel = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert rel < 0.15
    rtn_map = {"up|mid": "int4/16_from_float32", "head": "int8_from_float32"}
    rtn = jp.linen.quantize(model, jp.DTypePolicyMap("float32", rtn_map), variables, x)
    rtn_rel = np.linalg.norm(fn(rtn, x) - want) / np.linalg.norm(want)
    assert rel < rtn_rel


# Below 64 rows each int4 block kernel reaches its dot as int4; from 64 rows it is
# dequantized once and multiplied by one GEMM (faster there on an H200).
@pytest.mark.parametrize("rows, int4_dots", [(32, 2), (63, 2), (64, 0)])
def test_calibrated_int4_kernels_reach_the_dot_as_int4(calibrated, rows, int4_dots):
    model, _, q, _ = calibrated
    jaxpr = jax.make_jaxpr(jp.linen.apply(model, MAP))(q, _inputs(rows, seed=2))
    assert int4_converts_into_dots(jaxpr.jaxpr) == int4_dots  # GPTQ's and AWQ's kernels


class EinsumBlock(nn.Module):
    """An MLP of two ``nn.Einsum`` layers: ``[d] -> [heads, head_dim] -> [d]``."""

    @nn.compact
    def __call__(self, x):
        h = nn.Einsum((32, 4, 16), "btd,dnh->btnh", name="up")(x)
        return nn.Einsum((4, 16, 32), "btnh,nhd->btd", name="down")(nn.gelu(h))


class DenseGeneralBlock(nn.Module):
    """``EinsumBlock`` with ``DenseGeneral`` layers: the same parameters."""

    @nn.compact
    def __call__(self, x):
        h = nn.DenseGeneral((4, 16), name="up")(x)
        return nn.DenseGeneral(32, axis=(-2, -1), name="down")(nn.gelu(h))


EINSUM_MAP = {"up": "gptq/4/16_from_float32", "down": "awq/4/16_from_float32"}


@pytest.mark.parametrize("jit", [False, True])
def test_an_einsum_is_calibrated_as_the_dense_general_of_its_kernel(jit):
    x = _inputs(256).reshape(8, 32, 32)
    variables = EinsumBlock().init(jax.random.key(0), x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # both layers seen: no rounding to nearest
        q = jp.linen.calibrate(EinsumBlock(), EINSUM_MAP, variables, [x[:4], x[4:]])
        want = jp.linen.calibrate(DenseGeneralBlock(), EINSUM_MAP, variables, [x[:4], x[4:]])
    assert type(q["params"]["up"]["kernel"]) is jp.QuantizedArray
    assert type(q["params"]["down"]["kernel"]) is awq.InputScaledArray  # AWQ's input scale
    for name in ("up", "down"):
        got, expected = q["params"][name]["kernel"], want["params"][name]["kernel"]
        assert got.shape == expected.shape and got.mode == expected.mode == "int4"
        assert got.block_size == expected.block_size == 16
        np.testing.assert_array_equal(got.dequantize(jnp.float32), expected.dequantize(jnp.float32))
    apply = jp.linen.apply(EinsumBlock(), EINSUM_MAP)
    served = (jax.jit(apply) if jit else apply)(q, x)
    float_out = EinsumBlock().apply(variables, x)
    np.testing.assert_allclose(
        served, jp.linen.apply(DenseGeneralBlock(), EINSUM_MAP)(want, x), rtol=1e-5, atol=1e-5
    )
    rtn_map = jp.DTypePolicyMap("float32", {"up|down": "int4/16_from_float32"})
    rtn = jp.linen.apply(EinsumBlock(), rtn_map)(
        {"params": rtn_map.quantize(variables["params"], stacked_axes=0)}, x
    )
    assert np.linalg.norm(served - float_out) < 0.9 * np.linalg.norm(rtn - float_out)


class WithEinsum(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(16, name="dense")(x)
        return nn.Einsum((8, 16), "bi,oi->bo", name="einsum")(x)  # kernel [out, in]


def test_a_layer_whose_matmul_is_not_seen_is_rounded_to_nearest_with_a_warning():
    model, x = WithEinsum(), _inputs(64)
    variables = model.init(jax.random.key(0), x)
    with pytest.warns(
        UserWarning, match=r"'einsum/kernel'.*rounded to nearest.*layout GPTQ/AWQ do not read"
    ):
        q = jp.linen.calibrate(model, "gptq/4/-1_from_float32", variables, [x])
    assert q["params"]["einsum"]["kernel"].mode == "int4"
    assert q["params"]["dense"]["kernel"].mode == "int4"


class ScanMLP(nn.Module):
    """int8 ``up`` and ``head`` around an ``nn.scan`` stack of three Dense layers (each
    block under ``nn.remat`` with ``remat=True``)."""

    remat: bool = False

    @nn.compact
    def __call__(self, x):
        class Block(nn.Module):
            @nn.compact
            def __call__(self, x, _):
                return nn.relu(nn.Dense(32)(x)), None

        block = nn.remat(Block) if self.remat else Block
        x = nn.relu(nn.Dense(32, name="up")(x))
        layers = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True}, length=3)
        x = layers(name="layers")(x, None)[0]
        return nn.Dense(8, name="head")(x)


def _scan_layer_inputs(params, x):
    """The inputs each layer of the stack sees, run unrolled with the float parameters."""
    dense = params["layers"]["Dense_0"]
    up = (params["up"]["kernel"], params["up"]["bias"])
    return ref.stack_inputs(x, up, (dense["kernel"], dense["bias"]))


def _dequantized(q):
    return jax.tree.map(
        lambda a: a.dequantize() if isinstance(a, jp.QuantizedArray) else a,
        q,
        is_leaf=lambda a: isinstance(a, jp.QuantizedArray),
    )


class SharedScan(nn.Module):
    """One Dense kernel shared by three iterations of an ``nn.scan`` (not a stack)."""

    @nn.compact
    def __call__(self, x):
        class Cell(nn.Module):
            @nn.compact
            def __call__(self, x, _):
                return jnp.tanh(nn.Dense(32)(x)), None

        cells = nn.scan(Cell, variable_broadcast="params", split_rngs={"params": False}, length=3)
        return cells(name="cells")(x, None)[0]


def test_a_kernel_shared_by_scan_iterations_is_calibrated_on_all_their_inputs():
    model, x = SharedScan(), _inputs(128)
    variables = model.init(jax.random.key(0), x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        q = jp.linen.calibrate(model, "gptq/4/16_from_float32", variables, [x])
    kernel = q["params"]["cells"]["Dense_0"]["kernel"]
    assert kernel.shape == (32, 32) and kernel.stacked == 0
    dense = variables["params"]["cells"]["Dense_0"]
    h, inputs = x, []
    for _ in range(3):
        inputs.append(h)
        h = jnp.tanh(h @ dense["kernel"] + dense["bias"])
    want = ref.solve_alone("gptq", dense["kernel"], jnp.concatenate(inputs), 16)
    np.testing.assert_allclose(np.asarray(kernel.scale), np.asarray(want.scale), rtol=1e-5)


class VmapMLP(nn.Module):
    """int8 ``up`` and ``head`` around an ``nn.vmap`` stack of two Dense layers run in
    parallel (an ensemble): lane ``i`` sees ``up``'s output rolled by ``i`` features
    (``in_axes=0``), or (``broadcast=True``) the same output in every lane."""

    broadcast: bool = False

    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(32, name="up")(x))
        stack = nn.vmap(
            nn.Dense,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            in_axes=None if self.broadcast else 0,
            out_axes=0,
            axis_size=2,
        )
        lanes = h if self.broadcast else _rolled_lanes(h)
        return nn.Dense(8, name="head")(nn.relu(stack(32, name="layers")(lanes)).mean(0))


def _rolled_lanes(h):
    return jnp.stack([jnp.roll(h, i, axis=-1) for i in range(2)])


def _vmap_layer_inputs(params, x, broadcast=False):
    """The inputs each layer of the vmap stack sees, with the float parameters."""
    h = jax.nn.relu(x @ params["up"]["kernel"] + params["up"]["bias"])
    return [h, h] if broadcast else list(_rolled_lanes(h))


# A stack of layers run in a loop (`nn.scan`) or in parallel (`nn.vmap`): (model, the
# stack's kernel path, its depth, the inputs each layer sees with the float parameters).
STACKS = {
    "nn.scan": (ScanMLP, ("layers", "Dense_0"), 3, _scan_layer_inputs),
    "nn.vmap": (VmapMLP, ("layers",), 2, _vmap_layer_inputs),
}


@pytest.mark.parametrize("transform", sorted(STACKS))
@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_stack_layers_are_each_calibrated_on_their_own_inputs(transform, method, maybe_jit):
    make_model, at, depth, layer_inputs = STACKS[transform]
    model, x = make_model(), _inputs(256)
    variables = model.init(jax.random.key(0), x)
    policy = jp.DTypePolicyMap(
        "float32", {"layers": f"{method}/4/16_from_float32", "up|head": "int8_from_float32"}
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no layer of the stack falls back to round-to-nearest
        told = []
        q, report = jp.linen.calibrate(
            model, policy, variables, [x], return_report=True, progress=told.append
        )
    assert told == report  # progress is told each layer of the stack
    layer = lambda tree: functools.reduce(lambda t, k: t[k], at, tree)  # noqa: E731
    kernel = layer(q["params"])["kernel"]
    rtn_policy = jp.DTypePolicyMap(
        "float32", {"layers": "int4/16_from_float32", "up|head": "int8_from_float32"}
    )
    rtn = jp.linen.quantize(model, rtn_policy, variables, x)
    rtn_kernel = layer(rtn["params"])["kernel"]
    # the layout quantize gives a stack: stacked=1, scales [depth, blocks, out]
    assert (kernel.shape, kernel.stacked, kernel.block_size) == ((depth, 32, 32), 1, 16)
    assert kernel.scale.shape == rtn_kernel.scale.shape == (depth, 2, 32)
    assert kernel.values.dtype == jnp.int4
    assert q["params"]["up"]["kernel"].mode == "int8"
    assert layer(q["params"])["bias"].shape == (depth, 32)  # float, stacked
    path = "/".join(at)
    assert [(r.path, r.method) for r in report] == [
        (f"{path}/kernel[{i}]", method) for i in range(depth)
    ]
    for r in report:  # each layer's output error, on its own inputs, below RTN's
        assert r.error < r.rtn_error
    ref.assert_each_layer_solved_alone(
        method,
        kernel,
        rtn_kernel,
        layer(variables["params"])["kernel"],
        layer_inputs(variables["params"], x),
        layer_inputs(variables["params"], _inputs(128, seed=1)),  # held out
    )
    # the calibrated stack serves as a round-to-nearest stack does, as its dequantized
    # kernels (a float stack beside the same int8 layers)
    held = _inputs(128, seed=1)
    got = maybe_jit(jp.linen.apply(model, policy))(q, held)
    floats = {**q["params"], "layers": _dequantized(q["params"]["layers"])}
    int8_only = jp.DTypePolicyMap("float32", {"up|head": "int8_from_float32"})
    want = maybe_jit(jp.linen.apply(model, int8_only))({**q, "params": floats}, held)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-4, atol=2e-4)
    float_out = model.apply(variables, held)
    rel = lambda y: float(jnp.linalg.norm(y - float_out) / jnp.linalg.norm(float_out))  # noqa: E731
    assert rel(got) < rel(maybe_jit(jp.linen.apply(model, rtn_policy))(rtn, held))


def test_a_vmap_stack_with_broadcast_inputs_gives_each_layer_the_same_inputs():
    model, x = VmapMLP(broadcast=True), _inputs(128)
    variables = model.init(jax.random.key(0), x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        q = jp.linen.calibrate(model, {"layers": "gptq/4/16_from_float32"}, variables, [x])
    kernel = q["params"]["layers"]["kernel"]
    (h, _) = _vmap_layer_inputs(variables["params"], x, broadcast=True)
    for i in range(2):  # the same inputs, each layer's own kernel
        want = ref.solve_alone("gptq", variables["params"]["layers"]["kernel"][i], h, 16)
        np.testing.assert_allclose(np.asarray(kernel.scale[i]), np.asarray(want.scale), rtol=1e-5)


class ScanOfEnsembles(nn.Module):
    """An ``nn.scan`` of three ``nn.remat`` blocks, each an ``nn.vmap`` ensemble of two
    Dense layers on the same input (kernels ``[3, 2, in, out]``)."""

    @nn.compact
    def __call__(self, x):
        class Block(nn.Module):
            @nn.compact
            def __call__(self, x, _):
                ensemble = nn.vmap(
                    nn.Dense,
                    variable_axes={"params": 0},
                    split_rngs={"params": True},
                    in_axes=None,
                    axis_size=2,
                )
                return nn.relu(ensemble(32, name="ens")(x)).mean(0), None

        scan = nn.scan(
            nn.remat(Block), variable_axes={"params": 0}, split_rngs={"params": True}, length=3
        )
        return scan(name="layers")(x, None)[0]


def test_vmap_ensembles_in_a_scan_stack_are_each_calibrated_on_their_own_inputs():
    model, x = ScanOfEnsembles(), _inputs(128)
    variables = model.init(jax.random.key(0), x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        q, report = jp.linen.calibrate(
            model, "gptq/4/16_from_float32", variables, [x], return_report=True
        )
    kernel = q["params"]["layers"]["ens"]["kernel"]
    assert (kernel.shape, kernel.stacked, kernel.scale.shape) == ((3, 2, 32, 32), 2, (3, 2, 2, 32))
    assert [r.path for r in report] == [
        f"layers/ens/kernel[{d},{i}]" for d in range(3) for i in range(2)
    ]
    dense, h = variables["params"]["layers"]["ens"], x
    for d in range(3):  # the block's input: the mean of the ensemble before it
        for i in range(2):
            want = ref.solve_alone("gptq", dense["kernel"][d, i], h, 16)
            np.testing.assert_allclose(
                np.asarray(kernel.scale[d, i]), np.asarray(want.scale), rtol=1e-5
            )
        h = jax.nn.relu(
            jnp.einsum("bi,nio->nbo", h, dense["kernel"][d]) + dense["bias"][d][:, None]
        )
        h = h.mean(0)


class Remat(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.remat(nn.Dense)(32, name="dense")(x)


def test_nn_remat_layers_are_calibrated_alone_and_in_a_scan_stack():
    model, x = Remat(), _inputs(128)
    variables = model.init(jax.random.key(0), x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        q = jp.linen.calibrate(model, "gptq/4/16_from_float32", variables, [x])
    dense = variables["params"]["dense"]
    want = ref.solve_alone("gptq", dense["kernel"], x, 16)
    np.testing.assert_allclose(
        np.asarray(q["params"]["dense"]["kernel"].scale), np.asarray(want.scale), rtol=1e-5
    )
    # nn.scan over nn.remat blocks: the same per-layer kernels as without remat
    x = _inputs(256)
    policy = {"layers": "gptq/4/16_from_float32"}
    got = {}
    for remat in (False, True):
        model = ScanMLP(remat=remat)
        variables = model.init(jax.random.key(0), x)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            q, report = jp.linen.calibrate(model, policy, variables, [x], return_report=True)
        assert len(report) == 3
        got[remat] = q["params"]["layers"]["Dense_0"]["kernel"]
    np.testing.assert_array_equal(np.asarray(got[True].values), np.asarray(got[False].values))
    np.testing.assert_allclose(np.asarray(got[True].scale), np.asarray(got[False].scale))


def test_bad_arguments_are_clear_errors():
    model, x = MLP(), _inputs(8)
    variables = model.init(jax.random.key(0), x)
    with pytest.raises(ValueError, match=r"`batches` holds no batch"):
        jp.linen.calibrate(model, MAP, variables, [])
    with pytest.raises(TypeError, match=r"`batches` must be an iterable.*int"):
        jp.linen.calibrate(model, MAP, variables, 3)
    with pytest.raises(ValueError, match=r"no 'params' collection"):
        jp.linen.calibrate(model, MAP, {"stats": {}}, [x])
    with pytest.raises(TypeError, match=r"flax.linen Module"):
        jp.linen.calibrate(object(), MAP, variables, [x])


def test_batches_of_different_shapes_add_up():
    model, x = MLP(), _inputs(96)
    variables = model.init(jax.random.key(0), x)
    policy = jp.DTypePolicyMap("float32", {"up": "gptq/4/16_from_float32"})
    a = jp.linen.calibrate(model, policy, variables, [x[:32], x[32:96].reshape(2, 32, 32)])
    b = jp.linen.calibrate(model, policy, variables, [x])
    np.testing.assert_array_equal(
        np.asarray(a["params"]["up"]["kernel"].values),
        np.asarray(b["params"]["up"]["kernel"].values),
    )


class Attention(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.MultiHeadDotProductAttention(4, name="attn")(x)  # out: [4, 8, 32]


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_attention_output_projection_is_calibrated_over_its_two_input_axes(method, maybe_jit):
    model = Attention()
    x = _inputs(512).reshape(16, 32, 32)
    variables = model.init(jax.random.key(0), x)
    policy = jp.DTypePolicyMap("float32", {"attn": f"{method}/4/2_from_float32"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no layer falls back to round-to-nearest
        q, report = jp.linen.calibrate(model, policy, variables, [x[:8], x[8:]], return_report=True)
    out = q["params"]["attn"]["out"]["kernel"]
    assert out.shape == (4, 8, 32) and out.block_size == 2 and out.scale.shape == (2, 32)
    if method == "awq":
        assert isinstance(out, awq.InputScaledArray) and out.input_scale.shape == (4, 8)
    paths = [r.path for r in report]
    assert "attn/out/kernel" in paths and len(paths) == 4
    for r in report:
        assert r.error < r.rtn_error
    held = _inputs(256, seed=1).reshape(8, 32, 32)
    want = model.apply(variables, held)
    fn = maybe_jit(jp.linen.apply(model, policy))
    got = fn(q, held)
    rtn_policy = jp.DTypePolicyMap("float32", {"attn": "int4/2_from_float32"})
    rtn = jp.linen.quantize(model, rtn_policy, variables, held)
    rtn_got = maybe_jit(jp.linen.apply(model, rtn_policy))(rtn, held)
    rel = lambda y: float(jnp.linalg.norm(y - want) / jnp.linalg.norm(want))  # noqa: E731
    assert rel(got) < rel(rtn_got)
    # per channel, the output projection's int4 kernel reaches its dot as int4 (AWQ: the
    # inputs divided by s over both axes first); int4 blocks of a 3-D kernel dequantize, as
    # round-to-nearest's do
    channel = jp.DTypePolicyMap("float32", {"attn/out": f"{method}/4/-1_from_float32"})
    q1 = jp.linen.calibrate(model, channel, variables, [x])
    jaxpr = jax.make_jaxpr(jp.linen.apply(model, channel))(q1, held)
    assert int4_converts_into_dots(jaxpr.jaxpr) == 1
    # the stored kernel serves as its dequantized estimate: the matmul divides by s itself
    deq = jax.tree.map(
        lambda a: a.dequantize() if isinstance(a, jp.QuantizedArray) else a,
        q,
        is_leaf=lambda a: isinstance(a, jp.QuantizedArray),
    )
    np.testing.assert_allclose(
        np.asarray(got), np.asarray(model.apply(deq, held)), rtol=2e-4, atol=2e-4
    )


def test_clip_search_off_gives_abs_max_scales_and_a_bad_value_is_a_type_error():
    model, x = MLP(), _inputs(256)
    variables = model.init(jax.random.key(0), x)
    policy = jp.DTypePolicyMap("float32", {"mid": "gptq/4/16_from_float32"})
    off = jp.linen.calibrate(model, policy, variables, [x], clip_search=False)
    on = jp.linen.calibrate(model, policy, variables, [x])  # the default: clipped
    p = variables["params"]
    h = nn.relu(x @ p["up"]["kernel"] + p["up"]["bias"])  # mid's inputs
    for q, clip in ((off, False), (on, True)):
        want = ref.solve_alone("gptq", p["mid"]["kernel"], h, 16, clip_search=clip)
        got = q["params"]["mid"]["kernel"]
        np.testing.assert_allclose(np.asarray(got.scale), np.asarray(want.scale), rtol=1e-5)
    assert np.any(
        np.asarray(on["params"]["mid"]["kernel"].scale)
        < np.asarray(off["params"]["mid"]["kernel"].scale)
    )
    with pytest.raises(TypeError, match=r"`clip_search` must be True .* clip_search='yes'"):
        jp.linen.calibrate(model, policy, variables, [x], clip_search="yes")


class ScannedAttention(nn.Module):
    """Two attention blocks under ``nn.remat``, stacked by ``nn.scan`` (a transformer's
    usual layout): out projections ``[2, 4, 8, 32]``."""

    @nn.compact
    def __call__(self, x):
        class Block(nn.Module):
            @nn.compact
            def __call__(self, x, _):
                return x + nn.MultiHeadDotProductAttention(4, name="attn")(x), None

        scan = nn.scan(
            nn.remat(Block), variable_axes={"params": 0}, split_rngs={"params": True}, length=2
        )
        return scan(name="layers")(x, None)[0]


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_a_scanned_rematerialized_attention_stack_is_calibrated_per_layer(method):
    model, x = ScannedAttention(), _inputs(256).reshape(8, 32, 32)
    variables = model.init(jax.random.key(0), x)
    policy = jp.DTypePolicyMap("float32", {"layers": f"{method}/4/2_from_float32"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        q, report = jp.linen.calibrate(model, policy, variables, [x], return_report=True)
    out = q["params"]["layers"]["attn"]["out"]["kernel"]
    assert (out.shape, out.stacked, out.scale.shape) == ((2, 4, 8, 32), 1, (2, 2, 32))
    if method == "awq":
        assert out.input_scale.shape == (2, 4, 8)
    assert len(report) == 8 and all(r.error < r.rtn_error for r in report)
    assert "layers/attn/out/kernel[1]" in [r.path for r in report]
    held = _inputs(128, seed=1).reshape(4, 32, 32)
    want = model.apply(variables, held)
    rtn_policy = jp.DTypePolicyMap("float32", {"layers": "int4/2_from_float32"})
    rtn = jp.linen.quantize(model, rtn_policy, variables, held)
    rel = lambda y: float(jnp.linalg.norm(y - want) / jnp.linalg.norm(want))  # noqa: E731
    got = jax.jit(jp.linen.apply(model, policy))(q, held)
    assert rel(got) < rel(jp.linen.apply(model, rtn_policy)(rtn, held))


def _kernels_of(tree):
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=jp.QuantizedArray.__instancecheck__)
    return {jax.tree_util.keystr(kp): leaf for kp, leaf in leaves[0]}


@pytest.mark.parametrize("model_class", [MLP, ScanMLP])
def test_a_bound_on_the_statistics_bytes_gathers_layers_in_groups_to_the_same_result(
    model_class, monkeypatch
):
    # max_statistics_bytes=1: every layer (a stack as one) gathered in a pass of its own,
    # its statistics moved to the host before the next; the kernels are the same.
    model, x = model_class(), _inputs(256)
    variables = model.init(jax.random.key(0), x)
    policies = {"up|mid|layers": "gptq/4/16_from_float32", "head": "awq/4/16_from_float32"}
    batches = [x[:128], x[128:]]
    q, report = jp.linen.calibrate(model, policies, variables, batches, return_report=True)
    groups = []
    grouping = calibration_gather._groups
    monkeypatch.setattr(
        calibration_gather, "_groups", lambda *a: groups.append(grouping(*a)) or groups[-1]
    )
    grouped, grouped_report = jp.linen.calibrate(
        model, policies, variables, batches, return_report=True, max_statistics_bytes=1
    )
    layers = ["up", "mid", "head"] if model_class is MLP else ["up", "layers/Dense_0", "head"]
    assert len(groups) == 1 and sorted(groups[0]) == sorted([p] for p in layers)  # one each
    assert [r.path for r in grouped_report] == [r.path for r in report]
    want, got = _kernels_of(q), _kernels_of(grouped)
    assert want.keys() == got.keys()
    for key, leaf in want.items():
        if isinstance(leaf, jp.QuantizedArray):
            np.testing.assert_array_equal(got[key].dequantize(), leaf.dequantize(), err_msg=key)
    # a bound every layer fits in: one pass, the same again
    roomy = jp.linen.calibrate(model, policies, variables, batches, max_statistics_bytes=2**30)
    for key, leaf in _kernels_of(roomy).items():
        if isinstance(leaf, jp.QuantizedArray):
            np.testing.assert_array_equal(leaf.dequantize(), want[key].dequantize())


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        (0, ValueError, r"`max_statistics_bytes` must be a positive integer or None.*=0$"),
        (1.5, TypeError, r"`max_statistics_bytes` must be .*Received: .*1.5"),
        ("1G", TypeError, r"`max_statistics_bytes` must be .*'1G'"),
    ],
)
def test_a_bad_bound_on_the_statistics_bytes_is_refused_before_any_run(value, error, match):
    model, x = MLP(), _inputs(16)
    variables = model.init(jax.random.key(0), x)
    with pytest.raises(error, match=match):
        jp.linen.calibrate(model, MAP, variables, [x], max_statistics_bytes=value)
