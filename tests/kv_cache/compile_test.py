"""The attention reads the quantized cache without a float copy of it (issue #50), checked
in the compiled decode step (``benchmarks/kv_cache_compile.py``): on the CPU always, and for
an H100 without a GPU where the CUDA PJRT plugin is installed (``tests/h100_forms_test.py``
installs it into ``.cuda-plugin/<jaxlib version>``)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import jaxlib
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import kv_cache_compile as kc  # noqa: E402

PLUGIN_DIR = ROOT / ".cuda-plugin" / jaxlib.__version__


def _written(buffers):
    """The float buffers that hold a cache: its copies and its token writes."""
    return [b for b in buffers if "dynamic" in b or " copy" in b]


def _no_float_cache_copy(result, formats=("int8", "float8_e4m3fn")):
    bf16 = result["None"]["large_float_buffers"]
    # the bfloat16 program writes the new token into each of its two caches (XLA may copy
    # them first): float buffers of a cache's size that the 8-bit programs must not have
    assert len(_written(bf16)) >= 2, bf16
    for fmt in formats:
        found = result[fmt]
        assert found["stored_cache_readers"], fmt  # the 8-bit cache enters a fusion
        # no float buffer of a cache's size beyond those the bfloat16 program also has
        # (XLA's own products of the attention), and none holds a written float cache
        assert not _written(found["large_float_buffers"]), (fmt, found)
        assert len(found["large_float_buffers"]) <= len(bf16) - len(_written(bf16)), (fmt, bf16)
    # What a step reads of the cache: its inputs, values and scales. bf16: two caches of
    # 1 x 4096 x 8 x 128 at 2 bytes; int8: 1 byte each and a float32 scale per token and
    # head (0.5 + 2/128 of bf16's); float8: a scale per token.
    values = 2 * kc.B * kc.LENGTH * kc.HEADS * kc.HEAD_DIM
    assert result["None"]["cache_bytes_read"] == 2 * values
    expected = {
        "int8": values + 2 * kc.LENGTH * kc.HEADS * 4,
        "float8_e4m3fn": values + 2 * kc.LENGTH * 4,
    }
    for fmt in formats:
        assert result[fmt]["cache_bytes_read"] == expected[fmt], fmt


@pytest.mark.heavy(15)
def test_cpu_int8_step_reads_the_stored_cache_without_a_float_copy():
    result = {str(f): kc.summary(kc.compiled_hlo(f, "cpu")) for f in (None, "int8")}
    _no_float_cache_copy(result, formats=("int8",))


@pytest.mark.heavy(30)
def test_h100_step_reads_the_stored_cache_without_a_float_copy():
    if not (PLUGIN_DIR / "jax_plugins").is_dir():
        pytest.skip(
            f"no CUDA PJRT plugin in {PLUGIN_DIR} (tests/h100_forms_test.py installs it: "
            f"pip install --no-deps --target {PLUGIN_DIR} jax-cuda12-plugin=="
            f"{jaxlib.__version__} jax-cuda12-pjrt=={jaxlib.__version__})"
        )
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    env["PYTHONPATH"] = os.pathsep.join([str(PLUGIN_DIR), str(ROOT), env.get("PYTHONPATH", "")])
    env["JAX_PLATFORMS"] = "cpu"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "kv_cache_compile.py"), "h100"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    _no_float_cache_copy(json.loads(done.stdout))
