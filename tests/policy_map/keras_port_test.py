"""Keras 3's own DTypePolicyMap tests, ported: only the imports changed.

From keras-team/keras, keras/src/dtype_policies/dtype_policy_map_test.py (Keras 3.15,
Apache License 2.0, Copyright The Keras Authors). Left out: ``test_basic_usage`` (it
builds and saves a Keras model). The second half of ``test_default_policy`` checks a
difference this library keeps on purpose; it is rewritten as
``test_default_policy_none_keeps_entry_names_kept_difference``. ``testing.TestCase`` is
``unittest.TestCase`` with Keras's ``assertLen``.
"""

import unittest

import jmp_policy as dtype_policies
from jmp_policy import DTypePolicyMap, dtype_policy, set_dtype_policy


class _TestCase(unittest.TestCase):
    def assertLen(self, container, expected):
        self.assertEqual(len(container), expected)


class testing:
    TestCase = _TestCase


class DTypePolicyMapTest(testing.TestCase):
    def setUp(self):
        super().setUp()
        self._global_dtype_policy = dtype_policy()

    def tearDown(self):
        super().tearDown()
        set_dtype_policy(self._global_dtype_policy)

    def test_add(self):
        dtype_policy_map = DTypePolicyMap()
        dtype_policy_map["layer/dense_0"] = dtype_policies.DTypePolicy("bfloat16")
        dtype_policy_map["layer/dense_1"] = dtype_policies.QuantizedDTypePolicy(
            "int8", "mixed_bfloat16"
        )
        dtype_policy_map["layer/dense_2"] = dtype_policies.QuantizedFloat8DTypePolicy(
            "float8", "mixed_float16"
        )

        self.assertLen(dtype_policy_map, 3)

        policy = dtype_policy_map["layer/dense_0"]
        self.assertIsInstance(policy, dtype_policies.DTypePolicy)
        self.assertEqual(policy.name, "bfloat16")

        policy = dtype_policy_map["layer/dense_1"]
        self.assertIsInstance(policy, dtype_policies.QuantizedDTypePolicy)
        self.assertEqual(policy._source_name, "mixed_bfloat16")
        self.assertEqual(policy.quantization_mode, "int8")

        policy = dtype_policy_map["layer/dense_2"]
        self.assertIsInstance(policy, dtype_policies.QuantizedFloat8DTypePolicy)
        self.assertEqual(policy._source_name, "mixed_float16")
        self.assertEqual(policy.quantization_mode, "float8")

        with self.assertRaisesRegex(
            ValueError, r"^layer/dense_0 already exist in the DTypePolicyMap"
        ):
            dtype_policy_map["layer/dense_0"] = dtype_policies.DTypePolicy("float32")

        with self.assertRaisesRegex(ValueError, "Cannot interpret the assigned value."):
            dtype_policy_map["layer/dense_3"] = 123

    def test_get(self):
        # 1. Setup
        bfloat16_policy = dtype_policies.DTypePolicy("bfloat16")
        int8_policy = dtype_policies.QuantizedDTypePolicy("int8", "mixed_bfloat16")
        float32_policy = dtype_policies.DTypePolicy("float32")
        float16_policy = dtype_policies.DTypePolicy("float16")

        policy_map = DTypePolicyMap()
        # Policy for an exact layer path
        policy_map["model/encoder/layer_0/dense"] = bfloat16_policy
        # Policy for a layer that is also a prefix of another layer's name
        policy_map["model/encoder/attention/query"] = int8_policy
        # Regex policies for entire scopes MUST include wildcards
        policy_map["model/decoder/.*"] = float32_policy
        policy_map["model/decoder/attention/.*"] = float16_policy

        # 2. Test exact match
        self.assertEqual(policy_map["model/encoder/layer_0/dense"], bfloat16_policy)
        self.assertEqual(policy_map["model/encoder/attention/query"], int8_policy)

        # 3. Test successful regex fallback (explicit wildcard)
        # "model/decoder/.*" should match its children.
        self.assertEqual(policy_map["model/decoder/layer_0"], float32_policy)

        # 4. Test that partial matches are ignored
        # The exact key "model/encoder/attention/query" should not match
        # "model/encoder/attention/query_norm" without a wildcard.
        self.assertEqual(
            policy_map["model/encoder/attention/query_norm"],
            policy_map.default_policy,
        )
        # A plain key "model/decoder" will not match "model/decoder/layer_0"
        policy_map["model/decoder"] = bfloat16_policy  # Add exact key
        self.assertEqual(policy_map["model/decoder/layer_0"], float32_policy)
        # Still matches the more general regex
        self.assertEqual(policy_map["model/decoder"], bfloat16_policy)

        # 5. Test no match
        self.assertEqual(policy_map["model/embedding"], policy_map.default_policy)

        # 6. Test multiple regex matches causing a ValueError
        # "model/decoder/attention/output" matches two regex patterns:
        # - "model/decoder/.*"
        # - "model/decoder/attention/.*"
        with self.assertRaisesRegex(
            ValueError,
            "Path 'model/decoder/attention/output' matches multiple dtype policy",
        ):
            _ = policy_map["model/decoder/attention/output"]

    def test_delete(self):
        dtype_policy_map = DTypePolicyMap()
        dtype_policy_map["layer/dense_0"] = dtype_policies.DTypePolicy("bfloat16")
        dtype_policy_map["layer/dense_1"] = dtype_policies.QuantizedDTypePolicy(
            "int8", "mixed_bfloat16"
        )

        self.assertEqual(
            dtype_policy_map.pop("layer/dense_0"),
            dtype_policies.DTypePolicy("bfloat16"),
        )
        with self.assertRaises(KeyError):
            dtype_policy_map.pop("layer/dense_0")

        # Test `del`, causing no hit
        del dtype_policy_map["layer/dense_1"]
        self.assertEqual(dtype_policy_map["layer/dense_1"], dtype_policy_map.default_policy)

        self.assertLen(dtype_policy_map, 0)

    def test_len(self):
        dtype_policy_map = DTypePolicyMap()
        self.assertLen(dtype_policy_map, 0)

        dtype_policy_map["layer/dense_0"] = dtype_policies.DTypePolicy("bfloat16")
        dtype_policy_map["layer/dense_1"] = dtype_policies.QuantizedDTypePolicy(
            "int8", "mixed_bfloat16"
        )
        self.assertLen(dtype_policy_map, 2)

    def test_iter(self):
        dtype_policy_map = DTypePolicyMap()
        dtype_policy_map["layer/dense_0"] = dtype_policies.DTypePolicy("bfloat16")
        dtype_policy_map["layer/dense_1"] = dtype_policies.QuantizedDTypePolicy(
            "int8", "mixed_bfloat16"
        )

        self.assertEqual(list(dtype_policy_map.keys()), ["layer/dense_0", "layer/dense_1"])

        keys = []
        values = []
        for k, v in dtype_policy_map.items():
            keys.append(k)
            values.append(v)
        self.assertEqual(keys, ["layer/dense_0", "layer/dense_1"])
        self.assertEqual(
            values,
            [
                dtype_policies.DTypePolicy("bfloat16"),
                dtype_policies.QuantizedDTypePolicy("int8", "mixed_bfloat16"),
            ],
        )

    def test_in(self):
        dtype_policy_map = DTypePolicyMap()
        dtype_policy_map["layer/dense_0"] = dtype_policies.DTypePolicy("bfloat16")
        dtype_policy_map["layer/dense_1"] = dtype_policies.QuantizedDTypePolicy(
            "int8", "mixed_bfloat16"
        )

        self.assertTrue("layer/dense_0" in dtype_policy_map)
        self.assertTrue("layer/dense_1" in dtype_policy_map)
        self.assertFalse("layer/dense_2" in dtype_policy_map)

    def test_default_policy(self):
        # Test default_policy is set to `"float32"`
        dtype_policy_map = DTypePolicyMap(default_policy="mixed_bfloat16")
        dtype_policy_map["layer/dense_0"] = dtype_policies.DTypePolicy("mixed_bfloat16")
        dtype_policy_map["layer/dense_1"] = dtype_policies.QuantizedDTypePolicy(
            "int8", "mixed_bfloat16"
        )
        config = dtype_policy_map.get_config()
        dtype_policy_map = DTypePolicyMap.from_config(config)
        self.assertEqual(
            dtype_policy_map["layer/dense_0"],
            dtype_policies.DTypePolicy("mixed_bfloat16"),
        )
        self.assertEqual(
            dtype_policy_map["layer/dense_1"],
            dtype_policies.QuantizedDTypePolicy("int8", "mixed_bfloat16"),
        )
        # No hit, defers to `dtype_policy_map.default_policy`
        self.assertEqual(dtype_policy_map["layer/dense_2"], dtype_policy_map.default_policy)

    def test_default_policy_none_keeps_entry_names_kept_difference(self):
        # Keras's second half of test_default_policy: Keras writes the entries of a
        # `default_policy=None` map without names (they follow the global policy when
        # loaded). A difference kept on purpose (DESIGN.md, README "Names that work
        # here"): our configs keep the entries' names; the default still follows the
        # global policy at lookup time.
        set_dtype_policy("bfloat16")
        dtype_policy_map = DTypePolicyMap()
        dtype_policy_map["layer/dense_0"] = dtype_policies.DTypePolicy("mixed_bfloat16")
        dtype_policy_map["layer/dense_1"] = dtype_policies.QuantizedDTypePolicy(
            "int8", "mixed_bfloat16"
        )
        config = dtype_policy_map.get_config()
        dtype_policy_map = DTypePolicyMap.from_config(config)
        self.assertEqual(
            dtype_policy_map["layer/dense_0"],
            dtype_policies.DTypePolicy("mixed_bfloat16"),
        )
        self.assertEqual(
            dtype_policy_map["layer/dense_1"],
            dtype_policies.QuantizedDTypePolicy("int8", "mixed_bfloat16"),
        )
        self.assertEqual(dtype_policy_map["layer/dense_2"], dtype_policy_map.default_policy)
        self.assertEqual(dtype_policy_map["layer/dense_2"], dtype_policies.get("bfloat16"))

    def test_serialization(self):
        dtype_policy_map = DTypePolicyMap(default_policy="mixed_bfloat16")
        dtype_policy_map["layer/dense_0"] = dtype_policies.DTypePolicy("mixed_bfloat16")
        dtype_policy_map["layer/dense_1"] = dtype_policies.QuantizedDTypePolicy(
            "int8", "mixed_bfloat16"
        )

        config = dtype_policies.serialize(dtype_policy_map)
        reloaded_dtype_policy_map = dtype_policies.deserialize(config)
        self.assertEqual(
            dtype_policy_map.default_policy,
            reloaded_dtype_policy_map.default_policy,
        )
        for k, v in dtype_policy_map.items():
            self.assertEqual(reloaded_dtype_policy_map[k], v)

        # Test that config remains intact during deserialization
        config = dtype_policy_map.get_config()
        original_config = config.copy()
        DTypePolicyMap.from_config(config)
        self.assertDictEqual(config, original_config)

    def test_repr(self):
        dtype_policy_map = DTypePolicyMap()
        dtype_policy_map["layer/dense_0"] = dtype_policies.DTypePolicy("mixed_bfloat16")
        repr_str = repr(dtype_policy_map)
        self.assertTrue("DTypePolicyMap" in repr_str)
        self.assertTrue("default_policy" in repr_str)
        self.assertTrue("mapping=[('layer/dense_0', 'mixed_bfloat16')]" in repr_str)

    def test_invalid_policy_map(self):
        with self.assertRaisesRegex(TypeError, "If specified, `policy_map` must be a dict."):
            DTypePolicyMap(policy_map=123)

        with self.assertRaisesRegex(TypeError, "If specified, `policy_map` must be a dict."):
            DTypePolicyMap(policy_map=dtype_policies.DTypePolicy("mixed_bfloat16"))
