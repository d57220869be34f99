"""A calibration report as lines under an ``explain`` table (``explain(...,
calibration=report)``, Linen and NNX)."""

from __future__ import annotations

import numbers
from typing import Any

import jax

from jmp_policy._src import dtypes as dt
from jmp_policy._src.explain import INDENT, SEP
from jmp_policy._src.quantization import quantized_array as quantization
from jmp_policy._src.quantization.calibration import LayerReport
from jmp_policy._src.tree_paths import leaf_path

_TEXT = ("path", "method")
_NUMBERS = ("rtn_error", "error", "seconds")


def _check_rows(report: Any, params: Any) -> None:
    """Each row's fields of their types, and (with ``params``) its kernel in the model."""
    for i, r in enumerate(report):
        for name in _TEXT + _NUMBERS:
            value = getattr(r, name)
            ok = isinstance(value, str) if name in _TEXT else isinstance(value, numbers.Real)
            if not ok or isinstance(value, bool):
                kind = "a string" if name in _TEXT else "a real number"
                raise TypeError(
                    f"`calibration[{i}].{name}` must be {kind}, as `calibrate(..., "
                    f"return_report=True)` writes it. Received: calibration[{i}].{name}="
                    f"{dt.bounded_repr(value)}"
                )
    if params is None:
        return
    flat = jax.tree_util.tree_flatten_with_path(params, is_leaf=quantization.is_quantized)[0]
    known = {leaf_path(kp) for kp, _ in flat}
    missing = [r.path for r in report if r.path.partition("[")[0] not in known]
    if missing:
        raise ValueError(
            f"`calibration` lists kernels the model does not have: {missing[:5]!r}"
            f"{' ...' if len(missing) > 5 else ''} (a report of another model?). Give the "
            "report `calibrate(..., return_report=True)` returned for this model."
        )


def format_calibration(report: Any, params: Any = None) -> str:
    """A calibration report (``calibrate(..., return_report=True)``'s list of
    ``LayerReport``) as lines under an explain table (``""`` for ``None``): per calibrated
    kernel, its method, the relative output error ``|XW - XŴ| / |XW|`` on the
    calibration inputs of round-to-nearest and of the method, and the seconds its solve
    took.

    Raises:
        TypeError: ``report`` is not a list or tuple of ``LayerReport``, or a row's
            field is not of its type.
        ValueError: a row names a kernel ``params`` (the model's, when given) lacks.

    Examples:
        >>> from jmp_policy._src.calibration_report import format_calibration
        >>> from jmp_policy._src.quantization.calibration import LayerReport
        >>> print(format_calibration([LayerReport("up/kernel", "gptq", 0.0812, 0.0413, 1.25)]))
        <BLANKLINE>
        calibrated (output error on the calibration inputs: round to nearest -> method):
          up/kernel  gptq  8.12% -> 4.13%  1.2 s
    """
    if report is None:
        return ""
    if not isinstance(report, (list, tuple)) or not all(isinstance(r, LayerReport) for r in report):
        raise TypeError(
            "`calibration` must be the report `calibrate(..., return_report=True)` returns "
            f"(a list of LayerReport), or None. Received: calibration={report!r:.200}"
        )
    if not report:
        return ""
    _check_rows(report, params)
    width = max(len(r.path) for r in report)
    method = max(len(r.method) for r in report)
    lines = ["", "calibrated (output error on the calibration inputs: round to nearest -> method):"]
    for r in report:
        lines.append(
            f"{INDENT}{r.path:<{width}}{SEP}{r.method:<{method}}{SEP}"
            f"{r.rtn_error:.2%} -> {r.error:.2%}{SEP}{r.seconds:.1f} s"
        )
    return "\n".join(lines)
