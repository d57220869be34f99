"""The library's programs reach their forms on Cloud TPUs (issue #53), checked without a TPU:
each program is compiled for one chip of a TPU v5e, v5p or v6e topology on the CPU (libtpu's
compile-only devices, ``benchmarks/tpu_compile.py``) and XLA's optimized HLO is read.

Per program (``benchmarks/tpu_forms.py``): the bf16 steps multiply bf16 by bf16; every matmul
of a float8 step is on float8 operands; int8/int4 serving weights (AWQ's too) are an operand
of their matmul (the TPU's convolution multiplies bf16 by s8/s4), with no float copy of
them; int8 x int8 is s8 x s8 -> s32. Which formats have a matmul mode of their own per generation comes
from the compiler's cost estimates (int8 x int8 about half bf16's cycles on v5e and v5p;
float8 about bf16's everywhere: no float8 mode). The checks fail on forms that must fail.
Nothing here says how fast any of it runs.

libtpu is a test requirement that the test installs itself at the version jax's ``tpu``
extra pins (``pip install --no-deps --target .libtpu/<version>``, about 600 MB, once per
version): only the subprocess that compiles everything puts it on its path, so the rest of the
suite never loads it. Where the install fails (no network) the tests fail, never skip.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import tpu_compile as tc  # noqa: E402
import tpu_forms  # noqa: E402

LIBTPU_DIR = ROOT / ".libtpu" / tc.libtpu_pin()
PROGRAMS = {p.name: p for p in tpu_forms.programs()}
# The HLO is the same on each generation: every program for v5e, a few for v6e.
ON_V6E = ("f8 current linen Dense step", "serve int8 weights, batch 16")
ON_V6E += ("serve int4 weights, batch 1", "serve int8 x int8, batch 256")
GENERATIONS = {"v5e:2x2": "TPU v5 lite", "v5p:2x2x1": "TPU v5", "v6e:2x2": "TPU v6 lite"}


def _dequantize_then_dot():
    """Serving by dequantizing the int8 weights to bf16 in float32, then a bf16 matmul."""

    def serve(x, w, s):
        return x @ (w.astype(jnp.float32) * s).astype(jnp.bfloat16)

    d = tpu_forms.SERVE_DIM
    args = (
        jax.ShapeDtypeStruct((16, d), jnp.bfloat16),
        jax.ShapeDtypeStruct((d, d), jnp.int8),
        jax.ShapeDtypeStruct((d,), jnp.float32),
    )
    return serve, tpu_forms.hc.on_h100(args)


def _bf16_dot():
    """A plain bf16 matmul: the form an int8 x int8 or float8 check must refuse."""
    shape = jax.ShapeDtypeStruct((256, tpu_forms.SERVE_DIM), jnp.bfloat16)
    return lambda a, b: a @ b.T, tpu_forms.hc.on_h100((shape, shape))


MUST_FAIL = {
    "dequantize then dot": tpu_forms.Program(
        "dequantize then dot", "serving", _dequantize_then_dot, 1, "s8", tpu_forms.SERVE_DIM**2
    ),
    "bf16 as int8 x int8": tpu_forms.Program("bf16 as int8 x int8", "int8 x int8", _bf16_dot, 1),
    "bf16 as float8": tpu_forms.Program("bf16 as float8", "float8", _bf16_dot, 1),
}


# -- one subprocess compiles everything ------------------------------------------------------


def compile_everything(path):
    """Compiles the programs for each generation and writes what XLA made to ``path``."""
    out = {"problem": tc.libtpu_problem(), "forms": {}, "errors": {}, "modes": {}, "kinds": {}}
    out["seconds"] = {}
    if out["problem"] is None:
        for topology in GENERATIONS:
            out["kinds"][topology] = tc.device_kind(topology)
            out["modes"][topology] = tc.matmul_modes(topology)
        todo = [("v5e:2x2", n) for n in {**PROGRAMS, **MUST_FAIL}]
        for topology, name in todo + [("v6e:2x2", n) for n in ON_V6E]:
            key, start = f"{topology} {name}", time.perf_counter()
            try:
                program = PROGRAMS.get(name) or MUST_FAIL[name]
                out["forms"][key] = tpu_forms.forms(program, topology).to_json()
            except Exception:  # that program's tests fail with it; the others still run
                out["errors"][key] = traceback.format_exc()
            out["seconds"][key] = round(time.perf_counter() - start, 1)
    path.write_text(json.dumps(out))


def _install_libtpu():
    """Installs libtpu at jax's pin into :data:`LIBTPU_DIR` unless it is there; returns why
    that failed (``None``: it is there)."""
    marker = LIBTPU_DIR / ".installed"
    if marker.exists():
        return None
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    command += [
        "--no-deps",
        "--upgrade",
        "--target",
        str(LIBTPU_DIR),
        f"libtpu=={tc.libtpu_pin()}.*",
    ]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        return f"Installing libtpu failed ({' '.join(command)}):\n{result.stderr[-3000:]}"
    marker.write_text(tc.libtpu_pin())
    return None


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """What the subprocess wrote: once per session, whichever xdist worker comes first."""
    import fcntl

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the session's folder, shared by its workers
    path = root / "tpu_forms.json"
    with open(root / "tpu_forms.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.exists():
            problem = _install_libtpu()
            if problem:
                return {"failure": problem}
            paths = [str(LIBTPU_DIR), str(ROOT), os.environ.get("PYTHONPATH", "")]
            env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION")}
            env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
            result = subprocess.run(
                [sys.executable, __file__, str(path)],
                capture_output=True,
                text=True,
                cwd=ROOT,
                env=env,
            )
            if result.returncode != 0:
                return {"failure": "Compiling for a TPU failed:\n" + result.stderr[-5000:]}
    return json.loads(path.read_text())


def _usable(compiled):
    """Fails the test (never skips it) when nothing could be compiled."""
    if "failure" in compiled:
        pytest.fail(compiled["failure"])
    if compiled["problem"]:
        pytest.fail(f"{compiled['problem']} (this test installs it into {LIBTPU_DIR})")


def _forms(compiled, name, topology="v5e:2x2"):
    _usable(compiled)
    key = f"{topology} {name}"
    if key in compiled["errors"]:
        pytest.fail(f"{name} did not compile for {topology}:\n{compiled['errors'][key]}")
    return tpu_forms.Forms.from_json(compiled["forms"][key])


def _programs(*groups):
    return [n for n, p in PROGRAMS.items() if p.group in groups]


# -- libtpu and the generations ----------------------------------------------------------------


@pytest.mark.heavy(120)
def test_libtpu_at_jaxs_pin_compiles_for_each_generation(compiled):
    _usable(compiled)
    assert compiled["kinds"] == GENERATIONS


def test_int8_x_int8_has_its_own_mode_on_v5e_v5p_and_v6e_and_float8_none(compiled):
    """The cost model's cycles over bf16's for one 4096-cubed matmul: int8 x int8 at most
    0.85x (0.50x on v5e and v5p, 0.76x on v6e); float8 at least bf16's (no float8 mode: its
    operands go through a bf16 pass)."""
    _usable(compiled)
    for topology, modes in compiled["modes"].items():
        assert modes["int8 x int8"] <= tc.NATIVE_RATIO, (topology, modes)
        assert modes["float8"] >= 1.0, (topology, modes)


def test_the_library_knows_which_generations_have_no_float8_mode(compiled):
    """The library's table of TPU generations without a float8 matmul mode (its warning)
    holds each generation the compiled programs show without one."""
    from jmp_policy._src.quantization import matmuls

    _usable(compiled)
    without = {
        compiled["kinds"][t] for t, m in compiled["modes"].items() if m["float8"] > tc.NATIVE_RATIO
    }
    assert without <= set(matmuls.TPU_WITHOUT_FLOAT8), without


# -- the library's programs ----------------------------------------------------------------------


@pytest.mark.parametrize("name", _programs("bf16 step"))
def test_mixed_bfloat16_steps_multiply_bf16_by_bf16(compiled, name):
    found = _forms(compiled, name)
    assert len(found.matmuls) == 5, found.describe()
    assert {(m.lhs, m.rhs, m.result) for m in found.matmuls} == {("bf16", "bf16", "bf16")}
    # the f32 parameters are cast to bf16 inside the matmuls' fusions, not by a kernel of their own
    assert {m.lhs_read for m in found.matmuls} | {m.rhs_read for m in found.matmuls} == {
        "f32",
        "bf16",
    }
    assert tpu_forms.problems(PROGRAMS[name], found) == []


@pytest.mark.parametrize("name", _programs("float8"))
def test_every_matmul_of_a_float8_step_is_on_float8_operands(compiled, name):
    """2 forwards e4m3 x e4m3, 3 gradients with one e5m2 operand; no generation here has a
    float8 mode, so the table says so rather than native."""
    found = _forms(compiled, name)
    operands = sorted(tuple(sorted((m.lhs, m.rhs))) for m in found.matmuls)
    assert operands == [("f8e4m3fn", "f8e4m3fn")] * 2 + [("f8e4m3fn", "f8e5m2")] * 3
    assert tpu_forms.problems(PROGRAMS[name], found) == []
    verdict = tpu_forms.native(PROGRAMS[name], found, compiled["modes"]["v5e:2x2"])
    assert verdict.startswith("no float8 mode ("), verdict


@pytest.mark.parametrize("name", _programs("serving"))
def test_int8_and_int4_weights_are_an_operand_of_their_matmul(compiled, name):
    """Each layer's convolution multiplies bf16 activations by its s8/s4 weights; nothing
    copies the weights to a float type."""
    program = PROGRAMS[name]
    found = _forms(compiled, name)
    assert len(found.matmuls) == 2, found.describe()
    assert [m.reads_int_weights for m in found.matmuls] == [program.weights] * 2
    assert found.float_copies == []
    assert tpu_forms.problems(program, found) == []


def test_int4_blocks_from_64_rows_are_dequantized_then_one_bf16_matmul(compiled):
    """jax 0.12 (libtpu 0.0.50) writes one bf16 copy of each layer's weights; jax 0.10.2
    (libtpu 0.0.42) dequantizes them inside the matmul's fusion. Both: bf16 x bf16."""
    (name,) = _programs("serving dequantized")
    found = _forms(compiled, name)
    assert [(m.lhs, m.rhs) for m in found.matmuls] == [("bf16", "bf16")] * 2
    copies = found.float_copies
    if jax.__version_info__ >= (0, 12):
        assert len(copies) == 2 and all(c.startswith("s4 copy -> bf16[") for c in copies), copies
    else:
        assert copies == [] and {m.rhs_read for m in found.matmuls} == {"f32"}
    assert tpu_forms.problems(PROGRAMS[name], found) == []


def test_int8_x_int8_is_an_s8_x_s8_to_s32_matmul_in_the_int8_mode(compiled):
    (name,) = _programs("int8 x int8")
    found = _forms(compiled, name)
    assert len(found.matmuls) == 2 and all(m.is_int8 for m in found.matmuls), found.describe()
    assert tpu_forms.native(PROGRAMS[name], found, compiled["modes"]["v5e:2x2"]) == "native"


@pytest.mark.parametrize("name", ON_V6E)
def test_v6e_makes_the_same_forms_as_v5e(compiled, name):
    def multiplied(found):
        return sorted((*sorted((m.lhs, m.rhs)), m.result) for m in found.matmuls)

    v5e, v6e = _forms(compiled, name), _forms(compiled, name, "v6e:2x2")
    assert multiplied(v6e) == multiplied(v5e)
    assert v6e.float_copies == v5e.float_copies == []
    assert tpu_forms.problems(PROGRAMS[name], v6e) == []


# -- the checks fail on forms that must fail ---------------------------------------------------


def test_the_serving_check_fails_on_dequantize_then_dot(compiled):
    """The TPU compiler fuses the dequantization into the matmul's fusion (no float copy),
    but there it multiplies every weight by its scale in float32 at each call, and the
    convolution's operand is bf16: the weights are no operand of the matmul."""
    found = _forms(compiled, "dequantize then dot")
    assert found.describe() == "1x bf16 x f32->bf16 -> bf16"
    assert found.float_copies == []
    assert tpu_forms.problems(MUST_FAIL["dequantize then dot"], found) == [
        "0 of 1 layers' matmuls take their s8 weights as stored: 1x bf16 x f32->bf16 -> bf16"
    ]


@pytest.mark.parametrize("name", ["bf16 as int8 x int8", "bf16 as float8"])
def test_the_int8_and_float8_checks_fail_on_a_bf16_matmul(compiled, name):
    found = _forms(compiled, name)
    (problem,) = tpu_forms.problems(MUST_FAIL[name], found)
    assert problem.startswith(("not s8 x s8 -> s32: bf16 x bf16", "not on float8 operands: bf16"))
    assert tpu_forms.native(MUST_FAIL[name], found, compiled["modes"]["v5e:2x2"]) == "NOT native"


def test_the_script_prints_its_help_without_compiling():
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "tpu_forms.py"), "--help"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("usage: tpu_forms.py")
    assert "--topology" in result.stdout and "--only" in result.stdout


def test_a_generation_without_the_mode_is_named_in_the_table():
    found = tpu_forms.Forms([tc.Matmul("c", "s8", "s8", "s32", "s8", "s8", 10)], [])
    (name,) = _programs("int8 x int8")
    verdict = tpu_forms.native(PROGRAMS[name], found, {"int8 x int8": 1.09, "float8": 1.17})
    assert verdict == "no int8 x int8 mode (1.09x bf16's cycles)"


if __name__ == "__main__":  # the subprocess of the `compiled` fixture
    compile_everything(pathlib.Path(sys.argv[1]))
