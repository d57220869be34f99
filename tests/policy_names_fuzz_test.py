"""Fuzzed policy names and identifiers (issue 20): no text reaches NumPy's dtype parser, no
value is taken for a dtype, and every error names the argument and quotes the value."""

import contextlib
import copy
import re

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jmp_policy as jp

FUZZ = settings(max_examples=80, deadline=None, derandomize=True)  # the same examples every run

# Characters that NumPy's dtype parser reads as syntax, and the pieces of real names.
_NAME_ALPHABET = st.sampled_from(list("(),=:<>|[]{}/_ 0123456789abcdefimnoptxÝñ"))
_PIECES = st.sampled_from(
    ["f4", "bf16", "c=", "p=", "o=", "mixed_", "float", "_from_", "int8", ","]
)
names = st.one_of(
    st.text(_NAME_ALPHABET, max_size=24),
    st.lists(_PIECES, max_size=6).map("".join),
    st.text(max_size=16),
    st.lists(_NAME_ALPHABET, max_size=8).map(",".join),
)


def _assert_names(error, argument, value):
    message = str(error)
    assert f"{argument}={value!r}" in message, message


# -- the examples -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "argument", "name"),
    [
        (jp.get_policy, "name", ","),
        (jp.get, "identifier", "Ýñ,"),
        (jp.get_policy, "name", "(" + "1," * 50000 + ")f4,"),
        (jp.get, "identifier", "f4"),
        (jp.DTypePolicy, "name", "(2,)f4,"),
        (jp.Policy, "name", "i4"),
    ],
)
def test_names_never_reach_numpys_parser(call, argument, name):
    with pytest.raises(ValueError, match="Cannot convert") as info:
        call(name)
    assert type(info.value) is ValueError
    _assert_names(info.value, argument, name)
    assert "Expected a dtype name" in str(info.value)


@pytest.mark.parametrize(
    "value", [jnp.ones(3), np.ones(2, np.float16), np.True_, np.float32(1.0), b"h", b"float32"]
)
def test_get_takes_no_value_for_a_dtype(value):
    with pytest.raises(TypeError, match="Cannot interpret `dtype` argument") as info:
        jp.get(value)
    assert "identifier=" in str(info.value)


@pytest.mark.parametrize("value", [jnp.ones(2), np.True_, b"h", np.float32(2.0)])
def test_jmp_constructor_takes_no_value_for_a_dtype(value):
    with pytest.raises(TypeError, match=r"`name` must be a numeric dtype") as info:
        jp.Policy(value, value)
    assert "not an array or a value" in str(info.value)
    with pytest.raises(TypeError, match=r"`compute_dtype` must be a numeric dtype"):
        jp.Policy("float32", value)
    with pytest.raises(TypeError, match=r"`dtype` must be a numeric dtype"):
        jp.DTypePolicy("float32").with_compute_dtype(value)


@pytest.mark.parametrize(
    "dtype", [np.float32, jnp.bfloat16, np.dtype("float16"), "bfloat16", "bf16"]
)
def test_jmp_constructor_still_takes_dtypes_and_names(dtype):
    policy = jp.Policy("float32", dtype)
    assert policy.compute_dtype in (np.float32, jnp.bfloat16, np.float16)


def test_get_takes_dtypes_and_scalar_types():
    assert jp.get(np.dtype("float16")) == jp.DTypePolicy("float16")
    assert jp.get(jnp.bfloat16) == jp.DTypePolicy("bfloat16")
    assert jp.get(np.float32) == jp.DTypePolicy("float32")


def test_get_returns_no_object_merely_named_like_a_policy_class():
    class DTypePolicy:
        pass

    class DTypePolicyMap:
        pass

    for fake in (DTypePolicy(), DTypePolicyMap()):
        with pytest.raises(TypeError, match="Cannot interpret `dtype` argument"):
            jp.get(fake)
    real = jp.DTypePolicyMap("float32")
    assert jp.get(real) is real


@pytest.mark.parametrize("name", ["float8_e4m3fn", "float8_e5m2", " float8_e4m3fn "])
def test_float8_dtype_names_round_trip(name):
    policy = jp.Policy(name)
    assert jp.get(policy.name) == policy
    assert jp.get_policy(policy.name) == policy
    assert jp.deserialize(jp.serialize(policy)) == policy


@pytest.mark.parametrize(
    ("name", "suggestion"),
    [
        ("mixed_bfloat61", "mixed_bfloat16"),
        ("mixed_flaot16", "mixed_float16"),
        ("bfloat61", "bfloat16"),
        ("c=bf61", "bf16"),
        ("comptue=bf16", "compute"),
        ("int9_from_float32", "int8"),
    ],
)
def test_near_misses_get_a_did_you_mean(name, suggestion):
    with pytest.raises(ValueError, match=re.escape(f"Did you mean {suggestion!r}?")):
        jp.get_policy(name)


def test_quantized_source_errors_name_source_name():
    with pytest.raises(ValueError) as info:
        jp.QuantizedDTypePolicy("int8", "mixed_bfloat61")
    _assert_names(info.value, "source_name", "mixed_bfloat61")
    assert "Did you mean 'mixed_bfloat16'?" in str(info.value)


# -- fuzzed -------------------------------------------------------------------------------


@FUZZ
@given(name=names)
def test_any_text_is_a_policy_or_a_value_error_quoting_it(name):
    for call, argument in ((jp.get_policy, "name"), (jp.get, "identifier"), (jp.Policy, "name")):
        try:
            policy = call(name)
        except ValueError as e:
            assert not isinstance(e, TypeError)
            _assert_names(e, argument, name)
        else:
            assert isinstance(policy, jp.DTypePolicy)
            # A policy read from a name reads back from its name.
            assert jp.get(policy.name) == policy


@FUZZ
@given(
    value=st.one_of(
        st.integers(),
        st.floats(),
        st.booleans(),
        st.binary(max_size=4),
        st.lists(st.text(max_size=3), max_size=2),
        st.builds(np.array, st.lists(st.floats(width=32), max_size=3)),
        st.sampled_from([np.True_, np.float32(1), np.int8(3), jnp.zeros(2), 1 + 1j, object()]),
    )
)
def test_any_non_identifier_is_a_type_error_quoting_it(value):
    original = copy.deepcopy(value) if not isinstance(value, jnp.ndarray) else value
    with pytest.raises(TypeError) as info:
        jp.get(value)
    assert "identifier=" in str(info.value)
    assert repr(value) in str(info.value)
    if isinstance(value, np.ndarray):  # NaN equals NaN here: nothing was written
        np.testing.assert_array_equal(value, original)
    elif isinstance(value, list):
        assert value == original


@FUZZ
@given(
    config=st.dictionaries(st.sampled_from(["class_name", "config", "module"]), names, max_size=3)
)
def test_configs_are_never_mutated(config):
    original = copy.deepcopy(config)
    with contextlib.suppress(TypeError, ValueError):
        jp.get(config)
    assert config == original
