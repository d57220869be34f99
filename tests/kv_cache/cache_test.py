"""The quantized KV cache pytree (issue #50): formats, writes at an index, bytes, pytree
contract, and the ``kv_cache=`` option's parsing and resolution by path."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_policy as jp
from jmp_policy._src.kv_cache import make_spec
from jmp_policy._src.kv_cache.formats import FORMATS, format_named

SHAPE = (2, 16, 4, 128)  # [batch, length, heads, head_dim]
JIT = pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])


def _kv(seed=0, shape=SHAPE, dtype=jnp.bfloat16):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


@pytest.mark.parametrize(
    ("name", "stored", "scale_shape"),
    [("int8", jnp.int8, (2, 16, 4, 1)), ("float8_e4m3fn", jnp.float8_e4m3fn, (2, 16, 1, 1))],
)
def test_quantize_stores_values_and_float32_scales_per_token(name, stored, scale_shape):
    cache = jp.QuantizedKVCache.quantize(_kv(), name)
    assert cache.values.dtype == stored and cache.values.shape == SHAPE
    assert cache.scale.dtype == jnp.float32 and cache.scale.shape == scale_shape
    assert cache.format == name and cache.dtype == "bfloat16"
    assert cache.dequantize().dtype == jnp.bfloat16


@pytest.mark.parametrize(("name", "rel"), [("int8", 0.01), ("fp8", 0.04)])
def test_dequantize_is_close_to_the_cache(name, rel):
    x = _kv(dtype=jnp.float32)
    back = jp.QuantizedKVCache.quantize(x, name).dequantize()
    err = float(jnp.linalg.norm(back - x) / jnp.linalg.norm(x))
    assert 0 < err < rel


def test_int8_uses_the_full_symmetric_grid_per_token_and_head():
    cache = jp.QuantizedKVCache.quantize(_kv(), "int8")
    amax = jnp.max(jnp.abs(cache.values.astype(jnp.int32)), axis=-1)
    assert bool((amax == 127).all())


@pytest.mark.parametrize("name", ["int8", "float8_e4m3fn"])
def test_bytes_at_most_053_of_bfloat16_scales_included(name):
    x = _kv(shape=(4, 256, 8, 128))
    cache = jp.QuantizedKVCache.quantize(x, name)
    assert cache.nbytes == cache.values.nbytes + cache.scale.nbytes
    assert cache.nbytes / x.nbytes <= 0.53


@JIT
@pytest.mark.parametrize("name", ["int8", "float8_e4m3fn"])
def test_write_quantizes_only_the_new_tokens_and_keeps_the_others(jit, name):
    cache = jp.QuantizedKVCache.quantize(jnp.zeros(SHAPE, jnp.bfloat16), name)

    def write(cache, new, index):
        return cache.write(new, (0, index, 0, 0))

    write = jax.jit(write) if jit else write
    history = []
    for step in range(5):
        cache = write(cache, _kv(step, (2, 1, 4, 128)), step)
        history.append(cache)
    for step, earlier in enumerate(history):
        # a token's stored values and scale never change after its step
        np.testing.assert_array_equal(
            np.asarray(cache.values[:, : step + 1]), np.asarray(earlier.values[:, : step + 1])
        )
        np.testing.assert_array_equal(
            np.asarray(cache.scale[:, : step + 1]), np.asarray(earlier.scale[:, : step + 1])
        )
    fresh = jp.QuantizedKVCache.quantize(_kv(3, (2, 1, 4, 128)), name)
    np.testing.assert_array_equal(np.asarray(cache.values[:, 3:4]), np.asarray(fresh.values))
    assert bool((cache.values[:, 5:].astype(jnp.float32) == 0).all())


def test_zero_and_non_finite_tokens():
    x = jnp.zeros((1, 3, 1, 128), jnp.float32).at[0, 1, 0, 0].set(jnp.inf)
    back = jp.QuantizedKVCache.quantize(x, "int8").dequantize()
    assert bool((back[0, 0] == 0).all()) and bool((back[0, 2] == 0).all())
    assert not bool(jnp.isfinite(back[0, 1]).all())  # never made finite


def test_pytree_round_trips_keep_every_field():
    cache = jp.QuantizedKVCache.quantize(_kv(), "fp8")
    assert jax.tree.map(lambda a: a, cache) == cache
    assert jax.jit(lambda c: c)(cache) == cache
    leaves, treedef = jax.tree.flatten(cache)
    assert len(leaves) == 2
    # unflatten takes any leaves (JAX's contract): None, strings, specs
    odd = jax.tree.unflatten(treedef, [None, "x"])
    assert odd.values is None and odd.scale == "x" and odd.format == "float8_e4m3fn"
    stacked = jax.vmap(lambda c: c)(jax.tree.map(lambda a: jnp.stack([a, a]), cache))
    assert stacked.values.shape == (2, *SHAPE)


def test_quantize_rejects_a_cache_it_cannot_scale_and_unknown_formats():
    with pytest.raises(ValueError, match=r"rank 3 or more.*\(16, 128\)"):
        jp.QuantizedKVCache.quantize(jnp.ones((16, 128)), "int8")
    with pytest.raises(ValueError, match=r"Unknown KV cache format 'int9'.*'int8'"):
        jp.QuantizedKVCache.quantize(jnp.ones(SHAPE), "int9")
    with pytest.raises(ValueError, match="`format` must name a quantized"):
        jp.QuantizedKVCache.quantize(jnp.ones(SHAPE), None)


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("int8", "int8"),
        ("fp8", "float8_e4m3fn"),
        ("FP8_E4M3", "float8_e4m3fn"),
        ("float8_e4m3fn", "float8_e4m3fn"),
    ],
)
def test_format_names_accept_vllm_spellings(given, expected):
    assert format_named(given) is FORMATS[expected]


def test_auto_and_none_store_the_cache_as_written():
    assert make_spec(None) is None
    assert make_spec("auto") is None


def test_bad_option_values_name_the_argument_and_quote_the_value():
    with pytest.raises(ValueError, match=r"`kv_cache`; expected one of.*Did you mean 'fp8'"):
        make_spec("fp9")
    with pytest.raises(TypeError, match=r"`kv_cache` must be a format name.*kv_cache=8"):
        make_spec(8)
    with pytest.raises(TypeError, match=r"Keys of `kv_cache` must be module paths.*key 3"):
        make_spec({3: "int8"})
    with pytest.raises(ValueError, match=r"kv_cache\['dec/attn'\]"):
        make_spec({"dec/attn": "int7"})
    with pytest.raises(ValueError, match="`kv_cache`"):
        make_spec({"dec/(": "int8"})


def test_a_map_resolves_exact_then_patterns_then_ancestors():
    spec = make_spec({"dec/layer_0/attn": "fp8", r"dec/layer_\d+": "int8", "enc": None})
    assert spec.resolve("dec/layer_0/attn").name == "float8_e4m3fn"
    assert spec.resolve("dec/layer_3/attn").name == "int8"  # its ancestor's pattern
    assert spec.resolve("enc/attn") is None
    assert spec.resolve("other") is None  # no default: stored as written
    assert make_spec("int8").resolve("anything").name == "int8"
    clash = make_spec({"dec/.*": "int8", ".*/attn": "fp8"})
    with pytest.raises(ValueError, match=r"'dec/attn' matches several keys of `kv_cache`"):
        clash.resolve("dec/attn")
