"""The policy-name grammar (``jmp_policy._src.name_grammar``): a name is parsed once into a
frozen ``ParsedName`` that the policy classes are built from."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

import jmp_policy as jp
from jmp_policy._src import name_grammar
from jmp_policy._src.quantization.int_schemes import Int4Scheme


@pytest.fixture
def counted(monkeypatch):
    """Counts the float-dtype parses (every name's dtypes go through one function)."""
    name_grammar.forget_parsed()
    calls = []
    inner = name_grammar._float_dtypes

    def counting(name, argument):
        calls.append(name)
        return inner(name, argument)

    monkeypatch.setattr(name_grammar, "_float_dtypes", counting)
    yield calls
    name_grammar.forget_parsed()


def test_parse_gives_a_frozen_value_with_everything_a_policy_is_built_from():
    parsed = name_grammar.parse(" int4/64_from_mixed_bfloat16 ")
    assert parsed == name_grammar.ParsedName(
        "int4/64_from_mixed_bfloat16",
        np.dtype("float32"),
        np.dtype(jnp.bfloat16),
        np.dtype(jnp.bfloat16),
        Int4Scheme(block_size=64),
        "int4/64",
        "mixed_bfloat16",
    )
    assert parsed.policy_class == "Int4DTypePolicy"
    assert name_grammar.parse("_infer") == name_grammar.ParsedName("_infer", None, None, None)
    assert name_grammar.parse("c=bf16").policy_class == "DTypePolicy"
    with pytest.raises(dataclasses.FrozenInstanceError):
        parsed.compute = np.dtype("float16")


@pytest.mark.parametrize(
    ("name", "cls"),
    [
        ("mixed_bfloat16", jp.DTypePolicy),
        ("int8_from_mixed_bfloat16", jp.QuantizedDTypePolicy),
        ("int4/128_from_float32", jp.Int4DTypePolicy),
        ("float8_current_from_mixed_bfloat16", jp.QuantizedFloat8DTypePolicy),
        ("gptq/4/128_from_float32", jp.GPTQDTypePolicy),
    ],
)
def test_get_parses_a_name_once_and_builds_its_class_from_it(counted, name, cls):
    policy = jp.get(name)
    assert type(policy) is cls and policy.name == name
    assert len(counted) == 1  # the source's dtypes, once: no constructor parses it again
    assert jp.get(name) == policy and len(counted) == 1  # and a name read again is cached


def test_constructors_parse_their_name_once(counted):
    assert jp.DTypePolicy("p=f32,c=bf16").compute_dtype == jnp.bfloat16
    assert jp.QuantizedDTypePolicy("int8", "mixed_bfloat16 ").source_name == "mixed_bfloat16"
    assert counted == ["p=f32,c=bf16", "mixed_bfloat16 "]


def test_a_parse_error_names_the_whole_name_and_the_part_at_fault():
    with pytest.raises(ValueError) as info:
        name_grammar.parse("int8_from_float16", "policy")
    assert str(info.value).endswith(
        "Received: policy='int8_from_float16', where source_name='float16'"
    )


def test_get_of_a_dtype_the_grammar_has_no_name_for_is_a_value_error():
    with pytest.raises(ValueError, match="Cannot interpret `dtype` argument") as info:
        jp.get(np.longdouble)
    assert "identifier=" in str(info.value)
    assert jp.get(np.int32) == jp.DTypePolicy("int32")


@pytest.mark.parametrize("mode", ["gptq/4/{}", "awq/4/{}", "gptq/{}/-1", "int4/{}"])
@pytest.mark.parametrize(
    "number", ["\uff11\uff12\uff18", "12_8", "+8", "08", "99999999999999999999"]
)
def test_every_modes_numbers_are_ascii_digits_within_bounds_refused_at_the_name(mode, number):
    name = mode.format(number) + "_from_float32"
    with pytest.raises(ValueError) as info:
        jp.get(name)
    message = str(info.value)
    assert f"Received: name={name!r}" in message or f"identifier={name!r}" in message
    assert "ASCII digits" in message and ("65536" in message or "4 or 8" in message)
    assert "block_size" not in message  # the name is at fault, not an argument never passed


def test_a_group_of_20_digits_is_refused_by_the_name_not_later_by_calibrate():
    with pytest.raises(ValueError, match=r"from 1 to 65536.*'gptq/4/99999999999999999999'"):
        jp.DTypePolicyMap("float32", {"a": "gptq/4/99999999999999999999_from_float32"})
    assert jp.get("gptq/4/65536_from_float32").name == "gptq/4/65536_from_float32"  # the bound
