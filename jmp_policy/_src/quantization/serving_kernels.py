"""Whether a weight-only matmul runs the library's Pallas kernel or XLA's form.

The apply wrappers' ``serving_kernel`` option (:data:`SERVING_KERNELS`), held for the
run (:func:`using`), and the rule :func:`jmp_policy._src.quantization.kernel_matmul.kernel_form`
asks at trace time (:func:`pallas_rows`):

* ``"auto"`` (the default): the kernel on a GPU whose kind :data:`PALLAS_MAX_ROWS` lists,
  up to its rows; XLA's form everywhere else. The table is empty: on an H100 (2026-11-27)
  XLA's weight-only form was the faster at every measured shape of 1 to 16 rows, so
  ``"auto"`` is XLA's form everywhere.
* ``"pallas"``: the kernel on any GPU up to :data:`~jmp_policy._src.quantization.pallas_matmul.MAX_ROWS`
  rows (opt-in); XLA's form on CPUs, TPUs and at more rows.
* ``"xla"``: XLA's form everywhere.

The GPU is the one the program is traced for: the abstract mesh's device when one is
set (compiling for a GPU without one, as Pallas's own lowering reads it), else the
default device.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import jax

from jmp_policy._src.dtypes import bounded_repr
from jmp_policy._src.quantization import pallas_matmul

SERVING_KERNELS = ("auto", "pallas", "xla")

# GPU kind (a prefix of `device_kind`, e.g. "NVIDIA H100") -> the most rows at which the
# Pallas kernel is the default ("auto"). Filled from measurements only (pallas_tune.py and
# serving_bench's kernel rows, docs/benchmarks.md). "NVIDIA H100" measured (jax 0.11.2,
# 2026-11-27): XLA's form faster at 1, 16 and 64 rows for int8, int4 and int4/128 (except
# int4/128 at 64 rows of an 8192 kernel), so no entry: the kernel runs only when asked for.
PALLAS_MAX_ROWS: dict[str, int] = {}

_CHOICE: contextvars.ContextVar[str] = contextvars.ContextVar(
    "jmp_policy_serving_kernel", default="auto"
)
# Tests run the kernel's route on CPUs in Pallas's interpreter (never set by users).
_INTERPRET: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "jmp_policy_pallas_interpret", default=False
)


def check(value: Any) -> str:
    """``value`` of the ``serving_kernel`` option, checked."""
    if not isinstance(value, str) or value not in SERVING_KERNELS:
        raise ValueError(
            "`serving_kernel` must be 'auto' (the Pallas kernel where measured faster: no "
            "GPU so far), 'pallas' (the Pallas kernel on GPUs at up to "
            f"{pallas_matmul.MAX_ROWS} rows) or 'xla' (XLA's matmul everywhere). Received: "
            f"serving_kernel={bounded_repr(value)}"
        )
    return value


@contextlib.contextmanager
def using(value: str) -> Iterator[None]:
    """Inside the block, weight-only matmuls follow the ``serving_kernel`` ``value``."""
    token = _CHOICE.set(value)
    try:
        yield
    finally:
        _CHOICE.reset(token)


@contextlib.contextmanager
def interpreted() -> Iterator[None]:
    """Inside the block the kernel runs in Pallas's interpreter, on any backend as if on a
    GPU (for tests on CPUs)."""
    token = _INTERPRET.set(True)
    try:
        yield
    finally:
        _INTERPRET.reset(token)


def interpret() -> bool:
    """Whether the kernel runs in Pallas's interpreter (:func:`interpreted`)."""
    return _INTERPRET.get()


def target_gpu() -> str | None:
    """The device kind of the GPU the program is traced for, ``None`` for another device."""
    if _INTERPRET.get():
        return "interpreted"
    abstract = jax.sharding.get_abstract_mesh()
    device = getattr(abstract, "abstract_device", None)  # jax >= 0.11
    if device is None:
        device = jax.devices()[0]
    if device.platform not in ("gpu", "cuda", "rocm"):
        return None
    return str(device.device_kind)


def pallas_rows() -> int:
    """The most rows at which the kernel runs here (``0``: never), by the option in force
    and the GPU the program is traced for."""
    choice = _CHOICE.get()
    kind = target_gpu()
    if choice == "xla" or kind is None:
        return 0
    if choice == "pallas":
        return pallas_matmul.MAX_ROWS
    return max([r for k, r in PALLAS_MAX_ROWS.items() if kind.startswith(k)], default=0)
