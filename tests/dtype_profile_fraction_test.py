"""`DTypeProfile.fraction` takes a dtype, its name or a profile key; anything else is a
ValueError listing the accepted names (#30: `fraction("bogus")` returned 0.0)."""

import jax.numpy as jnp
import numpy as np
import pytest

import jmp_policy as jp


@pytest.fixture(scope="module")
def profile():
    def f(x, w, v):
        return (x @ w).astype(jnp.float32) @ v

    x = jnp.ones((4, 8), jnp.bfloat16)
    w = jnp.ones((8, 8), jnp.bfloat16)
    v = jnp.ones((8, 2), jnp.float32)
    return jp.dtype_profile(f, x, w, v)


def test_fraction_by_name_dtype_and_alias(profile):
    assert profile.matmul_flops == {"bfloat16": 2 * 4 * 8 * 8, "float32": 2 * 4 * 8 * 2}
    share = 512 / (512 + 128)
    assert profile.fraction("bfloat16") == pytest.approx(share)
    assert profile.fraction(jnp.bfloat16) == pytest.approx(share)
    assert profile.fraction(np.dtype("float32")) == pytest.approx(1 - share)
    assert profile.fraction("bf16") == pytest.approx(share)  # jmp's short name


def test_a_dtype_the_profile_does_not_use_is_zero(profile):
    assert profile.fraction("float16") == 0.0
    assert profile.fraction("float8_e4m3fn+float8_e5m2") == 0.0


@pytest.mark.parametrize(
    ("bad", "hint"),
    [
        ("bogus", ""),
        ("bfloat61", " Did you mean 'bfloat16'?"),
        ("bfloat16+nope", " Did you mean 'bfloat16'?"),
        (3, ""),
    ],
)
def test_an_unknown_dtype_is_a_value_error_listing_the_accepted_names(profile, bad, hint):
    with pytest.raises(ValueError) as info:
        profile.fraction(bad)
    message = str(info.value)
    assert message.startswith(
        "`dtype` must be a dtype or its name: this profile's are ['bfloat16', 'float32'], "
        "and any of ["
    )
    assert "'float16'" in message and "'int8'" in message
    assert message.endswith(f"(a fraction of 0.0 where unused).{hint} Received: dtype={bad!r}")
