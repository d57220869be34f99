"""Serialization: get_config/from_config, serialize/deserialize, peers' configs, `get`."""

import copy
import json

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jmp_policy as jp

F16, BF16, F32 = np.dtype("float16"), np.dtype(ml_dtypes.bfloat16), np.dtype("float32")

POLICIES = [
    jp.DTypePolicy("mixed_bfloat16"),
    jp.DTypePolicy("p=f32,c=bf16,o=f32"),
    jp.DTypePolicy("int32"),
    jp.FloatDTypePolicy("mixed_float16"),
    jp.Policy("float64"),
    jp.Policy("c=f16"),
    jp.QuantizedDTypePolicy("int8", "mixed_bfloat16"),
    jp.QuantizedDTypePolicy("int4", "float32"),
    jp.QuantizedDTypePolicy("int4/128", "mixed_bfloat16"),
    jp.QuantizedFloat8DTypePolicy("float8", "mixed_bfloat16"),
    jp.QuantizedFloat8DTypePolicy("float8", "float32", 16),
]


def assert_same_policy(a, b):
    assert type(a) is type(b)
    assert a == b
    assert a.name == b.name
    assert (a.variable_dtype, a.compute_dtype, a.output_dtype) == (
        b.variable_dtype,
        b.compute_dtype,
        b.output_dtype,
    )
    assert a.get_config() == b.get_config()


@pytest.mark.parametrize("policy", POLICIES, ids=repr)
def test_serialize_round_trip_keeps_class_name_and_value(policy):
    config = jp.serialize(policy)
    assert config == {
        "module": "jmp_policy",
        "class_name": type(policy).__name__,
        "config": policy.get_config(),
    }
    assert json.loads(json.dumps(config)) == config
    assert_same_policy(jp.deserialize(config), policy)
    assert_same_policy(jp.deserialize(json.loads(json.dumps(config))), policy)
    assert_same_policy(jp.get(config), policy)


@pytest.mark.parametrize("policy", POLICIES, ids=repr)
def test_get_config_from_config_round_trip(policy):
    config = policy.get_config()
    assert_same_policy(type(policy).from_config(config), policy)


@pytest.mark.parametrize(
    ("policy", "config"),
    [
        (jp.DTypePolicy("mixed_float16"), {"name": "mixed_float16"}),
        (
            jp.QuantizedDTypePolicy("int8", "mixed_bfloat16"),
            {"mode": "int8", "source_name": "mixed_bfloat16"},
        ),
        (
            jp.QuantizedDTypePolicy("int4/128", "float32"),
            {"mode": "int4/128", "source_name": "float32"},
        ),
        (
            jp.QuantizedFloat8DTypePolicy("float8", "mixed_bfloat16", 512),
            {"mode": "float8", "source_name": "mixed_bfloat16", "amax_history_length": 512},
        ),
    ],
    ids=repr,
)
def test_get_config_matches_keras(policy, config):
    assert policy.get_config() == config


def test_round_trip_does_not_depend_on_global_policy():
    config = jp.serialize(jp.QuantizedDTypePolicy("int8", "mixed_bfloat16"))
    jp.set_dtype_policy("float16")
    assert jp.deserialize(config).name == "int8_from_mixed_bfloat16"


# Configs exactly as Keras 3.15 writes them (`keras.saving.serialize_keras_object`).
KERAS_CONFIGS = [
    (
        {
            "module": "keras",
            "class_name": "DTypePolicy",
            "config": {"name": "mixed_float16"},
            "registered_name": None,
        },
        jp.DTypePolicy,
        "mixed_float16",
        (F32, F16, F16),
    ),
    (
        {
            "module": "keras",
            "class_name": "FloatDTypePolicy",
            "config": {"name": "mixed_bfloat16"},
            "registered_name": None,
        },
        jp.FloatDTypePolicy,
        "mixed_bfloat16",
        (F32, BF16, BF16),
    ),
    (
        {
            "module": "keras.dtype_policies",
            "class_name": "QuantizedDTypePolicy",
            "config": {"mode": "int8", "source_name": "mixed_bfloat16"},
            "registered_name": None,
        },
        jp.QuantizedDTypePolicy,
        "int8_from_mixed_bfloat16",
        (F32, BF16, BF16),
    ),
    (
        {
            "module": "keras.dtype_policies",
            "class_name": "QuantizedDTypePolicy",
            "config": {"mode": "int4", "source_name": "float32"},
            "registered_name": None,
        },
        jp.QuantizedDTypePolicy,
        "int4_from_float32",
        (F32, F32, F32),
    ),
    (
        {
            "module": "keras.dtype_policies",
            "class_name": "Int4DTypePolicy",
            "config": {"mode": "int4/128", "source_name": "mixed_bfloat16"},
            "registered_name": None,
        },
        jp.QuantizedDTypePolicy,
        "int4/128_from_mixed_bfloat16",
        (F32, BF16, BF16),
    ),
    (
        {
            "module": "keras.dtype_policies",
            "class_name": "QuantizedFloat8DTypePolicy",
            "config": {
                "mode": "float8",
                "source_name": "mixed_bfloat16",
                "amax_history_length": 512,
            },
            "registered_name": None,
        },
        jp.QuantizedFloat8DTypePolicy,
        "float8_from_mixed_bfloat16",
        (F32, BF16, BF16),
    ),
    # tf.keras `Policy`.
    (
        {"class_name": "Policy", "config": {"name": "mixed_float16"}},
        jp.Policy,
        "mixed_float16",
        (F32, F16, F16),
    ),
    (
        {"class_name": "Policy", "config": {"name": "float32"}},
        jp.Policy,
        "float32",
        (F32, F32, F32),
    ),
    # tf.keras's experimental policy carried a loss scale; it is dropped.
    (
        {
            "class_name": "PolicyV1",
            "config": {
                "name": "mixed_float16",
                "loss_scale": {
                    "class_name": "DynamicLossScale",
                    "config": {
                        "initial_loss_scale": 32768.0,
                        "increment_period": 2000,
                        "multiplier": 2.0,
                    },
                },
            },
        },
        jp.Policy,
        "mixed_float16",
        (F32, F16, F16),
    ),
    (
        {"class_name": "PolicyV1", "config": {"name": "mixed_bfloat16", "loss_scale": None}},
        jp.Policy,
        "mixed_bfloat16",
        (F32, BF16, BF16),
    ),
    (
        {"class_name": "Policy", "config": {"name": "mixed_float16", "loss_scale": "dynamic"}},
        jp.Policy,
        "mixed_float16",
        (F32, F16, F16),
    ),
]


@pytest.mark.parametrize(
    ("config", "cls", "name", "dtypes"), KERAS_CONFIGS, ids=lambda x: str(x)[:60]
)
@pytest.mark.parametrize("reader", [jp.deserialize, jp.get], ids=["deserialize", "get"])
def test_reads_peer_configs(reader, config, cls, name, dtypes):
    before = copy.deepcopy(config)
    policy = reader(config)
    assert type(policy) is cls
    assert policy.name == name
    assert (policy.variable_dtype, policy.compute_dtype, policy.output_dtype) == dtypes
    assert config == before  # never mutated
    assert not hasattr(policy, "loss_scale")


def test_int4_config_keeps_block_size_and_float8_history():
    int4 = jp.deserialize(KERAS_CONFIGS[4][0])
    assert int4.block_size == 128
    assert int4.mode == "int4/128"
    float8 = jp.deserialize(KERAS_CONFIGS[5][0])
    assert float8.amax_history_length == 512


def test_from_config_drops_loss_scale_and_keeps_input():
    config = {"name": "mixed_float16", "loss_scale": {"class_name": "FixedLossScale"}}
    before = copy.deepcopy(config)
    policy = jp.Policy.from_config(config)
    assert policy == jp.DTypePolicy("mixed_float16")
    assert config == before


def test_deserialize_reads_plain_names():
    assert jp.deserialize("mixed_bfloat16") == jp.DTypePolicy("mixed_bfloat16")
    assert type(jp.deserialize("float8_from_float32")) is jp.QuantizedFloat8DTypePolicy


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"class_name": "Bogus", "config": {"name": "float32"}}, "Unknown `class_name` 'Bogus'"),
        ({"config": {"name": "float32"}}, "Unknown `class_name` None"),
        (
            {"class_name": "DTypePolicy", "config": "float32"},
            r"`config\['config'\]` must be a dict",
        ),
        ({"class_name": "DTypePolicy", "config": {"name": "mixed_bfloat15"}}, "Cannot convert"),
        (
            {
                "class_name": "QuantizedDTypePolicy",
                "config": {"mode": "int7", "source_name": "float32"},
            },
            "Invalid quantization mode",
        ),
        (
            {
                "class_name": "QuantizedDTypePolicy",
                "config": {"mode": "int8", "source_name": "mixed_float16"},
            },
            "doesn't work well",
        ),
        (
            {
                "class_name": "QuantizedFloat8DTypePolicy",
                "config": {"mode": "float8", "source_name": "float32", "amax_history_length": 0},
            },
            "amax_history_length",
        ),
    ],
    ids=lambda x: str(x)[:50],
)
def test_deserialize_bad_config_raises_value_error(config, match):
    before = copy.deepcopy(config)
    with pytest.raises(ValueError, match=match):
        jp.deserialize(config)
    assert config == before


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"class_name": "DTypePolicy", "config": {"nme": "float32"}}, "does not fit DTypePolicy"),
        ({"class_name": "DTypePolicy", "config": {"name": "float32", "extra": 1}}, "extra"),
        ({"class_name": "DTypePolicy", "config": {"name": 3}}, "`name`: 'name' must be a string"),
        (
            {
                "class_name": "QuantizedFloat8DTypePolicy",
                "config": {"mode": "float8", "source_name": "float32", "amax_history_length": 2.0},
            },
            "must be an integer",
        ),
    ],
    ids=lambda x: str(x)[:50],
)
def test_deserialize_ill_typed_config_raises_type_error(config, match):
    with pytest.raises(TypeError, match=match):
        jp.deserialize(config)


@pytest.mark.parametrize("bad", [3, None, ["float32"], jnp.float32])
def test_deserialize_non_dict_raises_type_error(bad):
    with pytest.raises(TypeError, match="`config` must be a dict"):
        jp.deserialize(bad)


@pytest.mark.parametrize("bad", ["x", [1]])
def test_from_config_non_dict_raises_type_error(bad):
    with pytest.raises(TypeError, match="`config` must be a dict"):
        jp.DTypePolicy.from_config(bad)


@pytest.mark.parametrize("bad", ["mixed_float16", None, 3, jnp.float32, object()])
def test_serialize_non_policy_raises_type_error(bad):
    with pytest.raises(TypeError, match="`obj` must be a dtype policy"):
        jp.serialize(bad)


# -- get ---------------------------------------------------------------------------------------


def test_get_none_is_global_policy():
    assert jp.get(None) is jp.dtype_policy()
    assert jp.get() is jp.dtype_policy()
    with jp.policy_scope("mixed_bfloat16"):
        assert jp.get(None).name == "mixed_bfloat16"


@pytest.mark.parametrize(
    ("name", "cls"),
    [
        ("bfloat16", jp.DTypePolicy),
        ("mixed_float16", jp.DTypePolicy),
        ("p=f32,c=bf16,o=f32", jp.DTypePolicy),
        ("half", jp.DTypePolicy),
        ("int32", jp.DTypePolicy),
        ("int8_from_mixed_bfloat16", jp.QuantizedDTypePolicy),
        ("int4/64_from_float32", jp.QuantizedDTypePolicy),
        ("float8_from_float32", jp.QuantizedFloat8DTypePolicy),
        ("float8_from_mixed_float16", jp.QuantizedFloat8DTypePolicy),
    ],
)
def test_get_name(name, cls):
    policy = jp.get(name)
    assert type(policy) is cls
    assert policy.name == name
    assert policy == jp.get_policy(name)


@pytest.mark.parametrize("policy", POLICIES, ids=repr)
def test_get_policy_object_returns_it(policy):
    assert jp.get(policy) is policy


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [
        (jnp.bfloat16, BF16),
        (jnp.float16, F16),
        (jnp.float32, F32),
        (np.float16, F16),
        (np.float32, F32),
        (np.dtype("float32"), F32),
        (jnp.dtype("bfloat16"), BF16),
        (np.dtype(ml_dtypes.bfloat16), BF16),
        (jnp.int32, np.dtype("int32")),
        (np.bool_, np.dtype("bool")),
    ],
    ids=str,
)
def test_get_dtype_makes_policy_of_that_dtype(dtype, expected):
    policy = jp.get(dtype)
    assert type(policy) is jp.DTypePolicy
    assert (policy.variable_dtype, policy.compute_dtype, policy.output_dtype) == (expected,) * 3
    assert policy.name == expected.name


@pytest.mark.parametrize(
    "bad", [123, 1.5, True, ["float32"], object(), np.dtype("O"), np.dtype("U3")]
)
def test_get_bad_identifier_raises_type_error(bad):
    with pytest.raises(TypeError, match="Cannot interpret `dtype` argument"):
        jp.get(bad)


@pytest.mark.parametrize("bad", ["mixed_bfloat15", "int8_from_", "int8_from_mixed_bfloat15"])
def test_get_bad_name_raises_value_error(bad):
    with pytest.raises(ValueError, match="Cannot convert"):
        jp.get(bad)


def test_get_policy_map_returns_it():
    policy_map_cls = getattr(jp, "DTypePolicyMap", None)
    if policy_map_cls is None:
        pytest.skip("DTypePolicyMap is not there yet")
    policy_map = policy_map_cls("mixed_bfloat16", {"head": "float32"})
    assert jp.get(policy_map) is policy_map


# --- Keras's error phrases and types ----------------------------------------------------


def test_keras_error_phrases_and_types():
    # Keras raises ValueError where a wrong type is passed; ours is both a ValueError and a
    # TypeError, so code written for either catches it.
    with pytest.raises(ValueError, match=r"Cannot interpret `dtype` argument."):
        jp.get(123)
    with pytest.raises(TypeError, match=r"Cannot interpret `dtype` argument."):
        jp.get(123)
    with pytest.raises(ValueError, match="Invalid `policy` argument"):
        jp.set_dtype_policy(12345)
    with pytest.raises(ValueError, match="Cannot convert"):
        jp.get("mixed_bfloat15")
    with pytest.raises(ValueError, match="Cannot convert"):
        jp.get("int8_from_mixed_bfloat15")
    with pytest.raises(ValueError, match="Cannot convert"):
        jp.get("int8_from_")
    with pytest.raises(ValueError, match="Cannot convert `policy` into a valid pair"):
        jp.get("int8_abc_")
    with pytest.raises(TypeError, match="'name' must be a string"):
        jp.DTypePolicy(123)
    with pytest.raises(TypeError, match="'name' must be a string"):
        jp.QuantizedFloat8DTypePolicy(mode="float8", source_name=123)
