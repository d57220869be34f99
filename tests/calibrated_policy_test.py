"""GPTQDTypePolicy and AWQDTypePolicy: Keras 3's names, configs and checks, and what we store."""

import pytest

import jmp_policy as jp

# The configs Keras 3.15 writes for these classes (`keras.saving.serialize_keras_object`).
KERAS_GPTQ = {
    "module": "keras.dtype_policies",
    "class_name": "GPTQDTypePolicy",
    "config": {"mode": "gptq/4/128", "source_name": "mixed_bfloat16"},
    "registered_name": None,
}
KERAS_AWQ = {
    "module": "keras.dtype_policies",
    "class_name": "AWQDTypePolicy",
    "config": {"mode": "awq/4/-1", "source_name": "float32"},
    "registered_name": None,
}


def test_names_give_the_keras_classes_with_their_fields():
    gptq = jp.get("gptq/4/128_from_mixed_bfloat16")
    assert type(gptq) is jp.GPTQDTypePolicy
    assert gptq.name == "gptq/4/128_from_mixed_bfloat16"
    assert (gptq.quantization_mode, gptq.mode) == ("gptq", "gptq")
    assert (gptq.weight_bits, gptq.group_size, gptq.block_size) == (4, 128, 128)
    assert gptq.storage_mode == "int4"
    assert gptq.compute_dtype.name == "bfloat16" and gptq.variable_dtype.name == "float32"
    awq = jp.get("awq/4/-1_from_float32")
    assert type(awq) is jp.AWQDTypePolicy and awq.group_size == -1 and awq.block_size == -1
    int8 = jp.get("gptq/8/-1_from_float32")
    assert (int8.weight_bits, int8.block_size, int8.storage_mode) == (8, None, "int8")


def test_keras_configs_read_back_and_ours_are_keras_shaped():
    gptq, awq = jp.deserialize(KERAS_GPTQ), jp.deserialize(KERAS_AWQ)
    assert gptq == jp.GPTQDTypePolicy("gptq/4/128", "mixed_bfloat16")
    assert awq == jp.AWQDTypePolicy("awq/4/-1", "float32")
    assert jp.serialize(gptq, format="keras") == KERAS_GPTQ
    assert jp.serialize(awq, format="keras") == KERAS_AWQ


def test_policies_differ_by_method_bits_and_group_and_hash_by_value():
    a = jp.GPTQDTypePolicy("gptq/4/128", "float32")
    assert a == jp.get("gptq/4/128_from_float32") and hash(a) == hash(jp.get(str(a)))
    assert a != jp.GPTQDTypePolicy("gptq/4/64", "float32")
    assert a != jp.AWQDTypePolicy("awq/4/128", "float32")
    assert a != jp.Int4DTypePolicy("int4", "float32", 128)
    assert jp.GPTQDTypePolicy("gptq/4/-1", "float32") != jp.GPTQDTypePolicy("gptq/8/-1", "float32")


def test_names_work_in_a_map_and_round_trip_it():
    m = jp.DTypePolicyMap(
        "mixed_bfloat16",
        {"mlp/.*": "gptq/4/128_from_mixed_bfloat16", "head": "awq/4/-1_from_mixed_bfloat16"},
    )
    assert type(m["mlp/up"]) is jp.GPTQDTypePolicy
    assert type(m["head"]) is jp.AWQDTypePolicy
    assert m["head"].compute_dtype.name == "bfloat16"
    assert jp.deserialize(jp.serialize(m)) == m


@pytest.mark.parametrize(
    ("name", "match"),
    [
        (
            "gptq/3/128_from_float32",
            r"GPTQ only supports 4-bit or 8-bit weights here.*weights of 3 bits are not supported",
        ),
        (
            "gptq/2/-1_from_float32",
            r"4-bit or 8-bit.*jnp.int4 or jnp.int8.*2 bits are not supported",
        ),
        ("gptq/8/128_from_float32", r"int8 per output channel here: use 'gptq/8/-1'"),
        (
            "awq/8/-1_from_float32",
            r"AWQ only supports 4-bit weights here.*8 bits are not supported",
        ),
        ("gptq/4_from_float32", r"Expected format 'gptq/<weight_bits>/<group_size>'"),
        (
            "gptq/4/0_from_float32",
            r"<group_size> -1 \(per channel\) or from 1 to 65536.*'gptq/4/0'",
        ),
        ("awq/x/128_from_float32", r"must be integers.*'awq/x/128'"),
        ("gptq/4/128_from_int8_from_float32", r"float source policy"),
    ],
)
def test_bad_names_are_value_errors_that_say_what_is_supported(name, match):
    with pytest.raises(ValueError, match=match):
        jp.get(name)


def test_a_mode_that_is_not_a_string_is_a_type_error():
    with pytest.raises(TypeError, match=r"`mode` of GPTQDTypePolicy must be a string.*4"):
        jp.GPTQDTypePolicy(4)


def test_quantize_without_calibration_points_to_calibrate():
    with pytest.raises(ValueError, match=r"calibrate\(.*'int4/128' for round-to-nearest"):
        jp.get("gptq/4/128_from_float32").quantize({"kernel": 1})
