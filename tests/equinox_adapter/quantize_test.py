"""``jp.equinox.quantize``: int8/int4 weights of an Equinox transformer whose blocks are a
``filter_vmap``-made stack run with ``lax.scan``, each layer reading its own slice of the
integer values inside the loop, with and without ``jit``."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from quantization.loop_reads import assert_read_in_loop, integer_dots

import jmp_policy as jp
from equinox_adapter.models import DEPTH, WIDTH, Transformer, tokens

HEAD_F32 = {"head": "float32"}


@pytest.fixture(scope="module")
def model():
    return Transformer(jax.random.key(0))


@pytest.mark.parametrize(
    ("name", "dtype", "tolerance"),
    [("int8_from_float32", "int8", 0.02), ("int4/16_from_float32", "int4", 0.2)],
)
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_stacked_weights_reach_each_layers_matmul_as_integers(model, name, dtype, tolerance, jit):
    policy_map = jp.DTypePolicyMap(name, HEAD_F32)
    q = jp.equinox.quantize(model, policy_map)
    kernel = q.blocks.attn.query_proj.weight
    assert isinstance(kernel, jp.QuantizedArray)
    assert (kernel.stacked, kernel.shape) == (1, (DEPTH, WIDTH, WIDTH))  # per layer, [in, out]
    run = lambda m, t: jp.equinox.apply(m, policy_map)(t)  # noqa: E731
    out = (eqx.filter_jit(run) if jit else run)(q, tokens())
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(out, model(tokens()), atol=tolerance)
    jaxpr = jax.make_jaxpr(lambda t: run(q, t))(tokens()).jaxpr
    assert_read_in_loop(jaxpr, kernel, dtype)
    assert len(integer_dots(jaxpr)) == 6  # q, k, v, out and the MLP's 2 layers, in the loop


def test_each_layer_gets_its_own_scales_from_its_own_weights(model):
    q = jp.equinox.quantize(model, "int8_from_float32")
    kernel = q.blocks.mlp.layers[0].weight  # [depth, in, out] of Equinox's [depth, out, in]
    assert kernel.scale.shape == (DEPTH, 2 * WIDTH)
    weights = model.blocks.mlp.layers[0].weight
    expected = jnp.max(jnp.abs(weights), axis=-1) / 127  # per layer and output channel
    np.testing.assert_allclose(kernel.scale, expected, rtol=1e-6)
    np.testing.assert_allclose(kernel.dequantize(), jnp.swapaxes(weights, -1, -2), atol=0.01)


def test_float_head_biases_norms_and_embedding_stay_float_and_the_model_is_not_modified(model):
    q = jp.equinox.quantize(model, jp.DTypePolicyMap("int8_from_float32", HEAD_F32))
    assert q.head.weight.dtype == jnp.float32
    assert q.embed.weight.dtype == jnp.float32
    assert q.blocks.norm1.weight.dtype == jnp.float32
    assert q.blocks.mlp.layers[0].bias.dtype == jnp.float32
    assert isinstance(model.blocks.attn.query_proj.weight, jax.Array)
    assert model.blocks.attn.query_proj.weight.shape == (DEPTH, WIDTH, WIDTH)


def test_an_unstacked_mlp_is_quantized_by_path():
    mlp = eqx.nn.MLP(8, 4, 16, depth=2, key=jax.random.key(0))
    q = jp.equinox.quantize(mlp, {"layers/0": "int8_from_float32"})
    assert isinstance(q.layers[0].weight, jp.QuantizedArray)
    assert q.layers[0].weight.stacked == 0 and q.layers[0].weight.shape == (8, 16)
    assert isinstance(q.layers[1].weight, jax.Array)
    x = jnp.linspace(-1, 1, 8)
    out = jp.equinox.apply(q, {"layers/0": "int8_from_float32"})(x)
    np.testing.assert_allclose(out, mlp(x), atol=0.02)


def test_a_policy_that_quantizes_nothing_is_refused_quoting_it(model):
    with pytest.raises(ValueError, match=r"quantizes nothing.*'mixed_bfloat16'"):
        jp.equinox.quantize(model, "mixed_bfloat16")


def test_quantizing_something_that_is_not_a_module_is_a_type_error():
    with pytest.raises(TypeError, match=r"(?s)`model` must be an Equinox module.*of type list"):
        jp.equinox.quantize([jnp.ones((2, 2))], "int8_from_float32")
