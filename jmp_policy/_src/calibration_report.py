"""A calibration report as lines under an ``explain`` table (``explain(...,
calibration=report)``, Linen and NNX)."""

from __future__ import annotations

from typing import Any

from jmp_policy._src.explain import INDENT, SEP
from jmp_policy._src.quantization.calibration import LayerReport


def format_calibration(report: Any) -> str:
    """A calibration report (``calibrate(..., return_report=True)``'s list of
    ``LayerReport``) as lines under an explain table (``""`` for ``None``): per calibrated
    kernel, its method, the relative output error ``|XW - XŴ| / |XW|`` on the
    calibration inputs of round-to-nearest and of the method, and the seconds its solve
    took.

    Raises:
        TypeError: ``report`` is not a list or tuple of ``LayerReport``.

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
    width = max(len(r.path) for r in report)
    method = max(len(r.method) for r in report)
    lines = ["", "calibrated (output error on the calibration inputs: round to nearest -> method):"]
    for r in report:
        lines.append(
            f"{INDENT}{r.path:<{width}}{SEP}{r.method:<{method}}{SEP}"
            f"{r.rtn_error:.2%} -> {r.error:.2%}{SEP}{r.seconds:.1f} s"
        )
    return "\n".join(lines)
