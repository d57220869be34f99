"""examples/train.py, the README's main command, runs and reports what it promises."""

import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import jmp_policy as jp

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("train_example", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # Flax modules are dataclasses: they look themselves up
    spec.loader.exec_module(module)
    return module


def _train(tmp_path, *flags, returncode=0):
    temp = tmp_path / "temp"  # the script's temporary directory
    temp.mkdir(exist_ok=True)
    result = subprocess.run(
        [sys.executable, str(SCRIPT), *flags],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        # this checkout's jmp_policy
        env={**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(temp)},
    )
    assert result.returncode == returncode, result.stderr[-3000:]
    return result


@pytest.mark.heavy(12)
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
        "step time (median",
        "kept for backward, total",
        "  activations (x batch)",
        "  fixed (parameter copies)",
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


def _ratio(table, row):
    return float(next(line for line in table.splitlines() if row in line).split()[-1][:-1])


@pytest.mark.heavy(12)
@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_16_bit_policies_keep_fewer_activation_bytes_even_on_a_cpu(tmp_path, policy):
    """The bytes are read from the traced step, not from XLA's CPU buffers (which keep
    16-bit arithmetic in float32): 16-bit activations are smaller on every device."""
    result = _train(tmp_path, "--steps=3", f"--policy={policy}", "--no-progress")
    out = result.stdout
    assert _ratio(out, "activations (x batch)") < 0.8

    # The total is the activations plus the fixed copies, and the legend says so.
    def mb(row, column):  # the row's MB figure in column 0 (ours) or 1 (float32)
        line = next(line for line in out.splitlines() if row in line)
        return float(re.findall(r"([\d.]+) MB", line)[column])

    for column in (0, 1):
        total = mb("total", column)
        assert abs(total - mb("x batch", column) - mb("fixed (", column)) < 2e-3
    assert "kept for backward = activations, which grow with the batch, + a fixed part" in out
    assert _ratio(out, "parameter bytes") == 1.0  # float32 master weights
    if "on CPU" in out:
        assert "step time (median, CPU)" in out
        assert "No 16-bit speed-up on a CPU: XLA's CPU backend upcasts 16-bit arithmetic" in out
    assert "float8:" not in out and "int8:" not in out
    # Not into the working directory: into the temporary one, and it says where.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["temp"]
    plot = tmp_path / "temp" / "jmp_policy_train_loss.png"
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out.splitlines()[-1] == f"plot of the loss and the loss scale written to {plot}"


def test_help_gives_every_default_and_the_policy_map_keys(tmp_path):
    out = _train(tmp_path, "--help").stdout
    options = re.findall(r"^  (--[a-z-]+)", out, flags=re.MULTILINE)
    assert options == [
        "--policy",
        "--policy-map",
        "--steps",
        "--batch",
        "--hidden",
        "--lr",
        "--seed",
        "--loss-scale-period",
        "--plot",
        "--no-progress",
    ]
    # Each option's help, up to the next option: words, then its default.
    helps = re.split(r"^  --[a-z-]+", out.partition("options:")[2], flags=re.MULTILINE)[1:]
    for option, text in zip(options, helps, strict=True):
        words = " ".join(text.split())
        assert "(default: " in words, (option, words)
        assert len(re.sub(r"\(default: .*\)|[A-Z_]+", "", words).strip()) > 10, (option, words)
    assert "(default: 600)" in helps[2] and "(default: 0.001)" in helps[5]
    plot = "".join(helps[8].split())  # argparse wraps a long path anywhere
    assert f"(default:{tmp_path / 'temp' / 'jmp_policy_train_loss.png'})" in plot
    epilog = out.rpartition("(default: False)")[2]
    assert "--policy-map keys: the model's submodules, head, hidden_0, hidden_1, norm" in epilog


@pytest.mark.heavy(5)
def test_module_names_are_the_policy_map_keys():
    train = _load_script()
    names = train.module_names()
    assert sorted(names) == ["head", "hidden_0", "hidden_1", "norm"]
    policy_map = train.parse_policy_map(",".join(f"{n}=float32" for n in names), "bfloat16")
    model, x = train.MLP(8), jnp.zeros((1, 64))
    variables = model.init(jax.random.key(0), x)
    table = jp.linen.explain(model, policy_map, variables, x)
    assert sorted(re.findall(r"key '(\w+)'", table)) == sorted(names)


def _results(scale):
    steps = 5
    history = {"loss": [2.0, 1.5, 1.0, 0.8, 0.7], "scale": [scale or 1.0] * steps}
    history["skipped"] = [0] * steps
    return {"history": history, "scale": scale}


def test_plot_without_loss_scaling_is_one_panel_that_says_so():
    train = _load_script()
    fig = train.figure("mixed_bfloat16", _results(None), _results(None))
    try:
        (panel,) = fig.axes  # no empty half
        assert panel.get_title() == "mixed_bfloat16: no loss scaling (no float16)"
        ours, base = panel.lines
        # float32 drawn last, dashed and thinner: visible where the two curves agree.
        assert base.get_label() == "float32" and base.get_linestyle() == "--"
        assert base.get_linewidth() < ours.get_linewidth()
    finally:
        train.plt.close(fig)


def test_plot_with_loss_scaling_draws_the_scale():
    train = _load_script()
    fig = train.figure("mixed_float16", _results(2.0**15), _results(None))
    try:
        panel = fig.axes[1]
        assert not panel.texts and panel.get_yscale() == "log"
        assert list(panel.lines[0].get_ydata()) == [2.0**15] * 5
    finally:
        train.plt.close(fig)


def test_saved_bytes_counts_the_residuals_not_the_arguments():
    train = _load_script()
    x = jnp.ones((8, 4))
    assert train.saved_bytes(lambda x: jnp.sum(x), x) == 0  # linear: nothing kept
    assert train.saved_bytes(lambda x: jnp.sum(jnp.sin(x)), x) == 8 * 4 * 4  # cos(x)
    assert train.saved_bytes(lambda x: jnp.sum(jnp.sin(x.astype(jnp.bfloat16))), x) == 64


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--policy=mixed_bflaot16"],
            "argument --policy: Cannot convert value mixed_bflaot16 to a mixed precision Policy. Unknown "
            "dtype or policy name 'mixed_bflaot16'. Did you mean 'mixed_bfloat16'?",
        ),
        (
            ["--policy-map={head: float32}"],
            "argument --policy-map: not valid JSON (Expecting property name enclosed in "
            "double quotes at character 1)",
        ),
        (["--policy-map=[1, 2]"], "argument --policy-map: expected a JSON object"),
        (
            ["--policy-map=head=float33"],
            "argument --policy-map: Cannot interpret the assigned value for key 'head'",
        ),
        (
            ["--policy=int8"],  # #46: it ended in a traceback; the valid choices instead
            "argument --policy: 'int8' computes in int8: training needs a floating compute "
            "dtype. Valid choices: float32, bfloat16, float16, mixed_bfloat16",
        ),
        (
            ["--policy=gptq/4/128_from_float32"],
            "argument --policy: 'gptq/4/128_from_float32' is calibrated after training",
        ),
        (
            ["--policy-map=head=int8"],
            "argument --policy-map: 'head=int8' computes in int8: training needs a floating",
        ),
    ],
)
def test_command_line_mistakes_are_one_line_and_exit_code_2(tmp_path, flags, message):
    result = _train(tmp_path, *flags, returncode=2)
    assert "Traceback" not in result.stderr
    error = [line for line in result.stderr.splitlines() if not line.startswith(("usage", " "))]
    assert len(error) == 1, result.stderr
    assert error[0].startswith(f"train.py: error: {message}"), error[0]
    assert result.stdout == ""


@pytest.mark.heavy(7)
def test_a_typo_in_the_map_warns_once_at_the_scripts_line(tmp_path):
    result = _train(tmp_path, "--steps=2", "--policy-map=haed=float32", "--no-progress")
    warnings = [line for line in result.stderr.splitlines() if "UserWarning" in line]
    assert len(warnings) == 1, result.stderr
    assert warnings[0].startswith(f"{SCRIPT}:"), warnings[0]
    assert "['haed']" in warnings[0] and "closest module paths: 'head'" in warnings[0]


@pytest.mark.heavy(6)
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
    assert result.stdout.startswith("policy map: <DTypePolicyMap default_policy=mixed_bfloat16")
    assert "float8: the float8 layers ran explicit float8 matmuls" in result.stdout
    assert "int8:" not in result.stdout
    # One warning at most (the size warning is given once, not per layer and shape).
    assert len([line for line in result.stderr.splitlines() if "Warning: " in line]) <= 1
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
    with pytest.raises(ValueError, match="expected JSON or 'key=policy"):
        train.parse_policy_map("head", "mixed_bfloat16")


@pytest.mark.heavy(8)
def test_int8_policy_says_int8_matmuls_ran_and_how_weights_shrink(tmp_path):
    result = _train(tmp_path, "--steps=3", "--policy=int8_from_mixed_bfloat16", "--no-progress")
    assert "int8: the int8 layers ran int8 matmuls" in result.stdout
    assert "`jp.linen.quantize` stores them" in result.stdout
    assert "float8:" not in result.stdout


@pytest.mark.heavy(8)
def test_progress_bar_writes_the_scale_as_the_table_does(tmp_path):
    result = _train(tmp_path, "--steps=3", "--policy=mixed_float16", "--plot=loss.png")
    assert "scale=2**15" in result.stderr and "e+" not in result.stderr


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--steps=0"], "argument --steps: expected an integer from 1 to 10,000,000; got '0'"),
        (["--steps=x"], "argument --steps: expected an integer; got 'x'"),
        (["--batch=0"], "argument --batch: expected an integer from 1 to 719 (half the"),
        (["--batch=100000"], "argument --batch: expected an integer from 1 to 719"),
        (["--hidden=-1"], "argument --hidden: expected an integer from 1 to 65,536; got '-1'"),
        (["--lr=nan"], "argument --lr: expected a finite number above 0; got 'nan'"),
        (["--lr=inf"], "argument --lr: expected a finite number above 0; got 'inf'"),
        (["--lr=-1"], "argument --lr: expected a finite number above 0; got '-1'"),
        (["--seed=-3"], "argument --seed: expected an integer from 0 to"),
        (["--loss-scale-period=0"], "argument --loss-scale-period: expected an integer from 1"),
        (["--plot=/nonexistent/dir/loss.png"], "argument --plot: the directory '/nonexistent/dir'"),
    ],
)
def test_bad_numbers_and_paths_are_one_line_before_anything_runs(capsys, flags, message):
    train = _load_script()
    with pytest.raises(SystemExit) as info:
        train.make_parser().parse_args(flags)
    assert info.value.code == 2
    err = capsys.readouterr().err
    error = [line for line in err.splitlines() if not line.startswith(("usage", " "))]
    assert len(error) == 1, err
    assert error[0].split(": error: ", 1)[1].startswith(message), error[0]


def test_steps_0_exits_with_one_line_and_no_traceback(tmp_path):
    result = _train(tmp_path, "--steps=0", returncode=2)
    assert "Traceback" not in result.stderr
    assert "argument --steps: expected an integer from 1" in result.stderr


def test_help_does_not_trace_the_model(monkeypatch):
    train = _load_script()
    assert sorted(train.module_names()) == list(train.MODULE_NAMES)

    def traced(*args, **kwargs):
        raise AssertionError("--help traced the model")

    monkeypatch.setattr(train, "module_names", traced)
    monkeypatch.setattr(train.jax, "eval_shape", traced)
    assert "head, hidden_0, hidden_1, norm" in train.make_parser().format_help()


@pytest.mark.parametrize("flags", [["--help"], ["--steps=0"], ["--lr=nan"]])
def test_help_and_bad_flags_answer_before_jax_and_the_plotting_libraries_load(flags):
    """``--help`` and a mistyped number answer from ``train_cli`` alone: jax, Flax,
    scikit-learn and matplotlib (30-40 s to import on a loaded 2-core machine) never load."""
    code = (
        "import runpy, sys\n"
        f"sys.argv = ['train.py', *{flags!r}]\n"
        "try:\n"
        f"    runpy.run_path({str(SCRIPT)!r}, run_name='__main__')\n"
        "except SystemExit as e:\n"
        "    code = e.code\n"
        "heavy = ('jax', 'flax', 'sklearn', 'matplotlib', 'jmp_policy')\n"
        "print(code, sorted(m for m in heavy if m in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True
    )
    assert result.stdout.splitlines()[-1] == f"{0 if flags == ['--help'] else 2} []"
