"""The storage descriptors of a QuantizedArray (``jmp_policy._src.quantization.storage``): its
checks, ``quantize``, ``dequantize`` and the matmul's choice of form ask the descriptor, so a
new bit width is a new descriptor and no edit of those modules."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_policy as jp
from jmp_policy._src import quantization
from jmp_policy._src.quantization import kernel_matmul, storage
from jmp_policy._src.quantization.storage import Storage, storage_of

DIMS = (((1,), (0,)), ((), ()))


@pytest.fixture
def int6():
    """A 6-bit signed storage, per channel, its values in int8."""
    kind = storage.add(Storage(mode="int6", bits=6, value_dtype=jnp.int8))
    try:
        yield kind
    finally:
        storage.remove("int6")


def test_the_built_in_storages_describe_int8_and_int4():
    int8, int4 = storage_of("int8"), storage_of("int4")
    assert (int8.bits, int8.qmax, int8.blocked, int8.dtype_names) == (8, 127.0, False, ("int8",))
    assert (int4.bits, int4.qmax, int4.blocked, int4.dtype_names) == (
        4,
        7.0,
        True,
        ("int4", "uint8"),
    )
    assert int8.integer_gemm and not int4.integer_gemm
    assert int4.is_packed(np.zeros(2, np.uint8)) and not int4.is_packed(jnp.zeros(2, jnp.int4))
    assert Storage(mode="u4", bits=4, value_dtype=jnp.uint4, signed=False).qmax == 15.0


def test_an_unknown_storage_mode_is_a_value_error_listing_the_modes():
    with pytest.raises(
        ValueError, match=r"`mode` must be one of \('int8', 'int4'\)\. Received: mode='int5'"
    ):
        storage_of("int5")
    with pytest.raises(ValueError, match="`mode` must be one of"):
        quantization.quantize(jnp.ones((4, 4)), "int5")


def test_a_taken_storage_mode_is_refused():
    with pytest.raises(ValueError, match="The storage mode 'int8' is already"):
        storage.add(Storage(mode="int8", bits=7, value_dtype=jnp.int8))
    with pytest.raises(TypeError, match="`storage` must be a Storage"):
        storage.add("int8")


@pytest.mark.parametrize("jit", [False, True])
def test_a_new_bit_width_is_a_descriptor_not_an_edit(int6, jit):
    x = jax.random.normal(jax.random.key(0), (32, 8))
    q = quantization.quantize(x, "int6")
    assert q.mode == "int6" and q.values.dtype == jnp.int8 and q.block_size is None
    assert int(jnp.max(jnp.abs(q.values))) == 31
    amax = np.max(np.abs(np.asarray(x)), axis=0)
    want = np.clip(np.round(np.asarray(x) / (amax / 31)), -31, 31) * (amax / 31)
    np.testing.assert_allclose(q.dequantize(), want, rtol=1e-5, atol=1e-6)
    # The checks ask the descriptor: a block size is refused for a per-channel storage.
    with pytest.raises(ValueError, match="`block_size` must be None for int6"):
        jp.QuantizedArray(q.values, q.scale, "int6", 128, q.shape, np.dtype("float32"))
    # A pytree like any other: through tree.map and jit, every field kept.
    back = jax.tree.map(lambda v: v, q)
    assert back == q and (jax.jit(lambda t: t)(q) == q)
    # The matmul chooses its form from the descriptor (not int8: no int8 x int8 GEMM).
    lhs = jax.random.normal(jax.random.key(1), (256, 32))
    assert kernel_matmul.kernel_form(q, DIMS, 256, int8_compute=True) == "weight-only, scale after"
    dot = kernel_matmul.quantized_kernel_dot_general(q, int8_compute=True)
    run = jax.jit(dot, static_argnums=2) if jit else dot
    y = run(lhs, q.values.astype(jnp.float32), DIMS)
    np.testing.assert_allclose(y, lhs @ q.dequantize(), rtol=1e-4, atol=1e-4)


def test_a_zero_point_storage_is_read_dequantized_and_not_written_by_quantize():
    kind = storage.add(
        Storage(mode="uint8zp", bits=8, value_dtype=jnp.uint8, signed=False, has_zero_point=True)
    )
    try:
        assert not kind.integer_gemm
        with pytest.raises(ValueError, match="symmetric storage only"):
            quantization.quantize(jnp.ones((4, 4)), "uint8zp")
        q = jp.QuantizedArray(
            jnp.ones((4, 4), jnp.uint8), jnp.ones(4), "uint8zp", None, (4, 4), np.dtype("float32")
        )
        assert kernel_matmul.kernel_form(q, DIMS, 256, int8_compute=True) == "dequantized"
    finally:
        storage.remove("uint8zp")
