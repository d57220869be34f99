"""`from_config` rejects unknown fields (#30): every policy class and the map name the
field, list the accepted ones and quote the config, never passing it on or dropping it."""

import copy
import re

import jax.numpy as jnp
import pytest

import jmp_policy as jp

# Each class, a config it writes, and the fields its `from_config` accepts.
CASES = [
    (jp.DTypePolicy, {"name": "mixed_bfloat16"}),
    (jp.FloatDTypePolicy, {"name": "float32"}),
    (jp.Policy, {"name": "mixed_float16"}),
    (jp.QuantizedDTypePolicy, {"mode": "int8", "source_name": "float32"}),
    (jp.Int4DTypePolicy, {"mode": "int4", "source_name": "float32", "block_size": 64}),
    (
        jp.QuantizedFloat8DTypePolicy,
        {"mode": "float8", "source_name": "float32", "amax_history_length": 16},
    ),
    (jp.DTypePolicyMap, {"default_policy": None, "policy_map": {}}),
]
ACCEPTED = {
    jp.DTypePolicy: ["name", "compute_dtype", "output_dtype", "param_dtype", "variable_dtype"],
    jp.FloatDTypePolicy: ["name", "compute_dtype", "output_dtype", "param_dtype", "variable_dtype"],
    jp.Policy: ["name", "compute_dtype", "output_dtype", "param_dtype", "variable_dtype"],
    jp.QuantizedDTypePolicy: ["mode", "source_name"],
    jp.Int4DTypePolicy: ["mode", "source_name", "block_size", "symmetric"],
    jp.QuantizedFloat8DTypePolicy: ["mode", "source_name", "amax_history_length", "scaling"],
    jp.DTypePolicyMap: ["default_policy", "policy_map"],
}
IDS = [c[0].__name__ for c in CASES]


@pytest.mark.parametrize(("cls", "config"), CASES, ids=IDS)
def test_config_round_trips(cls, config):
    obj = cls.from_config(config)
    assert type(obj) is cls
    assert cls.from_config(obj.get_config()) == obj


@pytest.mark.parametrize(("cls", "config"), CASES, ids=IDS)
def test_unknown_field_names_it_and_lists_accepted_ones(cls, config):
    bad = {**config, "bogus": 1}
    before = copy.deepcopy(bad)
    accepted = ", ".join(repr(a) for a in ACCEPTED[cls])
    expected = (
        f"Unknown field 'bogus' in a {cls.__name__} `config`; accepted fields: {accepted}. "
        "Received: config={"
    )
    with pytest.raises(ValueError, match=re.escape(expected)) as info:
        cls.from_config(bad)
    assert "'bogus': 1" in str(info.value).partition("Received: config=")[2]  # quoted
    # Keras's `cls(**config)` raises TypeError: that `except` catches it too.
    with pytest.raises(TypeError, match="Unknown field 'bogus'"):
        cls.from_config(bad)
    assert bad == before


@pytest.mark.parametrize(("cls", "config"), CASES, ids=IDS)
def test_unknown_field_through_deserialize(cls, config):
    bad = {"class_name": cls.__name__, "config": {**config, "extra": None}}
    with pytest.raises(ValueError, match=f"Unknown field 'extra' in a {cls.__name__} `config`"):
        jp.deserialize(bad)


def test_several_unknown_fields_all_named_in_order_and_bounded():
    config = {"name": "float32", "b": 1, "a": 2}
    with pytest.raises(ValueError, match=r"Unknown fields 'b', 'a' in a DTypePolicy `config`"):
        jp.DTypePolicy.from_config(config)
    many = {"name": "float32", **{f"f{i}": i for i in range(8)}}
    with pytest.raises(ValueError, match=r"'f0', 'f1', 'f2', 'f3', 'f4' \(and 3 more\) in"):
        jp.DTypePolicy.from_config(many)


@pytest.mark.parametrize("cls", [jp.DTypePolicy, jp.DTypePolicyMap])
def test_non_string_keys_are_unknown_fields_not_internal_errors(cls):
    # Mixed key types once made `sorted` (map) or `cls(**config)` (policy) fail inside.
    config = {1: "x", "zz": 2}
    with pytest.raises(ValueError, match=r"Unknown fields 1, 'zz' in a"):
        cls.from_config(config)


def test_tf_keras_loss_scale_is_still_ignored():
    config = {"name": "mixed_float16", "loss_scale": "dynamic"}
    assert jp.Policy.from_config(config) == jp.DTypePolicy("mixed_float16")
    # ... but only by policies: the map has no such field.
    with pytest.raises(ValueError, match=r"Unknown field 'loss_scale' in a DTypePolicyMap"):
        jp.DTypePolicyMap.from_config({"policy_map": {}, "loss_scale": "dynamic"})


@pytest.mark.parametrize("cls", [jp.DTypePolicy, jp.QuantizedDTypePolicy, jp.DTypePolicyMap])
@pytest.mark.parametrize("bad", ["float32", 5, None, ["name"]])
def test_non_dict_config_is_a_type_error_quoting_it(cls, bad):
    with pytest.raises(TypeError, match="`config` must be a dict such as") as info:
        cls.from_config(bad)
    assert str(info.value).endswith(f"Received: config={bad!r}")


def test_nested_map_value_with_unknown_field_is_rejected():
    config = {
        "default_policy": None,
        "policy_map": {"dense": {"class_name": "DTypePolicy", "config": {"nam": "float32"}}},
    }
    with pytest.raises(ValueError, match=r"Unknown field 'nam' in a DTypePolicy `config`"):
        jp.DTypePolicyMap.from_config(config)


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ({"name": "float32", "compute_dtype": "float16"}, "compute_dtype"),
        ({"name": "mixed_bfloat16", "output_dtype": "float32"}, "output_dtype"),
        ({"name": "float32", "variable_dtype": "float16"}, "variable_dtype"),
        ({"name": "bfloat16", "param_dtype": "float32"}, "param_dtype"),
    ],
)
def test_a_config_whose_name_and_dtype_fields_disagree_is_refused(config, field):
    # Keras reads the name alone (its DTypePolicy takes no dtype field): a `compute_dtype`
    # beside 'float32' turned it into 'p=f32,c=f16' in silence.
    for read in (jp.DTypePolicy.from_config, lambda c: jp.deserialize(
        {"class_name": "DTypePolicy", "config": c, "module": "keras"}
    )):  # fmt: skip
        with pytest.raises(ValueError, match=rf"'name' and '{field}' disagree.*Received: config="):
            read(dict(config))


def test_a_config_whose_dtype_fields_agree_with_its_name_is_that_policy():
    config = {"name": "mixed_bfloat16", "compute_dtype": "bfloat16", "variable_dtype": "float32"}
    assert jp.DTypePolicy.from_config(config) == jp.DTypePolicy("mixed_bfloat16")
    assert jp.DTypePolicy.from_config({"compute_dtype": "float16"}).compute_dtype == jnp.float16
