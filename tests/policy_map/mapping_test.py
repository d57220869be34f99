"""Tests of the map's mapping methods (about stored keys) and of its config validation.

`get`, `pop`, `setdefault`, `in`, `items`, `values` and `==` are about stored keys, while
`map[path]` resolves a path; bad configs are clear errors naming the argument (issue #9).
"""

import copy
import re

import pytest

import jmp_policy as jp

BF16 = jp.DTypePolicy("bfloat16")
F16 = jp.DTypePolicy("float16")
F32 = jp.DTypePolicy("float32")


def _map():
    return jp.DTypePolicyMap(F32, {"enc/.*": BF16, "head": F16})


# -- get, pop, setdefault: stored keys ------------------------------------------------------


def test_get_returns_the_stored_policy_or_the_default_for_keys_not_stored():
    m = _map()
    assert m.get("enc/.*") == BF16
    assert m.get("head") == F16
    assert m["enc/mlp"] == BF16  # a path that resolves...
    assert m.get("enc/mlp") is None  # ...is not a stored key
    assert m.get("enc/mlp", "fallback") == "fallback"
    assert m.get("head/dense", F32) is F32  # inherits from "head", yet not stored


def test_pop_of_a_missing_key_returns_the_default_or_raises_key_error():
    m = _map()
    assert m.pop("missing", None) is None
    assert m.pop("enc/mlp", "fallback") == "fallback"  # resolvable, not stored
    with pytest.raises(KeyError, match="enc/mlp"):
        m.pop("enc/mlp")
    assert len(m) == 2
    assert m.pop("head", None) == F16
    assert "head" not in m
    assert m["head"] == F32  # the write cleared the resolution cache


def test_setdefault_inserts_into_the_stored_keys_and_returns_the_stored_policy():
    m = _map()
    assert m["enc/mlp"] == BF16
    assert m.setdefault("enc/mlp", "float32") == F32  # not stored yet: inserted
    assert list(m) == ["enc/.*", "head", "enc/mlp"]
    assert m["enc/mlp"] == F32  # the exact key now wins
    assert m.setdefault("enc/mlp", "float16") == F32  # stored: unchanged
    assert m.setdefault("head", BF16) == F16
    assert len(m) == 3


def test_setdefault_validates_its_value_and_inserts_nothing_on_error():
    m = _map()
    with pytest.raises(ValueError, match=r"Cannot interpret the assigned value for key 'x'"):
        m.setdefault("x", 123)
    with pytest.raises(ValueError, match=r"Cannot interpret the assigned value for key 'x'"):
        m.setdefault("x")
    assert "x" not in m


def test_values_items_and_keys_are_the_stored_ones():
    m = _map()
    assert list(m.keys()) == ["enc/.*", "head"]
    assert list(m.values()) == [BF16, F16]
    assert list(m.items()) == [("enc/.*", BF16), ("head", F16)]
    assert ("enc/.*", BF16) in m.items()
    assert ("enc/mlp", BF16) not in m.items()


def test_clear_update_and_popitem():
    m = _map()
    assert m.popitem() == ("enc/.*", BF16)
    m.update({"a": "float32"}, b="bfloat16")
    assert list(m.items()) == [("head", F16), ("a", F32), ("b", BF16)]
    with pytest.raises(ValueError, match=r"^a already exist in the DTypePolicyMap"):
        m.update({"a": "float16"})
    m.clear()
    assert len(m) == 0
    assert m["head"] == F32


# -- equality ---------------------------------------------------------------------------------


def test_equality_does_not_depend_on_insertion_order():
    a = jp.DTypePolicyMap(F32, {"enc/.*": BF16, "head": F16})
    b = jp.DTypePolicyMap(F32, {"head": F16, "enc/.*": BF16})
    assert a == b
    assert all(a[p] == b[p] for p in ["enc/x", "head", "head/y", "other", ""])
    assert a != jp.DTypePolicyMap(F32, {"enc/.*": BF16})
    assert a != jp.DTypePolicyMap(BF16, {"head": F16, "enc/.*": BF16})
    assert a != jp.DTypePolicyMap(None, {"head": F16, "enc/.*": BF16})
    assert (a == {"enc/.*": BF16, "head": F16}) is False


# -- config validation --------------------------------------------------------------------------


def test_a_map_config_is_not_a_value_of_another_map():
    inner = jp.serialize(jp.DTypePolicyMap("float32", {"a": "bfloat16"}))
    with pytest.raises(
        ValueError, match=r"key 'x'.*cannot be a policy of another map.*'DTypePolicyMap'"
    ):
        jp.DTypePolicyMap(None, {"x": inner})
    m = jp.DTypePolicyMap()
    with pytest.raises(ValueError, match="cannot be a policy of another map"):
        m["x"] = inner
    with pytest.raises(ValueError, match="cannot be a value of another map"):
        m["x"] = jp.DTypePolicyMap()
    assert len(m) == 0


def test_a_map_config_is_not_a_default_policy():
    inner = jp.serialize(jp.DTypePolicyMap("float32", {"a": "bfloat16"}))
    with pytest.raises(
        ValueError, match=r"Invalid `default_policy`.*another map.*'DTypePolicyMap'"
    ):
        jp.DTypePolicyMap(inner)
    with pytest.raises(ValueError, match=r"`default_policy` cannot be a `DTypePolicyMap`"):
        jp.DTypePolicyMap(jp.DTypePolicyMap())


@pytest.mark.parametrize("bad", ["abc", 123, ["a", "b"], [("a", "float32")], F32])
def test_policy_map_must_be_a_mapping_naming_the_argument_and_quoting_it(bad):
    with pytest.raises(
        TypeError, match=r"`policy_map` must be a dict.*" + re.escape(f"policy_map={bad!r}")
    ):
        jp.DTypePolicyMap(None, bad)
    config = {"default_policy": None, "policy_map": bad}
    with pytest.raises(TypeError, match=re.escape(f"policy_map={bad!r}")):
        jp.DTypePolicyMap.from_config(config)


@pytest.mark.parametrize("class_name", [["DTypePolicy"], {"a": 1}, 3])
def test_a_config_with_a_non_string_class_name_is_a_clear_error(class_name):
    config = {"class_name": class_name, "config": {"name": "float32"}}
    original = copy.deepcopy(config)
    for error in (TypeError, ValueError):
        with pytest.raises(
            error, match=r"key 'x'.*`class_name`.*must be a string.*" + re.escape(repr(class_name))
        ):
            jp.DTypePolicyMap(None, {"x": config})
        with pytest.raises(
            error, match=r"Invalid `default_policy`.*`class_name`.*" + re.escape(repr(class_name))
        ):
            jp.DTypePolicyMap(config)
    assert config == original


def test_policy_config_values_and_default_are_accepted():
    m = jp.DTypePolicyMap(
        jp.serialize(jp.DTypePolicy("mixed_bfloat16")),
        {"x": {"class_name": "Policy", "config": {"name": "float16"}}},
    )
    assert m["x"] == F16
    assert m["y"] == jp.DTypePolicy("mixed_bfloat16")
