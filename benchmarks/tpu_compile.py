"""Compile a JAX program for a Cloud TPU on a machine with no TPU, and read its matmuls.

``libtpu`` (PyPI, the version jax's ``tpu`` extra pins) gives compile-only TPU devices for a
topology name (``jax.experimental.topologies.get_topology_desc(topology_name="v5e:2x2",
platform="tpu")``), as the CUDA PJRT plugin does for ``h100_compile.py``.
``jax.jit(f).lower(*args placed on them).compile()`` runs the TPU compiler, and ``as_text()``
is the optimized HLO the TPU would run. Nothing runs and nothing is timed.

On a TPU a matmul is a ``convolution`` in the optimized HLO, inside an output fusion whose
parameters show what it reads (an s8/s4 weight parameter converted inside: the integer
weights read in place). Those operand types are the same for v5e, v5p and v6e; what differs
is how the compiler schedules each convolution, and its cost model writes an estimate into
the fusion (``"estimated_cycles"``). :func:`matmul_modes` compares those estimates for one
matmul in bf16, int8 x int8 and float8: a format whose matmul is estimated at no fewer
cycles than bf16's has no mode of its own on that generation (its operands are widened for a
bf16 pass). Cost-model estimates, not times: no speed is measured or claimed.

Run with ``JAX_PLATFORMS=cpu`` (set here when unset) and libtpu on ``PYTHONPATH`` only for
this process (``tests/tpu_forms_test.py`` installs it into ``.libtpu/<version>``).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import importlib.util
import os
import re
import sys
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# libtpu holds /tmp/libtpu_lockfile against a second process on the same TPU; nothing here
# touches a TPU, and two compiling processes (two environments' tests) may share a machine.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import h100_compile as hc  # the HLO reader is the H100 check's

TOPOLOGIES = ("v5e:2x2", "v5p:2x2x1", "v6e:2x2")
PROBE = 4096  # the matmul of matmul_modes: large enough to be bound by the MXU, not memory
NATIVE_RATIO = 0.85  # estimated cycles of a format's matmul over bf16's, at most, to be native


def libtpu_pin() -> str:
    """The libtpu version jax's ``tpu`` extra pins (``"0.0.50"`` for ``libtpu==0.0.50.*``)."""
    for requirement in importlib.metadata.requires("jax") or []:
        found = re.match(r"libtpu\s*==\s*([\w.]+?)(\.\*)?\s*;.*extra\s*==\s*\"tpu\"", requirement)
        if found:
            return found.group(1)
    raise RuntimeError(f"jax {jax.__version__} pins no libtpu in its `tpu` extra.")


def libtpu_problem() -> str | None:
    """Why libtpu cannot compile for a TPU here (``None``: it can)."""
    pin = libtpu_pin()
    if importlib.util.find_spec("libtpu") is None:
        return f"Compiling for a TPU needs libtpu {pin}.* (jax {jax.__version__}'s pin): not found"
    version = importlib.metadata.version("libtpu")
    if not (version == pin or version.startswith(pin + ".")):
        return f"Compiling for a TPU needs libtpu {pin}.* (jax {jax.__version__}'s pin), found {version}"
    return None


@functools.cache
def tpu_sharding(topology: str) -> jax.sharding.NamedSharding:
    """A replicated sharding over one compile-only chip of ``topology`` (``"v5e:2x2"``)."""
    from jax.experimental import topologies

    problem = libtpu_problem()
    if problem:
        raise RuntimeError(problem)
    devices = topologies.get_topology_desc(topology_name=topology, platform="tpu").devices
    mesh = jax.sharding.Mesh(devices[:1], ("x",))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def device_kind(topology: str) -> str:
    return tpu_sharding(topology).mesh.devices.flat[0].device_kind  # "TPU v5 lite"


def on_tpu(tree: Any, topology: str) -> Any:
    """Each array (or ``ShapeDtypeStruct``) of ``tree`` as an abstract argument on the TPU."""
    sharding = tpu_sharding(topology)
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), tree)


def compile_for_tpu(fn: Any, args: tuple[Any, ...]) -> str:
    """XLA's optimized HLO of ``jax.jit(fn)(*args)``, ``args`` placed by :func:`on_tpu`."""
    return jax.jit(fn).lower(*args).compile().as_text()


# -- reading the optimized HLO ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Matmul:
    """A ``convolution`` (or ``dot``) of the optimized HLO, with its operands' element types
    as it multiplies them and as its fusion reads them."""

    computation: str
    lhs: str
    rhs: str
    result: str
    lhs_read: str
    rhs_read: str
    cycles: int  # the cost model's estimate for the fusion that holds it (0: none found)

    @property
    def is_int8(self) -> bool:
        return (self.lhs, self.rhs, self.result) == ("s8", "s8", "s32")

    @property
    def is_float8(self) -> bool:
        return self.lhs.startswith("f8") and self.rhs.startswith("f8")

    @property
    def reads_int_weights(self) -> str | None:
        """``"s8"``/``"s4"`` when an operand is integer weights read by a float matmul: an
        operand of the convolution (which multiplies bf16 by s8/s4) or converted inside its
        fusion; ``None`` for an integer matmul, or weights read in a float type."""
        for read, other in ((self.lhs_read, self.rhs), (self.rhs_read, self.lhs)):
            if read in ("s8", "s4") and other not in ("s8", "s4"):
                return read
        return None

    def describe(self) -> str:
        def side(operand: str, read: str) -> str:
            return hc._short(operand) if operand == read else f"{read}->{hc._short(operand)}"

        lhs, rhs = side(self.lhs, self.lhs_read), side(self.rhs, self.rhs_read)
        return f"{lhs} x {rhs} -> {hc._short(self.result)}"


def _cycles(comps: dict[str, dict[str, hc.Instruction]]) -> dict[str, int]:
    """``{fused computation: estimated cycles}`` from the fusions that call them."""
    found = {}
    for ops in comps.values():
        for op in ops.values():
            estimate = re.search(r'"estimated_cycles":"(\d+)"', op.attributes)
            for called in hc._called(op, "calls"):
                found[called] = int(estimate.group(1)) if estimate else 0
    return found


def matmuls(hlo: str) -> list[Matmul]:
    """Every matmul (``convolution`` or ``dot``) of optimized TPU HLO text."""
    comps = hc.computations(hlo)
    fused, cycles = hc._fused(comps), _cycles(comps)
    result = []
    for computation, ops in comps.items():
        for op in ops.values():
            if op.opcode not in ("convolution", "dot"):
                continue
            lhs, rhs = (hc._dtype(ops.get(o)) for o in op.operands[:2])
            nested = computation in fused
            reads = [hc._dtype(hc._source(comps, computation, o, nested)) for o in op.operands[:2]]
            cost = cycles.get(computation, 0)
            result.append(Matmul(computation, lhs, rhs, op.dtype, *reads, cost))
    return result


def float_copies(hlo: str, min_elements: int) -> list[str]:
    """Kernels outside a matmul's fusion that write an s8/s4 array of at least
    ``min_elements`` elements (the weights) in a float type: a dequantized copy."""
    comps = hc.computations(hlo)
    fused = hc._fused(comps)
    with_matmul = {
        name for name, ops in comps.items() if any(o.opcode == "convolution" for o in ops.values())
    }
    found = []
    for name, ops in comps.items():
        if name in fused:
            continue
        for op in ops.values():
            if op.dtype in ("s8", "s4", "s32", "pred", "token") or op.size < min_elements:
                continue
            if any(c in with_matmul for c in hc._called(op)):
                continue
            reads = [hc._source(comps, name, o, nested=False) for o in op.operands]
            ints = [r for r in reads if r and r.dtype in ("s8", "s4") and r.size >= min_elements]
            if ints:
                dims = ",".join(map(str, op.shape))
                found.append(f"{ints[0].dtype} copy -> {op.dtype}[{dims}] ({op.name})")
    return found


# -- which formats have a matmul mode of their own on a TPU generation ------------------------

MODE_FORMATS = {  # format -> (lhs, rhs, result)
    "bf16": ("bfloat16", "bfloat16", "float32"),
    "int8 x int8": ("int8", "int8", "int32"),
    "float8": ("float8_e4m3fn", "float8_e4m3fn", "float32"),
}


def matmul_modes(topology: str) -> dict[str, float]:
    """Each format of :data:`MODE_FORMATS`: the estimated cycles of a ``PROBE``-cubed matmul
    on ``topology`` over bf16's (at most :data:`NATIVE_RATIO`: the format has a mode of its
    own; about 1: its operands go through a bf16 pass)."""
    cycles = {}
    for name, (a, b, out) in MODE_FORMATS.items():

        def fn(x: Any, y: Any, out: Any = out) -> Any:
            return jax.lax.dot_general(x, y, (((1,), (0,)), ((), ())), preferred_element_type=out)

        shapes = (jax.ShapeDtypeStruct((PROBE, PROBE), a), jax.ShapeDtypeStruct((PROBE, PROBE), b))
        args = on_tpu(shapes, topology)
        (found,) = matmuls(compile_for_tpu(fn, args))
        cycles[name] = found.cycles
    return {name: round(c / cycles["bf16"], 2) for name, c in cycles.items()}
