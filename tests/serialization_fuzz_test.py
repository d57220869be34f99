"""Fuzzed round trips (issue 20): everything ``serialize`` writes, ``deserialize`` reads back
equal, through JSON too, and the configs are never mutated."""

import copy
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jmp_policy as jp

FUZZ = settings(max_examples=80, deadline=None, derandomize=True)  # the same examples every run

POLICY_NAMES = [
    "float32",
    "bfloat16",
    "mixed_bfloat16",
    "mixed_float16",
    "p=f32,c=bf16,o=f32",
    "int8_from_mixed_bfloat16",
    "int4/64_from_float32",
    "float8_from_mixed_bfloat16",
    "float8_e4m3fn",
    "int32",
    "_infer",
]


def _round_trip(obj):
    config = jp.serialize(obj)
    original = copy.deepcopy(config)
    restored = jp.deserialize(json.loads(json.dumps(config)))
    assert config == original
    return config, restored


# -- the examples -------------------------------------------------------------------


def test_map_with_infer_default_keeps_it():
    m = jp.DTypePolicyMap("_infer", {"x": "float32"})
    _, restored = _round_trip(m)
    assert restored == m
    assert restored.default_policy.compute_dtype is None
    # A None default still means the global policy.
    _, restored = _round_trip(jp.DTypePolicyMap(None, {"x": "float32"}))
    assert restored.get_config()["default_policy"] is None


def test_map_with_infer_values_reads_back():
    m = jp.DTypePolicyMap(None, {"x": "_infer", "y/.*": jp.Policy("_infer")})
    _, restored = _round_trip(m)
    assert restored == m
    assert restored["x"].compute_dtype is None


@pytest.mark.parametrize(
    "policy_map",
    [
        {"class_name": "float32", "config": "bfloat16"},
        {"class_name": "float32", "config": "bfloat16", "module": "int8_from_float32"},
        {"config": "mixed_bfloat16", "class_name": "_infer", "registered_name": "float16"},
    ],
)
def test_map_with_keys_named_like_config_fields_reads_back(policy_map):
    m = jp.DTypePolicyMap("float32", policy_map)
    _, restored = _round_trip(m)
    assert restored == m
    assert list(restored) == list(m)


def test_infer_policy_round_trips_through_none():
    config, restored = _round_trip(jp.Policy("_infer"))
    assert config is None
    assert restored == jp.Policy("_infer")


# -- fuzzed -------------------------------------------------------------------------------

keys = st.one_of(
    st.sampled_from(["class_name", "config", "module", "registered_name", "name", ""]),
    st.text(st.sampled_from("abc/_01"), max_size=8),
    st.text(st.sampled_from("abc/_.*"), max_size=6),
)


@FUZZ
@given(
    default=st.one_of(st.none(), st.sampled_from(POLICY_NAMES)),
    entries=st.dictionaries(keys, st.sampled_from(POLICY_NAMES), max_size=6),
)
def test_any_map_reads_back_equal(default, entries):
    original = copy.deepcopy(entries)
    try:
        m = jp.DTypePolicyMap(default, entries)
    except ValueError as e:  # a key that is no regular expression ("*"), named
        assert any(repr(k) in str(e) for k in entries), str(e)
        return
    assert entries == original
    config, restored = _round_trip(m)
    assert restored == m
    assert list(restored) == list(m)
    assert restored.get_config() == config["config"]


@FUZZ
@given(name=st.sampled_from(POLICY_NAMES), cls=st.sampled_from([jp.DTypePolicy, jp.Policy]))
def test_any_policy_reads_back_equal(name, cls):
    policy = jp.get(name) if "_from_" in name else cls(name)
    _, restored = _round_trip(policy)
    assert restored == policy
    assert jp.get(policy.name) == policy
