"""A float8 layer on a TPU generation whose matmul has no float8 mode (issue #53) warns once,
and ``explain`` marks each such layer; elsewhere nothing changes."""

from __future__ import annotations

import warnings

import jax
import pytest

from jmp_policy._src.quantization import matmuls


class _Device:
    device_kind = "TPU v5 lite"


@pytest.fixture
def on_v5e(monkeypatch):
    monkeypatch.setattr(matmuls, "_WARNED_TPU", set())
    monkeypatch.setattr(matmuls, "_WARNED", {(0, 0, 0)})  # the small-size warning: given
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    monkeypatch.setattr(jax, "devices", lambda *a: [_Device()])


def test_a_float8_layer_on_a_v5e_warns_once_and_its_form_says_why(on_v5e):
    with matmuls.recording() as forms, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        matmuls.record_float8("up", 8192, 4096, 8192, "delayed")
        matmuls.record_float8("down", 8192, 8192, 4096, "current")
    assert forms["up"] == (
        "float8 (delayed), e4m3 x e4m3 GEMM 8192x4096x8192; "
        "TPU v5 lite has no float8 matmul: bf16 may be faster"
    )
    assert forms["down"].endswith("; TPU v5 lite has no float8 matmul: bf16 may be faster")
    assert len(caught) == 1  # once per process
    message = str(caught[0].message)
    assert message.startswith("The float8 layer 'up' runs on a TPU v5 lite, whose matmul has no")
    assert "not expected to be faster than bfloat16 there" in message


def test_the_generations_without_float8_are_those_the_compiled_programs_show():
    """v5e, v5p and v6e (and v4) by their device kinds; ``tests/tpu_forms_test.py`` checks
    the table against programs compiled for each."""
    assert matmuls.TPU_WITHOUT_FLOAT8 == ("TPU v4", "TPU v5 lite", "TPU v5", "TPU v6 lite")


@pytest.mark.parametrize("backend,kind", [("cpu", "cpu"), ("tpu", "TPU v7x")])
def test_no_warning_off_a_tpu_or_on_a_tpu_not_in_the_table(monkeypatch, backend, kind):
    class Device:
        device_kind = kind

    monkeypatch.setattr(matmuls, "_WARNED_TPU", set())
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    monkeypatch.setattr(jax, "devices", lambda *a: [Device()])
    assert matmuls.tpu_without_float8() is None
    with matmuls.recording() as forms, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        matmuls.record_float8("up", 8192, 4096, 8192, "delayed")
    assert forms["up"] == "float8 (delayed), e4m3 x e4m3 GEMM 8192x4096x8192"
    assert caught == []


@pytest.mark.filterwarnings("ignore:The float8 layer")
def test_explain_marks_each_float8_layer_on_a_tpu_without_float8(monkeypatch):
    import flax.linen as nn
    import jax.numpy as jnp

    import jmp_policy as jp

    monkeypatch.setattr(matmuls, "tpu_without_float8", lambda: "TPU v6 lite")
    policy = "float8_current_from_mixed_bfloat16"
    model, x = nn.Dense(64), jnp.ones((8, 32))
    variables = jp.linen.init(model, policy)(jax.random.key(0), x)
    table = jp.linen.explain(model, policy, variables, x)
    matmul_lines = " ".join(table.split("matmuls:")[1].split())
    assert "TPU v6 lite has no float8 matmul: bf16 may be faster" in matmul_lines, table
