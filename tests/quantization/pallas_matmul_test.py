"""The Pallas weight-only kernel, run in Pallas's interpreter on the CPU, against the
reference ``x @ (values * scale)`` in float32 (issue #48). Shapes are small and ragged
(not multiples of the tiles); small tiles make several output blocks and splits of the
input dimension. Its compiled form for an H100 is tests/h100_forms_test.py's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmp_policy._src.quantization import pallas_matmul as pm

SMALL = pm.Tiles(out=32, step=32, programs=16, partials=100.0)  # splits at every row count


def _operands(rows, k, n, dtype, block, compute=jnp.float32, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(keys[0], (rows, k), jnp.float32).astype(compute)
    low, high = (-127, 128) if dtype == jnp.int8 else (-8, 8)
    values = jax.random.randint(keys[1], (k, n), low, high, jnp.int32).astype(dtype)
    blocks = 1 if block in (None, -1) else -(-k // block)
    scale = jax.random.uniform(keys[2], (blocks, n), jnp.float32, 0.5, 1.5) / 64
    return x, values, scale


def _reference(x, values, scale, block):
    k = values.shape[0]
    size = k if block in (None, -1) else block
    w = values.astype(jnp.float32) * scale[np.arange(k) // size]
    return np.asarray(jnp.dot(x.astype(jnp.float32), w, precision="highest"))


def _run(jit, *args, **kw):
    fn = lambda x, v, s: pm.weight_only_matmul(x, v, s, interpret=True, tiles=SMALL, **kw)  # noqa: E731
    return (jax.jit(fn) if jit else fn)(*args)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 16, 64])
def test_int8_per_channel_matches_the_reference_to_float32_rounding(rows, jit):
    x, values, scale = _operands(rows, 100, 70, jnp.int8, None)  # ragged in and out
    y = _run(jit, x, values, scale[0])
    assert y.shape == (rows, 70) and y.dtype == jnp.float32
    ref = _reference(x, values, scale, None)
    np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize(("rows", "block"), [(1, None), (7, 32), (16, 64), (64, -1)])
def test_int4_per_channel_and_in_blocks_match_the_reference(rows, block, jit):
    # 150 input rows: the last block of 32 or 64 is short; 66 outputs: not a tile multiple.
    x, values, scale = _operands(rows, 150, 66, jnp.int4, block)
    y = _run(jit, x, values, scale, block_size=block)
    assert y.shape == (rows, 66) and y.dtype == jnp.float32
    ref = _reference(x, values, scale, block)
    np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("compute", [jnp.bfloat16, jnp.float16])
def test_a_16_bit_input_accumulates_in_float32_and_returns_its_dtype(compute):
    x, values, scale = _operands(5, 96, 40, jnp.int8, None, compute=compute)
    y = _run(True, x, values, scale)
    assert y.dtype == compute
    ref = _reference(x, values, scale, None)  # x exact in float32: only the result rounds
    np.testing.assert_allclose(np.asarray(y, np.float32), ref, rtol=1e-2, atol=1e-2)
    assert float(np.max(np.abs(np.asarray(y, np.float32) - ref))) <= np.abs(ref).max() * 2**-7


def test_out_dtype_is_the_results():
    x, values, scale = _operands(3, 64, 32, jnp.int8, None, compute=jnp.bfloat16)
    assert _run(False, x, values, scale, out_dtype=jnp.float32).dtype == jnp.float32


def test_vmap_over_a_batch_of_sequences_matches_each_sequence():
    x, values, scale = _operands(2 * 3, 64, 34, jnp.int4, 32)
    xs = x.reshape(2, 3, 64)

    def one(x):
        return pm.weight_only_matmul(x, values, scale, 32, interpret=True, tiles=SMALL)

    y = jax.jit(jax.vmap(one))(xs)
    assert y.shape == (2, 3, 34)
    ref = _reference(x, values, scale, 32).reshape(2, 3, 34)
    np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize(("rows", "grid"), [(1, (4, 4)), (16, (4, 4)), (64, (4, 1))])
def test_the_default_tiles_split_the_input_dimension_less_at_more_rows(rows, grid):
    """A 1024 x 256 int8 kernel: 4 output blocks of 64; the input dimension is split
    while the float32 partial sums of the padded rows (at least 16) stay within a quarter
    of the weight bytes: 4 splits at 1 and 16 rows, none at 64."""
    x, values, scale = _operands(rows, 1024, 256, jnp.int8, None)
    fn = lambda x: pm.weight_only_matmul(x, values, scale, interpret=True)  # noqa: E731
    jaxpr = jax.make_jaxpr(fn)(x)
    calls = [e for e in jaxpr.eqns if e.primitive.name == "pallas_call"]
    assert [e.params["grid_mapping"].grid for e in calls] == [grid]
    # The partial sums are as tall as the padded rows (a GPU does not mask a block taller
    # than its array: 1 row written as a block of 16 overwrote the next split's sums).
    assert [v.aval.shape for v in calls[0].outvars] == [(grid[1], max(16, rows), 256)]
    ref = _reference(x, values, scale, None)
    np.testing.assert_allclose(np.asarray(fn(x)), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize(
    ("shape", "dtype", "block", "rows", "expected"),
    [
        ((64, 32), jnp.int8, None, 1, True),
        ((64, 32), jnp.int8, None, 64, True),
        ((64, 32), jnp.int8, None, 65, False),
        ((64, 32), jnp.int8, None, 0, False),
        ((64, 32), jnp.int4, 128, 16, True),
        ((64, 32), jnp.int4, -1, 16, True),
        ((64, 33), jnp.int4, -1, 16, False),  # int4 needs an even number of outputs
        ((64, 32), jnp.int4, 100, 16, False),
        ((4, 64, 32), jnp.int8, None, 16, False),
    ],
)
def test_supports_says_which_kernels_and_rows_it_takes(shape, dtype, block, rows, expected):
    values = jax.ShapeDtypeStruct(shape, dtype)
    assert pm.supports(values, block, rows) is expected


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize(
    ("rows", "dtype", "block"),
    [(1, jnp.int8, None), (3, jnp.int8, None), (1, jnp.int4, 32), (4, jnp.int4, None)],
)
@pytest.mark.parametrize("mask_weights", [True, False])
def test_cuda_core_rows_and_unmasked_weights_match_the_reference(
    rows, dtype, block, mask_weights, jit
):
    # Tiles.fma_rows: at most 4 rows multiplied on CUDA cores (no 16-row dot); without the
    # weight mask the rows past the input dimension meet x's zero padding. Ragged shapes.
    tiles = pm.Tiles(out=32, step=32, programs=16, partials=100.0, fma_rows=4,
                     mask_weights=mask_weights)  # fmt: skip
    x, values, scale = _operands(rows, 150, 66, dtype, block, compute=jnp.bfloat16)

    def fn(x, v, s):
        return pm.weight_only_matmul(x, v, s, block, jnp.float32, interpret=True, tiles=tiles)

    y = (jax.jit(fn) if jit else fn)(x, values, scale)
    assert y.shape == (rows, 66) and y.dtype == jnp.float32
    ref = _reference(x, values, scale, block)  # x exact in float32; sums in float32
    np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
