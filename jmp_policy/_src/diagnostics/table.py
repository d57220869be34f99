"""Rendering a diagnostics report: the first non-finite value, then a table sorted by risk."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from jmp_policy._src.diagnostics.report import Report
from jmp_policy._src.diagnostics.stats import Stats
from jmp_policy._src.dtypes import bounded_repr

_PATH_WIDTH = 34
_HEADER = (
    f"{'path':<{_PATH_WIDTH}} {'dtype':<8} {'where':<8} {'max|x|':>10} "
    f"{'non-finite':>10} {'underflow':>9} {'near-max':>9}"
)
_UNTAPPED_SHOWN = 8
_WHERE = {"inputs": "input", "outputs": "output", "gradients": "gradient"}
_SITE = {"inputs": "forward input", "outputs": "forward output", "gradients": "backward gradient"}


def _host(stats: Stats) -> dict[str, float]:
    """Concrete values; a report stacked over steps (``scan``) is reduced over them."""
    values = {
        f.name: np.asarray(jax.device_get(getattr(stats, f.name)))
        for f in dataclasses.fields(stats)
    }
    out = {name: float(v.sum()) for name, v in values.items()}
    out["max_abs"] = float(values["max_abs"].max()) if values["max_abs"].size else 0.0
    return out


def _fraction(part: float, whole: float) -> float:
    return part / whole if whole else 0.0


def _percent(fraction: float) -> str:
    if fraction == 0:
        return "0%"
    if fraction < 1e-4:
        return "<0.01%"
    return f"{100 * fraction:.2f}%"


def _short(path: str) -> str:
    path = path or "(root)"
    return path if len(path) <= _PATH_WIDTH else "..." + path[-(_PATH_WIDTH - 3) :]


def first_non_finite(report: Report) -> str | None:
    """``"<path> (forward output)"`` for the first site, in execution order, with a
    non-finite value (the backward pass runs in reverse order, after the forward one)."""
    forward = []
    for info in report.paths:
        for site, seq in (("inputs", info.input_seq), ("outputs", info.output_seq)):
            stats = getattr(report, site).get(info.path)
            if stats is not None and _host(stats)["non_finite"] > 0:
                forward.append((seq, info.path, site))
    if forward:
        _, path, site = min(forward)
        return f"{path or '(root)'} ({_SITE[site]})"
    backward = []
    for info in report.paths:
        stats = report.gradients.get(info.path)
        if stats is not None and _host(stats)["non_finite"] > 0:
            backward.append((-info.output_seq, info.path))
    if backward:
        return f"{min(backward)[1] or '(root)'} ({_SITE['gradients']})"
    return None


def _check_arguments(report: Any, max_rows: Any) -> None:
    if not isinstance(report, Report):
        raise TypeError(
            "`report` must be the report of a `diagnose` function. Received: "
            f"report={bounded_repr(report)} (of type {type(report).__name__})"
        )
    if max_rows is not None and (
        isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 0
    ):
        raise TypeError(
            f"`max_rows` must be None or an int >= 0. Received: max_rows={bounded_repr(max_rows)}"
        )


def format_report(report: Report, max_rows: int | None = None) -> str:
    """Renders a diagnostics report as text: where the first non-finite value appeared,
    then one row per module path and place (input, output, gradient), riskiest first.

    The first line names the first submodule, in execution order, where a non-finite
    value appeared ("first non-finite: encoder/mlp (forward output)"), or says there was
    none. Rows are sorted by risk: those with non-finite values first, in execution order
    (so they show how the values spread), then by the fraction of values within a factor
    2 of the compute dtype's largest value (``near-max``: about to overflow), then by the
    fraction of nonzero values below its smallest normal (``underflow``: precision lost,
    then flushed to zero; gradients without loss scaling), ties in execution order.
    ``max|x|`` is the largest finite absolute value (``none`` when every value is
    non-finite). Lines are at most 100 columns; long paths keep their end. This reads the
    report's values, so
    it synchronises with the device: call it outside ``jit``. A report stacked over steps
    (the output of ``scan``) is summarised over them. With ``every > 1`` it says on how
    many steps the statistics were computed, and the paths a ``paths`` filter left out
    are listed (the first 8) at the end.

    Args:
        report: a report from ``jmp_policy.linen.diagnose`` or ``jmp_policy.nnx.diagnose``
            (with :meth:`Report.with_gradients` applied for backward rows).
        max_rows: show at most this many rows (the riskiest); ``None`` shows all.

    Returns:
        The table as a string.

    Raises:
        TypeError: ``report`` is not a diagnostics report, or ``max_rows`` not an int.

    Examples:
        >>> import jax.numpy as jnp
        >>> import flax.linen as nn
        >>> import jmp_policy as jp
        >>> class Model(nn.Module):
        ...     @nn.compact
        ...     def __call__(self, x):
        ...         x = nn.Dense(4, name="body")(x)
        ...         return nn.Dense(2, name="head")(x * 1e5)   # overflows float16
        >>> model = Model()
        >>> variables = model.init(jax.random.key(0), jnp.ones((1, 3)))
        >>> out, report = jp.linen.diagnose(model, "float16")(variables, jnp.ones((1, 3)))
        >>> print(jp.format_report(report).splitlines()[0])
        first non-finite: head (forward input)
    """
    _check_arguments(report, max_rows)
    sampled, steps = _sampled_steps(report)
    first = first_non_finite(report)
    if sampled == 0:
        lines = [f"first non-finite: not measured (no step sampled; every={report.every})"]
    else:
        lines = [f"first non-finite: {first or 'none'}"]
    rows = []
    last = max((max(p.input_seq, p.output_seq) for p in report.paths), default=0)
    for order, info in enumerate(report.paths):
        for site in ("inputs", "outputs", "gradients"):
            stats = getattr(report, site).get(info.path)
            if stats is None:
                continue
            v = _host(stats)
            under = _fraction(v["underflow"], v["size"])
            near = _fraction(v["near_overflow"], v["size"])
            if v["non_finite"] > 0:  # in execution order: how the values spread
                seq = {"inputs": info.input_seq, "outputs": info.output_seq}.get(site)
                key: tuple[float, ...] = (0, 2 * last - info.output_seq if seq is None else seq)
            else:
                key = (1, -near, -under, order)
            rows.append((key, info, site, v, under, near))
    rows.sort(key=lambda r: r[0])
    if sampled == 0:
        rows = []
    lines.append(_HEADER)
    shown = rows if max_rows is None else rows[:max_rows]
    for _, info, site, v, under, near in shown:
        # No finite value at all: its largest finite value is not 0, it does not exist.
        largest = "none" if v["size"] and v["non_finite"] >= v["size"] else f"{v['max_abs']:.3g}"
        lines.append(
            f"{_short(info.path):<{_PATH_WIDTH}} {info.dtype:<8} {_WHERE[site]:<8} "
            f"{largest:>10} {int(v['non_finite']):>10d} {_percent(under):>9} "
            f"{_percent(near):>9}"
        )
    if len(shown) < len(rows):
        lines.append(f"... {len(rows) - len(shown)} more row(s)")
    if report.every > 1:
        lines.append(
            f"sampled: {sampled} of {steps} step(s) (statistics on one step in {report.every})"
        )
    if not report.gradients and sampled:
        lines.append("gradients: not collected (differentiate with respect to `probe`)")
    if report.skipped:
        lines.append("not collected (called inside a transform of their own):")
        lines += [f"  {_short(p)}" for p in report.skipped]
    if report.untapped:
        shown_paths = report.untapped[:_UNTAPPED_SHOWN]
        lines.append(f"not tapped (left out by `paths`): {len(report.untapped)} path(s)")
        lines += [f"  {_short(p)}" for p in shown_paths]
        if len(report.untapped) > len(shown_paths):
            lines.append(f"  ... {len(report.untapped) - len(shown_paths)} more")
    return "\n".join(lines)


def _sampled_steps(report: Report) -> tuple[int, int]:
    """How many steps the report's statistics were computed on, of how many."""
    if report.sampled is None:
        return 1, 1
    sampled = np.asarray(jax.device_get(report.sampled))
    return int(sampled.sum()), int(sampled.size)
