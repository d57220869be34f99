"""benchmarks/run_all.py --quick runs every benchmark and prints one table (no timing checks)."""

import os
import pathlib
import re
import subprocess
import sys

import jax

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _run(script, *flags):
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *flags],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},  # this checkout's jmp_policy
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_run_all_quick_prints_one_table_of_ratios():
    result = _run("run_all.py", "--quick")
    lines = result.stdout.splitlines()
    rows = [line for line in lines if re.search(r"\s\d+\.\d{3}x$", line)]
    benchmarks = {line.split()[0] for line in rows}
    assert benchmarks == {"linen", "loss", "policy", "quantization", "float8"}, rows
    assert all(len(line) <= 100 for line in lines)
    # The deterministic columns: zero overhead against casting by hand.
    by_hand = {re.split(r"\s{2,}", line)[1]: line for line in rows if "by hand" in line}
    assert by_hand["convert ops"].endswith(" 1.000x")
    assert next(v for k, v in by_hand.items() if k.startswith("activation bytes")).endswith(
        " 1.000x"
    )
    assert any("apply_if_finite" in line for line in rows)
    # Against float32: the activations the step keeps, read from its trace (16-bit on any
    # device, where XLA's CPU temp bytes are not), and timings labelled CPU on a CPU.
    activations = next(line for line in rows if "activations kept for backward" in line)
    assert float(activations.split()[-1].rstrip("x")) < 0.8
    if jax.default_backend() == "cpu":
        cells = [re.split(r"\s{2,}", line) for line in rows]
        timed = [c[1] for c in cells if c[1].startswith("step time") and c[3] == "float32"]
        assert timed and all(what == "step time, CPU" for what in timed), timed
        assert lines[-1] == (
            "No speed-up on a CPU: XLA's CPU backend upcasts 16-bit arithmetic to float32."
        )
    int8 = next(line for line in rows if "parameter bytes, int8" in line)
    assert float(int8.split()[-1].rstrip("x")) <= 0.28  # int8 kernels + float32 biases
    # float8: every float8 convert where expected (6 per Dense: input, kernel and output
    # gradient, each to and from float8), and training tracks bf16.
    float8 = {re.split(r"\s{2,}", line)[1]: line for line in rows if line.startswith("float8")}
    assert float8["float8 converts"].endswith(" 1.000x")
    assert float8["dots in fp8 GEMM form"].endswith(" 1.000x")
    loss = next(v for k, v in float8.items() if k.startswith("loss after"))
    assert float(loss.split()[-1].rstrip("x")) < 0.05  # of the first loss


def test_float8_bench_quick_prints_its_table_and_the_loss_gap():
    result = _run("float8_bench.py", "--quick")
    lines = result.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("variant"))
    table = {line.split()[0]: line.split() for line in lines[start : start + 6]}
    assert set(table) == {"variant", "float8", "f8_cur", "flax_f8", "bf16", "float32"}
    # columns: variant, step ms, /, fwd ms, /, temp MB, /, f8 cvt, f8 dots, f8 GEMMs, loss, -bf16
    assert table["bf16"][7] == table["float32"][7] == "0"
    # Every dot of the step (4 Dense: forward and two backward) on float8 operands.
    for name in ("float8", "f8_cur", "flax_f8"):
        assert table[name][8] == "12/12", table[name]
    assert table["bf16"][8] == "0/12"
    if jax.default_backend() == "cpu":  # no float8 GEMMs there
        assert table["float8"][9] == "0/12"
    assert lines[-1].endswith("float8 state finite: True")
    assert table["bf16"][-1] == "+0.0000"
    for name in ("float8", "f8_cur"):  # loss - bf16's, over the first loss
        assert abs(float(table[name][-1])) < 0.05
    assert all(len(line) <= 100 for line in lines)


def test_serving_bench_quick_prints_every_variant_and_form():
    result = _run("serving_bench.py", "--quick")
    lines = result.stdout.splitlines()
    rows = [line for line in lines if line.split()[:1] in (["1"], ["16"], ["256"])]
    assert len(rows) == 3 * 4
    assert "int8 weights: weight-only, scale after" in rows[1]
    assert "int4 weights: weight-only, scale after" in rows[2]
    assert rows[-1].split()[1:4] == ["int8", "x", "int8"] and rows[-1].endswith("int8 x int8")
    # weight bytes per token: int8 about half of bf16's, int4 about a quarter
    numbers = [re.findall(r"\b\d+(?:\.\d+)?(?:e[+-]\d+)?\b", row) for row in rows[:3]]
    per_token = [float(n[3]) for n in numbers]  # batch, time, ratio, bytes, error
    assert per_token[1] < 0.55 * per_token[0] and per_token[2] < 0.3 * per_token[0]
