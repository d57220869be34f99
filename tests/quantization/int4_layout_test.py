"""int4 weights' layout: blocks of rows, and the packed uint8 layout of earlier versions."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmp_policy._src.quantization import int4_layout


@pytest.mark.parametrize("rows", [1, 6, 7])
def test_pack_then_unpack_gives_back_every_value_of_any_row_count(rows, maybe_jit):
    q = jnp.asarray(np.arange(rows * 3).reshape(rows, 3) % 16 - 8, jnp.int8)
    packed = maybe_jit(int4_layout.pack_int4)(q)
    assert packed.dtype == jnp.uint8 and packed.shape == ((rows + 1) // 2, 3)
    back = maybe_jit(int4_layout.unpack_int4, static_argnums=1)(packed, rows)
    np.testing.assert_array_equal(np.asarray(back), np.asarray(q, np.int32))


def test_blocked_pads_the_last_block_with_zeros():
    x = jnp.arange(10.0).reshape(5, 2)
    b = int4_layout.blocked(x, 2, 3)
    assert b.shape == (3, 2, 2)
    np.testing.assert_array_equal(np.asarray(b[2, 1]), [0.0, 0.0])
    np.testing.assert_array_equal(np.asarray(b.reshape(6, 2)[:5]), np.asarray(x))


@pytest.mark.parametrize("packed", [False, True])
def test_dequantize_scales_each_block_including_a_shorter_last_one(packed):
    values = jnp.asarray([[1, -1], [2, -2], [3, -3]], jnp.int8)
    scale = jnp.asarray([[1.0, 10.0], [0.5, 100.0]], jnp.float32)  # blocks of 2 rows
    stored = int4_layout.pack_int4(values) if packed else values.astype(jnp.int4)
    real = jax.jit(int4_layout.dequantize_int4, static_argnums=(2, 3))(stored, scale, 2, (3, 2))
    np.testing.assert_array_equal(np.asarray(real), [[1, -10], [2, -20], [1.5, -300]])
