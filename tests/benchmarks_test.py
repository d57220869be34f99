"""benchmarks/run_all.py --quick runs every benchmark and prints one table (no timing checks)."""

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_run_all_quick_prints_one_table_of_ratios():
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "run_all.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    rows = [line for line in lines if re.search(r"\s\d+\.\d{3}x$", line)]
    benchmarks = {line.split()[0] for line in rows}
    assert benchmarks == {"linen", "loss", "policy", "quantization"}, rows
    assert all(len(line) <= 100 for line in lines)
    # The deterministic columns: zero overhead against casting by hand.
    by_hand = {re.split(r"\s{2,}", line)[1]: line for line in rows if "by hand" in line}
    assert by_hand["convert ops"].endswith(" 1.000x")
    assert next(v for k, v in by_hand.items() if k.startswith("activation bytes")).endswith(
        " 1.000x"
    )
    assert any("apply_if_finite" in line for line in rows)
    int8 = next(line for line in rows if "parameter bytes, int8" in line)
    assert float(int8.split()[-1].rstrip("x")) <= 0.28  # int8 kernels + float32 biases
