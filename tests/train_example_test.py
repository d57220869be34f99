"""examples/train.py, the README's main command, runs and reports what it promises."""

import importlib.util
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("train_example", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # Flax modules are dataclasses: they look themselves up
    spec.loader.exec_module(module)
    return module


def _train(tmp_path, *flags):
    result = subprocess.run(
        [sys.executable, str(SCRIPT), *flags],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_short_float16_run_prints_the_table_and_writes_the_plot(tmp_path):
    plot = tmp_path / "loss.png"
    result = _train(
        tmp_path,
        "--steps=20",
        "--policy=mixed_float16",
        "--policy-map=head=float32,norm=float32",
        "--loss-scale-period=5",
        f"--plot={plot}",
    )
    out = result.stdout
    assert "loss scaling: dynamic" in out
    table = out[out.index("20 steps of batch 128") : out.index("parameters stored in")]
    for row in [
        "final train loss",
        "test accuracy",
        "step time (median)",
        "activation bytes (backward)",
        "parameter bytes",
        "skipped steps",
        "final loss scale",
    ]:
        assert row in table, row
    assert "mixed_float16 + map" in table and "float32" in table
    assert max(len(line) for line in table.splitlines()) <= 100
    # Float32 master weights: the same parameter bytes; the float32 run has no loss scale.
    assert "1.000x" in next(line for line in table.splitlines() if "parameter bytes" in line)
    scale_row = next(line for line in table.splitlines() if "final loss scale" in line)
    assert "- (none)" in scale_row and "2**" in scale_row
    assert f"written to {plot}" in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "it/s" in result.stderr  # the tqdm progress bar


def test_float8_policy_trains_with_its_state_split_off_the_gradients(tmp_path):
    """A float8 policy on the hidden layers: the script creates and carries the state."""
    result = _train(
        tmp_path,
        "--steps=30",
        "--policy=mixed_bfloat16",
        "--policy-map=hidden_.*=float8_from_mixed_bfloat16,head=float32",
        "--no-progress",
        f"--plot={tmp_path / 'loss.png'}",
    )
    table = result.stdout[result.stdout.index("30 steps of batch 128") :]
    accuracy = next(line for line in table.splitlines() if "test accuracy" in line).split()
    assert float(accuracy[2]) > 0.8 and abs(float(accuracy[2]) - float(accuracy[3])) < 0.05


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"head": "float32", "hidden_.*": "mixed_float16"}', {"head", "hidden_.*"}),
        ("head=float32, hidden_0=p=f32,c=f16,o=f32", {"head", "hidden_0"}),
    ],
)
def test_policy_map_option_takes_json_or_key_value_list(text, expected):
    train = _load_script()
    policy_map = train.parse_policy_map(text, "mixed_bfloat16")
    assert set(policy_map) == expected
    assert str(policy_map.default_policy.compute_dtype) == "bfloat16"
    assert train.uses_float16(policy_map) == ("f16" in text or "float16" in text)


def test_policy_map_option_rejects_an_item_without_a_policy():
    train = _load_script()
    with pytest.raises(SystemExit, match="--policy-map: expected JSON or 'key=policy"):
        train.parse_policy_map("head", "mixed_bfloat16")
