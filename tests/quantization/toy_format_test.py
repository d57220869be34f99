"""A format defined outside the package, with the public API only: a scheme, a policy class
and one ``jp.register`` call make "int6" (symmetric, one scale per output channel, its values
in [-31, 31] stored as int8) a policy name, a config and a quantized layer in Linen and NNX.
Nothing here imports ``jmp_policy._src``."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jmp_policy as jp

INT6_MAX = 31.0


# -- the format: a scheme, its policy class, one register call (in the fixture) ----------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class Int6Scheme(jp.Scheme):
    """int6 weights: int8 values in [-31, 31], one scale per output channel."""

    mode = "int6"
    grammar = ("'int6'",)
    # Its layers read the kernel dequantized to the compute dtype (no matmul of its own).
    reads_stored_kernels = False

    def quantize(self, x, stacked):
        x32 = jnp.asarray(x, jnp.float32)
        amax = jnp.max(jnp.abs(x32), axis=tuple(range(stacked, x.ndim - 1)), keepdims=True)
        scale = jnp.where(amax > 0, amax / INT6_MAX, 1.0)
        values = jnp.clip(jnp.round(x32 / scale), -INT6_MAX, INT6_MAX).astype(jnp.int8)
        return jp.QuantizedArray(
            values, scale.reshape(*x.shape[:stacked], x.shape[-1]), "int8", None,
            tuple(x.shape), np.dtype(x.dtype), stacked,
        )  # fmt: skip


class Int6DTypePolicy(jp.QuantizedDTypePolicy):
    """The int6 policy: ``"int6_from_<source>"``."""

    __slots__ = ()

    def __init__(self, mode: str = "int6", source_name: str | None = None):
        super().__init__(mode, source_name)

    @property
    def bits(self) -> int:
        return 6


@pytest.fixture
def int6():
    jp.register(Int6Scheme, Int6DTypePolicy)
    try:
        yield Int6Scheme
    finally:
        jp.unregister(Int6Scheme)


def _reference(kernel):
    """The kernel as int6 stores it (numpy)."""
    kernel = np.asarray(kernel, np.float32)
    amax = np.max(np.abs(kernel), axis=tuple(range(kernel.ndim - 1)), keepdims=True)
    scale = np.where(amax > 0, amax / INT6_MAX, 1.0)
    return np.clip(np.round(kernel / scale), -INT6_MAX, INT6_MAX) * scale


# -- names and configs ---------------------------------------------------------------------------


def test_the_toy_format_is_a_name_of_its_own_class(int6):
    policy = jp.get("int6_from_mixed_bfloat16")
    assert type(policy) is Int6DTypePolicy and policy.bits == 6
    assert policy.scheme == Int6Scheme() and policy.quantization_mode == "int6"
    assert policy.compute_dtype == jnp.bfloat16 and policy.variable_dtype == jnp.float32
    assert policy == Int6DTypePolicy("int6", "mixed_bfloat16")
    assert type(policy.with_compute_dtype(jnp.float32)) is Int6DTypePolicy


def test_the_toy_format_round_trips_through_configs(int6):
    policy = Int6DTypePolicy(source_name="mixed_bfloat16")
    config = policy.get_config()
    assert config == {"mode": "int6", "source_name": "mixed_bfloat16"}
    assert Int6DTypePolicy.from_config(config) == policy
    written = jp.serialize(policy)
    assert written["class_name"] == "Int6DTypePolicy"
    back = jp.deserialize(written)  # no custom_objects: the registry holds the class
    assert type(back) is Int6DTypePolicy and back == policy
    policy_map = jp.DTypePolicyMap("float32", {"hidden": "int6_from_float32"})
    back_map = jp.deserialize(jp.serialize(policy_map))
    assert type(back_map["hidden"]) is Int6DTypePolicy
    assert back_map.get_config() == policy_map.get_config()


def test_after_unregister_the_name_and_class_are_unknown(int6):
    jp.get("int6_from_float32")  # cached by the name grammar...
    written = jp.serialize(Int6DTypePolicy(source_name="float32"))
    jp.unregister(Int6Scheme)
    try:
        with pytest.raises(ValueError, match="Cannot convert value int6_from_float32 "):
            jp.get("int6_from_float32")  # ...and the cache was cleared
        with pytest.raises(ValueError, match="Unknown `class_name` 'Int6DTypePolicy'"):
            jp.deserialize(written)
    finally:
        jp.register(Int6Scheme, Int6DTypePolicy)


def test_a_taken_token_and_a_class_that_is_no_policy_are_refused(int6):
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Other(jp.Scheme):
        mode = "int6"

    with pytest.raises(ValueError, match="The token 'int6' is already the format Int6Scheme"):
        jp.register(Other)
    with pytest.raises(
        TypeError, match=r"`policy_class` must be a policy class.*policy_class=<class 'int'>"
    ):
        jp.register(Other, int)


# -- Linen ---------------------------------------------------------------------------------------


class _MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4, name="head")(nn.relu(nn.Dense(8, name="hidden")(x)))


@pytest.mark.parametrize("jit", [False, True])
def test_linen_quantize_apply_and_explain(int6, jit):
    policy_map = jp.DTypePolicyMap("float32", {"hidden": "int6_from_float32"})
    x = jax.random.normal(jax.random.key(0), (2, 16))
    variables = _MLP().init(jax.random.key(1), x)
    q = jp.linen.quantize(_MLP(), policy_map, variables, x)
    kernel = q["params"]["hidden"]["kernel"]
    assert isinstance(kernel, jp.QuantizedArray)
    assert int(jnp.max(jnp.abs(kernel.values))) <= INT6_MAX
    assert q["params"]["head"]["kernel"].dtype == jnp.float32
    reference = _reference(variables["params"]["hidden"]["kernel"])
    np.testing.assert_allclose(kernel.dequantize(), reference, rtol=1e-6)

    apply = jp.linen.apply(_MLP(), policy_map)
    y = (jax.jit(apply) if jit else apply)(q, x)
    hidden = dict(variables["params"]["hidden"], kernel=jnp.asarray(reference))
    want = _MLP().apply({"params": dict(variables["params"], hidden=hidden)}, x)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)

    table = jp.linen.explain(_MLP(), policy_map, q, x)
    hidden_row = next(line for line in table.splitlines() if line.startswith("hidden "))
    assert "int6_from_float32" in hidden_row and "key 'hidden'" in hidden_row


# -- NNX -----------------------------------------------------------------------------------------


class _NNXMLP(nnx.Module):
    def __init__(self, rngs):
        self.hidden = nnx.Linear(16, 8, rngs=rngs)
        self.head = nnx.Linear(8, 4, rngs=rngs)

    def __call__(self, x):
        return self.head(nnx.relu(self.hidden(x)))


@pytest.mark.parametrize("jit", [False, True])
def test_nnx_quantize_apply_and_explain(int6, jit):
    policy_map = jp.DTypePolicyMap("float32", {"hidden": "int6_from_float32"})
    model = _NNXMLP(nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(0), (2, 16))
    reference = _reference(model.hidden.kernel.get_value())
    quantized = jp.nnx.quantize(model, policy_map)
    kernel = quantized.hidden.kernel.get_value()
    assert isinstance(kernel, jp.QuantizedArray)
    np.testing.assert_allclose(kernel.dequantize(), reference, rtol=1e-6)

    apply = jp.nnx.apply(quantized, policy_map)
    y = (jax.jit(apply) if jit else apply)(x)
    model.hidden.kernel.set_value(jnp.asarray(reference, jnp.float32))
    np.testing.assert_allclose(y, model(x), rtol=1e-5, atol=1e-5)

    table = jp.nnx.explain(quantized, policy_map, x)
    hidden_row = next(line for line in table.splitlines() if line.startswith("hidden "))
    assert "int6_from_float32" in hidden_row and "key 'hidden'" in hidden_row
