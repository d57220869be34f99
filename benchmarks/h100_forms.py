"""The GEMMs XLA makes of the library's 8-bit programs for an H100, compiled on this machine.

Each program is compiled for an NVIDIA H100 without a GPU (``h100_compile.py``: the CUDA
PJRT plugin's compile-only devices) in two modes, and the optimized HLO is read:

* ``default``: XLA's flags; every dot stays in a Triton GEMM fusion (no device to autotune
  on), and the dot inside it shows the operand types it multiplies;
* ``cublas``: Triton GEMMs off; XLA's GEMM rewriter shows which dots can be cuBLASLt fp8
  GEMMs (``__cublas$lt$matmul$f8``) or s8 x s8 -> s32 GEMMs.

Programs (compile time does not depend on the sizes, but some forms do):

* a float8 training step (``value_and_grad``, ``jp.linen.split_gradients`` /
  ``jp.nnx.split_gradients``, adam) of two float8 layers of one kind with a gelu between,
  under delayed and under current scaling: Linen ``Dense``, ``DenseGeneral`` (the second
  contracting two axes), ``Einsum`` (the same), NNX ``Linear``, ``LinearGeneral``,
  ``Einsum``. Native: every GEMM on float8 operands (default) and a cuBLASLt fp8 GEMM (cuBLAS),
  5 per step (forward and both gradients of each layer; the input needs no gradient);
* an int8 QAT step (``"int8_from_mixed_bfloat16"``, float kernels): by design bf16 GEMMs on
  integer values (an int8 GEMM made inside the step is slow on an H100);
* weight-only serving of two Dense layers 4096 x 4096 with int8, int4 per channel and int4 in
  blocks of 128 weights at batch 1, 16 and 256: native when each layer's s8/s4 weights are
  read inside its GEMM fusion (or, for a matrix-vector product, its reduction) with no copy of
  the weights in a float type. 4096, not less: below about that size XLA turns a one-row
  matmul into a multiply and a reduction, and after a first layer writes the multiply's
  kernel-sized result, bf16 weights as well (a small layer's form, not the weights');
* the same serving at batch 1 and 16 with ``serving_kernel="pallas"`` (jax >= 0.11, whose
  Pallas lowering takes a GPU without one): native when each layer is one Pallas kernel
  (``__gpu$xla.gpu.triton``) reading its s8/s4 weights in place (int4 through a bitcast),
  and no GEMM reads them; with zero points too (int4/128/asym, int8/asym: the zero points'
  term taken from the kernel's result, no float copy of the weights);
* int8 x int8 (int8 weights under ``"int8_from_mixed_bfloat16"``) at 256 rows: native when
  every GEMM is s8 x s8 -> s32;
* the control: the Linen Dense step under ``"mixed_bfloat16"``, bf16 GEMMs and no fp8 one.

What this shows: the forms XLA makes on an H100. What it does not: any time, or which of
Triton's GEMM and cuBLAS's the autotuner of a real H100 picks (``docs/h100_forms.md`` has the
measured forms; a GPU measures the library's own times).

Needs the CUDA PJRT plugin at jaxlib's version (no CUDA toolkit or driver), best installed
apart as CI does, since in an environment it makes every process that imports jax print
CUDA-driver lines (``tests/h100_forms_test.py`` installs it so on its first run): ``pip
install --no-deps --target .cuda-plugin/V jax-cuda12-plugin==V jax-cuda12-pjrt==V``, V =
``python -c 'import jaxlib; print(jaxlib.__version__)'``. Run:
``PYTHONPATH=.cuda-plugin/V python benchmarks/h100_forms.py [--only REGEX] [--hlo DIR]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import re
import sys
import warnings
from collections.abc import Callable
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # nothing runs: no CUDA client is needed

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import h100_compile as hc

WIDTH, HIDDEN, TOKENS = 1024, 2048, 2048  # float8, QAT and control steps
SERVE_DIM, SERVE_LAYERS = 4096, 2  # at 2048 a one-row matmul is no GEMM (see above)
LAYERS = 2  # every step: two layers of one kind
STEP_GEMMS = 3 * LAYERS - 1  # forward and two gradients each; the input needs no gradient
F8 = {"delayed": "float8_from_mixed_bfloat16", "current": "float8_current_from_mixed_bfloat16"}


def pallas_lowers() -> bool:
    """Whether this JAX lowers a Pallas (Triton) kernel for a GPU it does not have: from
    jax 0.11 (its abstract mesh names the target device); jax 0.10's Pallas asks the
    default device, a CPU here."""
    import jax

    return tuple(int(p) for p in jax.__version__.split(".")[:2]) >= (0, 11)


@dataclasses.dataclass(frozen=True)
class Program:
    """A program to compile for an H100 and the forms it should reach."""

    name: str
    # "float8", "int8 QAT", "serving", "serving dequantized", "serving pallas", "int8 x int8"
    # or "control"
    group: str
    build: Callable[[], tuple[Callable[..., Any], tuple[Any, ...]]]  # fn and its arguments
    gemms: int  # the GEMMs (or matrix-vector products) the program makes
    weights: str = ""  # serving: the integer type the weights are stored in ("s8", "s4")
    weight_elements: int = 0  # serving: the elements of one layer's weights


# -- Linen -------------------------------------------------------------------------------------


def _linen_pair(kind: str, width: int, hidden: int) -> Any:
    import flax.linen as nn

    def layers() -> tuple[Any, Any]:
        if kind == "Dense":
            return nn.Dense(hidden, name="up"), nn.Dense(width, name="down")
        if kind == "DenseGeneral":  # the second contracts two axes
            return (
                nn.DenseGeneral((2, hidden // 2), name="up"),
                nn.DenseGeneral(width, axis=(-2, -1), name="down"),
            )
        return (  # Einsum, the second contracting two axes
            nn.Einsum((width, 2, hidden // 2), "td,dhi->thi", name="up"),
            nn.Einsum((2, hidden // 2, width), "thi,hio->to", name="down"),
        )

    class Pair(nn.Module):
        @nn.compact
        def __call__(self, x: Any) -> Any:
            up, down = layers()
            return down(nn.gelu(up(x)))

    return Pair()


def linen_step(
    kind: str, policy: Any, width: int = WIDTH, hidden: int = HIDDEN, tokens: int = TOKENS
) -> Callable[[], tuple[Callable[..., Any], tuple[Any, ...]]]:
    """A Linen training step (float8_bench's: ``value_and_grad``, ``split_gradients``, adam)
    of two ``kind`` layers, ``up`` and ``down``, under ``policy`` (``tokens`` rows)."""

    def build() -> tuple[Callable[..., Any], tuple[Any, ...]]:
        import float8_bench
        import jax
        import jax.numpy as jnp
        import optax

        import jmp_policy as jp

        model = _linen_pair(kind, width, hidden)
        policy_map = jp.DTypePolicyMap("mixed_bfloat16", {"up|down": policy})
        x = jax.ShapeDtypeStruct((tokens, width), jnp.float32)
        variables = jax.eval_shape(jp.linen.init(model, policy_map), jax.random.key(0), x)
        tx = optax.adam(1e-3)
        opt_state = jax.eval_shape(tx.init, variables["params"])
        step = float8_bench.make_step(model, policy_map, tx)
        return step, hc.on_h100((variables, opt_state, x, x))

    return build


# -- NNX ---------------------------------------------------------------------------------------


def nnx_step(kind: str, policy: Any) -> Callable[[], tuple[Callable[..., Any], tuple[Any, ...]]]:
    """An NNX training step (``nnx.value_and_grad``, ``jp.nnx.split_gradients``,
    ``nnx.Optimizer`` with adam) of two ``kind`` layers, ``up`` and ``down``, as a function of
    the model's and optimizer's state."""

    def build() -> tuple[Callable[..., Any], tuple[Any, ...]]:
        import jax
        import jax.numpy as jnp
        import optax
        from flax import nnx

        import jmp_policy as jp

        class Pair(nnx.Module):
            def __init__(self, rngs: nnx.Rngs) -> None:
                h = HIDDEN // 2
                if kind == "Linear":
                    self.up = nnx.Linear(WIDTH, HIDDEN, rngs=rngs)
                    self.down = nnx.Linear(HIDDEN, WIDTH, rngs=rngs)
                elif kind == "LinearGeneral":
                    self.up = nnx.LinearGeneral(WIDTH, (2, h), rngs=rngs)
                    self.down = nnx.LinearGeneral((2, h), WIDTH, axis=(-2, -1), rngs=rngs)
                else:
                    self.up = nnx.Einsum("td,dhi->thi", (WIDTH, 2, h), (2, h), rngs=rngs)
                    self.down = nnx.Einsum("thi,hio->to", (2, h, WIDTH), (WIDTH,), rngs=rngs)

            def __call__(self, x: Any) -> Any:
                return self.down(nnx.gelu(self.up(x)))

        policy_map = jp.DTypePolicyMap("mixed_bfloat16", {"up|down": policy})
        model = jp.nnx.init_float8(Pair(nnx.Rngs(0)), policy_map)
        optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
        graphdef, state = nnx.split((model, optimizer))
        wrt = nnx.DiffState(0, nnx.Any(nnx.Param, jp.nnx.Float8State))

        def step(state: Any, x: Any, y: Any) -> Any:
            model, optimizer = nnx.merge(graphdef, state)

            def loss_fn(m: Any) -> Any:
                out = jp.nnx.apply(m, policy_map)(x)
                return jnp.mean(jnp.square(out.astype(jnp.float32) - y))

            loss, grads = nnx.value_and_grad(loss_fn, argnums=wrt)(model)
            grads, float8_state = jp.nnx.split_gradients(grads)
            optimizer.update(model, grads)
            nnx.update(model, float8_state)
            return nnx.state((model, optimizer)), loss

        x = jax.ShapeDtypeStruct((TOKENS, WIDTH), jnp.float32)
        return step, hc.on_h100((state, x, x))

    return build


# -- serving -----------------------------------------------------------------------------------


def serving(
    stored: str, policy: str, batch: int, kernel: str = "auto"
) -> Callable[[], tuple[Any, tuple[Any, ...]]]:
    """serving_bench's stack of Dense layers (no bias), its kernels quantized under
    ``stored``, run forward at ``batch`` under ``policy`` (``kernel``: the
    ``serving_kernel`` option)."""

    def build() -> tuple[Callable[..., Any], tuple[Any, ...]]:
        import jax
        import jax.numpy as jnp
        import serving_bench

        import jmp_policy as jp

        model = serving_bench.Stack(SERVE_DIM, SERVE_LAYERS)
        x = jax.ShapeDtypeStruct((batch, SERVE_DIM), jnp.bfloat16)
        # Only shapes and dtypes reach the compiler: the weights are neither drawn nor
        # quantized (4096 x 4096 each), only traced.
        one = jax.ShapeDtypeStruct((1, SERVE_DIM), jnp.float32)
        params = jax.eval_shape(model.init, jax.random.key(0), one)["params"]
        quantized = jax.eval_shape(jp.get(stored).quantize, params)
        serve = jp.linen.apply(model, policy, serving_kernel=kernel)
        return serve, hc.on_h100(({"params": quantized}, x))

    return build


def on_cuda_cores(build: Callable[[], Any]) -> Callable[[], Any]:
    """``build``'s program traced with the Pallas kernel's rows on CUDA cores and its
    weights unmasked (``Tiles(fma_rows=4, mask_weights=False)``, read at trace time)."""
    from jmp_policy._src.quantization import pallas_matmul

    def built() -> Any:
        serve, args = build()

        def run(*a: Any) -> Any:
            tuned = pallas_matmul.TILES
            pallas_matmul.TILES = dataclasses.replace(tuned, fma_rows=4, mask_weights=False)
            try:
                return serve(*a)
            finally:
                pallas_matmul.TILES = tuned

        return run, args

    return built


# The weight-only serving formats the checks compile: label, stored policy, the weights' HLO
# element type (the H100 and TPU checks share them).
SERVING_FORMATS = (
    ("int8", "int8_from_float32", "s8"),
    ("int4", "int4_from_float32", "s4"),
    ("int4/128", "int4/128_from_float32", "s4"),
)
# Zero points (int4 per group, int8 per channel): the XLA forms fold them in; the Pallas
# route runs its kernel on the stored values and takes the zero points' term from its result.
ZERO_POINT_FORMATS = (
    ("int4/128/asym", "int4/128/asym_from_float32", "s4"),
    ("int8/asym", "int8/asym_from_float32", "s8"),
)


def programs() -> list[Program]:
    """Every program, in the order of the table."""
    result = []
    for scaling, policy in F8.items():
        for kind in ("Dense", "DenseGeneral", "Einsum"):
            build = linen_step(kind, policy)
            result.append(Program(f"f8 {scaling} linen {kind}", "float8", build, STEP_GEMMS))
        for kind in ("Linear", "LinearGeneral", "Einsum"):
            build = nnx_step(kind, policy)
            result.append(Program(f"f8 {scaling} nnx {kind}", "float8", build, STEP_GEMMS))
    qat = linen_step("Dense", "int8_from_mixed_bfloat16")
    result.append(Program("int8 QAT linen Dense", "int8 QAT", qat, STEP_GEMMS))
    elements = SERVE_DIM * SERVE_DIM
    for label, stored, weights in SERVING_FORMATS + ZERO_POINT_FORMATS:
        for batch in (1, 16, 256):
            build = serving(stored, "mixed_bfloat16", batch)
            name = f"serve {label} weights, batch {batch}"
            # int4 blocks from INT4_BLOCKS_MAX_ROWS rows: dequantized, then one bf16 GEMM
            # (measured faster there on an H200 than the matmul per block).
            blocks = label.startswith("int4/128")
            group = "serving" if not blocks or batch < 128 else "serving dequantized"
            result.append(Program(name, group, build, SERVE_LAYERS, weights, elements))
    for label, stored, weights in SERVING_FORMATS + ZERO_POINT_FORMATS:
        for batch in (1, 16):
            build = serving(stored, "mixed_bfloat16", batch, "pallas")
            name = f"serve {label} weights, pallas, batch {batch}"
            result.append(Program(name, "serving pallas", build, SERVE_LAYERS, weights, elements))
        if (label, stored, weights) in ZERO_POINT_FORMATS:
            continue
        # The kernel's untuned variant (#48, to time on a GPU): 1 row on CUDA cores, no mask.
        build = on_cuda_cores(serving(stored, "mixed_bfloat16", 1, "pallas"))
        name = f"serve {label} weights, pallas CUDA cores, batch 1"
        result.append(Program(name, "serving pallas", build, SERVE_LAYERS, weights, elements))
    build = serving("int8_from_float32", "int8_from_mixed_bfloat16", 256)
    result.append(
        Program("serve int8 x int8, batch 256", "int8 x int8", build, SERVE_LAYERS, "s8", elements)
    )
    control = linen_step("Dense", "mixed_bfloat16")
    result.append(Program("bf16 control linen Dense", "control", control, STEP_GEMMS))
    return result


# -- what XLA made, and whether it is native -------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Forms:
    """What XLA made of a program in one mode."""

    gemms: list[hc.Gemm]
    weight_reads: list[hc.WeightRead]  # serving: the non-GEMM kernels reading the weights
    # serving: per Pallas kernel, the weights it reads in place (hc.triton_kernels)
    triton: list[str] = dataclasses.field(default_factory=list)

    def describe(self) -> str:
        cells = [g.describe() for g in self.gemms] + [w.describe() for w in self.weight_reads]
        cells += [f"Pallas kernel reading {t or 'no weights'}" for t in self.triton]
        return hc.count(cells) or "no GEMM"

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Forms:
        reads = [{**w, "out_shape": tuple(w["out_shape"])} for w in data["weight_reads"]]
        gemms = [hc.Gemm(**g) for g in data["gemms"]]
        return cls(gemms, [hc.WeightRead(**w) for w in reads], data.get("triton", []))


def forms(
    program: Program, modes: Any = tuple(hc.MODES), hlo_dir: pathlib.Path | None = None
) -> dict[str, Forms]:
    """Compiles ``program`` for an H100 in each of ``modes`` (built and lowered once) and
    reads its GEMMs: ``{mode: Forms}``."""
    with warnings.catch_warnings():
        # Widths below 4096 warn that float8 may not pay there; the forms are the question here.
        warnings.filterwarnings("ignore", message=r"The float8 layer .* runs a")
        fn, args = program.build()
        hlos = hc.compile_in_modes(fn, args, modes, program.group == "serving pallas")
    found = {}
    for mode, hlo in hlos.items():
        if hlo_dir is not None:
            hlo_dir.mkdir(parents=True, exist_ok=True)
            slug = re.sub(r"[^\w]+", "_", program.name).strip("_")
            (hlo_dir / f"{slug}.{mode}.hlo.txt").write_text(hlo)
        reads = hc.weight_reads(hlo, program.weight_elements) if program.weights else []
        triton = hc.triton_kernels(hlo, program.weight_elements) if program.weights else []
        found[mode] = Forms(hc.gemms(hlo), reads, triton)
    return found


def problems(program: Program, mode: str, found: Forms) -> list[str]:
    """Why ``found`` (``program`` compiled in ``mode``) is not the native form: empty when
    it is. Each message names the GEMM or kernel at fault."""
    out = []
    gemms = found.gemms
    if program.group == "float8":
        if len(gemms) != program.gemms:
            out.append(f"{len(gemms)} GEMMs, expected {program.gemms}: {found.describe()}")
        for g in gemms:
            if mode == "default" and not (g.target == "dot" and g.is_fp8):
                out.append(f"not on float8 operands: {g.describe()} (in {g.computation})")
            if mode == "cublas" and g.target != hc.FP8_GEMM:
                out.append(f"not a cuBLASLt fp8 GEMM: {g.describe()} (in {g.computation})")
    elif program.group in ("control", "int8 QAT"):
        if len(gemms) != program.gemms:
            out.append(f"{len(gemms)} GEMMs, expected {program.gemms}: {found.describe()}")
        for g in gemms:
            if (g.lhs, g.rhs) != ("bf16", "bf16"):
                out.append(f"not a bf16 GEMM: {g.describe()} (in {g.computation})")
    elif program.group == "int8 x int8":
        if len(gemms) != program.gemms:
            out.append(f"{len(gemms)} GEMMs, expected {program.gemms}: {found.describe()}")
        for g in gemms:
            if not g.is_int8:
                out.append(f"not s8 x s8 -> s32: {g.describe()} (in {g.computation})")
    elif program.group == "serving dequantized":  # each layer: one copy to bf16, a bf16 GEMM
        copies = [w for w in found.weight_reads if w.is_copy and w.read == program.weights]
        if len(copies) != program.gemms or any(w.out_dtype != "bf16" for w in copies):
            out.append(
                f"{len(copies)} of {program.gemms} layers dequantize their {program.weights} "
                f"weights to bf16 once: {found.describe()}"
            )
        if len(gemms) != program.gemms or any((g.lhs, g.rhs) != ("bf16", "bf16") for g in gemms):
            out.append(f"expected {program.gemms} bf16 GEMMs: {found.describe()}")
    elif program.group == "serving pallas":  # each layer: a Pallas kernel reading them
        if found.triton != [program.weights] * program.gemms:
            out.append(
                f"expected {program.gemms} Pallas kernels reading their {program.weights} "
                f"weights in place: {found.describe()}"
            )
        if any(g.reads_int_weights for g in gemms):
            out.append(f"a GEMM reads the integer weights: {found.describe()}")
        for w in found.weight_reads:
            if w.is_copy:
                out.append(f"a copy of the weights: {w.describe()} ({w.name} in {w.computation})")
    else:  # serving: each layer reads its integer weights inside its GEMM or reduction
        for w in found.weight_reads:
            if w.is_copy:
                out.append(f"a copy of the weights: {w.describe()} ({w.name} in {w.computation})")
        for g in gemms:  # one row with a float32 result once made an f32 GEMM here
            if g.reads_int_weights and (g.lhs, g.rhs) != ("bf16", "bf16"):
                out.append(f"not a bf16 GEMM: {g.describe()} (in {g.computation})")
        read = [g for g in gemms if g.reads_int_weights == program.weights]
        read += [w for w in found.weight_reads if not w.is_copy and w.read == program.weights]  # type: ignore[misc]
        if len(read) != program.gemms:
            out.append(
                f"{len(read)} of {program.gemms} layers read their {program.weights} weights "
                f"inside a GEMM or reduction: {found.describe()}"
            )
    return out


# -- the table --------------------------------------------------------------------------------


def row(program: Program, results: dict[str, Forms]) -> list[str]:
    """The program's name, then per mode what XLA made and whether it is the form wanted:
    ``native`` (``bf16`` for the QAT step and the control), or ``NOT ...``."""
    word = "bf16" if program.group in ("control", "int8 QAT") else "native"
    cells = [program.name]
    for mode, found in results.items():
        bad = problems(program, mode, found)
        cells += [found.describe(), word if not bad else f"NOT {word}"]
    return cells


def format_table(rows: list[list[str]]) -> str:
    header = ["program", "default: GEMMs (Triton)", "", "Triton GEMMs off: GEMMs (cuBLAS)", ""]
    table = [header, *rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in table
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="programs whose name matches this regex")
    parser.add_argument(
        "--hlo", type=pathlib.Path, default=None, help="write each optimized HLO into this folder"
    )
    parser.add_argument("--explain", action="store_true", help="print why a form is not native")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    problem = hc.plugin_problem()
    if problem:
        print(f"{problem} (or with --no-deps --target DIR, then PYTHONPATH=DIR)", file=sys.stderr)
        return 2
    import jax

    device = hc.h100_sharding().mesh.devices.flat[0].device_kind
    print(f"jax {jax.__version__}, compiled for an {device} without a GPU; nothing is timed.")
    print(
        "native: float8, every GEMM on float8 operands (default) or a cuBLASLt fp8 GEMM "
        "(Triton off);\n  serving, each layer's s8/s4 weights read inside its GEMM, no copy; "
        "int8 x int8, s8 x s8 -> s32.\n  `a->b`: an operand read as a, converted to b inside "
        "the GEMM's fusion."
    )
    rows, bad = [], []
    for program in programs():
        if args.only and not re.search(args.only, program.name):
            continue
        if program.group == "serving pallas" and not pallas_lowers():
            print(f"skipped {program.name}: Pallas lowers for a GPU without one from jax 0.11")
            continue
        results = forms(program, tuple(hc.MODES), args.hlo)
        rows.append(row(program, results))
        if args.explain:
            bad += [
                f"{program.name} ({m}): {p}"
                for m, f in results.items()
                for p in problems(program, m, f)
            ]
    print(format_table(rows))
    print(
        "Triton GEMMs off, cuBLAS reads no s8/s4 beside bf16: the serving weights are copied to "
        "a float type first,\n  so on an H100 only Triton's GEMM (if the autotuner picks it) "
        "reads them in place. int8 x int8 there:\n  the kernel, stored [in, out], is transposed "
        "to cuBLAS's layout (an s8 copy) at every call."
    )
    for line in bad:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
