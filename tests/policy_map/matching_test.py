"""Tests of the map's matching methods and of the one variable rule in every tree method.

`match(path)` names a path itself; `match_variable(path)` names a variable: a key names a
variable when it matches the variable's path and not its module path. A variable at the
top of a tree belongs to the root module, path "" (issue #8, items 6 and 7).
"""

import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_policy as jp
from jmp_policy._src.options import Options
from jmp_policy._src.policy_map._trees import leaves
from jmp_policy._src.resolution import Resolver

BF16 = jp.DTypePolicy("bfloat16")
F16 = jp.DTypePolicy("float16")
F32 = jp.DTypePolicy("float32")
MIXED = jp.DTypePolicy("mixed_bfloat16")


# -- match ----------------------------------------------------------------------------------


def test_match_exact_key_wins_over_matching_regexes():
    m = jp.DTypePolicyMap(F32, {"enc/.*": BF16, "enc/x": F16, ".*x": F32})
    assert m.match("enc/x") == "enc/x"


def test_match_regex_by_fullmatch_and_none_without_ancestor_walk():
    m = jp.DTypePolicyMap(F32, {"enc/.*": BF16, "head": F16})
    assert m.match("enc/mlp") == "enc/.*"
    assert m.match("enc") is None  # "enc/.*" needs a child
    assert m.match("head") == "head"
    assert m.match("head/dense") is None  # no ancestor walk...
    assert m["head/dense"] == F16  # ...which resolution does
    assert m.match("my_head") is None  # fullmatch, not search


def test_match_ambiguity_names_path_and_keys_in_insertion_order():
    m = jp.DTypePolicyMap(F32, {".*/norm": F32, "enc/.*": BF16})
    with pytest.raises(
        ValueError,
        match=re.escape(
            "Path 'enc/norm' matches multiple dtype policy keys: ['.*/norm', 'enc/.*']"
        ),
    ):
        m.match("enc/norm")


def test_match_root_path():
    assert jp.DTypePolicyMap(None, {"": F32}).match("") == ""
    assert jp.DTypePolicyMap(None, {".*": F32}).match("") == ".*"
    assert jp.DTypePolicyMap(None, {".+": F32}).match("") is None


@pytest.mark.parametrize("method", ["match", "match_variable"])
def test_matching_methods_reject_non_string_paths(method):
    with pytest.raises(TypeError, match=r"A module path must be a string.*path=3"):
        getattr(jp.DTypePolicyMap(), method)(3)


def test_match_follows_writes():
    m = jp.DTypePolicyMap(F32, {"enc/.*": BF16})
    assert m.match("enc/x") == "enc/.*"
    m["enc/x"] = F16
    assert m.match("enc/x") == "enc/x"
    del m["enc/.*"]
    assert m.match("enc/y") is None


# -- match_variable -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key, path, named",
    [
        (".*/embedding", "embed/embedding", True),
        ("embed/embedding", "embed/embedding", True),
        ("encoder/.*", "encoder/head/kernel", False),  # matches the module "encoder/head"
        (r"encoder(/\w+)*", "encoder/head/kernel", False),
        ("encoder/.*", "encoder/kernel", True),  # does not match the module "encoder"
        (".*kernel", "dense/kernel", True),
        (".*", "dense/kernel", False),
        ("pos_.*", "pos_embedding", True),  # a root variable: module path ""
        (".*", "pos_embedding", False),  # ".*" matches the root's path ""
        ("", "pos_embedding", False),
        ("dense", "dense/kernel", False),
    ],
)
def test_match_variable_is_the_design_rule(key, path, named):
    m = jp.DTypePolicyMap(F32, {key: BF16})
    module = path.rpartition("/")[0]
    expected = bool(re.fullmatch(key, path)) and not re.fullmatch(key, module)
    assert expected == named  # the table agrees with DESIGN's words
    assert m.match_variable(path) == (key if named else None)


def test_match_variable_exact_key_wins_and_module_keys_are_no_rivals():
    m = jp.DTypePolicyMap(F32, {"tok/embedding": F16, ".*/embedding": BF16, "tok/.*": F32})
    assert m.match_variable("tok/embedding") == "tok/embedding"
    assert m.match_variable("pos/embedding") == ".*/embedding"
    # "tok/.*" names the module "tok/sub", so only ".*/embedding" names the variable.
    assert m.match_variable("tok/sub/embedding") == ".*/embedding"


def test_match_variable_ambiguity_names_path_and_keys():
    m = jp.DTypePolicyMap(F32, {".*/embedding": BF16, "tok/emb.*": F16})
    with pytest.raises(ValueError, match=r"'tok/embedding' matches multiple .*'tok/emb\.\*'"):
        m.match_variable("tok/embedding")


def test_match_variable_follows_writes():
    m = jp.DTypePolicyMap(F32)
    assert m.match_variable("a/kernel") is None
    m[".*/kernel"] = BF16
    assert m.match_variable("a/kernel") == ".*/kernel"


# -- one rule in every tree method: variable keys (#8 item 7) --------------------------------


def _encoder_tree():
    return {
        "encoder": {
            "head": {"kernel": jnp.ones((2, 2)), "bias": jnp.ones(2)},
            "mlp": {"kernel": jnp.ones((2, 2))},
        }
    }


@pytest.mark.parametrize("pattern", ["encoder/.*", r"encoder(/\w+)*"])
def test_module_pattern_never_overrides_the_exact_key_of_a_variables_module(pattern, maybe_jit):
    m = jp.DTypePolicyMap("float32", {pattern: "mixed_bfloat16", "encoder/head": "float32"})
    tree = _encoder_tree()
    policies = m.policy_tree(tree)
    assert policies["encoder"]["head"]["kernel"] == F32
    assert policies["encoder"]["mlp"]["kernel"] == MIXED
    cast = maybe_jit(m.cast_to_compute)(tree)
    assert cast["encoder"]["head"]["kernel"].dtype == jnp.float32
    assert cast["encoder"]["mlp"]["kernel"].dtype == jnp.bfloat16
    m16 = jp.DTypePolicyMap("float32", {pattern: "p=bf16,c=bf16,o=f16", "encoder/head": "float32"})
    assert maybe_jit(m16.cast_to_variable)(tree)["encoder"]["head"]["kernel"].dtype == jnp.float32
    assert maybe_jit(m16.cast_to_variable)(tree)["encoder"]["mlp"]["kernel"].dtype == jnp.bfloat16
    assert maybe_jit(m16.cast_to_output)(tree)["encoder"]["head"]["kernel"].dtype == jnp.float32
    assert maybe_jit(m16.cast_to_output)(tree)["encoder"]["mlp"]["kernel"].dtype == jnp.float16
    assert m.unused_keys(tree) == []
    rows = {line.split()[0]: line.split() for line in m.explain(tree).splitlines()}
    assert rows["encoder/head"][1:4] == ["float32", "key", "'encoder/head'"]
    assert "encoder/head/kernel" not in rows  # no key names the variable itself
    assert rows["encoder/mlp"][1:4] == ["mixed_bfloat16", "key", repr(pattern)]


def test_variable_pattern_in_every_tree_method(maybe_jit):
    m = jp.DTypePolicyMap("p=bf16,c=bf16,o=f16", {".*/embedding": "float32"})
    tree = {"tok": {"embedding": jnp.ones(2), "bias": jnp.ones(2)}}
    assert m.policy_tree(tree)["tok"] == {"embedding": F32, "bias": m.default_policy}
    for method, other in [
        ("cast_to_compute", jnp.bfloat16),
        ("cast_to_variable", jnp.bfloat16),
        ("cast_to_output", jnp.float16),
    ]:
        cast = maybe_jit(getattr(m, method))(tree)
        assert cast["tok"]["embedding"].dtype == jnp.float32, method
        assert cast["tok"]["bias"].dtype == other, method
    assert m.unused_keys(tree) == []
    assert m.unused_keys({"tok": {"bias": jnp.ones(2)}}) == [".*/embedding"]
    rows = {line.split()[0]: line.split() for line in m.explain(tree).splitlines()}
    assert rows["tok/embedding"][1:4] == ["float32", "key", "'.*/embedding'"]
    assert rows["tok"][1:3] == ["p=bf16,c=bf16,o=f16", "default"]


# -- one rule in every tree method: root variables (#8 item 6) ------------------------------


def _vit_tree():
    return {
        "pos_embedding": jnp.ones((4, 2)),
        "cls": jnp.zeros((1, 2)),
        "encoder": {"mlp": {"kernel": jnp.ones((2, 2))}},
    }


def test_root_variables_resolve_through_the_root_key_in_every_tree_method(maybe_jit):
    m = jp.DTypePolicyMap("p=bf16,c=bf16,o=f16", {"": "float32"})
    tree = _vit_tree()
    policies = m.policy_tree(tree)
    assert policies["pos_embedding"] == F32
    assert policies["cls"] == F32
    assert policies["encoder"]["mlp"]["kernel"] == m.default_policy  # "" is no ancestor
    for method, other in [
        ("cast_to_compute", jnp.bfloat16),
        ("cast_to_variable", jnp.bfloat16),
        ("cast_to_output", jnp.float16),
    ]:
        cast = maybe_jit(getattr(m, method))(tree)
        assert cast["pos_embedding"].dtype == jnp.float32, method
        assert cast["encoder"]["mlp"]["kernel"].dtype == other, method
    assert m.unused_keys(tree) == []
    lines = m.explain(tree).splitlines()
    root = next(line.split() for line in lines if line.startswith("<root>"))
    assert root == ["<root>", "float32", "key", "''", "f32", "40", "40"]


def test_root_variables_follow_the_default_without_a_root_key(maybe_jit):
    m = jp.DTypePolicyMap("mixed_bfloat16", {"encoder/.*": "float32"})
    cast = maybe_jit(m.cast_to_compute)(_vit_tree())
    assert cast["pos_embedding"].dtype == jnp.bfloat16
    assert cast["encoder"]["mlp"]["kernel"].dtype == jnp.float32


def test_root_variables_with_a_regex_for_the_root_and_a_variable_key():
    m = jp.DTypePolicyMap("mixed_bfloat16", {".*": "float16", "pos_.*": "float32"})
    policies = m.policy_tree(_vit_tree())
    assert policies["pos_embedding"] == F32  # named itself
    assert policies["cls"] == F16  # through the root, which ".*" matches
    # A module "pos_x" is named by both keys: Keras's ambiguity rule.
    with pytest.raises(ValueError, match=r"Path 'pos_x' matches multiple .*\['\.\*', 'pos_\.\*'\]"):
        m.policy_tree({"pos_x": {"w": jnp.ones(1)}})


def test_root_key_is_never_reported_unused():
    m = jp.DTypePolicyMap("mixed_bfloat16", {"": "float32", "haed": "float32"})
    assert m.unused_keys({"head": {"kernel": jnp.ones(1)}}) == ["haed"]
    assert m.unused_keys(_vit_tree()) == ["haed"]


# -- the tree methods and the glue's resolution agree ---------------------------------------

KEYS = [
    "",
    ".*",
    "enc",
    "enc/.*",
    r"enc(/\w+)*",
    "enc/head",
    "enc/head/kernel",
    ".*/kernel",
    "pos_.*",
    "enc/[^/]*",
    "dec/layers_[0-9]+/mlp",
]

TREE = {
    "pos_embedding": jnp.ones(1),
    "enc": {
        "kernel": jnp.ones(1),
        "head": {"kernel": jnp.ones(1), "bias": jnp.ones(1)},
        "mlp": {"kernel": jnp.ones(1)},
    },
    "dec": {"layers_3": {"mlp": {"kernel": jnp.ones(1), "bias": jnp.ones(1)}}},
}


def _outcome(fn):
    try:
        return fn()
    except ValueError as e:
        return "error: " + str(e).split(". ")[0]


def _single_leaf_tree(path):
    tree = jnp.ones(1)
    for part in reversed(path.split("/")):
        tree = {part: tree}
    return tree


def _leaf_policy(tree, path):
    for part in path.split("/"):
        tree = tree[part]
    return tree


@pytest.mark.parametrize("pair", list(itertools.combinations(range(len(KEYS)), 2)))
def test_tree_methods_and_glue_resolution_agree_on_every_variable(pair):
    m = jp.DTypePolicyMap(F32, {KEYS[pair[0]]: BF16, KEYS[pair[1]]: F16})
    for module, name, _ in leaves(TREE)[0]:
        path = f"{module}/{name}" if module else name
        tree = _outcome(
            lambda path=path: _leaf_policy(m.policy_tree(_single_leaf_tree(path)), path)
        )
        glue = _outcome(lambda path=path: Resolver(m, Options()).variable(path)[0])
        assert tree == glue, (KEYS[pair[0]], KEYS[pair[1]], path)
        key = _outcome(lambda path=path: m.match_variable(path))
        if not isinstance(key, str) or not key.startswith("error"):
            # The DESIGN rule, spelled out: matches the path and not its module's path.
            named = [
                k for k in m if (k == path or re.fullmatch(k, path)) and not re.fullmatch(k, module)
            ]
            assert key == (named[0] if named else None), (path, named)


def test_numpy_leaves_under_the_root_key_keep_their_type():
    m = jp.DTypePolicyMap("bfloat16", {"": "float32"})
    tree = {"pos": np.ones(2, np.float32), "enc": {"w": np.ones(2, np.float32)}}
    cast = m.cast_to_compute(tree)
    assert cast["pos"] is tree["pos"]
    assert isinstance(cast["enc"]["w"], np.ndarray)
    assert cast["enc"]["w"].dtype == jnp.bfloat16


def test_root_variables_under_jit_and_grad_keep_their_stored_dtype():
    m = jp.DTypePolicyMap("mixed_bfloat16", {"": "float32"})

    def loss(tree):
        cast = m.cast_to_compute(tree)
        assert cast["pos_embedding"].dtype == jnp.float32
        return sum(jnp.sum(x.astype(jnp.float32)) for x in jax.tree.leaves(cast))

    grads = jax.jit(jax.grad(loss))(_vit_tree())
    assert jax.tree.map(lambda g: g.dtype, grads) == jax.tree.map(lambda x: x.dtype, _vit_tree())


# -- keys indexed by their literal suffix (#46) ---------------------------------------------

_PIECES = [".*", "[a-c]+", "(a|b)", "(a)\\1", "\\d", "\\.", "x", "/", "mlp", "a", "\\\\", "$"]


def _brute_match(keys, path):
    if path in keys:  # an exact key wins
        return path
    found = [k for k in keys if re.fullmatch(k, path)]
    return found[0] if len(found) == 1 else ("ambiguous" if found else None)


def _brute_variable(keys, path):
    if path in keys:
        return path
    module = path.rpartition("/")[0]
    found = [k for k in keys if re.fullmatch(k, path) and not re.fullmatch(k, module)]
    return found[0] if len(found) == 1 else ("ambiguous" if found else None)


def _answer(call, path):
    try:
        return call(path)
    except ValueError as e:
        assert "matches multiple" in str(e)
        return "ambiguous"


@pytest.mark.parametrize("seed", range(40))
def test_keys_without_a_literal_prefix_match_as_python_re_does(seed):
    rng = np.random.default_rng(seed)
    keys = set()
    while len(keys) < 6:
        key = "".join(rng.choice(_PIECES, size=rng.integers(1, 5)))
        try:
            re.compile(key)
        except re.error:
            continue
        keys.add(key)
    m = jp.DTypePolicyMap("float32", dict.fromkeys(sorted(keys), "bfloat16"))
    words = ["a", "b", "aa", "x", "mlp", "1", ".", "\\", "c/mlp", "a.x"]
    for _ in range(60):
        path = "/".join(rng.choice(words, size=rng.integers(1, 4)))
        assert _answer(m.match, path) == _brute_match(sorted(keys), path), (keys, path)
        want = _brute_variable(sorted(keys), path)
        assert _answer(m.match_variable, path) == want, (keys, path)


def test_twenty_thousand_leading_wildcard_keys_compile_only_those_a_path_ends_like():
    keys = {f".*/layers_{i}/mlp": "bfloat16" for i in range(20_000)}
    m = jp.DTypePolicyMap("float32", keys)
    assert m["decoder/layers_7/mlp"].name == "bfloat16"
    assert m["decoder/layers_7/attn"].name == "float32"
    compiled = [k for k, p in m._index._regex.items() if p._matcher is not None]
    assert compiled == [".*/layers_7/mlp"]  # one key compiled, not 20,000
