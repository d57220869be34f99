"""Fuzzed scheme entry points (#30 item 7): `jp.get` of every registered scheme's names with
random settings and sources, configs round trips and mutated configs, and `quantize` of
random kernels under every weight-storing scheme. Derandomized, bounded example counts.

The schemes are read from the registry when this module is collected, so formats added
later (GPTQ, AWQ, ...) are fuzzed too."""

import copy

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jmp_policy as jp
from jmp_policy._src import schemes
from jmp_policy._src.quantization.calibrated_schemes import CalibratedScheme

FUZZ = settings(max_examples=80, deadline=None, derandomize=True)  # the same examples every run
TOKENS = sorted(schemes.tokens())
SOURCES = ["float32", "mixed_bfloat16", "mixed_float16", "bfloat16", "float16", "float64"]

blocks = st.one_of(
    st.just(""),
    st.integers(-3, 2**17).map(lambda n: f"/{n}"),
    st.sampled_from(["/", "//", "/-1", "/0", "/1.5", "/ 8", "/\uff18", "/1e3", "/0x10", "/+4"]),
    st.text(st.sampled_from(list("/-0123456789abx_ ")), max_size=6),
)
sources = st.one_of(st.sampled_from(SOURCES), st.text(max_size=12))


def _round_trips(policy):
    named = jp.get(policy.name)
    if named.get_config() == policy.get_config():
        assert named == policy
    else:  # a setting the name does not carry (float8's amax_history_length), as Keras
        assert named != policy and type(named) is type(policy)
    config = policy.get_config()
    before = copy.deepcopy(config)
    assert type(policy).from_config(config) == policy
    assert config == before  # never mutated
    back = jp.deserialize(jp.serialize(policy))
    assert back == policy and type(back) is type(policy)


def _quotes(error, argument, value):
    assert f"Received: {argument}={value!r}" in str(error), str(error)


@FUZZ
@given(token=st.sampled_from(TOKENS), block=blocks, source=sources)
def test_every_scheme_name_is_a_policy_or_an_error_quoting_it(token, block, source):
    name = f"{token}{block}_from_{source}"
    try:
        policy = jp.get(name)
    except (ValueError, TypeError) as e:
        _quotes(e, "identifier", name)
        return
    assert policy.quantization_mode == policy.scheme.mode
    assert policy.source_name.strip() != ""
    _round_trips(policy)


def _valid_policies():
    found = []
    for token in TOKENS:
        for source in ("float32", "mixed_bfloat16"):
            try:
                found.append(jp.get(f"{token}_from_{source}"))
            except ValueError:  # a format whose mode needs its settings (Keras's gptq/4/128)
                found.append(jp.get(f"{token}/4/128_from_{source}"))
    return found


POLICIES = _valid_policies()
values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**40), 2**40),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=10),
    st.sampled_from(["int8", "int4", "int4/64", "float8", "float8_current", "float32", "delayed"]),
    st.lists(st.integers(), max_size=2),
)


@FUZZ
@given(policy=st.sampled_from(POLICIES), data=st.data())
def test_mutated_configs_build_a_policy_or_raise_a_value_or_type_error(policy, data):
    config = policy.get_config()
    field = data.draw(st.sampled_from([*config, "bogus", "loss_scale"]), label="field")
    config[field] = data.draw(values, label="value")
    before = copy.deepcopy(config)
    cls = type(policy)
    try:
        rebuilt = cls.from_config(config)
    except (ValueError, TypeError) as e:
        assert "Received:" in str(e), str(e)
        if field == "bogus":
            assert "Unknown field 'bogus'" in str(e)
    else:
        assert field != "bogus"
        assert isinstance(rebuilt, cls)
        _round_trips(rebuilt)
    assert repr(config) == repr(before)  # never mutated (NaN-safe comparison)


STORED = [p for p in POLICIES if p.scheme.stores_weights and p.source_name == "float32"]
# Formats that choose their weights on calibration inputs quantize only through calibrate.
CALIBRATED = [p for p in STORED if isinstance(p.scheme, CalibratedScheme)]
STORING = [p for p in STORED if p not in CALIBRATED]


@pytest.mark.parametrize("policy", CALIBRATED, ids=lambda p: p.name)
def test_calibrated_formats_quantize_only_through_calibrate(policy):
    kernel = np.ones((4, 4), np.float32)
    with pytest.raises(ValueError, match=r"chooses its weights on calibration inputs.*calibrate"):
        policy.quantize({"kernel": kernel}, stacked_axes=0)


@settings(FUZZ, max_examples=30)  # each new shape compiles its eager ops: fewer, same spread
@given(
    policy=st.sampled_from(STORING),
    shape=st.tuples(st.integers(1, 9), st.integers(1, 5)),
    seed=st.integers(0, 2**16),
    scale=st.sampled_from([1e-30, 1e-3, 1.0, 1e3, 1e30]),
)
def test_every_storing_scheme_quantizes_random_kernels_within_its_grid(policy, shape, seed, scale):
    kernel = np.random.default_rng(seed).normal(size=shape).astype(np.float32) * scale
    original = kernel.copy()
    q = policy.quantize({"kernel": kernel}, stacked_axes=0)["kernel"]
    np.testing.assert_array_equal(kernel, original)  # nothing written
    assert isinstance(q, jp.QuantizedArray) and q.shape == shape
    assert (np.asarray(q.scale) > 0).all()  # finite, positive scales
    out = np.asarray(q.dequantize())
    assert out.shape == shape and np.isfinite(out).all()
    # Within half a step of the coarsest grid (int4: 7 levels) per column.
    step = np.abs(kernel).max(axis=0) / 7
    assert (np.abs(out - kernel) <= step / 2 * (1 + 1e-5) + 1e-37).all()
    assert jnp.asarray(out).dtype == jnp.float32


@pytest.mark.parametrize("token", TOKENS)
def test_each_token_alone_names_a_policy(token):
    try:
        policy = jp.get(f"{token}_from_float32")
    except ValueError as e:  # Keras's gptq/awq modes need their settings: said, with an example
        assert f"Expected format '{token}/<weight_bits>/<group_size>'" in str(e), str(e)
        policy = jp.get(f"{token}/4/128_from_float32")
    _round_trips(policy)
