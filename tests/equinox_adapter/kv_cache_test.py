"""``kv_cache=`` for Equinox: the caches a model keeps in ``eqx.nn.State`` stored as int8 or
float8, named by the path of their ``StateIndex`` fields (issue #50)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_policy as jp

LENGTH, HEADS, HEAD_DIM, WIDTH = 16, 2, 8, 16


class Attention(eqx.Module):
    """One head group of causal self-attention decoding a token a step, its caches in
    ``eqx.nn.State`` (as Equinox's stateful layers keep state)."""

    query: eqx.nn.Linear
    key: eqx.nn.Linear
    value: eqx.nn.Linear
    out: eqx.nn.Linear
    key_cache: eqx.nn.StateIndex
    value_cache: eqx.nn.StateIndex

    def __init__(self, key):
        kq, kk, kv, ko = jax.random.split(key, 4)
        self.query = eqx.nn.Linear(WIDTH, HEADS * HEAD_DIM, key=kq)
        self.key = eqx.nn.Linear(WIDTH, HEADS * HEAD_DIM, key=kk)
        self.value = eqx.nn.Linear(WIDTH, HEADS * HEAD_DIM, key=kv)
        self.out = eqx.nn.Linear(HEADS * HEAD_DIM, WIDTH, key=ko)
        empty = jnp.zeros((LENGTH, HEADS, HEAD_DIM), jnp.bfloat16)
        self.key_cache = eqx.nn.StateIndex(empty)
        self.value_cache = eqx.nn.StateIndex(empty)

    def __call__(self, x, pos, state):  # x: [WIDTH], one token
        q, k, v = (f(x).reshape(1, HEADS, HEAD_DIM) for f in (self.query, self.key, self.value))
        keys = jax.lax.dynamic_update_slice(
            state.get(self.key_cache), k.astype(jnp.bfloat16), (pos, 0, 0)
        )
        values = jax.lax.dynamic_update_slice(
            state.get(self.value_cache), v.astype(jnp.bfloat16), (pos, 0, 0)
        )
        state = state.set(self.key_cache, keys).set(self.value_cache, values)
        logits = jnp.einsum("qhd,khd->hk", q, keys.astype(q.dtype)) / HEAD_DIM**0.5
        logits = jnp.where(jnp.arange(LENGTH) <= pos, logits, -1e9)
        mixed = jnp.einsum("hk,khd->hd", jax.nn.softmax(logits), values.astype(q.dtype))
        return self.out(mixed.reshape(-1)), state


class Decoder(eqx.Module):
    blocks: list

    def __init__(self, key):
        self.blocks = [Attention(k) for k in jax.random.split(key, 2)]

    def __call__(self, x, pos, state):
        for block in self.blocks:
            y, state = block(x, pos, state)
            x = x + y
        return x, state


BOTH = {"blocks/.*/key_cache": "int8", "blocks/.*/value_cache": "int8"}
TOKENS = jax.random.normal(jax.random.key(1), (6, WIDTH))


def _model():
    return eqx.nn.make_with_state(Decoder)(jax.random.key(0))


def _decode(kv_cache, jit=False):
    model, state = _model()
    step = jp.equinox.apply(model, "mixed_bfloat16", kv_cache=kv_cache)
    step = jax.jit(step) if jit else step
    outs, states = [], []
    for pos, x in enumerate(TOKENS):
        out, state = step(x, pos, state)
        outs.append(np.asarray(out, np.float32))
        states.append(state)
    return model, np.stack(outs), states


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize(("kv_cache", "tolerance"), [(BOTH, 0.03), ("fp8", None)])
def test_decoding_is_close_to_the_bfloat16_cache(jit, kv_cache, tolerance):
    if kv_cache == "fp8":  # a format by path, in vLLM's spelling
        kv_cache, tolerance = {k: "fp8" for k in BOTH}, 0.06
    model, reference, _ = _decode(None, jit)
    _, outs, states = _decode(kv_cache, jit)
    error = np.abs(outs - reference).max() / np.abs(reference).max()
    assert 0 < error < tolerance
    stored = states[-1].get(model.blocks[1].value_cache)
    assert isinstance(stored, jp.QuantizedKVCache)
    assert stored.values.dtype == (jnp.int8 if tolerance == 0.03 else jnp.float8_e4m3fn)


def test_a_token_once_written_never_changes():
    model, _, states = _decode(BOTH)
    index = model.blocks[0].key_cache
    rows = [np.asarray(s.get(index).values) for s in states]
    scales = [np.asarray(s.get(index).scale) for s in states]
    for step in range(1, len(rows)):
        np.testing.assert_array_equal(rows[step][:step], rows[step - 1][:step])
        np.testing.assert_array_equal(scales[step][:step], scales[step - 1][:step])
        assert np.abs(rows[step][step]).max() > 0  # this step's token written


@pytest.mark.parametrize("jit", [False, True])
def test_a_scan_decoding_loop_carries_the_quantized_state(jit):
    model, state = _model()
    state = jp.equinox.quantize_caches(model, state, BOTH)
    step = jp.equinox.apply(model, "mixed_bfloat16", kv_cache=BOTH)

    def loop(state):
        def body(state, item):
            pos, x = item
            out, state = step(x, pos, state)
            return state, out

        return jax.lax.scan(body, state, (jnp.arange(len(TOKENS)), TOKENS))

    final, outs = (jax.jit(loop) if jit else loop)(state)
    _, python_loop, states = _decode(BOTH)
    np.testing.assert_allclose(np.asarray(outs, np.float32), python_loop, rtol=2e-2, atol=2e-2)
    np.testing.assert_array_equal(
        np.asarray(final.get(model.blocks[0].key_cache).values),
        np.asarray(states[-1].get(model.blocks[0].key_cache).values),
    )


class _Cache(eqx.Module):
    key_cache: eqx.nn.StateIndex

    def __init__(self, head_dim):
        self.key_cache = eqx.nn.StateIndex(jnp.zeros((64, 4, head_dim), jnp.bfloat16))


@pytest.mark.parametrize("fmt", ["int8", "float8_e4m3fn"])
def test_quantize_caches_stores_at_most_053_of_the_bfloat16_bytes(fmt):
    def nbytes(s):
        return sum(leaf.nbytes for leaf in jax.tree.leaves(s))

    model, state = eqx.nn.make_with_state(_Cache)(128)  # Gemma's and Llama's head size
    quantized = jp.equinox.quantize_caches(model, state, {"key_cache": fmt})
    ratio = nbytes(quantized) / nbytes(state)
    assert ratio <= 0.53
    assert ratio == (0.5 + 2 / 128 if fmt == "int8" else 0.5 + 2 / (4 * 128))
    assert jp.equinox.quantize_caches(model, state, None) is state


def test_flax_names_are_found_by_their_modules_path():
    class Flaxish(eqx.Module):
        cached_key: eqx.nn.StateIndex

        def __init__(self):
            self.cached_key = eqx.nn.StateIndex(jnp.zeros((4, 2, 8), jnp.float32))

    class Outer(eqx.Module):
        attn: Flaxish

        def __init__(self):
            self.attn = Flaxish()

    model, state = eqx.nn.make_with_state(Outer)()
    for kv_cache in ("int8", {"attn": "int8"}):
        stored = jp.equinox.quantize_caches(model, state, kv_cache).get(model.attn.cached_key)
        assert stored.values.dtype == jnp.int8 and stored.dtype == "float32"


def test_bad_requests_are_clear_errors():
    model, state = _model()
    with pytest.raises(ValueError, match=r"names no eqx.nn.StateIndex.*'blocks/0/k_cache'"):
        jp.equinox.quantize_caches(model, state, {"blocks/0/k_cache": "int8"})
    with pytest.raises(TypeError, match=r"`state` must be an eqx.nn.State.*dict"):
        jp.equinox.quantize_caches(model, {}, BOTH)
    with pytest.raises(ValueError, match=r"Unknown KV cache format 'int3'"):
        jp.equinox.quantize_caches(model, state, {"blocks/0/key_cache": "int3"})


def test_a_request_that_matches_no_cache_warns_once_naming_the_way_out():
    model, state = _model()
    step = jp.equinox.apply(model, "mixed_bfloat16", kv_cache="int8")  # no Flax names
    with pytest.warns(UserWarning, match=r"matched no attention cache.*StateIndex field"):
        _, state = step(TOKENS[0], 0, state)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(TOKENS[1], 1, state)


def test_explain_lists_each_cache_with_its_format_and_bytes():
    model, state = _model()
    stored = jp.equinox.quantize_caches(model, state, BOTH)
    for given in (state, stored):  # as it will be stored, and as it is
        table = jp.equinox.explain(model, "mixed_bfloat16", TOKENS[0], 0, given, kv_cache=BOTH)
        rows = {
            line.split()[0]: line.split() for line in table.split("KV caches")[0].splitlines()[-6:]
        }
        row = rows["blocks/0/key_cache"]
        assert row[1:5] == ["int8", "per", "token", "and"], row
        assert row[-2:] == [str(16 * 2 * 8 + 16 * 2 * 4), str(16 * 2 * 8 * 2)], row
        assert rows["total"][-2:] == ["1.5K", "2.0K"]
    plain = jp.equinox.explain(model, "mixed_bfloat16", TOKENS[0], 0, state)
    assert "KV caches" not in plain
