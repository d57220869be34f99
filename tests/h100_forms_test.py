"""The library's 8-bit programs reach their native forms on an H100 (issue #28), checked
without a GPU: each program is compiled for an H100 on the CPU (the CUDA PJRT plugin's
compile-only devices, ``benchmarks/h100_compile.py``) and XLA's optimized HLO is read.

Per program (``benchmarks/h100_forms.py``): every float8 matmul of a training step (forward
and both gradients; two where the input needs no gradient) has float8 operands with XLA's
default flags and is a cuBLASLt fp8 GEMM with Triton GEMMs off; int8/int4 serving weights
enter their GEMM fusion as s8/s4, with no copy of the weights in a float type; int8 x int8 is
s8 x s8 -> s32; the int8 QAT step and the bf16 control run bf16 GEMMs and no fp8 one. The
check fails on forms that must fail. Nothing here says how fast any of it runs.

The plugin is a test requirement that the test installs itself, so that the README's test
command passes on a fresh clone: at jaxlib's exact version, with ``pip install --no-deps
--target .cuda-plugin/<jaxlib version>`` (about 480 MB, once per jaxlib; two environments of
different JAX keep theirs apart). Installed in the environment, the plugin would make every
process that imports jax print CUDA-driver lines on stderr, so only the one subprocess that
compiles everything (this file run as a script; its JSON shared by the xdist workers) puts that
folder on its path: the rest of the suite runs as before. Where the install fails (no network),
the tests fail with the command to run, never skip.
"""

from __future__ import annotations

import collections
import json
import os
import pathlib
import re
import subprocess
import sys
import traceback

import jax
import jax.numpy as jnp
import jaxlib
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import h100_compile as hc  # noqa: E402
import h100_forms  # noqa: E402

PLUGIN_DIR = ROOT / ".cuda-plugin" / jaxlib.__version__  # where the fixture installs it
PROGRAMS = {p.name: p for p in h100_forms.programs()}
E4M3, E5M2 = "f8e4m3fn", "f8e5m2"


def _names(group):
    return [name for name, p in PROGRAMS.items() if p.group == group]


# -- forms that must fail ----------------------------------------------------------------------


def _qdq_step():
    """float8 by quantize-dequantize in bf16 (the form that ran no fp8 GEMM on an H100): the
    product of ``convert(convert(x, e4m3), bf16) / scale`` operands, and its gradients."""

    def qdq(t):
        scale = 448.0 / jnp.max(jnp.abs(t)).astype(jnp.float32)
        q = (t.astype(jnp.float32) * scale).astype(jnp.float8_e4m3fn)
        return q.astype(jnp.bfloat16) / scale.astype(jnp.bfloat16)

    def loss(w, x):
        return jnp.sum(jnp.dot(qdq(x), qdq(w)).astype(jnp.float32))

    shape = jax.ShapeDtypeStruct((2048, 2048), jnp.bfloat16)
    return jax.value_and_grad(loss, argnums=(0, 1)), hc.on_h100((shape, shape))


def _dequantize_then_dot():
    """Serving by dequantizing the int8 weights, then a bf16 matmul (measured slow)."""

    def serve(x, w, s):
        return x @ (w.astype(jnp.float32) * s).astype(jnp.bfloat16)

    d = 4096
    args = (
        jax.ShapeDtypeStruct((16, d), jnp.bfloat16),
        jax.ShapeDtypeStruct((d, d), jnp.int8),
        jax.ShapeDtypeStruct((d,), jnp.float32),
    )
    return serve, hc.on_h100(args)


MUST_FAIL = {
    "qdq float8 in bf16": h100_forms.Program("qdq float8 in bf16", "float8", _qdq_step, 3),
    "dequantize then dot": h100_forms.Program(
        "dequantize then dot", "serving", _dequantize_then_dot, 1, "s8", 4096 * 4096
    ),
}


# -- one subprocess compiles everything ------------------------------------------------------


def _modes(program):
    """Serving is asserted with XLA's default flags only (cuBLAS cannot read s8/s4)."""
    return ("default",) if program.group.startswith("serving") else tuple(hc.MODES)


def compile_everything(path):
    """Compiles every program and form that must fail for an H100 (both modes where the
    tests read both) and writes what XLA made to ``path`` as JSON."""
    out = {"plugin_problem": hc.plugin_problem(), "forms": {}, "errors": {}}
    if out["plugin_problem"] is None:
        device = hc.h100_sharding().mesh.devices.flat[0]
        out["device"] = [device.device_kind, device.client.runtime_type, jax.default_backend()]
        for name, program in {**PROGRAMS, **MUST_FAIL}.items():
            if program.group == "serving pallas" and not h100_forms.pallas_lowers():
                continue  # its test skips, naming jax's limitation
            try:
                found = h100_forms.forms(program, _modes(program))
                out["forms"][name] = {m: f.to_json() for m, f in found.items()}
            except Exception:  # that program's tests fail with it; the others still run
                out["errors"][name] = traceback.format_exc()
        for key, measure in (("layouts", _serving_layouts), ("diagnose", _diagnose_kernels)):
            try:
                out[key] = measure()
            except Exception:
                out["errors"][key] = traceback.format_exc()
    path.write_text(json.dumps(out))


def _kernels(hlo):
    """The kernels of the entry computation: fusions, custom calls and copies."""
    entry = hlo[hlo.index("ENTRY") :]
    body = entry[: entry.index("\n}\n")] if "\n}\n" in entry else entry
    return collections.Counter(re.findall(r"= [^ ]+ (fusion|custom-call|copy)\(", body))


def _diagnose_kernels():
    """Kernels of diagnostics_bench's training step (2 layers, d=256) compiled for an H100:
    with ``apply``, and with ``diagnose`` (its report returned), and the tapped tensors."""
    import diagnostics_bench as db

    import jmp_policy as jp

    model = db.Transformer(2, 256, 4)
    x = jnp.zeros((8, 128, 256), jnp.float32)
    params = jax.eval_shape(model.init, jax.random.key(1), x)["params"]
    plain = jp.linen.apply(model, "mixed_float16")
    diag = jp.linen.diagnose(model, "mixed_float16")
    probe = jax.eval_shape(lambda p, x: diag.probe({"params": p}, x), params, x)

    def apply_step(p, q, x):
        return jax.value_and_grad(lambda p: db._loss(plain({"params": p}, x)))(p)

    def diagnose_step(p, q, x):
        def loss(p, q):
            out, report = diag({"params": p}, x, probe=q)
            return db._loss(out), report

        grad = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)
        (value, report), (grads, probe_grad) = grad(p, q)
        return value, grads, report.with_gradients(probe_grad)

    args = hc.on_h100((params, probe, x))
    found = {
        n: _kernels(hc.compile_for_h100(f, args))
        for n, f in (("apply", apply_step), ("diagnose", diagnose_step))
    }
    return {"kernels": found, "tapped": 3 * len(probe)}


def _serving_layouts():
    """int8 x int8 serving (256 rows) compiled as ``jax.jit`` does and as
    ``jp.compile_for_serving`` does: the first kernel's layout, the transposes and GEMMs."""
    from jmp_policy._src.serving_layouts import serving_lowering

    fn, args = h100_forms.serving("int8_from_float32", "int8_from_mixed_bfloat16", 256)()
    found = {}
    for way, lowered in (
        ("jit", jax.jit(fn).lower(*args)),
        ("compile_for_serving", serving_lowering(fn, *args)),
    ):
        compiled = lowered.compile()
        hlo = compiled.as_text()
        kernel = compiled.input_formats[0][0]["params"]["layer_0"]["kernel"].values
        found[way] = {
            "layout": list(kernel.layout.major_to_minor),
            "transposes": hlo.count(" transpose("),
            "gemms": [g.describe() for g in hc.gemms(hlo)],
        }
    return found


def _install_plugin():
    """Installs the plugin at jaxlib's version into :data:`PLUGIN_DIR` unless it is there;
    returns why that failed (``None``: it is there)."""
    marker = PLUGIN_DIR / ".installed"
    if marker.exists():
        return None
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    command += ["--no-deps", "--upgrade", "--target", str(PLUGIN_DIR)]
    command += [f"{name}=={jaxlib.__version__}" for name in hc.PLUGINS]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        return f"Installing the CUDA plugin failed ({' '.join(command)}):\n{result.stderr[-3000:]}"
    marker.write_text(jaxlib.__version__)
    return None


def _subprocess_env():
    paths = [str(PLUGIN_DIR)] if PLUGIN_DIR.is_dir() else []
    paths += [str(ROOT), os.environ.get("PYTHONPATH", "")]
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    return {**env, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}  # compiled afresh


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """What the subprocess wrote: once per session, whichever xdist worker comes first (its
    failure is each test's, through :func:`_forms`: the tests fail, not error)."""
    import fcntl

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the session's folder, shared by its workers
    path = root / "h100_forms.json"
    with open(root / "h100_forms.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.exists():
            problem = _install_plugin()
            if problem:
                return {"failure": problem}
            result = subprocess.run(
                [sys.executable, __file__, str(path)],
                capture_output=True,
                text=True,
                cwd=ROOT,
                env=_subprocess_env(),
            )
            if result.returncode != 0:
                return {"failure": "Compiling for an H100 failed:\n" + result.stderr[-5000:]}
    return json.loads(path.read_text())


def _usable(compiled):
    """Fails the test (never skips it) when nothing could be compiled."""
    if "failure" in compiled:
        pytest.fail(compiled["failure"])
    if compiled["plugin_problem"]:
        pytest.fail(
            f"{compiled['plugin_problem']} (this test installs it with `pip install --no-deps "
            f"--target {PLUGIN_DIR.relative_to(ROOT)}`, which only its subprocess sees)"
        )


def _forms(compiled, name):
    """``{mode: Forms}`` of a program."""
    _usable(compiled)
    if name in compiled["errors"]:
        pytest.fail(f"{name} did not compile for an H100:\n{compiled['errors'][name]}")
    return {m: h100_forms.Forms.from_json(f) for m, f in compiled["forms"][name].items()}


# -- the plugin --------------------------------------------------------------------------------


@pytest.mark.heavy(50)
def test_the_cuda_plugin_compiles_for_an_h100_at_jaxlibs_version(compiled):
    _usable(compiled)
    assert compiled["device"] == ["NVIDIA H100 80GB HBM3", "compile_only_runtime", "cpu"]


def test_a_missing_or_mismatched_plugin_names_the_versions_to_install(monkeypatch):
    def version(name):
        if name == "jax-cuda12-pjrt":
            raise hc.importlib.metadata.PackageNotFoundError(name)
        return "0.0.1"

    monkeypatch.setattr(hc.importlib.metadata, "version", version)
    problem = hc.plugin_problem()
    v = jaxlib.__version__
    assert problem == (
        f"Compiling for an H100 needs the CUDA PJRT plugin at jaxlib's version {v} (found "
        f"jax-cuda12-plugin 0.0.1, jax-cuda12-pjrt not installed): "
        f"pip install jax-cuda12-plugin=={v} jax-cuda12-pjrt=={v}"
    )


def test_the_script_prints_its_help_without_compiling():
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "h100_forms.py"), "--help"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("usage: h100_forms.py")
    assert "--only" in result.stdout and "--hlo" in result.stdout


def test_an_unknown_mode_is_a_value_error():
    with pytest.raises(ValueError, match=r"`mode` must be one of \['cublas', 'default'\], got 'x'"):
        hc.compile_for_h100(lambda x: x, (), "x")


# -- float8 training steps ---------------------------------------------------------------------


@pytest.mark.parametrize("name", _names("float8"))
def test_every_float8_matmul_of_a_training_step_is_a_native_fp8_gemm(compiled, name):
    """Two float8 layers: 2 forwards e4m3 x e4m3, 3 gradients e5m2 with the saved e4m3
    operand (the first layer's input needs none): Triton dots of float8 operands by default,
    cuBLASLt fp8 GEMMs with Triton GEMMs off, all with bf16 results."""
    for mode, found in _forms(compiled, name).items():
        operands = sorted(tuple(sorted((g.lhs, g.rhs))) for g in found.gemms)
        assert operands == [(E4M3, E4M3)] * 2 + [(E4M3, E5M2)] * 3, (mode, found.describe())
        targets = {g.target for g in found.gemms}
        assert targets == ({"dot"} if mode == "default" else {hc.FP8_GEMM}), mode
        assert {g.result for g in found.gemms} == {"bf16"}
        assert all(g.is_fp8 for g in found.gemms)
        assert h100_forms.problems(PROGRAMS[name], mode, found) == []


def test_the_table_row_says_what_xla_made_in_both_modes(compiled):
    name = "f8 delayed linen Dense"
    row = h100_forms.row(PROGRAMS[name], _forms(compiled, name))
    assert row == [
        name,
        "2x e4m3 x e4m3 -> bf16, 2x e4m3 x e5m2 -> bf16, 1x e5m2 x e4m3 -> bf16",
        "native",
        "2x lt$matmul$f8 e4m3 x e4m3 -> bf16, 2x lt$matmul$f8 e4m3 x e5m2 -> bf16, "
        "1x lt$matmul$f8 e5m2 x e4m3 -> bf16",
        "native",
    ]


def test_int8_qat_step_runs_bf16_gemms_and_no_int8_or_fp8_one(compiled):
    """Quantization-aware training multiplies integer values in bf16 (an int8 GEMM made
    inside the step is slow on an H100): 5 bf16 GEMMs, forwards and gradients."""
    (name,) = _names("int8 QAT")
    for mode, found in _forms(compiled, name).items():
        assert len(found.gemms) == 5, (mode, found.describe())
        assert {(g.lhs, g.rhs) for g in found.gemms} == {("bf16", "bf16")}, mode
        assert not any(g.is_fp8 or g.is_int8 for g in found.gemms)
        assert h100_forms.problems(PROGRAMS[name], mode, found) == []


def test_the_bf16_control_has_bf16_gemms_and_no_fp8_one(compiled):
    (name,) = _names("control")
    for mode, found in _forms(compiled, name).items():
        assert len(found.gemms) == 5, (mode, found.describe())
        assert {(g.lhs, g.rhs, g.result) for g in found.gemms} == {("bf16", "bf16", "bf16")}
        assert not any(g.is_fp8 for g in found.gemms)
        assert h100_forms.problems(PROGRAMS[name], mode, found) == []


# -- serving -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", _names("serving"))
def test_int8_and_int4_weights_enter_their_gemm_fusion_as_s8_or_s4(compiled, name):
    """Weight-only serving (XLA's default flags, which keep Triton GEMM fusions): each layer's
    GEMM converts its s8/s4 weights inside the fusion; nothing copies them to a float type
    (with Triton GEMMs off cuBLAS cannot read them: a real H100 has to pick Triton)."""
    program = PROGRAMS[name]
    found = _forms(compiled, name)["default"]
    assert len(found.gemms) == 2, found.describe()
    assert [g.reads_int_weights for g in found.gemms] == [program.weights] * 2, found.describe()
    assert [w for w in found.weight_reads if w.is_copy] == []
    assert h100_forms.problems(program, "default", found) == []


@pytest.mark.parametrize("name", _names("serving pallas"))
def test_serving_pallas_runs_one_pallas_kernel_per_layer_reading_the_weights_in_place(
    request, name
):
    """``serving_kernel="pallas"`` at batch 1 and 16: each layer is one Pallas (Triton)
    kernel, ``__gpu$xla.gpu.triton``, whose operand is the s8 parameter or a bitcast of the
    s4 one (no copy), and no GEMM or other kernel reads or copies the integer weights."""
    if not h100_forms.pallas_lowers():
        pytest.skip(
            f"jax {jax.__version__} cannot lower a Pallas kernel for a GPU it does not have "
            "(its Pallas reads the default device; jax >= 0.11 reads the abstract mesh's)"
        )
    program = PROGRAMS[name]
    (found,) = _forms(request.getfixturevalue("compiled"), name).values()  # after the skip
    assert found.triton == [program.weights] * h100_forms.SERVE_LAYERS, found.describe()
    assert [g for g in found.gemms if g.reads_int_weights] == [], found.describe()
    assert [w for w in found.weight_reads if w.is_copy] == []
    assert h100_forms.problems(program, "default", found) == []


def test_the_pallas_check_fails_on_xlas_form():
    """A program of XLA's weight-only form fails the Pallas check (it has no Pallas kernel)."""
    gemm = hc.Gemm("fused", "dot", "bf16", "bf16", "f32", "bf16", "s8")
    found = h100_forms.Forms([gemm] * 2, [])
    program = PROGRAMS["serve int8 weights, pallas, batch 1"]
    assert h100_forms.problems(program, "default", found) == [
        "expected 2 Pallas kernels reading their s8 weights in place: 2x bf16 x s8->bf16 -> f32",
        "a GEMM reads the integer weights: 2x bf16 x s8->bf16 -> f32",
    ]


def test_int8_x_int8_is_an_s8_x_s8_to_s32_gemm_in_both_modes(compiled):
    (name,) = _names("int8 x int8")
    for mode, found in _forms(compiled, name).items():
        assert len(found.gemms) == 2, (mode, found.describe())
        assert all(g.is_int8 for g in found.gemms), (mode, found.describe())
        targets = {g.target for g in found.gemms}
        assert targets == ({"dot"} if mode == "default" else {"__cublas$lt$matmul"}), mode
        assert h100_forms.problems(PROGRAMS[name], mode, found) == []


def test_compile_for_serving_lets_xla_store_int8_kernels_for_the_s8_gemm(compiled):
    """Under ``jax.jit`` an ``[in, out]`` s8 kernel is transposed at every call for the
    s8 x s8 GEMM; with ``jp.compile_for_serving`` XLA stores it ``[out, in]`` (layout
    ``(1, 0)``) and no transpose is left (the layout measured 2.1x faster on an H200)."""
    _usable(compiled)
    if "layouts" in compiled["errors"]:
        pytest.fail(compiled["errors"]["layouts"])
    found = compiled["layouts"]
    layers = h100_forms.SERVE_LAYERS
    assert found["jit"]["layout"] == [0, 1]
    assert found["jit"]["transposes"] == layers
    assert found["compile_for_serving"]["layout"] == [1, 0]
    assert found["compile_for_serving"]["transposes"] == 0
    for way in found.values():
        assert way["gemms"] == ["s8 x s8 -> s32"] * layers, way


def test_a_diagnosed_step_adds_fewer_kernels_than_it_taps_tensors(compiled):
    """The report is packed (two arrays per direction): the diagnosed step adds its
    statistics' reductions, not a kernel per scalar statistic and no scalar copies (before
    packing: 3.4 added kernels per tapped tensor, most of them s32 scalar copies)."""
    _usable(compiled)
    if "diagnose" in compiled["errors"]:
        pytest.fail(compiled["errors"]["diagnose"])
    found = compiled["diagnose"]
    apply, diagnose = (sum(found["kernels"][k].values()) for k in ("apply", "diagnose"))
    assert found["kernels"]["diagnose"].get("copy", 0) == 0, found
    assert apply < diagnose < apply + found["tapped"], found


# -- the check fails on forms that must fail --------------------------------------------------


def test_the_float8_check_fails_on_quantize_dequantize_in_bf16(compiled):
    name = "qdq float8 in bf16"
    found = _forms(compiled, name)
    problems = h100_forms.problems(MUST_FAIL[name], "default", found["default"])
    assert len(problems) == 3, problems  # the forward and both gradients
    assert all(p.startswith("not on float8 operands: bf16 x bf16 -> bf16 (in ") for p in problems)
    # With Triton GEMMs off the rewriter makes the forward an fp8 GEMM (a known overstatement:
    # on an H100 Triton won and no fp8 GEMM ran), not the gradients: the check still fails.
    fp8 = collections.Counter(g.is_fp8 for g in found["cublas"].gemms)
    assert fp8 == {True: 1, False: 2}
    assert len(h100_forms.problems(MUST_FAIL[name], "cublas", found["cublas"])) == 2


def test_the_serving_check_fails_on_dequantize_then_dot(compiled):
    name = "dequantize then dot"
    found = _forms(compiled, name)["default"]
    assert [w.describe() for w in found.weight_reads] == ["s8 copy -> bf16[4096,4096]"]
    problems = h100_forms.problems(MUST_FAIL[name], "default", found)
    assert len(problems) == 2, problems
    assert problems[0].startswith("a copy of the weights: s8 copy -> bf16[4096,4096]")
    assert problems[1] == (
        "0 of 1 layers read their s8 weights inside a GEMM or reduction: "
        "1x bf16 x bf16 -> f32, 1x s8 copy -> bf16[4096,4096]"
    )


# -- the HLO reader, on HLO written by hand ----------------------------------------------------

NESTED = """\
HloModule nested

%rhs_computation (p: s8[64,32]) -> bf16[64,32] {
  %p = s8[64,32]{1,0} parameter(0)
  ROOT %c = bf16[64,32]{1,0} convert(%p)
}

%gemm_fusion_dot_computation (parameter_0: bf16[16,64], parameter_1: s8[64,32]) -> f32[16,32] {
  %parameter_0 = bf16[16,64]{1,0} parameter(0)
  %parameter_1 = s8[64,32]{1,0} parameter(1)
  %rhs = bf16[64,32]{1,0} fusion(%parameter_1), kind=kCustom, calls=%rhs_computation
  ROOT %dot = f32[16,32]{1,0} dot(%parameter_0, %rhs), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (x: bf16[16,64], w: s8[64,32]) -> f32[16,32] {
  %x = bf16[16,64]{1,0} parameter(0)
  %w = s8[64,32]{1,0} parameter(1)
  ROOT %gemm_fusion_dot = f32[16,32]{1,0} fusion(%x, %w), kind=kCustom, calls=%gemm_fusion_dot_computation
}
"""

COPIED = """\
HloModule copied

%fused_convert (param_0: s4[64,32]) -> bf16[64,32] {
  %param_0 = s4[64,32]{1,0:E(4)} parameter(0)
  ROOT %convert = bf16[64,32]{1,0} convert(%param_0)
}

ENTRY %main (x: bf16[16,64], w: s4[64,32]) -> f32[16,32] {
  %x = bf16[16,64]{1,0} parameter(0)
  %w = s4[64,32]{1,0:E(4)} parameter(1)
  %copy = bf16[64,32]{1,0} fusion(%w), kind=kLoop, calls=%fused_convert
  %cc = (f32[16,32]{1,0}, s8[1024]{0}) custom-call(%x, %copy), custom_call_target="__cublas$lt$matmul"
  ROOT %gte = f32[16,32]{1,0} get-tuple-element(%cc), index=0
}
"""


def test_the_reader_follows_weights_into_a_nested_gemm_fusion():
    """An operand fusion nested in the GEMM's fusion (XLA's nested Triton GEMM fusions) that
    converts the s8 weights: the GEMM reads them as s8."""
    (gemm,) = hc.gemms(NESTED)
    assert (gemm.target, gemm.lhs, gemm.rhs, gemm.result) == ("dot", "bf16", "bf16", "f32")
    assert (gemm.lhs_read, gemm.rhs_read, gemm.reads_int_weights) == ("bf16", "s8", "s8")
    assert gemm.describe() == "bf16 x s8->bf16 -> f32"
    assert hc.weight_reads(NESTED, 64 * 32) == []


def test_the_reader_sees_a_float_copy_of_the_weights_before_a_cublas_gemm():
    (gemm,) = hc.gemms(COPIED)
    assert gemm.target == "__cublas$lt$matmul"
    assert (gemm.lhs, gemm.rhs, gemm.result, gemm.rhs_read) == ("bf16", "bf16", "f32", "bf16")
    assert gemm.reads_int_weights is None  # a separate kernel converted them
    (copy,) = hc.weight_reads(COPIED, 64 * 32)
    assert (copy.name, copy.is_copy, copy.describe()) == ("copy", True, "s4 copy -> bf16[64,32]")
    assert hc.weight_reads(COPIED, 64 * 32 + 1) == []  # smaller than the weights asked about


if __name__ == "__main__":  # the subprocess of the `compiled` fixture
    compile_everything(pathlib.Path(sys.argv[1]))
