"""Keras 3 reads what `serialize(obj, format="keras")` writes, and we read what Keras writes.

Runs against the real `keras` package (JAX backend), which the `test` extra installs.
"""

import json
import os

import pytest

os.environ.setdefault("KERAS_BACKEND", "jax")
import keras  # the `test` extra installs it: these tests never skip

import jmp_policy as jp

POLICIES = [
    lambda: jp.DTypePolicy("mixed_bfloat16"),
    lambda: jp.FloatDTypePolicy("mixed_float16"),
    lambda: jp.Policy("float64"),
    lambda: jp.get_policy("p=f32,c=bf16"),
    lambda: jp.DTypePolicy("int32"),
    lambda: jp.QuantizedDTypePolicy("int8", "mixed_bfloat16"),
    lambda: jp.QuantizedDTypePolicy("int4", "float32"),
    lambda: jp.Int4DTypePolicy("int4", "mixed_bfloat16", 128),
    lambda: jp.Int4DTypePolicy("int4", "float32", -1),
    lambda: jp.QuantizedFloat8DTypePolicy("float8", "mixed_bfloat16", 16),
    lambda: jp.GPTQDTypePolicy("gptq/4/128", "mixed_bfloat16"),
    lambda: jp.GPTQDTypePolicy("gptq/8/-1", "float32"),
    lambda: jp.AWQDTypePolicy("awq/4/-1", "mixed_bfloat16"),
]


def _same_as_keras(ours, theirs):
    assert theirs.compute_dtype == ours.compute_dtype.name
    assert theirs.variable_dtype == ours.variable_dtype.name
    assert theirs.quantization_mode == ours.quantization_mode
    if isinstance(ours, jp.Int4DTypePolicy):
        assert isinstance(theirs, keras.dtype_policies.Int4DTypePolicy)
        assert theirs.block_size == ours.block_size
    if isinstance(ours, jp.QuantizedFloat8DTypePolicy):
        assert theirs.amax_history_length == ours.amax_history_length
    if isinstance(ours, (jp.GPTQDTypePolicy, jp.AWQDTypePolicy)):
        assert type(theirs).__name__ == type(ours).__name__
        assert (theirs.weight_bits, theirs.group_size) == (ours.weight_bits, ours.group_size)
        assert theirs.name == ours.name


@pytest.mark.parametrize("make", POLICIES)
def test_keras_reads_our_keras_format(make):
    policy = make()
    config = json.loads(json.dumps(jp.serialize(policy, format="keras")))
    theirs = keras.saving.deserialize_keras_object(config)
    assert isinstance(theirs, keras.DTypePolicy)
    _same_as_keras(policy, theirs)
    assert jp.deserialize(keras.saving.serialize_keras_object(theirs)) == policy


def test_keras_reads_our_map():
    policy_map = jp.DTypePolicyMap(
        "float32",
        {
            "encoder/.*": "mixed_bfloat16",
            "head": "int8_from_float32",
            "embed": jp.Int4DTypePolicy("int4", "float32", 64),
        },
    )
    config = json.loads(json.dumps(jp.serialize(policy_map, format="keras")))
    theirs = keras.saving.deserialize_keras_object(config)
    assert isinstance(theirs, keras.dtype_policies.DTypePolicyMap)
    assert sorted(theirs) == sorted(policy_map)
    for key in policy_map:
        _same_as_keras(policy_map[key], theirs[key])
    # Paths Keras resolves the same way: exact keys, regular expressions, the default.
    for path in ["encoder/layer_0", "head", "embed", "unknown"]:
        _same_as_keras(policy_map[path], theirs[path])
    back = jp.deserialize(keras.saving.serialize_keras_object(theirs))
    assert dict(back.items()) == dict(policy_map.items())


def test_keras_reads_our_map_without_default():
    policy_map = jp.DTypePolicyMap(None, {"head": "mixed_bfloat16"})
    theirs = keras.saving.deserialize_keras_object(jp.serialize(policy_map, format="keras"))
    assert theirs.default_policy == keras.config.dtype_policy()
    _same_as_keras(policy_map["head"], theirs["head"])


def test_default_format_is_not_keras_format():
    # The library's own format names its classes under `jmp_policy`: Keras cannot read it.
    with pytest.raises(TypeError, match="Could not locate class 'DTypePolicyMap'"):
        keras.saving.deserialize_keras_object(jp.serialize(jp.DTypePolicyMap()))


@pytest.mark.parametrize(
    ("make", "ours"),
    [
        (lambda: keras.dtype_policies.GPTQDTypePolicy("gptq/4/128", "float32"), jp.GPTQDTypePolicy),
        (lambda: keras.dtype_policies.GPTQDTypePolicy("gptq/8/-1", "bfloat16"), jp.GPTQDTypePolicy),
        (
            lambda: keras.dtype_policies.AWQDTypePolicy("awq/4/64", "mixed_bfloat16"),
            jp.AWQDTypePolicy,
        ),
    ],
)
def test_we_read_keras_calibrated_policies(make, ours):
    theirs = make()
    policy = jp.deserialize(json.loads(json.dumps(keras.saving.serialize_keras_object(theirs))))
    assert type(policy) is ours
    _same_as_keras(policy, theirs)
    assert jp.get(theirs.name) == policy


def test_keras_gptq_bits_we_cannot_store_are_a_clear_error():
    theirs = keras.dtype_policies.GPTQDTypePolicy("gptq/3/128", "float32")
    with pytest.raises(
        ValueError, match=r"GPTQ only supports 4-bit or 8-bit.*3 bits are not supported"
    ):
        jp.deserialize(keras.saving.serialize_keras_object(theirs))
