"""User path patterns (issue 30): every pattern a user gives (map keys, `stacked_axes=`,
`autocast_exclude=`, `diagnose(paths=)`) is compiled one way and matched as `re.fullmatch`
would, by RE2 in linear time or by `regex` with a timeout that raises a ValueError naming
the pattern and the path. The hang cases assert the outcome (a correct answer or that
error), never a time."""

from __future__ import annotations

import re
import unicodedata

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jmp_policy as jp
from jmp_policy._src import path_patterns
from jmp_policy._src.diagnostics.tap_selection import selection
from jmp_policy._src.options import make_options
from jmp_policy._src.path_patterns import compile_pattern
from jmp_policy._src.quantization.stacked_axes import stacked_axes_of

FUZZ = settings(max_examples=150, deadline=None, derandomize=True)
CYRILLIC = "\u0400"  # "Ѐ"
KEY = "key {key}"

# The hang cases: (pattern, path, Python's answer). Python's `re` takes from 9 s
# to minutes on each; each is answered by RE2.
HANGS = [
    (f"([{CYRILLIC}-\u04ff]+)+!", CYRILLIC * 26, False),
    (f"([{CYRILLIC}-\u04ff]+)+!", CYRILLIC * 26 + "!", True),
    (".*.*.*.*x", "a" * 600, False),
    (".*.*.*.*x", "a" * 600 + "x", True),
    ("\\w*\\w*\\w*\\w*!", "a" * 600, False),
    (".*/.*/.*/.*/x", "a/" * 300, False),
    (f"({CYRILLIC}+)+!", CYRILLIC * 28, False),
]


@pytest.mark.parametrize(("pattern", "path", "expected"), HANGS)
def test_hang_cases_are_answered_by_re2(pattern, path, expected):
    compiled = compile_pattern(pattern, KEY)
    assert compiled.fullmatch(path) is expected
    assert compiled.engine == "re2"


@pytest.mark.parametrize(("pattern", "path", "expected"), HANGS)
def test_hang_cases_through_every_entry_point(pattern, path, expected):
    m = jp.DTypePolicyMap("float32", {pattern: "bfloat16"})
    assert m[path] == jp.DTypePolicy("bfloat16" if expected else "float32")
    assert m.match(path) == (pattern if expected else None)
    assert stacked_axes_of({pattern: 1})(path) == int(expected)
    assert make_options(autocast_exclude=[pattern]).excluded(path, None) is expected
    assert selection(paths=[pattern]).taps(path) is expected


def test_a_pathological_lookaround_key_is_stopped_naming_key_and_path():
    # Lookarounds need backtracking (RE2 refuses them): `regex` runs them with a timeout.
    key, path = "(a|aa)+(?=b)b", "a" * 60
    m = jp.DTypePolicyMap("float32", {key: "bfloat16"})
    with pytest.raises(ValueError, match=r"was stopped after 20 ms") as info:
        m[path]
    message = str(info.value)
    assert f"Received: key={key!r}, path={path!r}" in message
    assert "against key '(a|aa)+(?=b)b' of the DTypePolicyMap" in message
    assert m["aab"] == jp.DTypePolicy("bfloat16")  # short paths still answer


def test_timeouts_through_autocast_exclude_and_diagnose_paths_name_the_option():
    key, path = "(a|aa)+(?=b)", "a" * 60
    with pytest.raises(ValueError, match=r"entry '\(a\|aa\)\+\(\?=b\)' of `autocast_exclude`"):
        make_options(autocast_exclude=[key]).excluded(path, None)
    with pytest.raises(ValueError, match=r"entry '\(a\|aa\)\+\(\?=b\)' of `paths`"):
        selection(paths=[key]).taps(path)
    with pytest.raises(ValueError, match=r"key '\(a\|aa\)\+\(\?=b\)' of `stacked_axes`"):
        stacked_axes_of({key: 1})(path)


def test_the_readme_lookahead_key_works_as_in_keras():
    m = jp.DTypePolicyMap("bfloat16", {"encoder/(?!.*norm).*": "float32"})
    assert m["encoder/layers_0/attention"] == jp.DTypePolicy("float32")
    assert m.match("encoder/layers_0/norm") is None
    assert m["encoder/norm"] == jp.DTypePolicy("bfloat16")
    assert compile_pattern("encoder/(?!.*norm).*", KEY).engine == "regex"


@pytest.mark.parametrize(
    ("option", "argument"),
    [
        (lambda p: make_options(autocast_exclude=[p]), "autocast_exclude"),
        (lambda p: selection(paths=[p]), "paths"),
        (lambda p: stacked_axes_of({p: 1}), "stacked_axes"),
        (lambda p: jp.DTypePolicyMap(None, {p: "float32"}), "DTypePolicyMap"),
    ],
)
@pytest.mark.parametrize(
    ("pattern", "why"),
    [
        ("a{99999999999}", "repetition count is too large"),
        ("(" * 2000 + "a" + ")" * 2000, "nested too deeply"),
        ("encoder/(.*", "missing )"),
    ],
)
def test_bad_patterns_are_value_errors_naming_the_option(option, argument, pattern, why):
    with pytest.raises(ValueError, match="is not a valid regular expression") as info:
        option(pattern)
    assert type(info.value) is ValueError
    assert why in str(info.value)
    assert argument in str(info.value)
    assert repr(pattern)[:40] in str(info.value)


def test_autocast_exclude_on_a_module_with_a_long_unicode_name():
    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(3, name=CYRILLIC * 28)(x)

    net = Net()
    x = jnp.ones((2, 4))
    params = net.init(jax.random.key(0), x)
    for exclude, dtype in [
        ([f"({CYRILLIC}+)+!"], jnp.bfloat16),
        ([f"({CYRILLIC}+)+"], jnp.float32),
    ]:
        out = jp.linen.apply(net, "mixed_bfloat16", autocast_exclude=exclude)(params, x)
        assert out.dtype == dtype, exclude


def test_twenty_thousand_alternation_keys_are_indexed():
    keys = {f"encoder/layers_{i}/(mlp|attn)_\\d+": "bfloat16" for i in range(20_000)}
    m = jp.DTypePolicyMap("float32", keys)
    assert m.match("encoder/layers_12345/attn_7") == "encoder/layers_12345/(mlp|attn)_\\d+"
    assert m["encoder/layers_19999/mlp_0/kernel"] == jp.DTypePolicy("bfloat16")
    assert m["encoder/layers_20000/mlp_0"] == jp.DTypePolicy("float32")
    assert m["encoder/layers_1/norm_0"] == jp.DTypePolicy("float32")
    # Only the keys of one prefix were compiled for those lookups.
    index = m._index
    compiled = [k for k, p in index._regex.items() if p._matcher is not None]
    assert 0 < len(compiled) <= 10, compiled
    assert jp.deserialize(jp.serialize(m)).match("encoder/layers_7/mlp_1") == (
        "encoder/layers_7/(mlp|attn)_\\d+"
    )


@pytest.mark.parametrize(
    ("pattern", "prefix"),
    [
        ("encoder/layers_3/(mlp|attn)_\\d+", "encoder/layers_3/"),
        ("a|b", ""),
        ("ab|ac", ""),
        ("a(?:b|c)", "a"),
        ("ab\\d|ac", ""),  # checked by its skeleton: the top-level `|` gives no prefix
        ("ab\\x41|ac", "a"),  # parsed: Python's parser factors the common prefix out
        ("(?i)enc.*", ""),
        ("enc(?i:oder)", "enc"),
        ("xy*z", "x"),
        ("dot\\.ted", "dot"),
        ("dot\\x2eted", "dot.ted"),
        ("(?x) a b # c", "ab"),
    ],
)
def test_literal_prefix_is_what_every_match_starts_with(pattern, prefix):
    assert compile_pattern(pattern, KEY).literal_prefix == prefix


# -- Python's meaning, kept -------------------------------------------------------------------

SEMANTICS = [
    r"a$",
    "a$\n",
    r"a\Z",
    r"a{,3}",
    r"[^\W\d]+",
    r"[\W\d]+",
    r"\W+",
    r"(?i)EnC.*",
    r"\bfoo\b.*",
    r"(?a)\w+",
    r"(a)\1",
    r"(?P<x>a)(?P=x)",
    "(?s).*",
    "x|y/z",
    r"[a-c\s]+",
    r"[^a-c\s]+",
    r"(?<=a)b|ab",
    r"a{1001}",
    r"(?m)a$\nb",
    r"[\D]",
    r"\S+",
    "a*+a",
    "(?>a*)a",
    "é+",
    r"\x00",
    r"(?:a|)b",
    "",
    r"(a)?(?(1)b|c)",
    r"\d+",
    r"\w+",
    r"\s",
]
SAMPLE_PATHS = [
    "a",
    "a\n",
    "aaa",
    "",
    "b",
    "ЁЁЁ",
    "foo bar",
    "Enc/x",
    "abc",
    "x",
    "y/z",
    " ",
    "\t\x1c",
    "\u0663\u0664",
    "a_1",
    "ab",
    "a\nb",
    "éé",
    "\x00",
    "é1_ß",
    "\u2003",
    "a" * 1001,
    "\u0301",  # a combining mark: no \w in Python
]


@pytest.mark.parametrize("pattern", SEMANTICS)
def test_matches_agree_with_python_re(pattern):
    compiled = compile_pattern(pattern, KEY)
    for path in SAMPLE_PATHS:
        assert compiled.fullmatch(path) is bool(re.fullmatch(pattern, path)), (pattern, path)


def test_unicode_classes_agree_with_python_on_every_assigned_code_point():
    # RE2's Unicode tables are newer than Python's: they differ only where Python's
    # version leaves a code point unassigned.
    points = [
        chr(c)
        for c in range(0, 0x30000, 7)
        if not 0xD800 <= c <= 0xDFFF and unicodedata.category(chr(c)) != "Cn"
    ]
    for cls in (r"\w", r"\d", r"\s", r"\W", r"[\w\s]", "."):
        compiled = compile_pattern(cls, KEY)
        assert compiled.engine == "re2"
        wrong = [p for p in points if compiled.fullmatch(p) is not bool(re.fullmatch(cls, p))]
        assert wrong == [], (cls, [hex(ord(p)) for p in wrong[:5]])


def test_a_path_with_a_lone_surrogate_is_matched():
    compiled = compile_pattern("a.b", KEY)
    assert compiled.engine == "re2"
    assert compiled.fullmatch("a\ud800b") is True


_PIECES = st.sampled_from(
    [
        *"ab/_.*+?|()[]^$\\-",
        "\\w",
        "\\d",
        "\\s",
        "\\W",
        "(?:",
        "(?=",
        "(?!",
        "[a-z]",
        "{2}",
        "{1,3}",
        ".*",
        "+?",
        "\\b",
        "\\Z",
        "(?i)",
        "é",
        "Ё",
        "[^a]",
        "{,2}",
        "\\1",
        "(?<=",
        "(?P<n>",
        "\\x4",
        "{",
        "}",
    ]
)
_PATH_CHARS = st.sampled_from("ab/_1 é\nЁ")


@pytest.mark.filterwarnings("ignore:Possible nested set:FutureWarning")  # Python's own
@FUZZ
@given(
    pattern=st.lists(_PIECES, max_size=10).map("".join),
    paths=st.lists(st.text(_PATH_CHARS, max_size=8), max_size=6),
)
def test_fuzzed_patterns_agree_with_python_re(pattern, paths):
    try:
        expected = re.compile(pattern)
    except (re.error, OverflowError, RecursionError):
        with pytest.raises(ValueError, match="is not a valid regular expression"):
            compile_pattern(pattern, KEY)
        return
    compiled = compile_pattern(pattern, KEY)
    for path in paths:
        try:
            got = compiled.fullmatch(path)
        except ValueError as e:  # the regex fallback stopped: never on these short paths
            pytest.fail(f"{pattern!r} on {path!r}: {e}")
        assert got is bool(expected.fullmatch(path)), (pattern, path, compiled.engine)
        if compiled.literal_prefix:
            assert not got or path.startswith(compiled.literal_prefix)


def test_timeout_is_documented_and_small():
    assert 0 < path_patterns.MATCH_TIMEOUT_S <= 0.05


def test_no_private_name_of_the_map_is_imported_by_diagnose():
    import inspect

    from jmp_policy._src.diagnostics import tap_selection as diagnostics_selection

    assert "policy_map" not in inspect.getsource(diagnostics_selection)


def test_stacked_axes_keys_use_the_same_patterns():
    of = stacked_axes_of({"layers/(?!bias).*": 1, "blocks_\\d+/.*": 2})
    assert of("layers/kernel") == 1
    assert of("layers/bias") == 0
    assert of("blocks_12/kernel") == 2


def test_a_key_nested_too_deeply_is_refused_when_the_map_is_built():
    key = "(?:" * 200 + "a" + ")+" * 200 + "b"
    with pytest.raises(ValueError, match=r"its groups nest 200 deep, more than the 50 levels"):
        jp.DTypePolicyMap("float32", {key: "bfloat16"})
    deepest = "(?:" * path_patterns.MAX_NESTING + "a" + ")+" * path_patterns.MAX_NESTING + "b"
    m = jp.DTypePolicyMap("float32", {deepest: "bfloat16"})  # the bound itself: matched
    assert m["aab"].name == "bfloat16" and m["ba"].name == "float32"


@pytest.mark.parametrize(
    ("key", "depth"),
    [("a(b(c))", 2), ("[(]((a))", 2), (r"\(\((a)", 1), ("[]((]a", 0), ("[^]((]", 0), ("", 0)],
)
def test_nesting_skips_escapes_and_classes(key, depth):
    assert path_patterns._nesting(key) == depth


@pytest.mark.parametrize(
    "key",
    ["[z-a]/x", "(a)\\2/x", "[]/x", "(a)\\12", "[\\]]x", "[]]x", "[^]]x", "[(]x)", "(a)\\1x",
     "\\0x", "\\012x", "[a-\\d]x", "x[", "[\u0430-\u044f]+/layers_3", "[[a]]x", "(a)(b)(c)\\3\\2\\1"],
)  # fmt: skip
def test_keys_with_classes_and_backreferences_are_valid_exactly_when_python_says(key):
    try:
        re.compile(key)
    except re.error:
        with pytest.raises(ValueError, match="is not a valid regular expression"):
            compile_pattern(key, KEY)
    else:
        assert compile_pattern(key, KEY).fullmatch("x") == bool(re.fullmatch(key, "x"))


def test_many_keys_of_one_shape_with_a_class_or_backreference_are_parsed_once(monkeypatch):
    # #46: 20,000 Cyrillic-class keys took 20 s to build, each parsed by Python's parser.
    parsed = []
    inner = path_patterns.parse
    path_patterns._check_skeleton.cache_clear()
    monkeypatch.setattr(path_patterns, "parse", lambda key: parsed.append(key) or inner(key))
    keys = {f"[\u0430-\u044f]+/layers_{i}": "bfloat16" for i in range(1_000)}
    keys.update({f"(a)\\1/block_{i}": "float16" for i in range(1_000)})
    m = jp.DTypePolicyMap("float32", keys)
    assert len(parsed) <= 2  # one skeleton per shape
    assert m["\u0441\u043b\u043e\u0439/layers_7"].name == "bfloat16"
    assert m["aa/block_3"].name == "float16" and m["ab/block_3"].name == "float32"


@pytest.mark.parametrize(
    ("key", "suffix"),
    [(".*/layers_3/mlp", "/layers_3/mlp"), ("(a)\\1/x", "/x"), ("[\u0430-\u044f]+/l_7", "/l_7"),
     (".*\\.txt", "txt"), (".*\\d", ""), (".*a|b", ""), ("(?i).*ab", ""), (".*\\x41b", ""),
     (".*\\012ab", "ab"), (".*\\\\x", "x"), (".*ab$", ""), (".*a{2}bc", "bc"), (".*a+", "")],
)  # fmt: skip
def test_plain_suffix_is_text_every_match_ends_with(key, suffix):
    assert path_patterns.plain_suffix(key) == suffix
