"""``jp.equinox.calibrate``: GPTQ and AWQ on an Equinox transformer whose blocks are a
``filter_vmap``-made stack run with ``lax.scan``, each layer solved from its own inputs,
beating round-to-nearest's output error; the calibrated model served with and without jit."""

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from quantization.loop_reads import integer_dots

import jmp_policy as jp
from equinox_adapter.models import DEPTH, WIDTH, Transformer, tokens

BATCHES = [tokens(i) for i in range(1, 7)]
HELD_OUT = [tokens(i) for i in range(20, 24)]


@pytest.fixture(scope="module")
def model():
    return Transformer(jax.random.key(0))


def _output_error(model, q, policy_map, jit=False):
    run = lambda m, t: jp.equinox.apply(m, policy_map)(t)  # noqa: E731
    run = eqx.filter_jit(run) if jit else run
    return float(sum(jnp.mean((run(q, t) - model(t)) ** 2) for t in HELD_OUT))


@pytest.fixture(scope="module")
def round_to_nearest_error(model):
    policy_map = jp.DTypePolicyMap("float32", {"blocks/.*": "int4/8_from_float32"})
    return _output_error(model, jp.equinox.quantize(model, policy_map), policy_map)


@pytest.mark.heavy(30)
@pytest.mark.parametrize("method", ["gptq", "awq"])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_calibrated_stack_beats_round_to_nearest(model, round_to_nearest_error, method, jit):
    policy_map = jp.DTypePolicyMap("float32", {"blocks/.*": f"{method}/4/8_from_float32"})
    q, report = jp.equinox.calibrate(model, policy_map, BATCHES, return_report=True)
    kernel = q.blocks.attn.query_proj.weight
    assert isinstance(kernel, jp.QuantizedArray)
    assert (kernel.stacked, kernel.shape) == (1, (DEPTH, WIDTH, WIDTH))
    assert len(report) == 6 * DEPTH  # every projection of every layer, solved alone
    assert all(r.error < r.rtn_error for r in report), report
    error = _output_error(model, q, policy_map, jit)
    assert error < 0.9 * round_to_nearest_error, (error, round_to_nearest_error)
    jaxpr = jax.make_jaxpr(lambda t: jp.equinox.apply(q, policy_map)(t))(tokens()).jaxpr
    assert integer_dots(jaxpr) == [("int4", True)] * 6  # read per layer inside the loop


def test_int8_layers_are_rounded_and_the_model_is_not_modified(model):
    policy_map = {"blocks/mlp/.*": "int8_from_float32"}
    q = jp.equinox.calibrate(model, policy_map, BATCHES[:1])
    assert (
        q.blocks.mlp.layers[0].weight
        == jp.equinox.quantize(model, policy_map).blocks.mlp.layers[0].weight
    )
    assert isinstance(q.blocks.attn.query_proj.weight, jax.Array)
    assert isinstance(model.blocks.mlp.layers[0].weight, jax.Array)


def test_a_batch_holding_nan_is_refused_naming_it(model):
    with pytest.raises(ValueError, match=r"batches\[1\]"):
        jp.equinox.calibrate(
            model, {"head": "gptq/4/8_from_float32"}, [jnp.ones(3), jnp.full(3, jnp.nan)]
        )
