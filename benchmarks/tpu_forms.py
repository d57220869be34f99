"""The matmuls XLA makes of the library's programs for a Cloud TPU, compiled on this machine.

Each program is compiled for one chip of a TPU topology without a TPU (``tpu_compile.py``:
libtpu's compile-only devices) and its optimized HLO is read. On a TPU every matmul is a
``convolution`` inside a fusion that shows the element types it multiplies and reads.

Programs (the H100 check's builders, ``h100_forms.py``, placed on the TPU; the training
steps 512 wide with a hidden 1024 on 512 rows, the serving layers 2048 wide: enough to see
the forms):

* ``mixed_bfloat16`` training steps of a Linen ``Dense`` pair and an NNX ``Linear`` pair:
  native when each of the 5 matmuls (forward and both gradients; the input needs none)
  multiplies bf16 by bf16;
* the Linen step under float8 (delayed and current scaling): every matmul on float8
  operands; native only on a generation whose float8 matmul has a mode of its own
  (``tpu_compile.matmul_modes``);
* weight-only serving of two Dense layers with int8, int4 per channel and int4 in blocks of
  128 at batch 1, 16 and 256, and AWQ-calibrated int4/128 (an input scale) at batch 16:
  native when each layer's s8/s4 weights are an operand of its matmul (a TPU convolution
  multiplies bf16 by s8/s4), with no float copy of them (int4 blocks from 64 rows:
  dequantized once, then one bf16 matmul, by design);
* int8 x int8 (``"int8_from_mixed_bfloat16"``) at 256 rows: every matmul s8 x s8 -> s32, native
  on a generation with an int8 mode.

What this shows: the forms, and which formats have a matmul mode of their own on the
generation by the compiler's cost model. What it does not: any time (nothing runs).

Run: ``PYTHONPATH=.libtpu/V python benchmarks/tpu_forms.py [--topology v5e:2x2 ...]
[--only REGEX] [--hlo DIR]``, V the libtpu version jax's ``tpu`` extra pins, installed with
``pip install --no-deps --target .libtpu/V "libtpu==V.*"`` (``tests/tpu_forms_test.py``
does it on its first run).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import pathlib
import re
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # nothing runs: no TPU client is needed

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import h100_compile as hc
import h100_forms
import tpu_compile as tc

SERVE_DIM, SERVE_LAYERS, STEP_MATMULS = 2048, 2, h100_forms.STEP_GEMMS
WIDTH, HIDDEN, TOKENS = 512, 1024, 512  # the training steps (compile time grows with them)


@dataclasses.dataclass(frozen=True)
class Program:
    """A program to compile for a TPU and the forms it should reach."""

    name: str
    # "bf16 step", "float8", "serving", "serving dequantized" or "int8 x int8"
    group: str
    build: Callable[[], tuple[Callable[..., Any], tuple[Any, ...]]]  # args placed on an H100
    matmuls: int
    weights: str = ""  # serving: the integer type the weights are stored in ("s8", "s4")
    weight_elements: int = 0


@contextlib.contextmanager
def _placed_on(topology: str) -> Iterator[None]:
    """The H100 check's builders place their arguments with ``hc.on_h100``: on the TPU here."""
    saved = hc.on_h100
    hc.on_h100 = lambda tree: tc.on_tpu(tree, topology)
    try:
        yield
    finally:
        hc.on_h100 = saved


def serving(stored: str, policy: str, batch: int) -> Callable[[], tuple[Any, tuple[Any, ...]]]:
    """``h100_forms.serving`` at ``SERVE_DIM``: serving_bench's stack of Dense layers, its
    kernels quantized under ``stored`` (shapes only; ``"awq"``: serving_bench's AWQ storage,
    int4/128 with an input scale), run at ``batch`` under ``policy``."""

    def build() -> tuple[Callable[..., Any], tuple[Any, ...]]:
        import jax
        import jax.numpy as jnp
        import serving_bench

        import jmp_policy as jp

        model = serving_bench.Stack(SERVE_DIM, SERVE_LAYERS)
        x = jax.ShapeDtypeStruct((batch, SERVE_DIM), jnp.bfloat16)
        one = jax.ShapeDtypeStruct((1, SERVE_DIM), jnp.float32)
        params = jax.eval_shape(model.init, jax.random.key(0), one)["params"]
        store = serving_bench.awq_storage if stored == "awq" else jp.get(stored).quantize
        quantized = jax.eval_shape(store, params)
        return jp.linen.apply(model, policy), hc.on_h100(({"params": quantized}, x))

    return build


def nnx_step() -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """An NNX ``mixed_bfloat16`` training step (``nnx.value_and_grad``, ``nnx.Optimizer``
    with adam) of an ``nnx.Linear`` pair with a gelu between, as a function of the state."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import jmp_policy as jp

    class Pair(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.up = nnx.Linear(WIDTH, HIDDEN, rngs=rngs)
            self.down = nnx.Linear(HIDDEN, WIDTH, rngs=rngs)

        def __call__(self, x: Any) -> Any:
            return self.down(nnx.gelu(self.up(x)))

    model = Pair(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))

    def step(state: Any, x: Any, y: Any) -> Any:
        model, optimizer = nnx.merge(graphdef, state)

        def loss_fn(m: Any) -> Any:
            out = jp.nnx.apply(m, "mixed_bfloat16")(x)
            return jnp.mean(jnp.square(out.astype(jnp.float32) - y))

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), loss

    x = jax.ShapeDtypeStruct((TOKENS, WIDTH), jnp.float32)
    return step, hc.on_h100((state, x, x))


def programs() -> list[Program]:
    """Every program, in the order of the table."""

    def step(kind: str, policy: str) -> Callable[[], tuple[Any, tuple[Any, ...]]]:
        return h100_forms.linen_step(kind, policy, WIDTH, HIDDEN, TOKENS)

    result = [
        Program("bf16 linen Dense step", "bf16 step", step("Dense", "mixed_bfloat16"), 5),
        Program("bf16 nnx Linear step", "bf16 step", nnx_step, 5),
    ]
    for scaling, policy in h100_forms.F8.items():
        name = f"f8 {scaling} linen Dense step"
        result.append(Program(name, "float8", step("Dense", policy), STEP_MATMULS))
    elements = SERVE_DIM * SERVE_DIM
    for label, stored, weights in h100_forms.SERVING_FORMATS:
        for batch in (1, 16, 256):
            build = serving(stored, "mixed_bfloat16", batch)
            group = "serving" if label != "int4/128" or batch < 64 else "serving dequantized"
            name = f"serve {label} weights, batch {batch}"
            result.append(Program(name, group, build, SERVE_LAYERS, weights, elements))
    build = serving("awq", "awq/4/128_from_mixed_bfloat16", 16)
    name = "serve AWQ int4/128 weights, batch 16"
    result.append(Program(name, "serving", build, SERVE_LAYERS, "s4", elements))
    build = serving("int8_from_float32", "int8_from_mixed_bfloat16", 256)
    name = "serve int8 x int8, batch 256"
    result.append(Program(name, "int8 x int8", build, SERVE_LAYERS, "s8", elements))
    return result


# -- what XLA made, and whether it is native -------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Forms:
    """What XLA made of a program for one TPU topology."""

    matmuls: list[tc.Matmul]
    float_copies: list[str]  # serving: kernels writing the weights in a float type

    def describe(self) -> str:
        return hc.count([m.describe() for m in self.matmuls] + self.float_copies) or "no matmul"

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Forms:
        return cls([tc.Matmul(**m) for m in data["matmuls"]], list(data["float_copies"]))


def forms(program: Program, topology: str, hlo_dir: pathlib.Path | None = None) -> Forms:
    """Compiles ``program`` for one chip of ``topology`` and reads its matmuls."""
    with warnings.catch_warnings(), _placed_on(topology):
        warnings.filterwarnings("ignore", message=r"The float8 layer .* runs a")
        fn, args = program.build()
        hlo = tc.compile_for_tpu(fn, args)
    if hlo_dir is not None:
        hlo_dir.mkdir(parents=True, exist_ok=True)
        slug = re.sub(r"[^\w]+", "_", f"{topology} {program.name}").strip("_")
        (hlo_dir / f"{slug}.hlo.txt").write_text(hlo)
    copies = tc.float_copies(hlo, program.weight_elements) if program.weights else []
    return Forms(tc.matmuls(hlo), copies)


def problems(program: Program, found: Forms) -> list[str]:
    """Why ``found`` is not the form ``program`` should reach: empty when it is (whether
    that form has a mode of its own on the generation is :func:`native`'s question)."""
    out, mms = [], found.matmuls
    count = len(mms) if program.group != "serving" else program.matmuls
    if len(mms) != count:
        out.append(f"{len(mms)} matmuls, expected {count}: {found.describe()}")
    for m in mms:
        where = f"{m.describe()} (in {m.computation})"
        if program.group == "bf16 step" and (m.lhs, m.rhs) != ("bf16", "bf16"):
            out.append(f"not bf16 x bf16: {where}")
        if program.group == "float8" and not (m.is_float8 and m.lhs_read == m.lhs):
            out.append(f"not on float8 operands: {where}")
        if program.group == "int8 x int8" and not (m.is_int8 and m.rhs_read == "s8"):
            out.append(f"not s8 x s8 -> s32: {where}")
    if program.group == "serving":
        out += [f"a float copy of the weights: {c}" for c in found.float_copies]
        read = [m for m in mms if m.reads_int_weights == program.weights]
        if len(read) != program.matmuls:
            out.append(
                f"{len(read)} of {program.matmuls} layers' matmuls take their {program.weights} "
                f"weights as stored: {found.describe()}"
            )
    if program.group == "serving dequantized":  # a bf16 copy per layer, or fused (jax 0.10.2)
        if any((m.lhs, m.rhs) != ("bf16", "bf16") for m in mms):
            out.append(f"expected bf16 x bf16 matmuls: {found.describe()}")
        if len(found.float_copies) not in (0, program.matmuls):
            out.append(f"expected one bf16 copy of each layer's weights: {found.describe()}")
    return out


def native(program: Program, found: Forms, modes: dict[str, float]) -> str:
    """``native``, ``NOT native`` (the form is wrong) or ``no <format> mode`` (the form is
    right, and the generation multiplies those operands in a bf16 pass)."""
    if problems(program, found):
        return "NOT native"
    mode = {"float8": "float8", "int8 x int8": "int8 x int8"}.get(program.group)
    if mode and modes[mode] > tc.NATIVE_RATIO:
        return f"no {mode} mode ({modes[mode]:.2f}x bf16's cycles)"
    return "dequantized by design" if program.group == "serving dequantized" else "native"


def format_table(rows: list[list[str]]) -> str:
    table = [["program", "matmuls (read->multiplied)", ""], *rows]
    widths = [max(len(r[i]) for r in table) for i in range(3)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in table]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topology", nargs="+", default=list(tc.TOPOLOGIES))
    parser.add_argument("--only", default="", help="programs whose name matches this regex")
    parser.add_argument("--hlo", type=pathlib.Path, default=None, help="write each HLO here")
    args = parser.parse_args(argv)
    problem = tc.libtpu_problem()
    if problem:
        print(
            f"{problem}: pip install --no-deps --target DIR, then PYTHONPATH=DIR", file=sys.stderr
        )
        return 2
    import importlib.metadata

    import jax

    libtpu = importlib.metadata.version("libtpu")
    for topology in args.topology:
        kind, modes = tc.device_kind(topology), tc.matmul_modes(topology)
        print(f"{topology} ({kind}), jax {jax.__version__}, libtpu {libtpu}; nothing is timed.")
        ratios = ", ".join(f"{k} {v:.2f}x" for k, v in modes.items())
        print(f"  a {tc.PROBE}-cubed matmul's estimated cycles over bf16's: {ratios}")
        rows = []
        for program in programs():
            if not args.only or re.search(args.only, program.name):
                found = forms(program, topology, args.hlo)
                rows.append([program.name, found.describe(), native(program, found, modes)])
        print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
