"""Policies: names, dtypes, quantized policies, validation, value semantics, derivation."""

import copy
import pickle
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jmp_policy as jp

F16, BF16, F32, F64 = (np.dtype(d) for d in ("float16", ml_dtypes.bfloat16, "float32", "float64"))
FLOATS = {"float16": F16, "bfloat16": BF16, "float32": F32, "float64": F64}
FLOAT_CLASSES = [jp.DTypePolicy, jp.FloatDTypePolicy, jp.Policy]


def dtypes_of(policy):
    return (policy.variable_dtype, policy.compute_dtype, policy.output_dtype)


# -- names ------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", FLOAT_CLASSES)
@pytest.mark.parametrize("name", sorted(FLOATS))
def test_float_dtype_name_sets_all_three_dtypes(cls, name):
    policy = cls(name)
    assert dtypes_of(policy) == (FLOATS[name],) * 3
    assert policy.name == name
    assert policy.quantization_mode is None


@pytest.mark.parametrize("cls", FLOAT_CLASSES)
@pytest.mark.parametrize(("name", "compute"), [("mixed_float16", F16), ("mixed_bfloat16", BF16)])
def test_mixed_name_keeps_variables_in_float32_and_output_in_compute(cls, name, compute):
    policy = cls(name)
    assert policy.variable_dtype == F32
    assert policy.param_dtype == F32
    assert policy.compute_dtype == compute
    assert policy.output_dtype == compute
    assert policy.name == name


def test_dtypes_are_numpy_dtypes_comparing_equal_to_names():
    policy = jp.DTypePolicy("mixed_bfloat16")
    for dtype in dtypes_of(policy):
        assert isinstance(dtype, np.dtype)
    assert policy.compute_dtype == "bfloat16"
    assert policy.variable_dtype == "float32"
    assert policy.compute_dtype == jnp.bfloat16


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        # jmp's default rules: params float32, compute follows params, output follows compute.
        ("c=f16", (F32, F16, F16)),
        ("c=bf16,o=full", (F32, BF16, F32)),
        ("p=bf16", (BF16, BF16, BF16)),
        ("p=f16,c=bf16", (F16, BF16, BF16)),
        ("p=f32,c=bf16,o=f32", (F32, BF16, F32)),
        ("o=f16", (F32, F32, F16)),
        ("params=float32,compute=bfloat16,output=float16", (F32, BF16, F16)),
        ("params=f64,compute=float64", (F64, F64, F64)),
        ("compute=half", (F32, BF16, BF16)),
        ("o=half,c=full,p=f16", (F16, F32, BF16)),
        ("p = f32 , c = bf16", (F32, BF16, BF16)),
        # One jmp value alone: all three dtypes.
        ("f16", (F16,) * 3),
        ("bf16", (BF16,) * 3),
        ("f32", (F32,) * 3),
        ("full", (F32,) * 3),
        ("f64", (F64,) * 3),
        ("half", (BF16,) * 3),
    ],
)
def test_jmp_string_follows_jmp_default_rules(name, expected):
    assert dtypes_of(jp.get_policy(name)) == expected
    assert dtypes_of(jp.DTypePolicy(name)) == expected


@pytest.mark.parametrize(
    ("value", "dtype"),
    [
        ("bf16", BF16),
        ("bfloat16", BF16),
        ("f16", F16),
        ("float16", F16),
        ("f32", F32),
        ("float32", F32),
        ("full", F32),
        ("f64", F64),
        ("float64", F64),
        ("half", BF16),
    ],
)
@pytest.mark.parametrize(
    ("params_key", "compute_key", "output_key"),
    [("p", "c", "o"), ("params", "compute", "output")],
)
def test_jmp_string_accepts_every_key_and_value_alias(
    value, dtype, params_key, compute_key, output_key
):
    assert jp.get_policy(f"{params_key}={value}").param_dtype == dtype
    assert jp.get_policy(f"{compute_key}={value}").compute_dtype == dtype
    assert jp.get_policy(f"{output_key}={value}").output_dtype == dtype


def test_half_is_bfloat16_whatever_the_device():
    # jmp makes `half` float16 off TPU; here it is always bfloat16.
    assert jax.devices()[0].platform == "cpu"
    assert dtypes_of(jp.get_policy("half")) == (BF16,) * 3
    assert jp.get_policy("c=half").compute_dtype == BF16


@pytest.mark.parametrize("name", ["int32", "int8", "uint8", "bool", "float8_e4m3fn"])
def test_other_dtype_name_makes_policy_of_that_dtype(name):
    policy = jp.DTypePolicy(name)
    assert dtypes_of(policy) == (np.dtype(jnp.dtype(name)),) * 3
    assert policy.name == name


def test_name_surrounding_whitespace_is_ignored():
    policy = jp.DTypePolicy("  mixed_bfloat16 ")
    assert policy.name == "mixed_bfloat16"
    assert policy == jp.DTypePolicy("mixed_bfloat16")


@pytest.mark.parametrize(
    "name",
    [
        "invalid_name",
        "",
        "   ",
        "mixed_float15",
        "mixed_bfloat15",
        "@mixed_float16!",
        "mixed_float16" * 100,
        "compute_float16",
        "float",
        "f4",  # numpy's type codes are not names
        "object",
        "str",
        "c=f17",
        "x=f32",
        "P=f32",
        "p=f32,",
        "p=f32,p=f16",
        "p=f32,params=f16",
        "c",
        "abc_from_def",
        "int7_from_mixed_bfloat16",
    ],
)
@pytest.mark.parametrize("cls", FLOAT_CLASSES)
def test_bad_name_raises_value_error_quoting_it_and_listing_forms(cls, name):
    with pytest.raises(ValueError, match="Cannot convert") as info:
        cls(name)
    message = str(info.value)
    assert repr(name) in message
    for form in ("mixed_float16", "mixed_bfloat16", "p=f32,c=bf16,o=f32", "int8_from_"):
        assert form in message


@pytest.mark.parametrize(
    ("name", "detail"),
    [
        ("compute_float16", "Unknown dtype"),  # jmp's phrase
        ("c=f17", "Unknown dtype 'f17'"),
        ("x=f32", "Unknown key 'x'"),
        ("p=f32,params=f16", "given twice"),
    ],
)
def test_bad_name_message_says_what_is_wrong(name, detail):
    with pytest.raises(ValueError, match=re.escape(detail)):
        jp.get_policy(name)


@pytest.mark.parametrize("cls", FLOAT_CLASSES)
def test_bad_name_message_has_tf_keras_phrase(cls):
    # tf.keras's policy_test matches "Cannot convert value abc to a mixed precision Policy."
    with pytest.raises(ValueError, match=r"Cannot convert value abc to a mixed precision Policy\."):
        cls("abc")


@pytest.mark.parametrize(
    "name",
    [
        "infer_float32_vars",
        "float16_with_float32_vars",
        "bfloat16_with_float32_vars",
        "int8_with_float32_vars",
    ],
)
def test_tf_keras_removed_float32_vars_names_say_they_were_removed(name):
    with pytest.raises(ValueError, match="Policies ending in '_float32_vars' have been removed"):
        jp.Policy(name)


def test_a_long_or_unprintable_bad_name_is_quoted_in_the_first_sentence():
    with pytest.raises(ValueError, match=r"Cannot convert value 'xxx.*\.\.\..*' to a"):
        jp.DTypePolicy("x" * 1000)
    with pytest.raises(ValueError, match=r"Cannot convert value 'a\\nb' to"):
        jp.DTypePolicy("a\nb")
    for invisible in ("", "   ", " abc "):  # spaces that would not show unquoted
        with pytest.raises(ValueError, match=f"Cannot convert value {invisible!r} to"):
            jp.DTypePolicy(invisible)


@pytest.mark.parametrize("name", ["ternary_from_float32", "int7_from_mixed_bfloat16"])
def test_an_unknown_quantization_mode_is_named_with_the_modes_there_are(name):
    with pytest.raises(ValueError, match=r"Unknown quantization mode '(ternary|int7)'") as info:
        jp.get(name)
    for form in ("'int8'", "'int4/<block>'", "'float8'", "'gptq/<weight_bits>/<group_size>'"):
        assert form in str(info.value)


@pytest.mark.parametrize(
    "name",
    ["int8_from_mixed_bfloat16", "int4/128_from_float32", "float8_current_from_mixed_bfloat16"],
)
def test_quantized_name_is_not_a_float_policy_name(name):
    with pytest.raises(ValueError, match=r"Cannot convert.*quantized name") as info:
        jp.DTypePolicy(name)
    assert "Unknown quantization mode" not in str(info.value)  # its mode is a known one


@pytest.mark.parametrize("name", [123, 1.5, None, b"float32", jnp.float32, np.dtype("float32")])
def test_get_policy_with_non_string_name_raises_type_error(name):
    with pytest.raises(TypeError, match="`name`: 'name' must be a string"):
        jp.get_policy(name)


@pytest.mark.parametrize("name", [123, b"float32", jnp.float32, ["float32"]])
@pytest.mark.parametrize("cls", FLOAT_CLASSES)
def test_non_string_name_raises_type_error(cls, name):
    with pytest.raises(TypeError, match="`name`: 'name' must be a string"):
        cls(name)


def test_get_policy_reads_quantized_names():
    policy = jp.get_policy("int8_from_mixed_bfloat16")
    assert type(policy) is jp.QuantizedDTypePolicy
    assert policy.name == "int8_from_mixed_bfloat16"


# -- DTypePolicy(None) follows the global policy ---------------------------------------------


@pytest.mark.parametrize(
    ("global_name", "expected"),
    [
        ("float32", (F32, F32, F32)),
        ("float16", (F16, F16, F16)),
        ("bfloat16", (BF16, BF16, BF16)),
        ("mixed_float16", (F32, F16, F16)),
        ("mixed_bfloat16", (F32, BF16, BF16)),
        ("p=f16,c=f32,o=bf16", (F16, F32, BF16)),
    ],
)
@pytest.mark.parametrize("cls", FLOAT_CLASSES)
def test_none_name_takes_global_policy_name(cls, global_name, expected):
    jp.set_dtype_policy(global_name)
    policy = cls(None)
    assert policy.name == global_name
    assert dtypes_of(policy) == expected
    assert dtypes_of(cls()) == expected


def test_none_name_follows_policy_scope():
    with jp.policy_scope("mixed_float16"):
        assert jp.DTypePolicy().name == "mixed_float16"
    assert jp.DTypePolicy().name == "float32"


@pytest.mark.parametrize(
    "global_policy",
    [
        "int8_from_mixed_bfloat16",
        "int4/128_from_mixed_bfloat16",
        "float8_from_mixed_bfloat16",
    ],
)
def test_none_name_under_quantized_global_takes_source_name(global_policy):
    jp.set_dtype_policy(global_policy)
    policy = jp.DTypePolicy(None)
    assert type(policy) is jp.DTypePolicy
    assert policy.name == "mixed_bfloat16"
    assert dtypes_of(policy) == (F32, BF16, BF16)


# -- quantized policies ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("float32", (F32, F32, F32)),
        ("bfloat16", (BF16, BF16, BF16)),
        ("mixed_bfloat16", (F32, BF16, BF16)),
        ("p=f32,c=bf16,o=f32", (F32, BF16, F32)),
    ],
)
def test_int8_policy_takes_dtypes_from_source(source, expected):
    policy = jp.QuantizedDTypePolicy("int8", source)
    assert policy.name == f"int8_from_{source}"
    assert dtypes_of(policy) == expected
    assert policy.quantization_mode == "int8"
    assert policy.mode == "int8"
    assert policy.block_size is None
    assert policy.source_name == source
    assert policy.source_policy == jp.DTypePolicy(source)
    assert repr(policy) == f'<QuantizedDTypePolicy "int8_from_{source}">'


@pytest.mark.parametrize(
    ("mode", "block"), [("int4", -1), ("int4/-1", -1), ("int4/128", 128), ("int4/1", 1)]
)
def test_int4_policy_parses_block_size(mode, block):
    policy = jp.QuantizedDTypePolicy(mode, "mixed_bfloat16")
    assert policy.quantization_mode == "int4"
    assert policy.mode == "int4"  # Keras's `mode`; the block is `block_size`
    assert policy.block_size == block
    assert policy.name == f"{mode}_from_mixed_bfloat16"
    assert dtypes_of(policy) == (F32, BF16, BF16)


@pytest.mark.parametrize("source", ["float32", "float16", "bfloat16", "mixed_float16"])
def test_int4_and_float8_accept_float16_compute(source):
    assert (
        jp.QuantizedDTypePolicy("int4", source).compute_dtype
        == jp.DTypePolicy(source).compute_dtype
    )
    policy = jp.QuantizedFloat8DTypePolicy("float8", source)
    assert policy.compute_dtype == jp.DTypePolicy(source).compute_dtype
    assert policy.name == f"float8_from_{source}"


@pytest.mark.parametrize(
    ("name", "cls", "mode"),
    [
        ("int8_from_mixed_bfloat16", jp.QuantizedDTypePolicy, "int8"),
        ("int4_from_float32", jp.QuantizedDTypePolicy, "int4"),
        ("int4/128_from_float32", jp.Int4DTypePolicy, "int4"),
        ("float8_from_mixed_bfloat16", jp.QuantizedFloat8DTypePolicy, "float8"),
        ("int8_from_p=f32,c=bf16,o=f32", jp.QuantizedDTypePolicy, "int8"),
    ],
)
def test_quantized_name_parses_to_its_class(name, cls, mode):
    policy = jp.get_policy(name)
    assert type(policy) is cls
    assert policy.name == name
    assert policy.quantization_mode == mode


def test_float8_policy_defaults():
    policy = jp.QuantizedFloat8DTypePolicy(source_name="mixed_bfloat16")
    assert policy.mode == "float8"
    assert policy.quantization_mode == "float8"
    assert policy.amax_history_length == 1024
    assert policy.name == "float8_from_mixed_bfloat16"
    assert repr(policy) == '<QuantizedFloat8DTypePolicy "float8_from_mixed_bfloat16">'
    assert jp.QuantizedFloat8DTypePolicy("float8", "float32", 1).amax_history_length == 1


@pytest.mark.parametrize("length", [1.0, 16.0, "16", None, True, False, np.array(16)])
def test_float8_non_int_history_length_raises_type_error(length):
    with pytest.raises(TypeError, match="`amax_history_length` must be an integer"):
        jp.QuantizedFloat8DTypePolicy("float8", "float32", length)


@pytest.mark.parametrize("length", [np.int64(16), np.int32(16), np.uint8(16)])
def test_float8_numpy_int_history_length_is_kept_as_an_int(length):
    policy = jp.QuantizedFloat8DTypePolicy("float8", "float32", length)
    assert policy.amax_history_length == 16 and type(policy.amax_history_length) is int
    assert policy.get_config()["amax_history_length"] == 16


@pytest.mark.parametrize("length", [0, -1, -1024])
def test_float8_history_length_below_one_raises_value_error(length):
    with pytest.raises(ValueError, match=f"amax_history_length={length}"):
        jp.QuantizedFloat8DTypePolicy("float8", "float32", length)


@pytest.mark.parametrize("source", ["float16", "mixed_float16", "c=f16", "p=bf16,c=f16"])
def test_int8_from_float16_compute_is_rejected(source):
    with pytest.raises(ValueError, match="doesn't work well") as info:
        jp.QuantizedDTypePolicy("int8", source)
    assert repr(source) in str(info.value)
    with pytest.raises(ValueError, match="doesn't work well"):
        jp.get(f"int8_from_{source}")


@pytest.mark.parametrize(
    "mode",
    [
        "int7",
        "float7",
        "int8/128",
        "int4/0",
        "int4/-2",
        "int4/x",
        "int4/ 128",
        "int4/+128",
        "INT8",
        "float8",
        "",
    ],
)
def test_quantized_policy_bad_mode_raises(mode):
    with pytest.raises(ValueError, match="Invalid quantization mode") as info:
        jp.QuantizedDTypePolicy(mode, "float32")
    assert repr(mode) in str(info.value)


@pytest.mark.parametrize("mode", ["int7", "int8", "int4", "float7"])
def test_float8_policy_bad_mode_raises(mode):
    with pytest.raises(ValueError, match="Invalid quantization mode"):
        jp.QuantizedFloat8DTypePolicy(mode, "float32")


def test_quantized_policy_non_string_mode_raises_type_error():
    with pytest.raises(TypeError, match="`mode` must be a string"):
        jp.QuantizedDTypePolicy(8, "float32")


@pytest.mark.parametrize("cls", [jp.QuantizedDTypePolicy, jp.QuantizedFloat8DTypePolicy])
def test_quantized_policy_non_string_source_raises_type_error(cls):
    mode = "float8" if cls is jp.QuantizedFloat8DTypePolicy else "int8"
    with pytest.raises(TypeError, match="`source_name`: 'name' must be a string"):
        cls(mode, 123)


@pytest.mark.parametrize(
    "source",
    [
        "abc",
        "",
        "def",
        "@int8_from_mixed_bfloat16!",
        "int8_from_mixed_bfloat16" * 100,
        "int7_from_mixed_bfloat16",
        "int8_from_float32",
        "mixed_bfloat15",
    ],
)
@pytest.mark.parametrize("cls", [jp.QuantizedDTypePolicy, jp.QuantizedFloat8DTypePolicy])
def test_quantized_policy_bad_source_raises_value_error(cls, source):
    mode = "float8" if cls is jp.QuantizedFloat8DTypePolicy else "int8"
    with pytest.raises(ValueError, match="Cannot convert"):
        cls(mode, source)


def test_quantized_policy_needs_floating_compute():
    with pytest.raises(ValueError, match="floating compute dtype"):
        jp.QuantizedDTypePolicy("int8", "int32")


@pytest.mark.parametrize("name", ["int8_from_", "int8_from_mixed_bfloat15", "float8_from_bogus"])
def test_get_policy_bad_quantized_name_raises(name):
    with pytest.raises(ValueError, match="Cannot convert"):
        jp.get_policy(name)


@pytest.mark.parametrize("cls", [jp.QuantizedDTypePolicy, jp.QuantizedFloat8DTypePolicy])
@pytest.mark.parametrize(
    ("global_name", "expected"),
    [("float32", (F32,) * 3), ("bfloat16", (BF16,) * 3), ("mixed_bfloat16", (F32, BF16, BF16))],
)
def test_quantized_policy_without_source_takes_global(cls, global_name, expected):
    jp.set_dtype_policy(global_name)
    mode = "float8" if cls is jp.QuantizedFloat8DTypePolicy else "int8"
    policy = cls(mode)
    assert policy.name == f"{mode}_from_{global_name}"
    assert policy.source_name == global_name
    assert dtypes_of(policy) == expected


def test_int8_without_source_under_float16_global_is_rejected():
    jp.set_dtype_policy("mixed_float16")
    with pytest.raises(ValueError, match="doesn't work well"):
        jp.QuantizedDTypePolicy("int8")


# -- value semantics -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "policy",
    [
        jp.DTypePolicy("mixed_bfloat16"),
        jp.Policy("float32"),
        jp.QuantizedDTypePolicy("int4/64", "mixed_bfloat16"),
        jp.QuantizedFloat8DTypePolicy("float8", "float32", 16),
    ],
    ids=repr,
)
@pytest.mark.parametrize(
    "attribute", ["name", "compute_dtype", "_compute_dtype", "_name", "new_attribute"]
)
def test_policy_is_frozen(policy, attribute):
    before = dtypes_of(policy)
    with pytest.raises(AttributeError):
        setattr(policy, attribute, "float16")
    with pytest.raises(AttributeError):
        delattr(policy, attribute)
    assert dtypes_of(policy) == before


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (jp.DTypePolicy("mixed_bfloat16"), jp.get_policy("p=f32,c=bf16,o=bf16")),
        (jp.DTypePolicy("mixed_bfloat16"), jp.get_policy("c=bf16")),
        (jp.DTypePolicy("mixed_float16"), jp.FloatDTypePolicy("mixed_float16")),
        (jp.DTypePolicy("mixed_float16"), jp.Policy("c=f16")),
        (jp.DTypePolicy("float32"), jp.Policy("full")),
        (jp.DTypePolicy("bfloat16"), jp.DTypePolicy("half")),
        (jp.DTypePolicy("float16"), jp.DTypePolicy("p=f16")),
        (jp.get("int8_from_mixed_bfloat16"), jp.get("int8_from_c=bf16")),
        (jp.get("int4_from_float32"), jp.get("int4/-1_from_f32")),
        (jp.get("float8_from_float32"), jp.QuantizedFloat8DTypePolicy("float8", "full", 1024)),
    ],
    ids=lambda p: p.name,
)
def test_policies_equal_by_value_whatever_names(a, b):
    assert a == b
    assert not a != b  # noqa: SIM202
    assert hash(a) == hash(b)
    assert {a: 1}[b] == 1
    assert len({a, b}) == 1


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (jp.DTypePolicy("mixed_bfloat16"), jp.DTypePolicy("mixed_float16")),
        (jp.DTypePolicy("mixed_bfloat16"), jp.DTypePolicy("p=f32,c=bf16,o=f32")),
        (jp.DTypePolicy("mixed_bfloat16"), jp.DTypePolicy("bfloat16")),
        (jp.DTypePolicy("mixed_bfloat16"), jp.get("int8_from_mixed_bfloat16")),
        (jp.get("int8_from_mixed_bfloat16"), jp.get("int4_from_mixed_bfloat16")),
        (jp.get("int4/128_from_float32"), jp.get("int4/64_from_float32")),
        (jp.get("int4/128_from_float32"), jp.get("int4_from_float32")),
        (jp.get("int8_from_float32"), jp.get("float8_from_float32")),
        (jp.get("int8_from_float32"), jp.get("int8_from_bfloat16")),
        (
            jp.QuantizedFloat8DTypePolicy("float8", "float32", 16),
            jp.QuantizedFloat8DTypePolicy("float8", "float32", 32),
        ),
    ],
    ids=lambda p: p.name,
)
def test_policies_differ_when_kind_or_dtypes_differ(a, b):
    assert a != b
    assert not a == b  # noqa: SIM201
    assert len({a, b}) == 2


@pytest.mark.parametrize(
    "policy",
    [jp.DTypePolicy("mixed_bfloat16"), jp.get("int8_from_mixed_bfloat16"), jp.Policy("float32")],
    ids=repr,
)
def test_policy_never_equals_a_string(policy):
    assert policy != policy.name
    assert policy.name != policy
    assert policy != str(policy)
    assert policy != "float32"
    assert policy is not None


def test_policy_is_usable_as_jit_static_argument():
    traces = []

    def f(x, policy):
        traces.append(policy)
        return policy.cast_to_compute(x) * 2

    g = jax.jit(f, static_argnums=1)
    x = jnp.ones(3)
    assert g(x, jp.DTypePolicy("mixed_bfloat16")).dtype == BF16
    # An equal policy with another name hits the cache: no retrace.
    assert g(x, jp.get_policy("p=f32,c=bf16,o=bf16")).dtype == BF16
    assert len(traces) == 1
    assert g(x, jp.DTypePolicy("mixed_float16")).dtype == F16
    assert len(traces) == 2


def test_policy_is_not_a_pytree():
    policy = jp.DTypePolicy("mixed_bfloat16")
    leaves = jax.tree.leaves({"p": policy})
    assert leaves == [policy]


@pytest.mark.parametrize(
    "policy",
    [
        jp.DTypePolicy("mixed_bfloat16"),
        jp.FloatDTypePolicy("c=f16"),
        jp.Policy("p=f16,c=f32,o=bf16"),
        jp.DTypePolicy("int32"),
        jp.QuantizedDTypePolicy("int8", "mixed_bfloat16"),
        jp.QuantizedDTypePolicy("int4/128", "float32"),
        jp.QuantizedFloat8DTypePolicy("float8", "mixed_bfloat16", 16),
    ],
    ids=repr,
)
@pytest.mark.parametrize("protocol", [0, pickle.HIGHEST_PROTOCOL])
def test_pickle_round_trip_keeps_class_name_and_value(policy, protocol):
    restored = pickle.loads(pickle.dumps(policy, protocol=protocol))
    assert type(restored) is type(policy)
    assert restored == policy
    assert restored.name == policy.name
    assert repr(restored) == repr(policy)
    assert dtypes_of(restored) == dtypes_of(policy)
    if isinstance(policy, jp.QuantizedDTypePolicy):
        assert restored.mode == policy.mode
        assert restored.block_size == policy.block_size
    if isinstance(policy, jp.QuantizedFloat8DTypePolicy):
        assert restored.amax_history_length == 16


def test_pickle_does_not_depend_on_global_policy():
    policy = jp.QuantizedDTypePolicy("int8", "mixed_bfloat16")
    data = pickle.dumps(policy)
    jp.set_dtype_policy("float16")
    assert pickle.loads(data) == policy


@pytest.mark.parametrize(
    "policy",
    [jp.DTypePolicy("mixed_bfloat16"), jp.QuantizedFloat8DTypePolicy("float8", "float32", 8)],
    ids=repr,
)
def test_copy_and_deepcopy_give_equal_policy(policy):
    for copied in (
        copy.copy(policy),
        copy.deepcopy(policy),
        copy.deepcopy({"p": [policy]})["p"][0],
    ):
        assert type(copied) is type(policy)
        assert copied == policy
        assert copied.name == policy.name


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        (jp.DTypePolicy("mixed_bfloat16"), '<DTypePolicy "mixed_bfloat16">'),
        (jp.DTypePolicy("float32"), '<DTypePolicy "float32">'),
        (jp.FloatDTypePolicy("mixed_float16"), '<DTypePolicy "mixed_float16">'),  # Keras's
        (jp.Policy("mixed_float16"), '<Policy "mixed_float16">'),
        (jp.DTypePolicy("c=f16"), '<DTypePolicy "c=f16">'),
        (
            jp.QuantizedDTypePolicy("int8", "mixed_bfloat16"),
            '<QuantizedDTypePolicy "int8_from_mixed_bfloat16">',
        ),
        (
            jp.QuantizedDTypePolicy("int4/128", "float32"),
            '<QuantizedDTypePolicy "int4/128_from_float32">',
        ),
        (
            jp.QuantizedFloat8DTypePolicy("float8", "mixed_bfloat16"),
            '<QuantizedFloat8DTypePolicy "float8_from_mixed_bfloat16">',
        ),
    ],
)
def test_repr_is_keras_style(policy, expected):
    assert repr(policy) == expected


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("mixed_bfloat16", "p=f32,c=bf16,o=bf16"),
        ("mixed_float16", "p=f32,c=f16,o=f16"),
        ("float32", "p=f32,c=f32,o=f32"),
        ("full", "p=f32,c=f32,o=f32"),
        ("float64", "p=f64,c=f64,o=f64"),
        ("c=bf16,o=full", "p=f32,c=bf16,o=f32"),
        ("int32", "p=int32,c=int32,o=int32"),
    ],
)
def test_str_is_jmp_short_form(name, expected):
    assert str(jp.DTypePolicy(name)) == expected


FLOAT_DTYPE_NAMES = ["float16", "bfloat16", "float32", "float64", "float8_e4m3fn", "float8_e5m2"]


@settings(max_examples=60, deadline=None, database=None)
@given(
    st.sampled_from(FLOAT_DTYPE_NAMES),
    st.sampled_from(FLOAT_DTYPE_NAMES),
    st.sampled_from(FLOAT_DTYPE_NAMES),
    st.sampled_from(FLOAT_CLASSES),
)
def test_str_reads_back_to_equal_policy(params, compute, output, cls):
    policy = cls(f"p={params},c={compute},o={output}")
    expected = tuple(np.dtype(jnp.dtype(d)) for d in (params, compute, output))
    assert dtypes_of(policy) == expected
    assert jp.get_policy(str(policy)) == policy
    assert cls(str(policy)) == policy
    assert hash(jp.get_policy(str(policy))) == hash(policy)


# -- derivation --------------------------------------------------------------------------------


def test_with_compute_dtype_changes_only_compute():
    policy = jp.DTypePolicy("mixed_bfloat16").with_compute_dtype("float16")
    assert dtypes_of(policy) == (F32, F16, BF16)
    assert str(policy) == "p=f32,c=f16,o=bf16"
    assert jp.get_policy(policy.name) == policy


def test_with_variable_dtype_changes_only_variables():
    policy = jp.DTypePolicy("mixed_bfloat16").with_variable_dtype(jnp.bfloat16)
    assert dtypes_of(policy) == (BF16, BF16, BF16)
    assert policy == jp.DTypePolicy("bfloat16")
    assert policy.name == "bfloat16"


def test_with_output_dtype_changes_only_output():
    policy = jp.DTypePolicy("mixed_bfloat16").with_output_dtype(np.float32)
    assert dtypes_of(policy) == (F32, BF16, F32)
    assert policy == jp.get_policy("p=f32,c=bf16,o=f32")


def test_with_dtype_gives_canonical_names():
    base = jp.DTypePolicy("float32")
    assert (
        base.with_compute_dtype("bfloat16").with_output_dtype("bfloat16").name == "mixed_bfloat16"
    )
    assert (
        base.with_compute_dtype(jnp.float16).with_output_dtype(jnp.float16).name == "mixed_float16"
    )
    assert base.with_output_dtype("float32").name == "float32"


def test_with_dtype_leaves_original_unchanged():
    policy = jp.DTypePolicy("mixed_bfloat16")
    policy.with_compute_dtype("float32")
    policy.with_variable_dtype("float16")
    policy.with_output_dtype("float64")
    assert dtypes_of(policy) == (F32, BF16, BF16)
    assert policy.name == "mixed_bfloat16"


def test_with_dtype_on_quantized_keeps_kind_and_mode():
    policy = jp.QuantizedDTypePolicy("int4/128", "mixed_bfloat16").with_output_dtype("float32")
    assert type(policy) is jp.QuantizedDTypePolicy
    assert (policy.mode, policy.block_size) == ("int4", 128)
    assert dtypes_of(policy) == (F32, BF16, F32)
    assert policy == jp.get("int4/128_from_p=f32,c=bf16,o=f32")
    f8 = jp.QuantizedFloat8DTypePolicy("float8", "float32", 16).with_compute_dtype("bfloat16")
    assert type(f8) is jp.QuantizedFloat8DTypePolicy
    assert f8.amax_history_length == 16
    assert f8.compute_dtype == BF16


def test_with_compute_float16_on_int8_is_rejected():
    with pytest.raises(ValueError, match="doesn't work well"):
        jp.QuantizedDTypePolicy("int8", "float32").with_compute_dtype("float16")


@pytest.mark.parametrize("dtype", ["bogus", None, object, "object", "str"])
@pytest.mark.parametrize(
    "method", ["with_compute_dtype", "with_variable_dtype", "with_output_dtype"]
)
def test_with_dtype_rejects_non_dtype(method, dtype):
    with pytest.raises(TypeError, match="`dtype` must be a numeric dtype") as info:
        getattr(jp.DTypePolicy("float32"), method)(dtype)
    assert repr(dtype) in str(info.value)


# --- jmp's constructor ---------------------------------------------------------------------


@pytest.mark.parametrize("cls", [jp.Policy, jp.DTypePolicy, jp.FloatDTypePolicy])
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32, np.float16])
def test_jmp_constructor_with_three_dtypes(cls, dtype):
    policy = cls(dtype, dtype, dtype)
    assert policy.param_dtype == policy.compute_dtype == policy.output_dtype == dtype
    assert jp.get_policy(str(policy)) == policy
    assert policy == cls(jnp.dtype(dtype).name)


def test_jmp_constructor_keywords_follow_jmps_defaults():
    p = jp.DTypePolicy(compute_dtype=jnp.bfloat16)
    assert (p.param_dtype, p.compute_dtype, p.output_dtype) == (
        jnp.float32,
        jnp.bfloat16,
        jnp.bfloat16,
    )
    assert p.name == "mixed_bfloat16"
    q = jp.Policy(param_dtype=jnp.float32, compute_dtype=jnp.float16, output_dtype=jnp.float32)
    assert str(q) == "p=f32,c=f16,o=f32"
    assert jp.DTypePolicy(variable_dtype="bfloat16").compute_dtype == jnp.bfloat16


def test_jmp_constructor_rejects_two_variable_dtypes_and_bad_dtypes():
    with pytest.raises(TypeError, match="Give the variable dtype once"):
        jp.DTypePolicy(jnp.float32, param_dtype=jnp.float32)
    with pytest.raises(TypeError, match=r"`compute_dtype` must be a numeric dtype.*'x'"):
        jp.DTypePolicy(jnp.float32, "x")
    with pytest.raises(TypeError, match="`output_dtype` must be a numeric dtype"):
        jp.DTypePolicy(jnp.float32, jnp.float32, object)


# -- Keras's and tf.keras's own classes and names ------------------------------------------


def test_float_dtype_policy_repr_is_keras():
    # Keras prints a FloatDTypePolicy under its first name.
    assert repr(jp.FloatDTypePolicy("mixed_float16")) == '<DTypePolicy "mixed_float16">'
    assert repr(jp.DTypePolicy("mixed_float16")) == '<DTypePolicy "mixed_float16">'
    assert repr(jp.Policy("mixed_float16")) == '<Policy "mixed_float16">'


def test_int4_dtype_policy_is_keras_class():
    policy = jp.Int4DTypePolicy(mode="int4", source_name="float32", block_size=128)
    assert type(policy) is jp.Int4DTypePolicy
    assert isinstance(policy, jp.QuantizedDTypePolicy)
    assert policy.mode == "int4"
    assert policy.quantization_mode == "int4"
    assert policy.block_size == 128
    assert policy.name == "int4/128_from_float32"
    assert repr(policy) == '<Int4DTypePolicy "int4/128_from_float32">'
    assert policy.get_config() == {"mode": "int4/128", "source_name": "float32"}
    assert dtypes_of(policy) == (F32, F32, F32)


def test_int4_dtype_policy_defaults_to_blocks_of_128():
    with jp.policy_scope("mixed_bfloat16"):
        policy = jp.Int4DTypePolicy()
    assert policy.block_size == 128
    assert policy.name == "int4/128_from_mixed_bfloat16"


@pytest.mark.parametrize(
    "make",
    [
        lambda: jp.QuantizedDTypePolicy("int4/128", "float32"),
        lambda: jp.Int4DTypePolicy("int4/128", "float32"),  # Keras 3's positional form
        lambda: jp.get("int4/128_from_float32"),
        lambda: jp.get("int4/128_from_p=f32"),
    ],
)
def test_int4_spellings_make_equal_policies(make):
    policy = make()
    expected = jp.Int4DTypePolicy("int4", "float32", 128)
    assert policy == expected
    assert hash(policy) == hash(expected)
    assert policy.mode == "int4"
    assert policy.block_size == 128


def test_get_int4_block_name_returns_int4_class():
    policy = jp.get("int4/128_from_float32")
    assert type(policy) is jp.Int4DTypePolicy
    assert policy.mode == "int4"
    assert policy.block_size == 128


@pytest.mark.parametrize(
    "make",
    [
        lambda: jp.get("int4/None_from_float32"),
        lambda: jp.QuantizedDTypePolicy("int4/None", "float32"),
        lambda: jp.Int4DTypePolicy("int4", "float32", block_size=None),
        lambda: jp.Int4DTypePolicy("int4", "float32", block_size=-1),
        lambda: jp.Int4DTypePolicy("int4/-1", "float32"),
    ],
)
def test_int4_legacy_none_block_and_minus_one_are_per_channel(make):
    policy = make()
    assert policy.block_size == -1
    assert policy.mode == "int4"
    assert policy == jp.QuantizedDTypePolicy("int4", "float32")
    assert policy.name == "int4/-1_from_float32"


def test_int4_dtype_policy_conflicting_block_sizes_raise():
    with pytest.raises(ValueError, match=r"`block_size`.*block_size=64.*mode='int4/32'"):
        jp.Int4DTypePolicy("int4/32", "float32", block_size=64)


@pytest.mark.parametrize("block", [0, -2])
def test_int4_dtype_policy_bad_block_size_raises_value_error(block):
    with pytest.raises(ValueError, match=rf"`block_size`.*-1.*Received: block_size={block}"):
        jp.Int4DTypePolicy("int4", "float32", block_size=block)


@pytest.mark.parametrize("block", [128.0, "128", True])
def test_int4_dtype_policy_non_int_block_size_raises_type_error(block):
    with pytest.raises(TypeError, match=r"`block_size` must be an integer"):
        jp.Int4DTypePolicy("int4", "float32", block_size=block)


@pytest.mark.parametrize("mode", ["int8", "float8", "int4/x"])
def test_int4_dtype_policy_other_mode_raises_value_error(mode):
    with pytest.raises(ValueError, match=r"mode"):
        jp.Int4DTypePolicy(mode, "float32")


@pytest.mark.parametrize(
    ("policy", "text"),
    [
        (jp.get("int8_from_mixed_bfloat16"), "int8_from_p=f32,c=bf16,o=bf16"),
        (jp.get("int4/128_from_float32"), "int4/128_from_p=f32,c=f32,o=f32"),
        (jp.get("int4_from_float32"), "int4_from_p=f32,c=f32,o=f32"),
        (jp.get("float8_from_mixed_bfloat16"), "float8_from_p=f32,c=bf16,o=bf16"),
    ],
    ids=repr,
)
def test_str_of_quantized_policy_keeps_mode_and_round_trips(policy, text):
    assert str(policy) == text
    assert jp.get(str(policy)) == policy
    assert jp.get_policy(str(policy)) == policy


# -- tf.keras's "_infer" ----------------------------------------------------------------------


@pytest.mark.parametrize("make", [jp.DTypePolicy, jp.Policy, jp.get, jp.get_policy])
def test_infer_policy_has_no_dtypes(make):
    policy = make("_infer")
    assert policy.name == "_infer"
    assert policy.compute_dtype is None
    assert policy.variable_dtype is None
    assert policy.param_dtype is None
    assert policy.output_dtype is None
    assert policy.quantization_mode is None
    assert str(policy) == "_infer"
    assert jp.get(str(policy)) == policy
    assert policy == jp.Policy("_infer")
    assert hash(policy) == hash(jp.Policy("_infer"))
    assert policy != jp.DTypePolicy("float32")


def test_infer_policy_casts_nothing(maybe_jit):
    policy = jp.Policy("_infer")
    tree = {"a": jnp.ones(2, jnp.bfloat16), "b": np.ones(2, np.float16), "c": 1.0}

    def cast(tree):
        return (
            policy.cast_to_compute(tree),
            policy.cast_to_variable(tree),
            policy.cast_to_output(tree),
        )

    for out in maybe_jit(cast)(tree):
        assert out["a"].dtype == jnp.bfloat16
        assert out["b"].dtype == np.float16
        assert out["c"] == 1.0
    eager = cast(tree)[0]
    assert eager["a"] is tree["a"] and eager["b"] is tree["b"]


def test_infer_policy_is_never_global():
    with pytest.raises(ValueError, match=r"floating compute dtype.*_infer"):
        jp.set_dtype_policy("_infer")
    with pytest.raises(ValueError, match=r"floating compute dtype.*_infer"):
        jp.set_dtype_policy(jp.Policy("_infer"))
    with (
        pytest.raises(ValueError, match=r"floating compute dtype.*_infer"),
        jp.policy_scope("_infer"),
    ):
        pass
    assert jp.dtype_policy().name == "float32"


def test_infer_policy_cannot_be_derived_or_quantized():
    with pytest.raises(ValueError, match=r"'_infer' policy has no dtypes"):
        jp.Policy("_infer").with_compute_dtype("bfloat16")
    with pytest.raises(ValueError, match=r"needs a floating compute dtype.*source_name='_infer'"):
        jp.QuantizedDTypePolicy("int8", "_infer")
