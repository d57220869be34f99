"""Tests for the shared tree numerics: float-leaf tests, `all_finite`, `select_tree`, scaling."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jmp_policy as jp
from jmp_policy._src import numerics

FLOAT_DTYPES = [jnp.float16, jnp.bfloat16, jnp.float32]
ROOT = Path(__file__).resolve().parents[1]


# --- float leaves --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("leaf", "expected"),
    [
        (1.0, True),
        (1j, True),
        (1, False),
        (True, False),
        (None, False),
        ("1.0", False),
        (np.float32(1), True),
        (np.ones(2, np.float64), True),
        (jnp.ones(2, jnp.bfloat16), True),
        (np.ones(2, ml_dtypes.float8_e4m3fn), True),
        (jnp.ones(2, jnp.complex64), True),
        (jnp.ones(2, jnp.int8), False),
        (jnp.ones(2, bool), False),
        (jax.ShapeDtypeStruct((2,), jnp.float16), True),
        (jax.ShapeDtypeStruct((2,), jnp.int32), False),
    ],
)
def test_is_float_leaf(leaf, expected):
    assert numerics.is_float_leaf(leaf) is expected


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [
        (jnp.float16, jnp.float32),
        (jnp.bfloat16, jnp.float32),
        (ml_dtypes.float8_e5m2, jnp.float32),
        (jnp.float32, jnp.float32),
        (jnp.float64, jnp.float64),
        (jnp.complex64, jnp.complex64),
    ],
)
def test_scaling_computes_in_float32_or_wider(dtype, expected):
    assert numerics.scaling_dtype(dtype) == np.dtype(expected)


# --- scale / unscale -----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_scale_tree_returns_float32_and_unscale_tree_keeps_dtype(maybe_jit, dtype):
    tree = {"g": jnp.full(3, 3.0, dtype), "step": jnp.int32(7), "none": None}
    scaled = maybe_jit(numerics.scale_tree)(tree, jnp.float32(2.0**14))
    assert scaled["g"].dtype == jnp.float32 and scaled["step"].dtype == jnp.int32
    np.testing.assert_array_equal(scaled["g"], np.full(3, 3.0 * 2**14))  # no float16 overflow
    assert scaled["none"] is None
    unscaled = maybe_jit(numerics.unscale_tree)({"g": scaled["g"].astype(dtype)}, 2.0**14)
    assert unscaled["g"].dtype == dtype
    np.testing.assert_array_equal(unscaled["g"].astype(np.float32), np.full(3, 3.0))


def test_unscale_tree_of_float16_computes_in_float32(maybe_jit):
    # 23.1 / 3 in float32 rounds to float16's 7.7; in float16 (x * (1/3 rounded to float16))
    # it would come out one step lower, 7.695.
    g = jnp.array([23.1, 38.5], jnp.float16)
    out = maybe_jit(numerics.unscale_tree)(g, jnp.float32(3.0))
    assert out.dtype == jnp.float16
    np.testing.assert_array_equal(out, np.array([7.7, 12.836], np.float16))
    assert not np.array_equal(out, g * (jnp.float16(1) / jnp.float16(3)))


# --- all_finite ----------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
@pytest.mark.parametrize("dtype", [*FLOAT_DTYPES, ml_dtypes.float8_e5m2, jnp.complex64], ids=str)
def test_all_finite_detects_non_finite_leaf(maybe_jit, bad, dtype):
    check = maybe_jit(jp.all_finite)
    good = {"a": jnp.ones(3, dtype), "b": jnp.zeros((2, 2), dtype), "n": jnp.int32(1)}
    assert bool(check(good))
    bad_tree = dict(good, b=good["b"].at[1, 0].set(bad))
    assert not bool(check(bad_tree))


def test_all_finite_of_numpy_and_python_leaves(maybe_jit):
    check = maybe_jit(jp.all_finite)
    assert bool(check([np.ones(3), 2.0]))
    assert not bool(check([np.ones(3), float("nan")]))
    assert not bool(check({"x": np.array([1.0, np.inf], np.float16)}))


def test_all_finite_of_largest_finite_values_is_true(maybe_jit):
    # Values a sum-based check (sum(x - x), sum(x) * 0) could turn into inf or NaN.
    tree = [jnp.full(1000, jnp.finfo(d).max, d) for d in FLOAT_DTYPES]
    assert bool(maybe_jit(jp.all_finite)(tree))


def test_all_finite_survives_fast_math_compilation():
    # XLA's fast-math folds `x - x` to 0, so a check built on arithmetic identities says a
    # NaN is finite and a NaN step is applied. `isfinite` keeps its meaning. The flag must be
    # set before jax is imported, hence a subprocess, with its own XLA_FLAGS (conftest's
    # device count is left out).
    code = textwrap.dedent(
        """
        import jax
        import jax.numpy as jnp
        import jmp_policy as jp

        x = jnp.array([1.0, 2.0, jnp.nan, 3.0] * 64)
        print(bool(jax.jit(jp.all_finite)({"x": x})), bool(jax.jit(jp.all_finite)(x.at[2].set(jnp.inf))))
        print(bool(jax.jit(lambda t: jnp.sum(t - t) == 0)(x)))
        """
    )
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PYTHONPATH")}
    env.update(
        XLA_FLAGS="--xla_cpu_enable_fast_math=true", JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT)
    )
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    checks, identity = result.stdout.split("\n")[:2]
    assert checks == "False False"
    # The flag is in effect: the identity the old check relied on is folded away.
    assert identity == "True"


def test_all_finite_compiles_to_isfinite():
    hlo = jax.jit(jp.all_finite).lower({"a": jnp.ones(3), "b": jnp.ones(2, jnp.float16)})
    text = hlo.as_text()
    assert text.count("is_finite") == 2 and "subtract" not in text


def test_all_finite_without_floating_leaves_is_true(maybe_jit):
    assert bool(jp.all_finite(None))
    assert bool(jp.all_finite({}))
    assert bool(maybe_jit(jp.all_finite)({"i": jnp.arange(3), "b": jnp.array(True)}))
    assert jp.all_finite({}).shape == ()


def test_select_tree_picks_by_predicate(maybe_jit):
    a = {"a": jnp.ones(2), "b": jnp.zeros((), jnp.int32)}
    b = {"a": jnp.full(2, jnp.nan), "b": jnp.ones((), jnp.int32)}
    select = maybe_jit(jp.select_tree)
    out = select(jnp.array(True), a, b)
    np.testing.assert_array_equal(out["a"], [1.0, 1.0])
    out = select(jnp.array(False), a, b)
    assert np.isnan(np.asarray(out["a"])).all() and int(out["b"]) == 1
    assert jp.select_tree(jnp.array(True), None, None) is None


def test_select_tree_rejects_bad_predicates_and_structures():
    with pytest.raises(
        ValueError, match=r"`pred` must be a scalar bool array, not of shape \(1,\)"
    ):
        jp.select_tree(jnp.ones([1], bool), None, None)
    with pytest.raises(TypeError, match="`pred` must be a scalar bool array"):
        jp.select_tree(jnp.float32(1), None, None)
    with pytest.raises(ValueError, match="same tree structure"):
        jp.select_tree(jnp.array(True), {"a": 1.0}, {"b": 1.0})


def test_jmp_all_finite_and_select_tree_on_none_and_empty_trees():
    assert bool(jp.all_finite(None)) and bool(jp.all_finite({}))
    a = {"a": jnp.ones([]), "b": jnp.zeros([])}
    b = {"a": jnp.zeros([]), "b": jnp.ones([])}
    assert jp.select_tree(jnp.bool_(True), None, None) is None
    assert jp.select_tree(jnp.bool_(False), None, None) is None
    assert jp.select_tree(jnp.bool_(True), a, b) == a
    assert jp.select_tree(jnp.bool_(False), a, b) == b
