"""Every error names the argument the user passed and quotes its value (issue 30)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import jmp_policy as jp


class _Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3, name="head")(x)


class _NnxNet(nnx.Module):
    def __init__(self):
        self.head = nnx.Linear(4, 3, rngs=nnx.Rngs(0))

    def __call__(self, x):
        return self.head(x)


X = jnp.ones((2, 4))


def test_deserialize_names_config():
    with pytest.raises(ValueError, match=r"Unknown dtype or policy name 'bogus'") as info:
        jp.deserialize("bogus")
    assert str(info.value).endswith("Received: config='bogus'")
    with pytest.raises(ValueError, match=r"Received: config=\{'class_name': 'Nope'\}"):
        jp.deserialize({"class_name": "Nope"})


def test_set_dtype_policy_names_policy():
    with pytest.raises(ValueError, match=r"block size") as info:
        jp.set_dtype_policy("int4/0_from_float32")
    message = str(info.value)
    assert "Received: policy='int4/0_from_float32', where mode='int4/0'" in message
    assert "name=" not in message
    with pytest.raises(ValueError, match=r"Received: policy='bogus'$"):
        jp.set_dtype_policy("bogus")
    assert jp.dtype_policy() == jp.DTypePolicy("float32")


def test_get_names_identifier():
    with pytest.raises(ValueError, match=r"Unknown `class_name` None in `identifier`") as info:
        jp.get({})
    assert str(info.value).endswith("Received: identifier={}")
    with pytest.raises(ValueError, match=r"Received: identifier='bogus'$"):
        jp.get("bogus")


def test_a_bad_map_value_through_linen_apply_names_policy_or_map_and_the_key():
    with pytest.raises(ValueError) as info:
        jp.linen.apply(_Net(), {"head": "bogus"})
    message = str(info.value)
    assert message.startswith(
        "Invalid `policy_or_map`: Cannot interpret the assigned value for key 'head'"
    )
    assert message.endswith("Received: value='bogus'")
    assert "identifier" not in message


@pytest.mark.parametrize("policy", ["float32", {"head": "mixed_bfloat16"}])
def test_quantize_wrappers_given_no_quantized_policy_name_policy_or_map(policy):
    net = _Net()
    variables = net.init(jax.random.key(0), X)
    expected = f"Received: policy_or_map={policy!r}, which holds"
    with pytest.raises(ValueError, match="`policy_or_map` quantizes nothing") as info:
        jp.linen.quantize(net, policy, variables, X)
    assert expected in str(info.value)
    with pytest.raises(ValueError, match="`policy_or_map` quantizes nothing") as info:
        jp.nnx.quantize(_NnxNet(), policy)
    assert expected in str(info.value)


@pytest.mark.parametrize(
    ("obj", "words"),
    [
        (jp.DTypePolicy("p=f32,c=bf16,o=f32"), "Keras has no output dtype"),
        (
            jp.DTypePolicyMap("p=f32,c=bf16,o=f32", {"a": "float32"}),
            "Cannot write the map's `default_policy` for Keras",
        ),
        (jp.Policy("_infer"), "Keras 3 has no '_infer' policy"),
    ],
)
def test_keras_format_serialize_errors_quote_obj(obj, words):
    with pytest.raises(ValueError, match=words) as info:
        jp.serialize(obj, format="keras")
    assert str(info.value).count("Received: obj=") == 1
    assert str(info.value).endswith(f"Received: obj={obj!r}")


@pytest.mark.parametrize("bad", [b"head", bytearray(b"head"), {"head": 1}])
def test_autocast_exclude_bytes_and_mappings_are_quoted_whole(bad):
    with pytest.raises(TypeError, match=r"`autocast_exclude` must be a sequence") as info:
        jp.linen.apply(_Net(), "float32", autocast_exclude=bad)
    assert str(info.value).endswith(f"Received: autocast_exclude={bad!r}")
    assert "104" not in str(info.value)
