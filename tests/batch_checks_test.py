"""The batches calibrate and search_map run the model on (#46): errors the model raises
on a batch name the batch, a NaN batch is refused, booleans are booleans."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jmp_policy as jp
from jmp_policy._src.batch_checks import blaming, check_bool, check_no_nan, describe

MODEL = nn.Sequential([nn.Dense(8), nn.relu, nn.Dense(4)])
X = jnp.ones((4, 8))
VARIABLES = MODEL.init(jax.random.key(0), X)
GPTQ = jp.DTypePolicyMap("float32", {"layers_0": "gptq/4/-1_from_float32"})
BUDGET = {"effective_bits": 8}


def loss_fn(out, batch):
    return jnp.mean(out.astype(jnp.float32) ** 2)


class Net(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(8, 4, rngs=rngs)

    def __call__(self, x):
        return self.up(x)


def test_describe_shows_shapes_and_dtypes_not_values():
    assert describe((jnp.ones((4, 8)), np.zeros(3, np.int32))) == "(float32[4, 8], int32[3])"
    assert describe({"x": jnp.ones(2, jnp.bfloat16), "flag": None}) == (
        "{'flag': None, 'x': bfloat16[2]}"
    )


@pytest.mark.parametrize("value", ["yes", 1, None, np.array(True)])
def test_check_bool_refuses_what_is_not_a_bool(value):
    with pytest.raises(TypeError, match=r"`jit` must be True \(x\) or False\. Received: jit="):
        check_bool(value, "jit", "x")
    assert check_bool(np.bool_(False), "jit", "x") is False


def _raise(error):
    with blaming("batches[2]", X, "f"):
        raise error


def test_blaming_names_the_argument_keeps_type_errors_and_chains_the_cause():
    with pytest.raises(TypeError, match=r"f: the model failed on `batches\[2\]` \(TypeError: t"):
        _raise(TypeError("t"))
    with pytest.raises(ValueError, match=r"`batches\[2\]` \(IndexError: i.*float32\[4, 8\]") as e:
        _raise(IndexError("i"))
    assert isinstance(e.value.__cause__, IndexError)
    with pytest.raises(ZeroDivisionError):  # not the model's argument error: as it is
        _raise(ZeroDivisionError())


def test_check_no_nan_names_the_batch_and_lets_infinities_through():
    check_no_nan([(X, jnp.full(3, -jnp.inf)), np.arange(3)], "f")  # a -inf mask is an input
    with pytest.raises(ValueError, match=r"f: `batches\[1\]\[0\]\['x'\]` holds 2 NaN value"):
        check_no_nan([X, ({"x": X.at[0, :2].set(jnp.nan)},)], "f")


# -- calibrate ------------------------------------------------------------------------------


def test_calibrate_refuses_a_string_of_batches_naming_it():
    for calibrate in (
        lambda b: jp.linen.calibrate(MODEL, GPTQ, VARIABLES, b),
        lambda b: jp.nnx.calibrate(Net(nnx.Rngs(0)), GPTQ, b),
    ):
        with pytest.raises(TypeError, match=r"`batches` must be an iterable.*batches='abc'"):
            calibrate("abc")
        with pytest.raises(ValueError, match=r"`batches` holds no batch.*Received: batches=\[\]"):
            calibrate([])


def test_calibrate_wraps_the_models_shape_error_naming_the_batch():
    with pytest.raises(ValueError, match=r"calibrate: the model failed on `batches\[0\]` \(Scope"):
        jp.linen.calibrate(MODEL, GPTQ, VARIABLES, [jnp.ones((4, 3))])
    with pytest.raises(ValueError, match=r"failed on `batches\[1\]`.*Received: batches\[1\]=\(f"):
        jp.linen.calibrate(MODEL, GPTQ, VARIABLES, [X, jnp.ones((4, 3))])
    net = Net(nnx.Rngs(0))
    nnx_map = jp.DTypePolicyMap("float32", {"up": "gptq/4/-1_from_float32"})
    with pytest.raises(TypeError, match=r"calibrate: the model failed on `batches\[0\]` \(Type"):
        jp.nnx.calibrate(net, nnx_map, [jnp.ones((4, 3))])  # JAX's dot_general shape error


def test_calibrate_refuses_a_batch_holding_nan():
    bad = X.at[1, 2].set(jnp.nan)
    with pytest.raises(ValueError, match=r"calibrate: `batches\[1\]\[0\]` holds 1 NaN"):
        jp.linen.calibrate(MODEL, GPTQ, VARIABLES, [X, bad])
    with pytest.raises(ValueError, match=r"calibrate: `batches\[0\]\[0\]` holds 1 NaN"):
        jp.nnx.calibrate(Net(nnx.Rngs(0)), GPTQ, [bad])


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_calibrate_return_report_must_be_a_bool(value):
    with pytest.raises(TypeError, match=r"`return_report` must be True .*return_report="):
        jp.linen.calibrate(MODEL, GPTQ, VARIABLES, [X], return_report=value)
    with pytest.raises(TypeError, match=r"`return_report` must be True .*return_report="):
        jp.nnx.calibrate(Net(nnx.Rngs(0)), GPTQ, [X], return_report=value)


def test_calibrate_warns_once_when_a_gptq_key_matches_no_layer():
    typo = jp.DTypePolicyMap("float32", {"layrs_0": "gptq/4/-1_from_float32"})
    with pytest.warns(UserWarning) as record:
        q = jp.linen.calibrate(MODEL, typo, VARIABLES, [X])
    messages = [str(w.message) for w in record if "calibrate:" in str(w.message)]
    assert len(messages) == 1
    assert "key(s) ['layrs_0'] choose the policy of no layer" in messages[0]
    assert "map.unused_keys(params)" in messages[0]
    assert q["params"]["layers_0"]["kernel"].dtype == jnp.float32  # left float
    with pytest.warns(UserWarning, match=r"key\(s\) \['nope'\] choose the policy of no layer"):
        jp.nnx.calibrate(
            Net(nnx.Rngs(0)), jp.DTypePolicyMap("float32", {"nope": "awq/4/-1_from_float32"}), [X]
        )


# -- search_map -----------------------------------------------------------------------------


def test_search_map_refuses_an_empty_batch_list_quoting_it():
    with pytest.raises(TypeError, match=r"non-empty list .*Received: batches=\[\]"):
        jp.linen.search_map(MODEL, VARIABLES, [], loss_fn, budget=BUDGET)
    with pytest.raises(TypeError, match=r"non-empty list .*Received: batches=\(\)"):
        jp.nnx.search_map(Net(nnx.Rngs(0)), (), loss_fn, budget=BUDGET)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"progress": 5}, r"`progress` must be None or a callable.*Received: progress=5 \(of type int"),
    ({"jit": "yes"}, r"`jit` must be True \(compile the passes\) or False.*jit='yes'"),
])  # fmt: skip
def test_search_map_checks_progress_and_jit(kwargs, match):
    with pytest.raises(TypeError, match=match):
        jp.linen.search_map(MODEL, VARIABLES, [X], loss_fn, budget=BUDGET, **kwargs)
    if "progress" in kwargs:  # NNX's search takes no `jit`
        with pytest.raises(TypeError, match=match):
            jp.nnx.search_map(Net(nnx.Rngs(0)), [X], loss_fn, budget=BUDGET, **kwargs)


def test_search_map_refuses_a_nan_batch_instead_of_choosing_int4_everywhere():
    with pytest.raises(ValueError, match=r"search_map: `batches\[1\]` holds 1 NaN value"):
        jp.linen.search_map(MODEL, VARIABLES, [X, X.at[0, 0].set(jnp.nan)], loss_fn, budget=BUDGET)


def test_search_map_refuses_a_non_finite_score():
    def nan_loss(out, batch):
        return jnp.mean(out) * jnp.nan

    with pytest.raises(ValueError, match=r"the score of '.*' on layer 'layers_\d' is nan"):
        jp.linen.search_map(MODEL, VARIABLES, [X], nan_loss, budget=BUDGET)


def test_search_map_wraps_the_models_shape_error_naming_the_batch():
    with pytest.raises(ValueError, match=r"search_map: the model failed on `batches\[0\]`.*inputs"):
        jp.linen.search_map(MODEL, VARIABLES, [jnp.ones((4, 3))], loss_fn, budget=BUDGET)


@pytest.mark.parametrize("candidates", [["float32"], ["mixed_bfloat16"], ["bfloat16"]])
def test_search_map_candidates_must_hold_a_quantized_policy(candidates):
    # A candidate is an option a layer may take: `base` always is one, so a float
    # candidate is the base (said once) or refused, and the base alone is nothing to choose.
    with pytest.raises(ValueError, match=r"`candidates` holds .*Received: candidates=\["):
        jp.linen.search_map(MODEL, VARIABLES, [X], loss_fn, budget=BUDGET, candidates=candidates)
    result = jp.linen.search_map(
        MODEL, VARIABLES, [X], loss_fn, budget={"effective_bits": 16},
        candidates=["mixed_bfloat16", "int8_from_mixed_bfloat16"],
    )  # fmt: skip
    assert {row.choice for row in result.table} <= {"mixed_bfloat16", "int8_from_mixed_bfloat16"}


# -- compile_for_serving --------------------------------------------------------------------


def test_compile_for_serving_names_args_when_fn_fails_on_them():
    serve = jp.linen.apply(MODEL, "float32")
    with pytest.raises(ValueError, match=r"compile_for_serving: the model failed on `args` \(Ind"):
        jp.compile_for_serving(serve, VARIABLES, None)
    with pytest.raises(ValueError, match=r"failed on `args`.*Received: args=\(float32\[4, 3\],\)"):
        jp.compile_for_serving(serve, VARIABLES, jnp.ones((4, 3)))
    compiled, placed = jp.compile_for_serving(serve, VARIABLES, X)
    np.testing.assert_array_equal(compiled(placed, X), MODEL.apply(VARIABLES, X))
