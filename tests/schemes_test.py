"""Quantization formats as values (``jmp_policy._src.schemes``): every registered format
round-trips through names and configs, and a format defined here, outside the package (an
emulated "int6": int8 storage on the int6 grid), runs end to end once registered."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jmp_policy as jp
from jmp_policy._src import name_grammar, quantization, schemes
from jmp_policy._src.quantization import matmuls
from jmp_policy._src.quantization.calibrated_schemes import AWQScheme, GPTQScheme
from jmp_policy._src.quantization.float8_scheme import Float8Scheme
from jmp_policy._src.quantization.int_schemes import Int4Scheme, Int8Scheme
from jmp_policy._src.quantization.smoothquant_scheme import SmoothQuantScheme

INT6_MAX = 31.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class Int6Scheme(schemes.Scheme):
    """Emulated int6 weights: int8 values in [-31, 31], one scale per output channel."""

    mode = "int6"
    grammar = ("'int6'",)

    def quantize(self, x, stacked):
        x32 = jnp.asarray(x, jnp.float32)
        amax = jnp.max(jnp.abs(x32), axis=tuple(range(stacked, x.ndim - 1)), keepdims=True)
        scale = jnp.where(amax > 0, amax / INT6_MAX, 1.0)
        values = jnp.clip(jnp.round(x32 / scale), -INT6_MAX, INT6_MAX).astype(jnp.int8)
        n = x.shape[-1]
        return quantization.QuantizedArray(
            values, scale.reshape(*x.shape[:stacked], n), "int8", None, tuple(x.shape),
            np.dtype(x.dtype), stacked,
        )  # fmt: skip

    def matmul(self, kind, *, path, state, kernel):
        if quantization.is_quantized(kernel):
            return matmuls.stored_kernel(kind, path, kernel, scheme=self, int8_compute=False)
        return None


@pytest.fixture
def int6():
    schemes.register(Int6Scheme)
    name_grammar.forget_parsed()
    try:
        yield Int6Scheme
    finally:
        schemes.unregister(Int6Scheme)
        name_grammar.forget_parsed()


def _examples():
    """``(mode text, scheme)`` for every registered format: each token as written, and
    each scheme's canonical mode."""
    found = []
    for cls in schemes.registered():
        for token in cls.tokens or (cls.mode,):
            if cls in (GPTQScheme, AWQScheme):  # the bare token is no mode: "gptq/4/128" is
                continue
            scheme = cls.parse(token)
            found += [(scheme.mode_text(token), scheme), (scheme.mode_text(), scheme)]
    found.append(("int4/64", Int4Scheme(block_size=64)))
    found.append(("gptq/4/128", GPTQScheme(weight_bits=4, group_size=128)))
    found.append(("gptq/8/-1", GPTQScheme(weight_bits=8, group_size=-1)))
    found.append(("awq/4/-1", AWQScheme(weight_bits=4, group_size=-1)))
    return list(dict.fromkeys(found))


@pytest.mark.parametrize(("mode", "scheme"), _examples(), ids=str)
@pytest.mark.parametrize("source", ["float32", "mixed_bfloat16"])
def test_every_registered_scheme_round_trips_through_names_and_configs(mode, scheme, source):
    policy = jp.get(f"{mode}_from_{source}")
    assert policy.scheme == scheme
    assert policy.quantization_mode == scheme.mode
    assert policy.name == f"{mode}_from_{source}"
    assert jp.get(str(policy)) == policy
    assert jp.get(policy.name) == policy
    assert type(policy).from_config(policy.get_config()) == policy
    back = jp.deserialize(jp.serialize(policy))
    assert back == policy and type(back) is type(policy) and back.scheme == scheme


def test_the_built_in_formats_are_registered_by_their_tokens():
    assert set(schemes.tokens()) == {
        "int8", "int4", "float8", "float8_current", "gptq", "awq", "smoothquant",
    }  # fmt: skip
    assert set(schemes.registered()) == {
        Int8Scheme,
        Int4Scheme,
        Float8Scheme,
        GPTQScheme,
        AWQScheme,
        SmoothQuantScheme,
    }
    assert schemes.lookup("int4/128") is Int4Scheme and schemes.lookup("int7") is None


def test_schemes_are_frozen_keyword_only_values():
    assert Int4Scheme(block_size=32) == Int4Scheme(block_size=32)
    assert hash(Float8Scheme()) == hash(Float8Scheme(scaling="delayed"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        Int4Scheme().block_size = 3
    with pytest.raises(TypeError):
        Int4Scheme(32)
    with pytest.raises(ValueError, match=r"`block_size` must be -1 .* Received: block_size=0"):
        Int4Scheme(block_size=0)


def test_register_rejects_a_taken_token_and_a_non_scheme():
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Other(schemes.Scheme):
        mode = "int8"

    with pytest.raises(ValueError, match="The token 'int8' is already the format Int8Scheme"):
        schemes.register(Other)
    with pytest.raises(TypeError, match="`scheme` must be a subclass of Scheme"):
        schemes.register(int)


def test_state_comes_from_the_scheme():
    assert Float8Scheme(amax_history_length=3).init_state()["kernel_amax_history"].shape == (3,)
    assert Float8Scheme(scaling="current").init_state() is None
    assert Int8Scheme().init_state() is None and not Int8Scheme().stateful


# -- a format from outside the package -------------------------------------------------------


def test_a_registered_format_is_a_policy_name_and_a_config(int6):
    policy = jp.get("int6_from_mixed_bfloat16")
    assert type(policy) is jp.QuantizedDTypePolicy
    assert policy.scheme == Int6Scheme() and policy.quantization_mode == "int6"
    assert policy.compute_dtype == jnp.bfloat16
    assert policy.get_config() == {"mode": "int6", "source_name": "mixed_bfloat16"}
    assert jp.QuantizedDTypePolicy("int6", "float32") == jp.get("int6_from_float32")
    assert jp.deserialize(jp.serialize(policy)) == policy


def test_an_unregistered_format_is_not_a_name():
    with pytest.raises(ValueError, match="Cannot convert value int6_from_float32 "):
        jp.get("int6_from_float32")


def _int6_reference(kernel):
    amax = np.max(np.abs(np.asarray(kernel, np.float32)), axis=0, keepdims=True)
    scale = np.where(amax > 0, amax / INT6_MAX, 1.0)
    return np.clip(np.round(np.asarray(kernel) / scale), -INT6_MAX, INT6_MAX) * scale


class _MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4, name="head")(nn.relu(nn.Dense(8, name="hidden")(x)))


def test_a_registered_format_runs_through_a_map_quantize_linen_explain_and_serialize(int6):
    policy_map = jp.DTypePolicyMap("float32", {"hidden": "int6_from_float32"})
    x = jax.random.normal(jax.random.key(0), (2, 16))
    params = _MLP().init(jax.random.key(1), x)["params"]
    q = policy_map.quantize(params)
    kernel = q["hidden"]["kernel"]
    assert quantization.is_quantized(kernel) and q["head"]["kernel"].dtype == jnp.float32
    assert int(jnp.max(jnp.abs(kernel.values))) <= INT6_MAX
    np.testing.assert_allclose(
        kernel.dequantize(), _int6_reference(params["hidden"]["kernel"]), rtol=1e-6
    )

    y = jp.linen.apply(_MLP(), policy_map)({"params": q}, x)
    hidden = dict(params["hidden"], kernel=kernel.dequantize())
    want = _MLP().apply({"params": dict(params, hidden=hidden)}, x)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)

    table = jp.linen.explain(_MLP(), policy_map, {"params": q}, x)
    assert "int6_from_float32" in table
    assert "int6 weights: weight-only, scale after" in table  # its int8 storage, read whole

    back = jp.deserialize(jp.serialize(policy_map))
    assert back.get_config() == policy_map.get_config()
    assert back["hidden"].scheme == Int6Scheme()


class _NNXMLP(nnx.Module):
    def __init__(self, rngs):
        self.hidden = nnx.Linear(16, 8, rngs=rngs)
        self.head = nnx.Linear(8, 4, rngs=rngs)

    def __call__(self, x):
        return self.head(nnx.relu(self.hidden(x)))


def test_a_registered_format_runs_under_nnx(int6):
    policy_map = jp.DTypePolicyMap("float32", {"hidden": "int6_from_float32"})
    model = _NNXMLP(nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(0), (2, 16))
    reference = _int6_reference(model.hidden.kernel.get_value())
    quantized = jp.nnx.quantize(model, policy_map)
    assert quantization.is_quantized(quantized.hidden.kernel.get_value())
    y = jp.nnx.apply(quantized, policy_map)(x)
    model.hidden.kernel.set_value(jnp.asarray(reference, jnp.float32))
    np.testing.assert_allclose(y, model(x), rtol=1e-5, atol=1e-5)
    assert "int6_from_float32" in jp.nnx.explain(quantized, policy_map, x)


def test_explain_words_a_registered_format_as_the_scheme_describes_it(int6):
    # The int6 values are stored as int8: explain names the format, not the storage.
    policy_map = jp.DTypePolicyMap("float32", {"hidden": "int6_from_float32"})
    x = jnp.ones((2, 16))
    params = _MLP().init(jax.random.key(1), x)["params"]
    q = policy_map.quantize(params)
    assert q["hidden"]["kernel"].mode == "int8"
    table = jp.linen.explain(_MLP(), policy_map, {"params": q}, x)
    forms = table.split("matmuls:")[1].strip().splitlines()
    assert forms == ["hidden  int6 weights: weight-only, scale after"]

    model = jp.nnx.quantize(_NNXMLP(nnx.Rngs(0)), policy_map)
    forms = jp.nnx.explain(model, policy_map, x).split("matmuls:")[1].strip().splitlines()
    assert forms == ["hidden  int6 weights: weight-only, scale after"]
    assert Int6Scheme().describe(q["hidden"]["kernel"]) == "int6"


def test_the_built_in_formats_describe_their_weights_by_storage():
    kernel = jnp.ones((256, 8))
    int4 = Int4Scheme(block_size=128).quantize(kernel, 0)
    assert Int4Scheme(block_size=128).describe(int4) == "int4/128"
    assert Int4Scheme().describe(Int4Scheme().quantize(kernel, 0)) == "int4"
    assert Int8Scheme().describe(Int8Scheme().quantize(kernel, 0)) == "int8"
    assert GPTQScheme().describe(int4) == "int4/128"
    assert matmuls.storage_label(int4) == "int4/128"
