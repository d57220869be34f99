"""Fuzzed DTypePolicyMap keys and operations (issue 20): regular-expression keys bounded in
cost, errors that name the key, and nothing the user passed mutated."""

import copy
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jmp_policy as jp

FUZZ = settings(max_examples=100, deadline=None, derandomize=True)  # the same examples every run
PATH = "encoder/layers_10/attention/query"
PATHS = [PATH, "", "a", "encoder", "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa!", "x/" * 30 + "y"]


def _assert_quotes_key(error, key):
    assert repr(key) in str(error), str(error)


# -- the examples -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "path", "expected"),
    [
        ("([a-z_0-9/]+)+!", "a" * 40, False),
        ("([a-z_0-9/]+)+!", "a/b" * 20 + "!", True),
        ("(a+)+", "a" * 40 + "b", False),
        ("(\\w+\\s?)*!", "ab " * 30, False),
        ("(.*/)*x", "a/" * 40, False),
        ("(a*)*", "a" * 40, True),
        ("(\\w+_\\d+/)*head", "layers_1/" * 30 + "tail", False),
        ("(a+){20}", "a" * 40 + "b", False),
        ("(x|x.)*y", "x" * 40, False),
        (".*.*.*.*.*!", "a" * 600, False),
        ("(a)\\1", "aa", True),
    ],
)
def test_keys_that_backtrack_in_python_re_are_matched_correctly(key, path, expected):
    # Python's `re` takes minutes on most of these; RE2 (or `regex` for the backreference)
    # answers at once.
    m = jp.DTypePolicyMap("float32", {key: "bfloat16"})
    assert (m.match(path) == key) is expected
    assert m[path] == jp.DTypePolicy("bfloat16" if expected else "float32")


@pytest.mark.parametrize(
    "key",
    [
        "encoder(/\\w+)*",
        "(layers_\\d+/)*query",
        "(\\w+/)*query",
        ".*/(query|key|value)",
        "(encoder|decoder)/layers_\\d+/.*",
        ".*encoder.*layers_\\d+.*attention.*",
        "encoder/(?!.*norm).*",
        "(?i)ENCODER/.*",
    ],
)
def test_keys_with_bounded_cost_are_accepted(key):
    m = jp.DTypePolicyMap("float32", {key: "bfloat16"})
    for path in PATHS:
        m.resolve(path)
    assert m.match(PATH) in (key, None)


@pytest.mark.parametrize(
    ("key", "why"),
    [
        ("a{99999999999}", "repetition count is too large"),
        ("(" * 2000 + "a" + ")" * 2000, "nested too deeply"),
        ("encoder/(.*", "missing )"),
        ("a**", "multiple repeat"),
    ],
)
def test_re_internal_errors_are_value_errors_naming_the_key(key, why):
    with pytest.raises(ValueError, match="of the DTypePolicyMap is not a valid regular") as info:
        jp.DTypePolicyMap(None, {key: "float32"})
    assert type(info.value) is ValueError
    assert why in str(info.value)
    _assert_quotes_key(info.value, key)


@pytest.mark.parametrize("bad", [[], {}, 3, None, ("a",), b"a"])
def test_non_string_keys_are_type_errors_saying_what_is_accepted(bad):
    m = jp.DTypePolicyMap(None, {"a": "float32"})
    for operation in (
        lambda: m[bad],
        lambda: m.__delitem__(bad),
        lambda: m.pop(bad),
        lambda: m.pop(bad, None),
        lambda: m.__setitem__(bad, "float32"),
        lambda: m.get(bad),
    ):
        with pytest.raises(TypeError, match=r"must be a string|are module paths") as info:
            operation()
        assert repr(bad) in str(info.value)
    assert bad not in m
    assert dict(m.items()) == {"a": jp.DTypePolicy("float32")}


def test_absent_keys_are_key_errors_with_a_clear_message():
    m = jp.DTypePolicyMap(None, {"encoder/layers_0": "float32"})
    with pytest.raises(KeyError, match="'zz' is not a key of the DTypePolicyMap"):
        m.pop("zz")
    with pytest.raises(KeyError, match="'zz' is not a key of the DTypePolicyMap"):
        del m["zz"]
    with pytest.raises(KeyError, match="Did you mean 'encoder/layers_0'"):
        m.pop("encoder/layers_1")
    assert m.pop("zz", 5) == 5
    assert len(m) == 1


def test_duplicate_key_is_quoted():
    m = jp.DTypePolicyMap(None, {"a b": "float32"})
    with pytest.raises(ValueError, match=r"^a b already exist in the DTypePolicyMap") as info:
        m["a b"] = "bfloat16"
    assert "key='a b'" in str(info.value)


# -- fuzzed -------------------------------------------------------------------------------

_REGEX_PIECES = st.sampled_from(
    [
        *list("ab/_.*+?|()[]{}^$\\0123456789-,"),
        "\\w",
        "\\d",
        "\\s",
        "(?:",
        "(?=",
        "(?!",
        "[a-z]",
        "{2}",
        "{1,3}",
        ".*",
        "+?",
    ]
)
keys = st.lists(_REGEX_PIECES, max_size=12).map("".join)


@FUZZ
@given(key=keys)
def test_any_key_is_accepted_and_cheap_or_rejected_naming_it(key):
    config = {key: "mixed_bfloat16", "head": "float32"}
    original = copy.deepcopy(config)
    try:
        m = jp.DTypePolicyMap("float32", config)
    except ValueError as e:
        assert not isinstance(e, TypeError)
        _assert_quotes_key(e, key)
    else:
        for path in PATHS:
            try:
                m.resolve(path)
            except ValueError as e:  # two keys match (named both), or the regex fallback
                # stopped on a pathological pattern (named, with the path)
                assert "matches multiple dtype policy keys" in str(e) or (
                    "was stopped after" in str(e) and repr(path) in str(e)
                ), str(e)
            else:  # the same answer as Python's `re`, where it matched
                assert m.match(path) == (
                    key if re.fullmatch(key, path) else "head" if path == "head" else None
                )
        assert jp.deserialize(jp.serialize(m)) == m
    assert config == original


@FUZZ
@given(
    keys=st.lists(st.text(st.sampled_from("abc/_0"), min_size=1, max_size=6), max_size=8),
    removed=st.text(st.sampled_from("abc/_0"), max_size=6),
)
def test_mapping_operations_agree_with_a_dict(keys, removed):
    reference = {k: jp.DTypePolicy("bfloat16") for k in dict.fromkeys(keys)}
    m = jp.DTypePolicyMap(None, reference)
    assert dict(m.items()) == reference
    if removed in reference:
        assert m.pop(removed) == reference.pop(removed)
    else:
        with pytest.raises(KeyError, match=repr(removed).replace("\\", "\\\\")):
            m.pop(removed)
    assert dict(m.items()) == reference
    assert (removed in m) == (removed in reference)
