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
    jp.GPTQDTypePolicy("gptq/4/128", "mixed_bfloat16"),
    jp.GPTQDTypePolicy("gptq/8/-1", "float32"),
    jp.AWQDTypePolicy("awq/4/-1", "mixed_bfloat16"),
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
        jp.Int4DTypePolicy,
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
    assert int4.mode == "int4"
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
        ({"class_name": "DTypePolicy", "config": {"nme": "float32"}}, "Unknown field 'nme'"),
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


@pytest.mark.parametrize("bad", [3, ["float32"], jnp.float32])
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
        ("int4/64_from_float32", jp.Int4DTypePolicy),
        ("int4_from_float32", jp.QuantizedDTypePolicy),
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


# --- tf.keras's "_infer" ------------------------------------------------------------------


@pytest.mark.parametrize("make", [jp.Policy, jp.DTypePolicy, jp.get])
def test_infer_policy_serializes_to_none_and_back(make):
    assert jp.serialize(make("_infer")) is None
    restored = jp.deserialize(None)
    assert type(restored) is jp.Policy  # tf.keras's class
    assert restored.name == "_infer"
    assert restored == make("_infer")
    assert restored.compute_dtype is None


def test_get_none_is_still_the_global_policy():
    # `deserialize(None)` is tf.keras's "_infer"; `get(None)` is Keras's global policy.
    with jp.policy_scope("mixed_bfloat16"):
        assert jp.get(None) == jp.DTypePolicy("mixed_bfloat16")


def test_infer_policy_config_round_trips():
    policy = jp.Policy("_infer")
    assert policy.get_config() == {"name": "_infer"}
    assert jp.Policy.from_config(policy.get_config()) == policy
    assert jp.deserialize({"class_name": "Policy", "config": {"name": "_infer"}}) == policy


# --- a user's subclass ---------------------------------------------------------------------


class MyPolicy(jp.DTypePolicy):
    """A user's policy class (as Keras's and tf.keras's tests define one)."""

    __slots__ = ()


class MyQuantized(jp.QuantizedDTypePolicy):
    __slots__ = ()


@pytest.mark.parametrize(
    "policy",
    [lambda: MyPolicy("mixed_bfloat16"), lambda: MyQuantized("int8", "mixed_bfloat16")],
)
def test_user_subclass_serializes_under_its_own_name(policy):
    policy = policy()
    config = jp.serialize(policy)
    assert config["class_name"] == type(policy).__name__
    assert config["config"] == policy.get_config()
    assert json.loads(json.dumps(config)) == config
    name = type(policy).__name__
    restored = jp.deserialize(config, custom_objects={name: type(policy)})
    assert type(restored) is type(policy)
    assert restored == policy
    assert restored.name == policy.name


def test_user_subclass_without_custom_objects_raises_value_error():
    config = jp.serialize(MyPolicy("mixed_bfloat16"))
    with pytest.raises(ValueError, match=r"Unknown `class_name` 'MyPolicy'.*custom_objects"):
        jp.deserialize(config)


def test_custom_objects_win_over_library_classes():
    config = jp.serialize(jp.DTypePolicy("float16"))
    config["class_name"] = "MyPolicy"
    assert type(jp.deserialize(config, custom_objects={"MyPolicy": MyPolicy})) is MyPolicy


def test_map_entries_use_custom_objects():
    policy_map = jp.DTypePolicyMap(MyPolicy("float32"), {"head": MyPolicy("mixed_bfloat16")})
    config = jp.serialize(policy_map)
    restored = jp.deserialize(json.loads(json.dumps(config)), custom_objects={"MyPolicy": MyPolicy})
    assert type(restored["head"]) is MyPolicy
    assert type(restored["other"]) is MyPolicy
    assert restored["head"] == jp.DTypePolicy("mixed_bfloat16")


@pytest.mark.parametrize(
    ("custom_objects", "match"),
    [
        (["MyPolicy"], r"`custom_objects` must be a dict.*\['MyPolicy'\]"),
        (
            {"MyPolicy": 3},
            r"`custom_objects\['MyPolicy'\]` must be a policy class.*\{'MyPolicy': 3\}",
        ),
    ],
)
def test_bad_custom_objects_raise_type_error(custom_objects, match):
    with pytest.raises(TypeError, match=match):
        jp.deserialize(jp.serialize(MyPolicy("float16")), custom_objects=custom_objects)


# --- Keras 3's own format -------------------------------------------------------------------


def _keras_entry(module, class_name, config):
    return {"module": module, "class_name": class_name, "config": config, "registered_name": None}


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (
            lambda: jp.DTypePolicy("mixed_bfloat16"),
            _keras_entry("keras", "DTypePolicy", {"name": "mixed_bfloat16"}),
        ),
        (
            lambda: jp.get_policy("p=f32,c=bf16"),  # Keras calls it "mixed_bfloat16"
            _keras_entry("keras", "DTypePolicy", {"name": "mixed_bfloat16"}),
        ),
        (
            lambda: jp.FloatDTypePolicy("float16"),
            _keras_entry("keras", "FloatDTypePolicy", {"name": "float16"}),
        ),
        (
            lambda: jp.Policy("int32"),
            _keras_entry("keras", "DTypePolicy", {"name": "int32"}),
        ),
        (
            lambda: jp.get("int8_from_mixed_bfloat16"),
            _keras_entry(
                "keras.dtype_policies",
                "QuantizedDTypePolicy",
                {"mode": "int8", "source_name": "mixed_bfloat16"},
            ),
        ),
        (
            lambda: jp.get("int4_from_float32"),
            _keras_entry(
                "keras.dtype_policies",
                "QuantizedDTypePolicy",
                {"mode": "int4", "source_name": "float32"},
            ),
        ),
        (
            lambda: jp.QuantizedDTypePolicy("int4/64", "float32"),
            _keras_entry(
                "keras.dtype_policies",
                "Int4DTypePolicy",
                {"mode": "int4/64", "source_name": "float32"},
            ),
        ),
        (
            lambda: jp.QuantizedFloat8DTypePolicy("float8", "mixed_bfloat16", 16),
            _keras_entry(
                "keras.dtype_policies",
                "QuantizedFloat8DTypePolicy",
                {"mode": "float8", "source_name": "mixed_bfloat16", "amax_history_length": 16},
            ),
        ),
    ],
)
def test_serialize_keras_format_of_policies(make, expected):
    config = jp.serialize(make(), format="keras")
    assert config == expected
    assert jp.deserialize(config) == make()


def test_serialize_keras_format_of_map():
    policy_map = jp.DTypePolicyMap(
        "float32", {"encoder/.*": "mixed_bfloat16", "head": "int8_from_float32"}
    )
    config = jp.serialize(policy_map, format="keras")
    assert config == _keras_entry(
        "keras.dtype_policies",
        "DTypePolicyMap",
        {
            "default_policy": _keras_entry("keras", "DTypePolicy", {"name": "float32"}),
            "policy_map": {
                "encoder/.*": _keras_entry("keras", "DTypePolicy", {"name": "mixed_bfloat16"}),
                "head": _keras_entry(
                    "keras.dtype_policies",
                    "QuantizedDTypePolicy",
                    {"mode": "int8", "source_name": "float32"},
                ),
            },
        },
    )
    restored = jp.deserialize(json.loads(json.dumps(config)))
    assert dict(restored.items()) == dict(policy_map.items())
    assert jp.serialize(jp.DTypePolicyMap(), format="keras")["config"] == {
        "default_policy": None,
        "policy_map": {},
    }


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (
            lambda: jp.get_policy("p=f32,c=bf16,o=f32"),
            r"Keras has no output dtype.*p=f32,c=bf16,o=f32",
        ),
        (lambda: jp.get_policy("p=bf16,c=f32"), r"Keras cannot represent.*p=bf16,c=f32"),
        (lambda: jp.Policy("_infer"), r"Keras 3 has no '_infer' policy"),
        (lambda: MyPolicy("float32"), r"Keras cannot represent.*subclass 'MyPolicy'"),
        (
            lambda: jp.get("int8_from_p=f32,c=bf16,o=f32"),
            r"Keras has no output dtype.*int8_from_p=f32,c=bf16,o=f32",
        ),
        (
            lambda: jp.DTypePolicyMap(None, {"a": "float32", "b": "p=f32,c=bf16,o=f32"}),
            r"key 'b'.*Keras has no output dtype",
        ),
        (
            lambda: jp.DTypePolicyMap(jp.get_policy("c=bf16,o=f32")),
            r"`default_policy`.*Keras has no output dtype",
        ),
    ],
)
def test_serialize_keras_format_rejects_what_keras_cannot_represent(make, match):
    with pytest.raises(ValueError, match=match):
        jp.serialize(make(), format="keras")


def test_serialize_unknown_format_raises_value_error():
    with pytest.raises(ValueError, match=r"`format`.*'jmp_policy', 'keras'.*format='tf'"):
        jp.serialize(jp.DTypePolicy("float32"), format="tf")


def test_a_maps_config_reads_each_distinct_policy_config_once(monkeypatch):
    # #46: a 100,000-key map took 8x its build time to read back (a signature inspected
    # and a config parsed per value); equal configs are now read once.
    from jmp_policy._src import identifiers

    keys = {f"blocks_{i}/.*" if i % 2 else f"blocks_{i}": ("bfloat16", "float16")[i % 2]
            for i in range(1_000)}  # fmt: skip
    expected = jp.DTypePolicyMap("float32", keys)
    config = jp.serialize(expected)
    reads = []
    inner = identifiers.read_policy
    monkeypatch.setattr(identifiers, "read_policy", lambda *a: reads.append(a) or inner(*a))
    back = jp.deserialize(config)
    assert len(reads) == 3  # the default and the two values' configs
    assert back["blocks_3/x"] is back["blocks_5/y"]  # one policy object for equal configs
    assert back == expected
