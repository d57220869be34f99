"""benchmarks/run_all.py --quick runs every benchmark and prints one table (no timing checks)."""

import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_policy as jp_policy

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _is_time(cell):
    """A time as ``format_value`` writes one, in whichever unit its size takes ("0.76 ms",
    "1.47 s" on a loaded machine): what a time reads as is never asserted."""
    return re.fullmatch(r"\d[\d,]*(\.\d+)? (ms|s)", cell) is not None


def _run(script, *flags):
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *flags],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},  # this checkout's jmp_policy
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def _sections(stdout):
    """run_all's table: {benchmark: (heading, rows)}, each row its six cells."""
    sections = {}
    for line in stdout.splitlines():
        if re.match(r"[a-z0-9][a-z0-9 ]*: ", line):  # a heading
            rows = []
            sections[line.partition(":")[0]] = (line, rows)
        elif line.startswith("  ") and not line.startswith("   ") and sections:
            if line.strip().startswith("-"):
                continue
            rows.append(re.split(r"\s{2,}", line.strip()))
    return sections


def _number(cell, unit):
    value, _, got = cell.partition(" ")
    assert got == unit, cell
    return float(value.replace(",", ""))


@pytest.mark.heavy(30)
def test_run_all_quick_prints_values_beside_ratios_in_plain_words():
    result = _run("run_all.py", "--quick")
    lines = result.stdout.splitlines()
    # A line of findings after each benchmark's rows, and what quick sizes cannot show.
    found = [line for line in lines if line.startswith("=> ")]
    assert len(found) == 5, result.stdout
    assert found[0].startswith("=> jp.linen.apply compiles to what casting by hand does")
    assert "of the first loss (bf16:" in result.stdout
    assert "Quick sizes are too small to time" in result.stdout
    assert all(len(line) <= 100 for line in lines)
    header = lines[1].split()
    assert header == ["what", "ours", "value", "against", "value", "ratio"]
    sections = _sections(result.stdout)
    assert list(sections) == ["linen", "loss scale", "policy map", "quantization", "float8"]
    for heading, rows in sections.values():
        assert rows and all(len(row) == 6 for row in rows), (heading, rows)
        for _, _, ours, _, against, ratio in rows:  # the ratio is of the values shown
            if ratio != "-":
                a, b = (float(re.match(r"[\d.,]+", v)[0].replace(",", "")) for v in (ours, against))
                if ours.split()[1:] == against.split()[1:]:  # same unit
                    assert abs(float(ratio.rstrip("x")) - a / b) <= 0.02 * a / b + 0.01, rows

    _, linen = sections["linen"]
    by_hand = {row[0]: row for row in linen if row[3] == "cast by hand"}
    # Zero overhead against casting by hand: the same compiled program.
    assert by_hand["convert ops"][2] == by_hand["convert ops"][4]
    assert by_hand["convert ops"][5] == "1.000x"
    temp = by_hand["XLA temp memory"]
    assert temp[2] == temp[4] and temp[2].endswith(("KB", "MB")) and temp[5] == "1.000x"
    for row in ("step time", "trace time"):
        assert _is_time(by_hand[row][2]) and _is_time(by_hand[row][4]), by_hand[row]
    # Against float32: the activations the step keeps, read from its trace (16-bit on any
    # device, where XLA's CPU temp bytes are not), and timings labelled CPU on a CPU.
    f32 = {row[0]: row for row in linen if row[3] == "float32"}
    kept = f32["activations kept for backward"]
    assert _number(kept[2], "KB") < 0.8 * _number(kept[4], "KB")
    assert float(kept[5].rstrip("x")) < 0.8
    if jax.default_backend() == "cpu":
        timed = [row[0] for _, rows in sections.values() for row in rows if "time" in row[0]]
        assert "step time, CPU" in timed and "update time, CPU" in timed
        assert lines[-1] == (
            "No speed-up on a CPU: XLA's CPU backend upcasts 16-bit arithmetic to float32."
        )

    heading, loss_scale = sections["loss scale"]
    assert "one adam update of" in heading
    assert {row[3] for row in loss_scale} == {"plain adam", "jmp-style by hand", "apply_if_finite"}
    assert all(row[1] == "jp.loss_scaling" for row in loss_scale)
    assert all(row[2].endswith("MB") for row in loss_scale if row[0] == "bytes read and written")

    # The policy map against Keras's, the README's peer; not against itself.
    heading, policy_map = sections["policy map"]
    assert [row[0] for row in policy_map] == [
        "1,000 module lookups",
        "whole tree (20,000 variables)",
    ]
    assert all(row[1] == "jp.DTypePolicyMap" and row[3].startswith("Keras") for row in policy_map)
    assert all(_is_time(row[2]) for row in policy_map), policy_map
    if "Keras not installed" in heading:
        assert all(row[4:] == ["-", "-"] for row in policy_map)
    else:
        assert all(_is_time(row[4]) and row[5].endswith("x") for row in policy_map), policy_map

    _, quantization = sections["quantization"]
    quantized = {(row[0], row[1]): row for row in quantization}
    int8 = quantized["parameter bytes", "int8"]
    assert float(int8[5].rstrip("x")) <= 0.28  # int8 kernels + float32 biases
    assert int8[2].endswith("KB") and int8[3] == "float32"
    error = quantized["output error vs float32's", "int8"]
    assert error[2].endswith("%") and float(error[2][:-1]) < 2 and error[5] == "-"

    # float8: every float8 convert where expected (3 per Dense in the program jax lowers:
    # input, kernel and output gradient), every dot on float8 operands, and training
    # tracks bf16's from the same start.
    heading, float8 = sections["float8"]
    assert "MLP block" in heading
    rows = {row[0]: row for row in float8}
    converts = rows["converts to float8 (traced)"]
    assert converts[3] == "3 per Dense x 4" and converts[2] == converts[4] == "12"
    assert rows["dots on float8 operands"][2:] == ["12", "all dots", "12", "1.000x"]
    # What training leaves of the first loss, float8 beside bf16: both trained, alike.
    loss = next(row for what, row in rows.items() if what.startswith("final / first loss"))
    assert loss[3] == "mixed_bfloat16" and loss[5] == "-"
    ours, bf16 = (float(v.rstrip("%")) for v in (loss[2], loss[4]))
    assert ours < 50 and bf16 < 50 and abs(ours - bf16) < 5  # percent of the first loss


def test_table_values_carry_their_units():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import run_all
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    assert run_all.format_value(278_000, "bytes") == "278 KB"
    assert run_all.format_value(1.5e6, "bytes") == "1.50 MB"
    assert run_all.format_value(512, "bytes") == "512 B"
    assert run_all.format_value(0.00076, "s") == "0.76 ms"
    assert run_all.format_value(0.0871, "s") == "87.1 ms"
    assert run_all.format_value(2.5, "s") == "2.50 s"
    assert run_all.format_value(1119, "count") == "1,119"
    assert run_all.format_value(0.0083, "share") == "0.83%"
    assert run_all.format_value(None, "s") == "-"
    row = run_all.Row("step time", "a", 0.002, "b", 0.004, "s")
    table = run_all.format_table([("linen: words", [row])]).splitlines()
    assert table[0].split() == list(run_all.HEADER)
    assert table[2] == "linen: words"
    unratioed = run_all.Row("loss left", "a", 0.002, "b", 0.00001, "share", ratio=False)
    table += run_all.format_table([("x: y", [unratioed])]).splitlines()
    assert table[-1].split()[-1] == "-"
    assert re.split(r"\s{2,}", table[3].strip()) == [
        "step time",
        "a",
        "2.00 ms",
        "b",
        "4.00 ms",
        "0.500x",
    ]


def float8_bench_variants():
    return ("float8", "f8_cur", "int8_qat", "flax_f8", "bf16", "float32")


@pytest.mark.heavy(15)
def test_float8_bench_quick_prints_its_table_and_the_loss_gap():
    result = _run("float8_bench.py", "--quick", "--log-steps", "1")
    lines = result.stdout.splitlines()
    # --log-steps: each variant's first loss; the delayed state's scales of the first block
    logged = [line for line in lines if " step 0: loss " in line]
    assert [line.split()[0] for line in logged] == list(float8_bench_variants())
    assert "up/float8_0.input=" in logged[0] and "down/float8_0.output_grad=" in logged[0]
    assert "=" not in logged[1].split(": loss ")[1]  # current scaling keeps no state
    start = next(i for i, line in enumerate(lines) if line.startswith("variant"))
    table = {line.split()[0]: line.split() for line in lines[start : start + 7]}
    assert set(table) == {"variant", "float8", "f8_cur", "int8_qat", "flax_f8", "bf16", "float32"}
    # columns: variant, step ms, /, fwd ms, /, temp MB, /, f8 cvt, f8 dots, f8 GEMMs, loss, -bf16
    assert table["bf16"][7] == table["float32"][7] == "0"
    assert table["float8"][3:5] == ["-", "-"]  # quick: the forward alone is not timed
    # Every dot of the step (4 Dense: forward and two backward) on float8 operands.
    for name in ("float8", "f8_cur", "flax_f8"):
        assert table[name][8] == "12/12", table[name]
    assert table["bf16"][8] == table["int8_qat"][8] == "0/12"
    assert table["int8_qat"][7] == "0"  # QAT rounds in the compute dtype: no float8
    if jax.default_backend() == "cpu":  # no float8 GEMMs there
        assert table["float8"][9] == "0/12"
    assert lines[-1].endswith("float8 state finite: True")
    assert table["bf16"][-1] == "+0.0000"
    for name in ("float8", "f8_cur"):  # loss - bf16's, over the first loss
        assert abs(float(table[name][-1])) < 0.05
    assert all(len(line) <= 100 for line in lines if line not in logged)


@pytest.mark.heavy(5)
def test_serving_bench_quick_prints_every_variant_and_form():
    result = _run("serving_bench.py", "--quick")
    lines = result.stdout.splitlines()
    rows = [line for line in lines if line.split()[:1] in (["1"], ["16"], ["256"])]
    assert len(rows) == 3 * 12
    assert "int8 weights: weight-only, scale after" in rows[1]
    assert "int4 weights: weight-only, scale after" in rows[2]
    assert rows[27].split()[1:4] == ["int8", "x", "int8"] and rows[27].endswith("int8 x int8")
    # compiled by jp.compile_for_serving: the same forms
    assert rows[6].split()[1:5] == ["int4", "w,", "XLA", "layout"], rows[6]
    assert rows[6].endswith("int4 weights: weight-only, scale after")
    assert rows[31].split()[1:6] == ["int8", "x", "int8,", "XLA", "layout"], rows[31]
    assert rows[31].endswith("int8 x int8")
    # int4 in blocks of 128 (GPTQ's storage) and AWQ's: a matmul per block below 64 rows,
    # dequantized and one GEMM from 64 (measured faster there on an H200)
    for i, form in ((4, "int4 blocks"), (16, "int4 blocks"), (28, "dequantized, one GEMM")):
        assert rows[i].split()[1] == "int4/128" and rows[i + 1].split()[1] == "awq/4/128"
        assert rows[i].endswith(f"int4/128 weights: {form}"), rows[i]
        assert rows[i + 1].endswith(f"int4/128 weights: {form}"), rows[i + 1]
    # serving_kernel="pallas" (in Pallas's interpreter off a GPU): the kernel up to 64 rows,
    # the same errors as XLA's form of the same weights; XLA's forms at 256 rows
    for batch in (0, 12):
        for i, label in ((8, "int8"), (9, "int4"), (10, "int4/128"), (11, "int4/128")):
            row = rows[batch + i]
            assert row.split()[-1] == "split-K)" and f"{label} weights: Pallas kernel" in row

    def error(row):  # the cell before the form ("<label> weights: ...")
        cells = row.split()
        return float(cells[cells.index("weights:") - 2])

    for i, xla in ((8, 1), (9, 2), (10, 4), (11, 5)):
        assert error(rows[i]) == pytest.approx(error(rows[xla]), abs=2e-4), (rows[i], rows[xla])
    assert rows[32].endswith("int8 weights: weight-only, scale after")
    assert rows[34].endswith("int4/128 weights: dequantized, one GEMM")
    # weight bytes per token: int8 about half of bf16's, int4 about a quarter
    numbers = [re.findall(r"\b\d+(?:\.\d+)?(?:e[+-]\d+)?\b", row) for row in rows[:3]]
    per_token = [float(n[3]) for n in numbers]  # batch, time, ratio, bytes, error
    assert per_token[1] < 0.55 * per_token[0] and per_token[2] < 0.3 * per_token[0]


def test_policy_map_bench_quick_prints_the_regex_key_rows():
    result = _run("policy_map_bench.py", "--quick")
    rows = re.findall(r"^\s+1,000\s+(without|with \|)\s+([\d.]+)\s+([\d.]+)$", result.stdout, re.M)
    assert [row[0] for row in rows] == ["without", "with |"], result.stdout


def test_map_key_shapes_bench_quick_prints_every_shape_and_the_config_ratio():
    result = _run("map_key_shapes_bench.py", "--quick")
    rows = re.findall(r"^  ([a-z ]+?)\s+([\d.]+)\s+([\d.]+)\s+bfloat16$", result.stdout, re.M)
    assert [row[0] for row in rows] == [
        "literal prefix", "alternation", "leading wildcard", "cyrillic class", "backreference"
    ], result.stdout  # fmt: skip
    assert re.search(
        r"10,000-key map: build [\d.]+ s, deserialize [\d.]+ s \([\d.]+x\)", result.stdout
    )


@pytest.mark.heavy(40)
def test_quantization_bench_quick_prints_the_calibrated_int4_rows():
    result = _run("quantization_bench.py", "--quick", "--calibrated-only")
    assert "Warning" not in result.stderr, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    assert lines[0].startswith("calibrated int4: lm_task LM") or lines[1].startswith(
        "calibrated int4: lm_task LM"
    )
    rows = {}
    for line in lines:
        cells = re.split(r"\s{2,}", line.strip())
        if len(cells) == 5 and cells[0] != "blocks under":
            rows[cells[0]] = cells[1:]
    assert list(rows) == [
        "bf16",
        "int8 (round to nearest)",
        "gptq/8/-1",
        "int4/128 (round to nearest)",
        "gptq/4/128",
        "awq/4/128",
        "int4/128/asym (round to nearest)",
        "gptq/4/128/asym",
        "awq/4/128/asym",
        "smoothquant/8",
    ]
    bytes_ = {k: int(v[0].replace(",", "")) for k, v in rows.items()}
    # #49's rows: zero points add bytes (a bf16 zero point per group), GPTQ stores what round
    # to nearest stores, AWQ and SmoothQuant add their per-input-channel scale.
    rtn_asym = bytes_["int4/128/asym (round to nearest)"]
    assert bytes_["int4/128 (round to nearest)"] < rtn_asym == bytes_["gptq/4/128/asym"]
    assert bytes_["awq/4/128/asym"] > rtn_asym
    assert bytes_["smoothquant/8"] > bytes_["int8 (round to nearest)"]
    # The calibrated kernels are stored as round-to-nearest stores them (AWQ adds its scale).
    assert bytes_["gptq/4/128"] == bytes_["int4/128 (round to nearest)"] < bytes_["bf16"] / 3
    assert bytes_["int8 (round to nearest)"] == bytes_["gptq/8/-1"]
    assert bytes_["awq/4/128"] > bytes_["gptq/4/128"]
    assert rows["bf16"][2] == "0.0000" and rows["bf16"][3] == "-"
    calibrated = ("gptq", "awq", "smoothquant")
    assert all(float(v[3]) > 0 for k, v in rows.items() if k.startswith(calibrated))
    assert all(v[3] == "-" for k, v in rows.items() if not k.startswith(calibrated))
    summary = {line.partition(":")[0]: line for line in lines if "loss gap" in line}
    assert list(summary) == [
        "gptq/4/128",
        "awq/4/128",
        "gptq/4/128/asym",
        "awq/4/128/asym",
        "gptq/8/-1",
        "smoothquant/8",
    ]
    gptq = re.search(
        r"output error (\d+)% below .* \((\d+)/(\d+) layers below\)", summary["gptq/4/128"]
    )
    assert int(gptq[1]) >= 30 and gptq[2] == gptq[3] == "24"  # every block kernel, 30%+


@pytest.mark.heavy(35)
def test_search_bench_quick_prints_every_map_and_the_rank_correlation():
    result = _run("search_bench.py", "--quick")
    out = result.stdout
    for label in ("uniform int4", "naive (head, first+last block bf16)", "searched at 4.5 bits"):
        assert label in out, out
    rho = float(re.search(r"int4: (-?[\d.]+)", out)[1])
    assert -1.0 <= rho <= 1.0
    searched = re.findall(r"searched at ([\d.]+) bits\s+[\d,]+\s+([\d.]+)", out)
    assert len(searched) == 3, out
    assert all(float(bits) <= float(budget) for budget, bits in searched), out


def test_diagnostics_bench_prints_each_variant_and_the_conditionals_left(capsys):
    import argparse

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import diagnostics_bench

    args = argparse.Namespace(layers=1, heads=2, batch=2, seq=8, repeats=1)
    diagnostics_bench.measure(args, 32)  # in this process: no interpreter to start
    stdout = capsys.readouterr().out
    lines = stdout.splitlines()
    # One cond per statistic (inputs, outputs, cotangents of each tapped submodule), all
    # kept on a CPU; XLA's GPU compiler turns the library's into selects (not the barrier's).
    found = re.search(
        r"conditionals left by the compiler: (\d+) \(every=10\), (\d+) \(every", lines[0]
    )
    assert found and int(found[2]) > 0, lines[0]
    if jax.default_backend() == "cpu":
        assert found[1] == found[2]
    rows = [line.split("  ")[1].strip() for line in lines[2:]]
    assert rows == ["apply", "diagnose", "diagnose every=10", "every=10, conds kept"]


def _bench_module(name):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def test_pretrained_bench_calibrates_every_projection_of_a_gemma3_block():
    # pretrained_int4_bench.py runs on a GGUF file CI does not have; its Flax Gemma 3 is
    # run here at a small size with random weights: calibrate must see all seven
    # projections of every block (none left to round to nearest with a warning), and the
    # result must run through the same policy map.
    import warnings

    import jax.numpy as jnp

    import jmp_policy as jp

    gemma = _bench_module("gemma3_gguf")
    bench = _bench_module("pretrained_int4_bench")
    config = gemma.Config(
        layers=2, d=128, heads=2, kv_heads=1, head_dim=32, mlp=256, vocab=64, eps=1e-6,
        rope_base=1e6, window=4,
    )  # fmt: skip
    model = gemma.Gemma3(config)
    ids = np.arange(32, dtype=np.int32).reshape(2, 16) % config.vocab
    params = model.init(jax.random.key(0), ids)["params"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pm = bench.policy_map("awq/4/128")
        stored = jp.linen.calibrate(model, pm, {"params": params}, [ids])["params"]
    names = ("attn/q", "attn/k", "attn/v", "attn/o", "mlp/gate", "mlp/up", "mlp/down")
    for layer in ("layers_0", "layers_1"):
        for name in names:
            node = stored[layer]
            for key in name.split("/"):
                node = node[key]
            assert isinstance(node["kernel"], jp.QuantizedArray), (layer, name)
        assert stored[layer]["attn_norm"]["scale"].dtype == jnp.float32
    losses = bench.sequence_losses(jp.linen.apply(model, pm)({"params": stored}, ids), ids)
    assert losses.shape == (2,) and np.all(np.isfinite(losses))
    # A local layer attends within its window (4 here): a change at position 0 reaches
    # positions 0-3 only; a global layer's reaches every later position.
    x = jax.random.normal(jax.random.key(1), (1, 16, config.d))
    x2 = x.at[:, 0].add(1.0)
    for is_global, reached in ((False, 4), (True, 16)):
        attn = gemma.Attention(config, is_global)
        v = attn.init(jax.random.key(2), x)
        changed = np.abs(np.asarray(attn.apply(v, x2) - attn.apply(v, x))).max(-1)[0] > 1e-6
        assert changed.tolist() == [True] * reached + [False] * (16 - reached), is_global


def test_pretrained_bench_smoothquant_rows_carry_their_alpha():
    bench = _bench_module("pretrained_int4_bench")
    pm = bench.policy_map("smoothquant/8@0.75")
    policy = pm["layers_3/mlp/down"]
    assert isinstance(policy, jp_policy.SmoothQuantDTypePolicy) and policy.alpha == 0.75
    assert policy.name == "smoothquant/8_from_mixed_bfloat16"
    assert bench.policy_map("smoothquant/8")["layers_0/attn/q"].alpha == 0.5
    assert pm["layers_3/mlp_norm"].name == "mixed_bfloat16" and pm["embed"].name == "float32"
    assert bench.known_row("smoothquant/8@0.75") and bench.known_row("awq/4/128")
    for bad in ("smoothquant/8@1.5", "smoothquant/8@x", "int8@0.5", "awq/4/99"):
        assert not bench.known_row(bad), bad


def test_pretrained_bench_sequences_start_with_bos_and_refuse_a_short_text():
    bench = _bench_module("pretrained_int4_bench")
    ids = np.arange(100, dtype=np.int32)
    batches = bench.sequences(ids, 10, 100, 2, 3, 8)
    assert len(batches) == 2 and batches[0].shape == (3, 8)
    assert (batches[0][:, 0] == 2).all() and batches[0][0, 1:].tolist() == list(range(10, 17))
    assert batches[1][0, 1:].tolist() == list(range(31, 38))  # consecutive, not overlapping
    with pytest.raises(ValueError, match="too few tokens for 20 sequences of 8"):
        bench.sequences(ids, 10, 100, 10, 2, 8)


def test_peer_int4_rows_quantize_the_projections_as_keras_stores_them():
    """The ``keras:int4/128`` row: each projection through a Keras ``Dense`` quantized to
    int4 in groups of 128 with zero points, read back as its effective kernel; the rest
    of the tree untouched; bytes as Keras stores them (two int4 values per int8 byte)."""
    gemma = _bench_module("gemma3_gguf")
    bench = _bench_module("pretrained_int4_bench")
    peers = _bench_module("peer_int4")
    config = gemma.Config(
        layers=1, d=256, heads=2, kv_heads=1, head_dim=128, mlp=512, vocab=64, eps=1e-6,
        rope_base=1e6, window=4,
    )  # fmt: skip
    ids = np.arange(32, dtype=np.int32).reshape(2, 16) % config.vocab
    params = gemma.Gemma3(config).init(jax.random.key(0), ids)["params"]
    stored, peer_bytes, replaced = peers.keras_int4(params, bench.PROJECTIONS)
    up, new = params["layers_0"]["mlp"]["up"]["kernel"], stored["layers_0"]["mlp"]["up"]["kernel"]
    assert new.shape == up.shape and new.dtype == np.float32
    rel = float(np.linalg.norm(new - up) / np.linalg.norm(up))
    assert 0.01 < rel < 0.15, rel  # int4's rounding: changed, and close
    levels = np.unique(np.round((new[:128, 0] - new[:128, 0].min()) * 1e4))
    assert len(levels) <= 16  # one group of one column: at most int4's 16 values
    assert stored["layers_0"]["attn_norm"]["scale"] is params["layers_0"]["attn_norm"]["scale"]
    # 7 kernels: d*(2*128 + 128 + ...) values at 4 bits, plus float32 scales, int8 zero
    # points per group of 128 and Keras's float32 g_idx per input row.
    kernels = [
        np.asarray(v)
        for k, v in jax.tree_util.tree_flatten_with_path(params["layers_0"])[0]
        if "kernel" in str(k[-1]) and "norm" not in str(k)
    ]
    assert replaced == sum(k.nbytes for k in kernels)
    expected = sum(
        k.size // 2 + (k.shape[0] // 128) * k.shape[1] * 5 + k.shape[0] * 4 for k in kernels
    )
    assert peer_bytes == expected


@pytest.mark.heavy(90)
def test_bf16_training_bench_quick_prints_bytes_and_losses_as_ratios(tmp_path):
    masters, sr = "f32 masters", "bf16 + SR, bf16 moments"
    saved = tmp_path / "run.json"
    result = _run("bf16_training_bench.py", "--quick", "--only", masters, sr, "--save", saved)
    rows: dict[str, list[str]] = {}
    for line in result.stdout.splitlines():  # the first table: one row per setup
        rows.setdefault(line[:28].strip(), line[28:].split())
    # bfloat16 weights and moments against float32's: half the bytes, read from the arrays.
    assert rows[masters][2] == "1.000x" and rows[sr][2] == "0.500x", result.stdout
    assert "training loss, mean of each 1 steps" in result.stdout
    again = _run("bf16_training_bench.py", "--report", saved)
    assert again.stdout.strip() == result.stdout.split("\n\n", 1)[1].strip()


@pytest.mark.heavy(5)
def test_pallas_tune_quick_times_every_tile_beside_bf16_and_xla(tmp_path):
    """The tuning script (run on a GPU) in Pallas's interpreter at tiny sizes: every tile
    tried per shape and format beside bf16 and XLA's form, each kernel's error against
    float32 small, and the JSON the session script reads the winner from."""
    out = tmp_path / "tune.json"
    result = _run("pallas_tune.py", "--quick", "--json", str(out), "--tiles",
                  '{"out": 64}', '{"out": 128, "programs": 1000000, "partials": 1.0}',
                  '{"out": 64, "fma_rows": 4, "mask_weights": false}')  # fmt: skip
    rows = __import__("json").loads(out.read_text())["rows"]
    assert len(rows) == 2 * 3 * 5  # 2 row counts x 3 formats x (bf16, xla, 3 tiles)
    kernels = [r for r in rows if r["variant"].startswith("pallas")]
    assert {r["variant"] for r in kernels} == {
        "pallas o64 k128 p264",
        "pallas o128 k128 p1000000 x1",
        "pallas o64 k128 p264 fma4 nomask",
    }
    assert all(0 < r["error"] < 1e-2 for r in kernels), [r["error"] for r in kernels]
    assert all(np.isnan(r["error"]) for r in rows if not r["variant"].startswith("pallas"))
    assert "best tiles per shape" in result.stdout


@pytest.mark.heavy(40)
def test_kv_cache_quality_harness_decodes_as_the_forward_at_tiny_size():
    # kv_cache_quality.py runs the pretrained Gemma 3 (a GGUF file CI does not have); its
    # harness runs here on the same port at a small size with random weights: six layers (the
    # sixth global), a window of 4 within 12 tokens, grouped-query attention. In float32 the
    # cached decode (a lax.scan of one-token steps under jit) gives the forward's logits; under
    # mixed_bfloat16 the int8 and float8 caches store quantized values and scales, at the
    # bytes the layout says, with losses close to the bf16 cache's.
    import jax.numpy as jnp

    gemma = _bench_module("gemma3_gguf")
    bench = _bench_module("kv_cache_quality")
    config = gemma.Config(
        layers=6, d=64, heads=4, kv_heads=2, head_dim=16, mlp=128, vocab=97, eps=1e-6,
        rope_base=1e6, window=4,
    )  # fmt: skip
    ids = np.array(jax.random.randint(jax.random.key(1), (3, 12), 0, config.vocab), np.int32)
    ids[:, 0] = gemma.BOS
    params = gemma.Gemma3(config).init(jax.random.key(0), ids)["params"]
    diff, scale, decoded, forward = bench.harness(config, params, ids)
    assert diff <= 1e-5 * scale, (diff, scale)
    np.testing.assert_allclose(decoded, forward, rtol=1e-5)
    results = bench.compare(config, params, ids)
    bf16_losses, bf16_bytes = results["bf16"]
    # int8: a float32 scale per token and head (16 values); float8: per token (2 heads x 16).
    for label, ratio, tol in (("int8", 0.5 + 2 / 16, 0.02), ("float8", 0.5 + 1 / 16, 0.05)):
        losses, nbytes = results[label]
        assert nbytes / bf16_bytes == pytest.approx(ratio), label
        np.testing.assert_allclose(losses, bf16_losses, rtol=tol, err_msg=label)
    cache = bench.init_cache(config, ids, "mixed_bfloat16", "int8")
    assert cache["layers_5"]["attn"]["cached_key"].values.dtype == jnp.int8


def test_serving_bench_loops_report_the_first_pass_and_chain_the_rest():
    # --loops N times N passes in one program; the error column is read from the first
    # pass, which does not compound over the passes as the last one's would.
    looped = _bench_module("serving_bench").looped
    x = jnp.arange(4.0, dtype=jnp.bfloat16)
    for fn in (looped(lambda v, y: y * v, 3), jax.jit(looped(lambda v, y: y * v, 3))):
        first, last = fn(jnp.float32(2.0), x)
        assert first.dtype == jnp.float32 and last.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(first), 2.0 * np.arange(4.0))
        np.testing.assert_array_equal(np.asarray(last, np.float32), 8.0 * np.arange(4.0))
    first, last = looped(lambda v, y: y + v, 1)(jnp.float32(1.0), x)
    np.testing.assert_array_equal(np.asarray(first), np.asarray(last, np.float32))
