"""The framework-independent run of quantized caches (issue #50): a handed-out cache's
``lax.dynamic_update_slice`` writes the quantized update into the stored cache."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_policy as jp
from jmp_policy._src.kv_cache import make_spec
from jmp_policy._src.kv_cache.formats import FORMATS
from jmp_policy._src.kv_cache.hook import CacheRun

INT8 = FORMATS["int8"]
SHAPE = (1, 8, 2, 128)


def _write(spec, cache, new, index):
    with CacheRun(spec) as run:
        run.hooked.add("attn")
        read = run.hand_out(cache)
        full = jax.lax.dynamic_update_slice(read, new, (0, index, 0, 0))
        return run.stored(full, INT8, "attn/cached_key", True), full


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_handed_out_caches_write_quantizes_only_the_update(jit):
    spec = make_spec("int8")
    write = (
        jax.jit(lambda c, n, i: _write(spec, c, n, i))
        if jit
        else (lambda c, n, i: _write(spec, c, n, i))
    )
    cache = jp.QuantizedKVCache.quantize(jnp.zeros(SHAPE, jnp.bfloat16), "int8")
    new = jnp.linspace(-1, 1, 256, dtype=jnp.float32).reshape(1, 1, 2, 128).astype(jnp.bfloat16)
    stored, full = write(cache, new, 3)
    assert isinstance(stored, jp.QuantizedKVCache)
    expected = cache.write(new, (0, 3, 0, 0))
    np.testing.assert_array_equal(np.asarray(stored.values), np.asarray(expected.values))
    np.testing.assert_array_equal(np.asarray(full), np.asarray(expected.dequantize()))


def test_outside_a_run_and_for_other_arrays_dynamic_update_slice_is_jaxs():
    x = jnp.zeros((4,))
    assert jax.lax.dynamic_update_slice(x, jnp.ones((1,)), (2,)).tolist() == [0, 0, 1, 0]
    with CacheRun(make_spec("int8")) as run:
        run.hooked.add("attn")
        out = jax.lax.dynamic_update_slice(x, jnp.ones((1,)), (1,))
    assert out.tolist() == [0, 1, 0, 0]


def test_a_cache_stored_whole_warns_once_and_a_run_that_met_no_cache_warns():
    spec = make_spec("int8")
    replaced = r"\['attn/cached_key'\] were replaced whole"
    with pytest.warns(UserWarning, match=replaced), CacheRun(spec) as run:
        run.hooked.add("attn")
        run.stored(jnp.ones(SHAPE), INT8, "attn/cached_key", True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with CacheRun(spec):  # once per spec
            pass
    unmatched = r"kv_cache='fp8' matched no attention cache"
    with pytest.warns(UserWarning, match=unmatched), CacheRun(make_spec("fp8")):
        pass


def test_an_error_in_the_run_is_not_hidden_by_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(RuntimeError, match="boom"), CacheRun(make_spec("int8")):
            raise RuntimeError("boom")


def test_flax_cache_names_resolve_by_module_path_any_other_name_by_its_own_path():
    from jmp_policy._src.kv_cache.hook import Run

    run = Run(make_spec({"dec/attn": "int8", "dec/.*/k_cache": "fp8"}))
    assert run.format_of("dec/attn", "cached_key") is INT8  # Flax's name, its module's key
    assert run.format_of("dec/attn", "v_cache") is None  # no key names this variable
    assert run.format_of("dec/mlp", "k_cache") is FORMATS["float8_e4m3fn"]
    assert run.format_of("dec/mlp", "cache_index") is None
    default = Run(make_spec("int8"))  # a bare format: Flax's names only
    assert default.format_of("any/attn", "cached_value") is INT8
    assert default.format_of("any/attn", "key_cache") is None
