"""What a model run tells the user: a typo'd map key warns once per map and model, at the
user's line (not inside JAX or Flax), naming the closest module paths."""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

import jmp_policy as jp
from jmp_policy._src.quantization import matmuls


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(8, name="hidden_0")(x))
        return nn.Dense(2, name="head")(x)


class NNXMLP(nnx.Module):
    def __init__(self, rngs):
        self.hidden_0, self.head = nnx.Linear(4, 8, rngs=rngs), nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x):
        return self.head(nnx.relu(self.hidden_0(x)))


X = jnp.ones((2, 4))


def _typo_warnings(record):
    return [w for w in record if "haed" in str(w.message)]


def test_typo_warns_once_across_init_and_jitted_apply_at_the_users_line():
    policy_map = jp.DTypePolicyMap("mixed_bfloat16", {"haed": "float32"})
    model = MLP()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        variables = jax.jit(jp.linen.init(model, policy_map))(jax.random.key(0), X)
        step = jax.jit(jp.linen.apply(model, policy_map))
        step(variables, X)
        step(variables, X)
        jp.linen.apply(model, policy_map)(variables, X)  # a second wrapper, same map and model
    found = _typo_warnings(record)
    assert len(found) == 1, [str(w.message) for w in record]
    assert found[0].filename == __file__
    message = str(found[0].message)
    assert "['haed']" in message
    assert "'haed' (closest module paths: 'head')" in message
    assert "unused_keys" in message


def test_typo_warns_again_for_another_map_or_another_typo():
    model = MLP()
    variables = model.init(jax.random.key(0), X)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        jp.linen.apply(model, jp.DTypePolicyMap("bfloat16", {"haed": "float32"}))(variables, X)
        policy_map = jp.DTypePolicyMap("bfloat16", {"haed": "float32"})
        jp.linen.apply(model, policy_map)(variables, X)
        policy_map["hiden_0"] = "float32"
        jp.linen.apply(model, policy_map)(variables, X)
    messages = [str(w.message) for w in _typo_warnings(record)]
    assert len(messages) == 3, messages
    assert "'hiden_0' (closest module paths: 'hidden_0')" in messages[2]


def test_nnx_typo_warning_is_attributed_to_the_users_line():
    policy_map = jp.DTypePolicyMap("mixed_bfloat16", {"haed": "float32"})
    model = NNXMLP(nnx.Rngs(0))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        nnx.jit(lambda m, x: jp.nnx.apply(m, policy_map)(x))(model, X)
    found = _typo_warnings(record)
    assert len(found) == 1, [str(w.message) for w in record]
    assert found[0].filename == __file__


def test_float8_size_warning_is_attributed_to_the_users_line():
    policy_map = jp.DTypePolicyMap("mixed_bfloat16", {"head": "float8_from_mixed_bfloat16"})
    model = MLP()
    matmuls._WARNED.clear()  # given once per process: as if this were the first
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        variables = jp.linen.init(model, policy_map)(jax.random.key(0), jnp.ones((3, 4)))
        jp.linen.apply(model, policy_map)(variables, jnp.ones((3, 4)))
        jp.linen.apply(model, policy_map)(variables, jnp.ones((5, 4)))  # another shape
    found = [w for w in record if "float8 layer" in str(w.message)]
    assert len(found) == 1, [str(w.message) for w in found]  # once, not per shape
    assert "this warning is given once" in str(found[0].message)
    assert {w.filename for w in found} == {__file__}
