"""Compile a JAX program for an NVIDIA H100 on a machine with no GPU, and read its GEMMs.

The CUDA PJRT plugin (``jax-cuda12-plugin`` and ``jax-cuda12-pjrt``, the version of the
installed ``jaxlib``; no CUDA toolkit or driver needed) accepts XLA's GPU target description
(``h100_sxm.txtpb`` beside this file) in ``jax.experimental.topologies.get_topology_desc``,
which then returns compile-only devices. ``jax.jit(f).lower(*args placed on them).compile()``
runs XLA's whole GPU pipeline, and ``as_text()`` is the optimized HLO an H100 would run
(jax's own ``tests/aot_test.py`` does the same). Nothing runs and nothing is timed.

Two modes (:data:`MODES`):

* ``default``: XLA's flags. Without a device the GEMM autotuner cannot time anything, so each
  dot stays in a Triton GEMM fusion with untuned tiles; the dot inside the fusion shows its
  operand types (float8 operands: native fp8 on the tensor cores; ``convert`` of an s8/s4
  fusion parameter: the integer weights read once, inside the GEMM).
* ``cublas``: ``xla_gpu_enable_triton_gemm=False``. The dots go through XLA's GEMM rewriter,
  which shows whether each one *can* be a cuBLASLt fp8 GEMM (``__cublas$lt$matmul$f8``) or an
  s8 x s8 -> s32 cuBLASLt GEMM.

A real H100 picks between the two by timing, which no compile without a device reproduces.

Run with ``JAX_PLATFORMS=cpu`` (set here when unset) so that jax does not start a CUDA client.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import importlib.metadata
import os
import pathlib
import re
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jaxlib

SPEC = pathlib.Path(__file__).resolve().with_name("h100_sxm.txtpb")
MODES: dict[str, dict[str, Any]] = {
    "default": {},
    "cublas": {"xla_gpu_enable_triton_gemm": False},
}
FP8_GEMM = "__cublas$lt$matmul$f8"
PLUGINS = ("jax-cuda12-plugin", "jax-cuda12-pjrt")


class PluginError(RuntimeError):
    """The CUDA PJRT plugin is missing, or not the installed jaxlib's version."""


def install_command() -> str:
    """The pip command that installs the plugin at the installed jaxlib's version."""
    version = jaxlib.__version__
    return "pip install " + " ".join(f"{name}=={version}" for name in PLUGINS)


def plugin_problem() -> str | None:
    """Why the plugin cannot compile for an H100 here (``None``: it can)."""
    found = {}
    for name in PLUGINS:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    if all(v == jaxlib.__version__ for v in found.values()):
        return None
    have = ", ".join(f"{n} {v or 'not installed'}" for n, v in found.items())
    return (
        f"Compiling for an H100 needs the CUDA PJRT plugin at jaxlib's version "
        f"{jaxlib.__version__} (found {have}): {install_command()}"
    )


@functools.cache
def h100_sharding() -> jax.sharding.NamedSharding:
    """A replicated sharding over one compile-only H100 (the topology is made once).

    Raises:
      PluginError: the plugin is missing or not at jaxlib's version, or refused the spec.
    """
    from jax.experimental import topologies

    problem = plugin_problem()
    if problem:
        raise PluginError(problem)
    try:
        topology = topologies.get_topology_desc(
            platform="cuda", target_config=SPEC.read_text(), topology="1x1x1"
        )
    except Exception as e:  # the plugin's own errors are plain RuntimeErrors
        raise PluginError(
            f"The CUDA PJRT plugin (jaxlib {jaxlib.__version__}) could not make a compile-only "
            f"H100 from {SPEC.name}: {e}"
        ) from e
    mesh = topologies.make_mesh(topology, (1,), ("x",))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def on_h100(tree: Any) -> Any:
    """Each array (or ``ShapeDtypeStruct``) of ``tree`` as an abstract argument on the H100."""
    sharding = h100_sharding()
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), tree)


def compile_for_h100(fn: Any, args: tuple[Any, ...], mode: str = "default") -> str:
    """XLA's optimized HLO of ``jax.jit(fn)(*args)`` for an H100 (``args`` from
    :func:`on_h100`), compiled in ``mode`` (a key of :data:`MODES`)."""
    return compile_in_modes(fn, args, (mode,))[mode]


def compile_in_modes(
    fn: Any, args: tuple[Any, ...], modes: Any, abstract_mesh: bool = False
) -> dict[str, str]:
    """:func:`compile_for_h100` in each of ``modes``, traced and lowered once; with
    ``abstract_mesh``, traced inside the H100 mesh's abstract mesh, as a program holding a
    Pallas kernel needs (its Triton lowering asks which GPU it targets; jax >= 0.11)."""
    for mode in modes:
        if mode not in MODES:
            raise ValueError(f"`mode` must be one of {sorted(MODES)}, got {mode!r}.")
    if abstract_mesh:
        with jax.sharding.use_abstract_mesh(h100_sharding().mesh.abstract_mesh):
            lowered = jax.jit(fn).lower(*args)
    else:
        lowered = jax.jit(fn).lower(*args)
    return {m: lowered.compile(compiler_options=MODES[m] or None).as_text() for m in modes}


# -- reading the optimized HLO ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Instruction:
    name: str
    dtype: str  # the element type; a tuple's first element's
    shape: tuple[int, ...]
    opcode: str
    operands: tuple[str, ...]
    arguments: str  # the text between the parentheses: a parameter's number, a constant
    attributes: str
    is_root: bool

    @property
    def size(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


_HEAD = re.compile(r"\s*(?:ROOT )?%([\w.\-]+) = ")
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\](?:\{[^}]*\})?")
_COMPUTATION = re.compile(r"(?:ENTRY )?%([\w.\-]+) \(")


def _closing(text: str, start: int) -> int:
    """The index of the parenthesis closing the one at ``start``."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return i
    return len(text)


def _instruction(line: str) -> Instruction | None:
    head = _HEAD.match(line)
    if not head:
        return None
    rest = line[head.end() :]
    if rest.startswith("("):  # a tuple: (f32[...]{...}, s8[...]{...})
        end = _closing(rest, 0)
        type_text, rest = rest[1:end], rest[end + 1 :].lstrip()
    else:
        type_text, _, rest = rest.partition(" ")
    array = _ARRAY.match(type_text)
    dtype, dims = (array.group(1), array.group(2)) if array else ("token", "")
    opcode = re.match(r"[\w\-]+", rest)
    if not opcode:
        return None
    open_at = opcode.end()
    close_at = _closing(rest, open_at)
    operands = tuple(re.findall(r"%([\w.\-]+)", rest[open_at:close_at]))
    shape = tuple(int(d) for d in dims.split(",") if d)
    return Instruction(
        head.group(1),
        dtype,
        shape,
        opcode.group(0),
        operands,
        rest[open_at + 1 : close_at],
        rest[close_at + 1 :],
        line.lstrip().startswith("ROOT "),
    )


def computations(hlo: str) -> dict[str, dict[str, Instruction]]:
    """Optimized HLO text as ``{computation: {instruction name: Instruction}}`` (names are
    unique only within a computation)."""
    result: dict[str, dict[str, Instruction]] = {}
    current: dict[str, Instruction] = {}
    for line in hlo.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            m = _COMPUTATION.match(line)
            current = result.setdefault(m.group(1) if m else line, {})
            continue
        instruction = _instruction(line)
        if instruction:
            current[instruction.name] = instruction
    return result


# Ops that move or retype data without computing: followed back to what a GEMM reads.
_MOVES = {"bitcast", "reshape", "transpose", "copy", "broadcast", "slice", "pad", "convert"}


def _source(
    comps: dict[str, dict[str, Instruction]], computation: str, name: str, nested: bool
) -> Instruction | None:
    """The instruction ``name`` (in ``computation``) is read from, through moves and
    converts; with ``nested`` (inside a fusion) also through the fusions nested in it, such
    as the operand fusions of a nested Triton GEMM fusion."""
    ops = comps.get(computation, {})
    for _ in range(64):
        op = ops.get(name)
        if op is None or not op.operands:
            return op
        if op.opcode in _MOVES:
            name = op.operands[0]
            continue
        called = _called(op, "calls") if nested and op.opcode == "fusion" else []
        inner = comps.get(called[0], {}) if called else {}
        root = next((i for i in inner.values() if i.is_root), None)
        if root is None:
            return op
        found = _source(comps, called[0], root.name, nested)
        if found is None or found.opcode != "parameter" or not found.arguments.isdigit():
            return found
        if int(found.arguments) >= len(op.operands):
            return found
        name = op.operands[int(found.arguments)]  # back out, at the fusion's operand
    return None


def _short(dtype: str) -> str:
    return {"f8e4m3fn": "e4m3", "f8e5m2": "e5m2"}.get(dtype, dtype)


@dataclasses.dataclass(frozen=True)
class Gemm:
    """A GEMM of the optimized HLO: a ``dot`` (in a Triton GEMM fusion, or on its own) or a
    cuBLAS custom call, with its operands' element types as the GEMM reads them."""

    computation: str
    target: str  # "dot" or the cuBLAS custom call's target
    lhs: str
    rhs: str
    result: str
    lhs_read: str  # the element type the operand was read as (a fusion's s8 parameter...)
    rhs_read: str

    @property
    def is_fp8(self) -> bool:
        """Native fp8: a cuBLASLt fp8 GEMM, or a dot of two float8 operands."""
        if self.target != "dot":
            return self.target == FP8_GEMM
        return self.lhs.startswith("f8") and self.rhs.startswith("f8")

    @property
    def is_int8(self) -> bool:
        """An s8 x s8 -> s32 GEMM."""
        return (self.lhs, self.rhs, self.result) == ("s8", "s8", "s32")

    @property
    def reads_int_weights(self) -> str | None:
        """``"s8"``/``"s4"`` when an operand is integer weights converted inside the GEMM."""
        for operand, read in ((self.lhs, self.lhs_read), (self.rhs, self.rhs_read)):
            if read in ("s8", "s4") and operand != read:
                return read
        return None

    def describe(self) -> str:
        def side(operand: str, read: str) -> str:
            return _short(operand) if operand == read else f"{read}->{_short(operand)}"

        where = "" if self.target == "dot" else f"{self.target.replace('__cublas$', '')} "
        lhs, rhs = side(self.lhs, self.lhs_read), side(self.rhs, self.rhs_read)
        return f"{where}{lhs} x {rhs} -> {_short(self.result)}"


def gemms(hlo: str) -> list[Gemm]:
    """Every GEMM of optimized HLO text."""
    result = []
    comps = computations(hlo)
    fused = _fused(comps)
    for computation, ops in comps.items():
        for op in ops.values():
            if op.opcode == "dot":
                target = "dot"
            elif op.opcode == "custom-call" and '"__cublas$' in op.attributes:
                target = re.search(r'custom_call_target="([^"]*)"', op.attributes).group(1)  # type: ignore[union-attr]
            else:
                continue
            lhs, rhs = (_dtype(ops.get(o)) for o in op.operands[:2])
            nested = computation in fused
            lhs_read, rhs_read = (
                _dtype(_source(comps, computation, o, nested)) for o in op.operands[:2]
            )
            result.append(Gemm(computation, target, lhs, rhs, op.dtype, lhs_read, rhs_read))
    return result


def _dtype(instruction: Instruction | None) -> str:
    return instruction.dtype if instruction else "?"


@dataclasses.dataclass(frozen=True)
class WeightRead:
    """A kernel (an instruction of a control computation, usually a fusion) that reads a
    large integer array (the weights) and is no GEMM: a matrix-vector product as a
    reduction, or a copy of the weights (float, or a transposed integer copy)."""

    computation: str
    name: str
    read: str  # the integer element type read
    out_dtype: str
    out_shape: tuple[int, ...]
    is_copy: bool  # it writes at least as many elements as the weights hold

    def describe(self) -> str:
        dims = ",".join(map(str, self.out_shape))
        what = "copy" if self.is_copy else "read"
        return f"{self.read} {what} -> {self.out_dtype}[{dims}]"


def weight_reads(hlo: str, min_elements: int) -> list[WeightRead]:
    """The non-GEMM kernels reading an s8/s4 array of at least ``min_elements`` elements."""
    comps = computations(hlo)
    fused = _fused(comps)
    with_gemm = {name for name, ops in comps.items() if any(_is_gemm(op) for op in ops.values())}
    result = []
    for name, ops in comps.items():
        if name in fused:
            continue
        for op in ops.values():
            if op.opcode in _MOVES | {"parameter", "get-tuple-element", "tuple"} or _is_gemm(op):
                continue
            if TRITON_CALL in op.attributes:  # a Pallas kernel: triton_kernels reads those
                continue
            if any(c in with_gemm for c in _called(op)):
                continue
            reads = [_source(comps, name, o, nested=False) for o in op.operands]
            ints = [r for r in reads if r and r.dtype in ("s8", "s4") and r.size >= min_elements]
            if ints:
                copy = op.size >= min_elements
                result.append(WeightRead(name, op.name, ints[0].dtype, op.dtype, op.shape, copy))
    return result


TRITON_CALL = '"__gpu$xla.gpu.triton"'  # how a Pallas (Triton) kernel appears in the program


def triton_kernels(hlo: str, min_elements: int) -> list[str]:
    """Per Pallas (Triton) kernel of the program, the integer weights it reads
    (``"s8"``/``"s4"``, an operand of at least ``min_elements`` elements or the array it is
    a bitcast of: read in place), ``"copy"`` when such an operand is a copy, else ``""``."""
    comps = computations(hlo)
    result = []
    for name, ops in comps.items():
        for op in ops.values():
            if op.opcode != "custom-call" or TRITON_CALL not in op.attributes:
                continue
            read = ""
            for operand in op.operands:
                direct = ops.get(operand)
                source = _source(comps, name, operand, nested=False)
                if source and source.dtype in ("s8", "s4") and source.size >= min_elements:
                    moved = direct is not None and direct.opcode not in ("parameter", "bitcast")
                    read = "copy" if moved else source.dtype
            result.append(read)
    return result


def _fused(comps: dict[str, dict[str, Instruction]]) -> set[str]:
    """The computations that are a fusion's body."""
    return {c for ops in comps.values() for op in ops.values() for c in _called(op, "calls")}


def _called(op: Instruction, keys: str = "calls|to_apply|body|condition") -> list[str]:
    """The computations ``op`` calls (a fusion's body, a reduction's, a loop's)."""
    return re.findall(rf"(?:{keys})=%([\w.\-]+)", op.attributes)


def _is_gemm(op: Instruction) -> bool:
    return op.opcode == "dot" or (op.opcode == "custom-call" and '"__cublas$' in op.attributes)


def count(items: list[str]) -> str:
    """``["a", "b", "a"]`` as ``"2x a, 1x b"`` (most common first)."""
    return ", ".join(f"{n}x {what}" for what, n in collections.Counter(items).most_common())
