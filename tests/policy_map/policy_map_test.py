"""Tests of DTypePolicyMap: Keras's map behaviour, the ancestor rule, tree methods."""

import copy
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_policy as jp
from jmp_policy._src.policy_map._trees import leaves

BF16 = jp.DTypePolicy("bfloat16")
F16 = jp.DTypePolicy("float16")
F32 = jp.DTypePolicy("float32")
INT8 = jp.QuantizedDTypePolicy("int8", "mixed_bfloat16")


# -- Keras's map behaviour ------------------------------------------------------------------


def test_add_len_and_lookup_of_every_policy_kind():
    m = jp.DTypePolicyMap()
    m["layer/dense_0"] = BF16
    m["layer/dense_1"] = INT8
    m["layer/dense_2"] = jp.QuantizedFloat8DTypePolicy("float8", "mixed_float16")
    assert len(m) == 3
    assert m["layer/dense_0"].name == "bfloat16"
    assert isinstance(m["layer/dense_1"], jp.QuantizedDTypePolicy)
    assert m["layer/dense_1"].source_name == "mixed_bfloat16"
    assert m["layer/dense_1"].quantization_mode == "int8"
    assert m["layer/dense_2"].quantization_mode == "float8"


def test_duplicate_key_is_rejected_and_keeps_the_first_policy():
    m = jp.DTypePolicyMap(policy_map={"layer/dense_0": BF16})
    with pytest.raises(ValueError, match=r"^layer/dense_0 already exist in the DTypePolicyMap"):
        m["layer/dense_0"] = F32
    assert m["layer/dense_0"] == BF16
    del m["layer/dense_0"]
    m["layer/dense_0"] = F32
    assert m["layer/dense_0"] == F32


@pytest.mark.parametrize("bad", [123, 1.5, object(), ["float32"]])
def test_invalid_value_is_rejected_on_insertion(bad):
    m = jp.DTypePolicyMap()
    with pytest.raises(ValueError, match="Cannot interpret the assigned value"):
        m["layer/dense_3"] = bad
    with pytest.raises(TypeError):
        m["layer/dense_3"] = bad
    assert "layer/dense_3" not in m


def test_invalid_name_is_rejected_in_the_constructor_naming_the_key():
    with pytest.raises(ValueError, match=r"'encoder/\.\*'.*'mixed_bf16'"):
        jp.DTypePolicyMap(policy_map={"encoder/.*": "mixed_bf16"})


def test_bad_regular_expression_is_rejected_on_insertion_naming_the_key():
    m = jp.DTypePolicyMap()
    with pytest.raises(ValueError, match=r"Key 'encoder/\(\.\*' .*not a valid regular expression"):
        m["encoder/(.*"] = "bfloat16"
    assert len(m) == 0


def test_non_string_key_is_a_type_error():
    with pytest.raises(TypeError, match="Keys of a DTypePolicyMap are module paths"):
        jp.DTypePolicyMap()[3] = "float32"


def test_policy_map_argument_must_be_a_mapping():
    with pytest.raises(TypeError, match="If specified, `policy_map` must be a dict"):
        jp.DTypePolicyMap(policy_map=123)
    with pytest.raises(TypeError, match="If specified, `policy_map` must be a dict"):
        jp.DTypePolicyMap(policy_map=jp.DTypePolicy("mixed_bfloat16"))


def test_default_policy_cannot_be_a_map():
    with pytest.raises(ValueError, match="`default_policy` cannot be a `DTypePolicyMap`"):
        jp.DTypePolicyMap(default_policy=jp.DTypePolicyMap())


def test_lookup_exact_then_regex_then_ancestor_then_default():
    m = jp.DTypePolicyMap()
    m["model/encoder/layer_0/dense"] = BF16
    m["model/encoder/attention/query"] = INT8
    m["model/decoder/.*"] = F32
    m["model/decoder/attention/.*"] = F16
    assert m["model/encoder/layer_0/dense"] == BF16
    assert m["model/encoder/attention/query"] == INT8
    assert m["model/decoder/layer_0"] == F32
    # No wildcard, no partial match: query_norm is not query's child.
    assert m["model/encoder/attention/query_norm"] == m.default_policy
    m["model/decoder"] = BF16
    assert m["model/decoder/layer_0"] == F32  # a regex key names it, before ancestors
    assert m["model/decoder"] == BF16
    assert m["model/embedding"] == m.default_policy
    # The ancestor rule: a child of an exact key inherits it.
    assert m["model/encoder/attention/query/kernel"] == INT8
    assert m["model/encoder/layer_0/dense/sub/deeper"] == BF16


def test_several_matching_keys_raise_naming_the_path_and_keys():
    m = jp.DTypePolicyMap(policy_map={"model/decoder/.*": F32, "model/decoder/attention/.*": F16})
    with pytest.raises(
        ValueError,
        match=re.escape(
            "Path 'model/decoder/attention/output' matches multiple dtype policy keys: "
            "['model/decoder/.*', 'model/decoder/attention/.*']"
        ),
    ):
        m["model/decoder/attention/output"]


def test_fullmatch_not_search():
    m = jp.DTypePolicyMap(F32, {"dense": BF16, "enc.*": F16})
    assert m["my_dense"] == F32
    assert m["dense_1"] == F32
    assert m["xenc"] == F32
    assert m["encoder"] == F16


def test_delete_pop_and_keyerror():
    m = jp.DTypePolicyMap(policy_map={"layer/dense_0": BF16, "layer/dense_1": INT8})
    assert m.pop("layer/dense_0") == BF16
    with pytest.raises(KeyError):
        m.pop("layer/dense_0")
    del m["layer/dense_1"]
    assert m["layer/dense_1"] == m.default_policy
    assert len(m) == 0
    with pytest.raises(KeyError):
        del m["layer/dense_1"]


def test_iteration_items_and_in_follow_insertion_order():
    m = jp.DTypePolicyMap()
    m["layer/dense_1"] = INT8
    m["layer/dense_0"] = BF16
    assert list(m) == ["layer/dense_1", "layer/dense_0"]
    assert list(m.keys()) == ["layer/dense_1", "layer/dense_0"]
    assert list(m.items()) == [("layer/dense_1", INT8), ("layer/dense_0", BF16)]
    assert "layer/dense_0" in m
    assert "layer/dense_2" not in m
    assert "layer/.*" not in m


def test_default_policy_none_follows_the_global_policy_at_lookup_time():
    m = jp.DTypePolicyMap(policy_map={"head": "float32"})
    assert m["body"] == F32  # resolved once (and cached) under the default global
    jp.set_dtype_policy("mixed_bfloat16")
    assert m["body"] == jp.DTypePolicy("mixed_bfloat16")
    with jp.policy_scope("mixed_float16"):
        assert m["body"] == jp.DTypePolicy("mixed_float16")
        assert m.default_policy == jp.DTypePolicy("mixed_float16")
        assert m["head"] == F32
    assert m["body"] == jp.DTypePolicy("mixed_bfloat16")


def test_explicit_default_policy_ignores_the_global_policy():
    m = jp.DTypePolicyMap("mixed_bfloat16")
    with jp.policy_scope("float16"):
        assert m["anything"] == jp.DTypePolicy("mixed_bfloat16")
    assert m.name == "map_mixed_bfloat16"
    assert m.compute_dtype == jnp.bfloat16
    assert m.variable_dtype == jnp.float32
    assert m.quantization_mode is None


def test_writes_clear_the_cache():
    m = jp.DTypePolicyMap(F32, {"enc/.*": BF16})
    assert m["enc/a/b"] == BF16
    m["enc/a"] = F16
    assert m["enc/a/b"] == BF16  # still a regex match of the path itself
    m["enc/a/b"] = F16
    assert m["enc/a/b"] == F16
    del m["enc/a/b"]
    del m["enc/.*"]
    assert m["enc/a/b"] == F16  # now inherited from enc/a
    assert m.resolve("enc/a/b") == (F16, "enc/a")


def test_root_path_resolves_to_the_default_and_is_no_ancestor():
    m = jp.DTypePolicyMap(F32, {"": BF16})
    assert m[""] == BF16
    assert m["Dense_0"] == F32
    assert jp.DTypePolicyMap(F16)[""] == F16


def test_resolve_rejects_non_string_paths():
    with pytest.raises(TypeError, match="module path must be a string"):
        jp.DTypePolicyMap()[("a", "b")]


def test_literal_prefix_index_does_not_miss_matches():
    keys = {
        "a+b/.*": BF16,  # "+" keeps the "a"
        "xy*z": F16,  # "*" makes the "y" optional
        "(?i)upper": F32,
        "p|q/.*": INT8,  # alternation: no prefix
        r"dot\.ted": jp.DTypePolicy("mixed_float16"),
    }
    m = jp.DTypePolicyMap("float64", keys)
    assert m["aab/c"] == BF16
    assert m["xz"] == F16
    assert m["xyyz"] == F16
    assert m["UPPER"] == F32
    assert m["q/r"] == INT8
    assert m["p"] == INT8
    assert m["dot.ted"] == jp.DTypePolicy("mixed_float16")
    assert m["dotxted"] == jp.DTypePolicy("float64")


def test_regex_resolution_agrees_with_brute_force_on_many_paths():
    rng = np.random.default_rng(0)
    keys = {f"block_{i}/(mlp|attn)/.*": F16 for i in range(0, 40, 3)}
    keys.update({f".*/proj_{i}": BF16 for i in range(5)})
    m = jp.DTypePolicyMap(F32, keys)
    compiled = {k: re.compile(k) for k in keys}
    for _ in range(300):
        parts = [f"block_{rng.integers(40)}", rng.choice(["mlp", "attn", "norm"])]
        parts.append(f"proj_{rng.integers(8)}")
        path = "/".join(parts)
        expected = []
        p = path
        while p and not expected:
            expected = [k for k, r in compiled.items() if r.fullmatch(p)]
            p = p.rpartition("/")[0]
        if len(expected) > 1:
            with pytest.raises(ValueError, match="matches multiple"):
                m[path]
        else:
            assert m[path] == (keys[expected[0]] if expected else F32), path


# -- serialization ---------------------------------------------------------------------------


def test_serialization_round_trip_keeps_default_and_every_key():
    m = jp.DTypePolicyMap("mixed_bfloat16", {"layer/dense_0": "mixed_bfloat16"})
    m["layer/dense_1"] = INT8
    m["enc/.*"] = jp.QuantizedFloat8DTypePolicy("float8", "mixed_bfloat16", 16)
    config = jp.serialize(m)
    assert json.loads(json.dumps(config)) == config
    reloaded = jp.deserialize(config)
    assert isinstance(reloaded, jp.DTypePolicyMap)
    assert reloaded.default_policy == m.default_policy
    assert list(reloaded.items()) == list(m.items())
    assert reloaded == m
    assert reloaded["enc/x"].amax_history_length == 16


def test_from_config_does_not_mutate_its_config():
    m = jp.DTypePolicyMap(None, {"a": "bfloat16", "b/.*": INT8})
    config = m.get_config()
    original = copy.deepcopy(config)
    jp.DTypePolicyMap.from_config(config)
    jp.deserialize({"class_name": "DTypePolicyMap", "config": config})
    assert config == original
    assert jp.DTypePolicyMap.from_config(config) == m


def test_reads_keras_3_map_config():
    keras_config = {
        "module": "keras.dtype_policies",
        "class_name": "DTypePolicyMap",
        "config": {
            "default_policy": "mixed_bfloat16",
            "policy_map": {
                "a/b": {
                    "module": "keras",
                    "class_name": "DTypePolicy",
                    "config": {"name": "bfloat16"},
                    "registered_name": None,
                },
                "c/.*": {
                    "module": "keras.dtype_policies",
                    "class_name": "QuantizedDTypePolicy",
                    "config": {"mode": "int8", "source_name": "mixed_bfloat16"},
                    "registered_name": None,
                },
            },
        },
        "registered_name": None,
    }
    original = copy.deepcopy(keras_config)
    m = jp.deserialize(keras_config)
    assert keras_config == original
    assert m["a/b"] == BF16
    assert m["c/d"] == INT8
    assert m["other"] == jp.DTypePolicy("mixed_bfloat16")


def test_keras_map_config_without_default_defers_to_the_global_policy_on_loading():
    # Keras writes nameless policies when the map has no default policy.
    keras_config = {
        "class_name": "DTypePolicyMap",
        "config": {
            "default_policy": None,
            "policy_map": {"x": {"class_name": "DTypePolicy", "config": {"name": None}}},
        },
    }
    jp.set_dtype_policy("bfloat16")
    m = jp.deserialize(keras_config)
    assert m["x"] == BF16
    assert m["y"] == BF16


def test_from_config_rejects_unknown_fields():
    with pytest.raises(ValueError, match=r"Unknown field 'policies' in a DTypePolicyMap"):
        jp.DTypePolicyMap.from_config({"policies": {}})


def test_repr_lists_default_and_mapping():
    m = jp.DTypePolicyMap()
    m["layer/dense_0"] = jp.DTypePolicy("mixed_bfloat16")
    text = repr(m)
    assert "DTypePolicyMap" in text
    assert "default_policy=None" in text
    assert "mapping=[('layer/dense_0', 'mixed_bfloat16')]" in text


def test_map_is_not_hashable_but_compares_by_content():
    a = jp.DTypePolicyMap(F32, {"x": BF16})
    b = jp.DTypePolicyMap("float32", {"x": "bfloat16"})
    assert a == b
    assert a != jp.DTypePolicyMap(F32, {"x": F16})
    with pytest.raises(TypeError):
        hash(a)


# -- tree methods ---------------------------------------------------------------------------


def _params():
    return {
        "embed": {"embedding": jnp.ones((10, 4))},
        "encoder": {
            "layers_0": {"mlp": {"kernel": jnp.ones((4, 4)), "bias": jnp.zeros(4)}},
            "norm": {"scale": jnp.ones(4)},
        },
        "head": {"kernel": np.ones((4, 2), np.float32), "count": jnp.array(3)},
    }


def test_policy_tree_resolves_each_leaf_by_its_path():
    tree = _unambiguous_map().policy_tree(_params())
    assert tree["embed"]["embedding"] == jp.DTypePolicy("mixed_bfloat16")
    assert tree["encoder"]["layers_0"]["mlp"]["kernel"] == jp.DTypePolicy("mixed_float16")
    assert tree["head"]["count"] == F32


def test_tree_methods_report_ambiguous_paths():
    m = jp.DTypePolicyMap("mixed_bfloat16", {"encoder/.*": "mixed_float16", ".*norm.*": "float32"})
    with pytest.raises(ValueError, match="'encoder/norm' matches multiple"):
        m.cast_to_compute({"encoder": {"norm": {"scale": jnp.ones(2)}}})


def _unambiguous_map():
    return jp.DTypePolicyMap(
        "mixed_bfloat16",
        {"encoder/layers_.*": "mixed_float16", ".*norm": "float32", "head": "float32"},
    )


def test_cast_to_compute_casts_each_leaf_by_its_module_policy(maybe_jit):
    m = _unambiguous_map()
    params = _params()
    cast = maybe_jit(m.cast_to_compute)(params)
    assert cast["embed"]["embedding"].dtype == jnp.bfloat16
    assert cast["encoder"]["layers_0"]["mlp"]["kernel"].dtype == jnp.float16
    assert cast["encoder"]["layers_0"]["mlp"]["bias"].dtype == jnp.float16
    assert cast["encoder"]["norm"]["scale"].dtype == jnp.float32
    assert cast["head"]["kernel"].dtype == jnp.float32
    assert cast["head"]["count"].dtype == jnp.int32
    np.testing.assert_array_equal(cast["embed"]["embedding"], np.ones((10, 4)))


def test_cast_keeps_identity_and_numpy_type_of_untouched_leaves():
    m = _unambiguous_map()
    params = _params()
    cast = m.cast_to_compute(params)
    assert cast["head"]["kernel"] is params["head"]["kernel"]
    assert cast["head"]["count"] is params["head"]["count"]
    assert cast["encoder"]["norm"]["scale"] is params["encoder"]["norm"]["scale"]
    bf = jp.DTypePolicyMap("bfloat16").cast_to_compute({"a": np.ones(2, np.float32)})
    assert isinstance(bf["a"], np.ndarray)
    assert bf["a"].dtype == jnp.bfloat16


def test_cast_to_variable_and_output_use_those_dtypes(maybe_jit):
    m = jp.DTypePolicyMap("p=bf16,c=f32,o=f16", {"x": "float32"})
    tree = {"x": {"w": jnp.ones(2)}, "y": {"w": jnp.ones(2)}}
    assert maybe_jit(m.cast_to_variable)(tree)["y"]["w"].dtype == jnp.bfloat16
    assert maybe_jit(m.cast_to_param)(tree)["x"]["w"].dtype == jnp.float32
    assert maybe_jit(m.cast_to_output)(tree)["y"]["w"].dtype == jnp.float16


def test_variable_key_overrides_its_module_policy():
    m = jp.DTypePolicyMap("mixed_bfloat16", {"embed/embedding": "float32"})
    params = {"embed": {"embedding": jnp.ones((3, 2)), "other": jnp.ones(2)}}
    cast = m.cast_to_compute(params)
    assert cast["embed"]["embedding"].dtype == jnp.float32
    assert cast["embed"]["other"].dtype == jnp.bfloat16
    assert m["embed"] == jp.DTypePolicy("mixed_bfloat16")


def test_tree_paths_with_integers_and_nnx_value_suffix():
    class Box:
        def __init__(self, value):
            self.value = value

    jax.tree_util.register_dataclass(Box, data_fields=["value"], meta_fields=[])
    m = jp.DTypePolicyMap("float32", {"layers/1": "bfloat16"})
    tree = {"layers": [{"kernel": Box(jnp.ones(2))}, {"kernel": Box(jnp.ones(2))}]}
    cast = m.cast_to_compute(tree)
    assert cast["layers"][0]["kernel"].value.dtype == jnp.float32
    assert cast["layers"][1]["kernel"].value.dtype == jnp.bfloat16
    assert m.unused_keys(tree) == []


def test_gradients_through_map_cast_come_back_in_the_stored_dtype():
    m = _unambiguous_map()

    def loss(params):
        cast = m.cast_to_compute(params)
        return sum(jnp.sum(x.astype(jnp.float32)) for x in jax.tree.leaves(cast))

    params = {k: v for k, v in _params().items() if k != "head"}
    grads = jax.grad(loss)(params)
    assert jax.tree.map(lambda g: g.dtype, grads) == jax.tree.map(lambda p: p.dtype, params)


def test_unused_keys_finds_typos_and_shadowed_keys():
    m = jp.DTypePolicyMap(
        None,
        {"Dense_0": "bfloat16", "Dnse_1": "bfloat16", "enc/.*": "float16", "enc/x": "float32"},
    )
    tree = {"Dense_0": {"kernel": jnp.ones(1)}, "enc": {"x": {"kernel": jnp.ones(1)}}}
    # "enc/.*" names only "enc/x" (won by the exact key) and "enc/x/kernel" (inherits).
    assert m.unused_keys(tree) == ["Dnse_1", "enc/.*"]
    tree["enc"]["y"] = {"kernel": jnp.ones(1)}
    assert m.unused_keys(tree) == ["Dnse_1"]


def test_explain_lists_path_policy_key_dtypes_and_bytes():
    m = jp.DTypePolicyMap("float32", {"encoder/.*": "mixed_bfloat16", "embed/embedding": "float16"})
    tree = {
        "encoder": {"mlp": {"kernel": jnp.ones((4, 4)), "bias": jnp.ones(4)}},
        "embed": {"embedding": jnp.ones((2, 4)), "pos": jnp.ones(4)},
        "head": {"kernel": jnp.ones((4, 2)), "steps": jnp.zeros((), jnp.int32)},
    }
    lines = m.explain(tree).splitlines()
    assert lines[0].split() == ["path", "policy", "source", "dtype", "bytes", "c.bytes"]
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    assert rows["encoder/mlp"] == [
        "encoder/mlp",
        "mixed_bfloat16",
        "key",
        "'encoder/.*'",
        "f32→bf16",
        "80",
        "40",
    ]
    assert rows["embed/embedding"] == [
        "embed/embedding",
        "float16",
        "key",
        "'embed/embedding'",
        "f32→f16",
        "32",
        "16",
    ]
    assert rows["embed"] == ["embed", "float32", "default", "f32", "16", "16"]
    assert rows["head"] == ["head", "float32", "default", "f32,i32", "36", "36"]
    assert rows["total"] == ["total", "164", "108"]


def test_module_pattern_does_not_capture_the_variables_of_an_exact_key():
    m = jp.DTypePolicyMap(F32, {"enc/.*": BF16, "enc/head": F16})
    tree = {"enc": {"head": {"kernel": jnp.ones(2)}, "mlp": {"kernel": jnp.ones(2)}}}
    cast = m.cast_to_compute(tree)
    assert cast["enc"]["head"]["kernel"].dtype == jnp.float16
    assert cast["enc"]["mlp"]["kernel"].dtype == jnp.bfloat16


def test_variable_pattern_names_variables_by_their_name():
    m = jp.DTypePolicyMap("mixed_bfloat16", {".*/embedding": "float32", "enc/.*": "float16"})
    tree = {
        "tok": {"embedding": jnp.ones(2), "bias": jnp.ones(2)},
        "enc": {"pos": {"embedding": jnp.ones(2), "kernel": jnp.ones(2)}},
    }
    policies = m.policy_tree(tree)
    assert policies["tok"]["embedding"] == F32
    assert policies["tok"]["bias"] == jp.DTypePolicy("mixed_bfloat16")
    assert policies["enc"]["pos"]["kernel"] == F16
    # "enc/.*" names enc's modules; ".*/embedding" names the variable itself and wins.
    assert policies["enc"]["pos"]["embedding"] == F32
    assert m.cast_to_compute(tree)["enc"]["pos"]["embedding"].dtype == jnp.float32
    # Two variable patterns naming one variable: Keras's ambiguity rule.
    m2 = jp.DTypePolicyMap(F32, {".*/embedding": BF16, "tok/emb.*": F16})
    with pytest.raises(ValueError, match="'tok/embedding' matches multiple"):
        m2.cast_to_compute(tree)


def test_tree_methods_walk_every_pytree_kind_like_jax():
    from flax.core import FrozenDict

    m = jp.DTypePolicyMap("float32", {"a/1": "bfloat16", "f/k": "float16", "t/0/w": "float16"})
    tree = {
        "a": [jnp.ones(1), jnp.ones(1)],
        "f": FrozenDict({"k": {"w": jnp.ones(1)}, "j": jnp.ones(1)}),
        "t": ({"w": jnp.ones(1)},),
        "n": None,
        "s": "text",
    }
    cast = m.cast_to_compute(tree)
    assert jax.tree.structure(cast) == jax.tree.structure(tree)
    assert cast["a"][0].dtype == jnp.float32
    assert cast["a"][1].dtype == jnp.bfloat16
    assert cast["f"]["k"]["w"].dtype == jnp.float16
    assert cast["f"]["j"].dtype == jnp.float32
    assert cast["t"][0]["w"].dtype == jnp.float16
    assert cast["n"] is None
    assert cast["s"] == "text"
    # The module path and variable name of each leaf, as the map sees them.
    paths = [leaf[:2] for leaf in leaves(tree)[0]]
    assert sorted(paths) == sorted(
        [("a", "0"), ("a", "1"), ("f", "j"), ("f/k", "w"), ("t/0", "w"), ("", "s")]
    )


def test_readme_disjoint_patterns_keep_norms_in_float32():
    m = jp.DTypePolicyMap("float32", {"encoder/(?!.*norm).*": BF16, ".*norm.*": F32})
    assert m["encoder/layers_0/mlp"] == BF16
    assert m["encoder/layers_0/norm"] == F32
    assert m["decoder/final_norm"] == F32
    assert m["encoder/layers_0/mlp/kernel"] == BF16


# -- the package ------------------------------------------------------------------------------


def test_package_modules_each_hold_one_concept_and_stay_small():
    import ast
    import pathlib

    import jmp_policy._src.policy_map as package
    from jmp_policy._src.policy_map import (  # noqa: F401  the names the Flax glue imports
        DTypePolicyMap,
        leaf_path,
        parent_path,
    )

    files = sorted(pathlib.Path(package.__file__).parent.glob("*.py"))
    assert [f.name for f in files] == [
        "__init__.py",
        "_config.py",
        "_index.py",
        "_mapping.py",
        "_matching.py",
        "_trees.py",
        "_values.py",
    ]
    for f in files:
        text = f.read_text()
        assert len(text.splitlines()) <= 350, f.name
        assert ast.get_docstring(ast.parse(text)), f.name
        assert "flax" not in text.replace("Flax glue", ""), f.name
