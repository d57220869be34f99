"""Bad arguments end in a ValueError/TypeError quoting the value and saying the limit, never
a RecursionError, OverflowError, NumPy's TypeError or an allocation (issue 30)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import jmp_policy as jp
from jmp_policy._src.policy_map._trees import MAX_TREE_DEPTH


def _deep_map_config(depth):
    config = "float32"
    for _ in range(depth):
        config = {
            "class_name": "DTypePolicyMap",
            "config": {"default_policy": None, "policy_map": {"a": config}},
        }
    return config


def test_a_5000_deep_map_config_is_a_value_error():
    with pytest.raises(ValueError, match="cannot be a policy of another map") as info:
        jp.deserialize(_deep_map_config(5000))
    assert "Received the map config {'class_name': 'DTypePolicyMap'" in str(info.value)
    assert len(str(info.value)) < 3000


def _deep_tree(depth):
    tree = jnp.ones((4, 4))
    for _ in range(depth):
        tree = {"a": tree}
    return tree


@pytest.mark.parametrize("method", ["quantize", "cast_to_compute", "cast_to_param"])
def test_a_900_level_tree_is_a_value_error_saying_the_limit(method):
    m = jp.DTypePolicyMap("mixed_bfloat16", {"x": "int8_from_float32"})
    with pytest.raises(ValueError, match=rf"nested more than {MAX_TREE_DEPTH} levels") as info:
        getattr(m, method)(_deep_tree(900))
    assert "Received: tree={'a': {'a':" in str(info.value)


def test_a_tree_at_the_depth_limit_is_walked_with_and_without_jit():
    m = jp.DTypePolicyMap("mixed_bfloat16")
    tree = _deep_tree(MAX_TREE_DEPTH - 1)

    def innermost(t):
        while isinstance(t, dict):
            t = t["a"]
        return t

    assert innermost(m.cast_to_compute(tree)).dtype == jnp.bfloat16
    assert innermost(jax.jit(m.cast_to_compute)(tree)).dtype == jnp.bfloat16


def test_dequantize_rejects_a_non_dtype_quoting_it():
    q = jp.get("int8_from_float32").quantize({"kernel": jnp.ones((4, 4))})["kernel"]
    for bad in ("bogus", 5, jnp.int8):
        with pytest.raises(TypeError, match=r"`dtype` must be a floating dtype") as info:
            q.dequantize(bad)
        assert "Received: dtype=" in str(info.value)
    assert q.dequantize("bfloat16").dtype == jnp.bfloat16
    assert jax.jit(lambda q: q.dequantize(jnp.float16))(q).dtype == jnp.float16


@pytest.mark.parametrize("length", [0, 65537, 10**9, 2**40])
def test_amax_history_length_is_bounded_saying_the_limit(length):
    with pytest.raises(ValueError, match=r"from 1 to 65536") as info:
        jp.QuantizedFloat8DTypePolicy("float8", "float32", amax_history_length=length)
    assert f"amax_history_length={length}" in str(info.value)
    assert jp.QuantizedFloat8DTypePolicy("float8", "float32", 65536).amax_history_length == 65536


def test_float8_current_with_delayed_scaling_is_a_contradiction():
    with pytest.raises(ValueError, match=r"`scaling='delayed'` contradicts") as info:
        jp.QuantizedFloat8DTypePolicy("float8_current", scaling="delayed")
    assert "Received: mode='float8_current', scaling='delayed'" in str(info.value)
    assert jp.QuantizedFloat8DTypePolicy("float8_current").scaling == "current"
    assert jp.QuantizedFloat8DTypePolicy("float8").scaling == "delayed"
    current = jp.QuantizedFloat8DTypePolicy("float8_current", "float32", scaling="current")
    assert jp.deserialize(jp.serialize(current)) == current


@pytest.mark.parametrize("block", [10**30, 65537])
def test_huge_int4_blocks_are_rejected(block):
    with pytest.raises(ValueError, match=r"from 1 to 65536") as info:
        jp.Int4DTypePolicy("int4", "float32", block_size=block)
    assert f"block_size={block}" in str(info.value)
    with pytest.raises(ValueError, match=r"from 1 to 65536"):
        jp.get(f"int4/{block}_from_float32")
    assert jp.Int4DTypePolicy("int4", "float32", block_size=65536).block_size == 65536


def test_update_is_all_or_nothing():
    m = jp.DTypePolicyMap("float32", {"a": "bfloat16"})
    for bad in (
        {"b": "float16", "c": "bogus"},
        {"b": "float16", "a": "float16"},  # a duplicate key
        {"b": "float16", "enc(": "float16"},
        [("b", "float16"), ("c",)],
    ):
        with pytest.raises((ValueError, TypeError)):
            m.update(bad)
        assert dict(m.items()) == {"a": jp.DTypePolicy("bfloat16")}
        assert m["b"] == jp.DTypePolicy("float32")
    m.update({"b": "float16"}, c="mixed_bfloat16")
    assert list(m) == ["a", "b", "c"]


class _NotAPolicy:
    @classmethod
    def from_config(cls, config):
        return cls()


def test_custom_objects_entries_must_be_policy_classes():
    config = {"class_name": "Mine", "config": {"name": "float32"}}
    with pytest.raises(TypeError, match=r"`custom_objects\['Mine'\]` must be a policy class"):
        jp.deserialize(config, custom_objects={"Mine": _NotAPolicy})

    class Mine(jp.DTypePolicy):
        pass

    assert type(jp.deserialize(config, custom_objects={"Mine": Mine})) is Mine


def test_duplicate_key_has_keras_words_first_then_the_quoted_value():
    m = jp.DTypePolicyMap(None, {"layer/dense_0": "float32"})
    with pytest.raises(ValueError) as info:
        m["layer/dense_0"] = "bfloat16"
    message = str(info.value)
    assert message.startswith("layer/dense_0 already exist in the DTypePolicyMap with value")
    assert message.endswith("Received: key='layer/dense_0'")
