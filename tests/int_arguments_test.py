"""The one check of an integer argument against its bounds."""

import numpy as np
import pytest

from jmp_policy._src.int_arguments import accepted_ints, check_int, int_from_text


@pytest.mark.parametrize("value", [1, 5, 8, np.int8(3), np.uint64(8), np.int64(1)])
def test_check_int_returns_a_python_int_within_the_bounds(value):
    out = check_int(value, "n", 1, 8)
    assert out == value and type(out) is int


@pytest.mark.parametrize("value", [0, 9, -1, np.int32(9), 2**70])
def test_check_int_out_of_range_raises_value_error_naming_quoting_and_saying_what(value):
    with pytest.raises(ValueError) as info:
        check_int(value, "n", 1, 8, why=" (a count)")
    assert str(info.value) == f"`n` must be an integer from 1 to 8 (a count). Received: n={value!r}"


@pytest.mark.parametrize(
    "value", [True, False, np.bool_(True), 2.0, np.float32(2), "2", None, np.array(2), [2]]
)
def test_check_int_non_integer_raises_type_error_with_its_type(value):
    with pytest.raises(TypeError) as info:
        check_int(value, "n", 0)
    assert str(info.value) == (
        f"`n` must be a non-negative integer. Received: n={value!r} "
        f"(of type {type(value).__name__})"
    )


def test_check_int_without_an_upper_bound_accepts_any_large_int():
    assert check_int(2**70, "n", 1) == 2**70
    with pytest.raises(ValueError, match=r"`n` must be an integer >= 3\. Received: n=2"):
        check_int(2, "n", 3)


def test_accepted_ints_words():
    assert accepted_ints(1) == "a positive integer"
    assert accepted_ints(0) == "a non-negative integer"
    assert accepted_ints(-1) == "an integer >= -1"
    assert accepted_ints(1, 10) == "an integer from 1 to 10"


@pytest.mark.parametrize(("text", "value"), [("128", 128), ("-1", -1), ("0", 0), ("65536", 65536)])
def test_int_from_text_reads_ascii_digits_within_the_bounds(text, value):
    out = int_from_text(text, -1, 65536)
    assert out == value and type(out) is int


_NOT_READ = ["\uff11\uff12\uff18", "12_8", "+128", " 128", "128 ", "0128", "-0", "", "-", "1e3"]


@pytest.mark.parametrize("text", [*_NOT_READ, "\u0663", "65537", "-2", "9" * 20, "9" * 10_000])
def test_int_from_text_refuses_what_int_would_read_or_the_bounds_refuse(text):
    assert int_from_text(text, -1, 65536) is None
