"""``jp.equinox.apply``: an Equinox transformer (a ``filter_vmap``-made stack run with
``lax.scan``) per submodule under a policy map, with and without ``jit``."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_policy as jp
from equinox_adapter.models import Transformer, dot_operand_dtypes, rounded_dots, tokens

HEAD_F32 = {"head": "float32"}


@pytest.fixture(scope="module")
def model():
    return Transformer(jax.random.key(0))


def _run(model, policy_or_map, jit):
    fn = lambda m, t: jp.equinox.apply(m, policy_or_map)(t)  # noqa: E731
    return (eqx.filter_jit(fn) if jit else fn)(model, tokens())


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_map_by_path_gives_float32_head_over_bfloat16_blocks(model, jit):
    policy_map = jp.DTypePolicyMap("mixed_bfloat16", HEAD_F32)
    out = _run(model, policy_map, jit)
    assert out.dtype == jnp.float32 and out.shape == (8, 32)
    np.testing.assert_allclose(out, model(tokens()), atol=0.05)
    jaxpr = jax.make_jaxpr(lambda t: jp.equinox.apply(model, policy_map)(t))(tokens()).jaxpr
    dots = dot_operand_dtypes(jaxpr)
    assert dots[-1] == ("float32", "float32")  # the head, after the stack's loop
    assert dots.count(("bfloat16", "bfloat16")) == len(dots) - 1  # every block matmul
    assert rounded_dots(jaxpr) == 0  # no int8 grid under a float policy


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_map_written_for_cast_apply_resolves_the_same_paths(model, jit):
    policy_map = jp.DTypePolicyMap("float32", {"blocks/mlp/layers/0": "bfloat16"})
    assert policy_map.unused_keys(model) == []  # the plain-tree functions' paths
    out = _run(model, policy_map, jit)
    jaxpr = jax.make_jaxpr(lambda t: jp.equinox.apply(model, policy_map)(t))(tokens()).jaxpr
    assert dot_operand_dtypes(jaxpr).count(("bfloat16", "bfloat16")) == 1
    assert out.dtype == jnp.float32


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_int8_policy_runs_int8_matmuls_on_every_block_projection(model, jit):
    policy_map = jp.DTypePolicyMap("int8_from_mixed_bfloat16", HEAD_F32)
    out = _run(model, policy_map, jit)
    np.testing.assert_allclose(out, model(tokens()), atol=0.05)
    jaxpr = jax.make_jaxpr(lambda t: jp.equinox.apply(model, policy_map)(t))(tokens()).jaxpr
    # Both operands on the int8 grid (an exact bfloat16 GEMM of integers: the library's
    # int8 compute), for q, k, v, out and the 2 MLP layers; the float32 head is not.
    assert rounded_dots(jaxpr) == 6
    assert dot_operand_dtypes(jaxpr)[-1] == ("float32", "float32")


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_float8_current_scaling_runs_e4m3_forward_dots(model, jit):
    policy_map = jp.DTypePolicyMap("float8_current_from_mixed_bfloat16", HEAD_F32)
    jaxpr = jax.make_jaxpr(lambda t: jp.equinox.apply(model, policy_map)(t))(tokens()).jaxpr
    dots = dot_operand_dtypes(jaxpr)
    assert dots.count(("float8_e4m3fn", "float8_e4m3fn")) == 6
    out = _run(model, policy_map, jit)
    np.testing.assert_allclose(out, model(tokens()), atol=0.1)


def test_gradients_reach_the_stored_float32_weights_through_filter_grad(model):
    policy_map = jp.DTypePolicyMap("mixed_bfloat16", HEAD_F32)

    def loss(m, t):
        return jnp.mean(jp.equinox.apply(m, policy_map)(t).astype(jnp.float32) ** 2)

    grads = eqx.filter_jit(eqx.filter_grad(loss))(model, tokens())
    weight = grads.blocks.attn.query_proj.weight
    assert weight.dtype == jnp.float32 and weight.shape == (3, 32, 32)
    assert float(jnp.abs(weight).sum()) > 0
    reference = eqx.filter_grad(lambda m, t: jnp.mean(m(t) ** 2))(model, tokens())
    np.testing.assert_allclose(grads.head.weight, reference.head.weight, rtol=0.1, atol=1e-3)


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "float8_current_from_mixed_bfloat16"])
def test_twenty_training_steps_with_optax_lower_the_loss_as_bfloat16(model, policy):
    policy_map = jp.DTypePolicyMap(policy, HEAD_F32)
    tx = optax.adam(1e-2)
    x, y = tokens(1), jnp.roll(tokens(1), 1)

    def loss(params, static):
        logits = jp.equinox.apply(eqx.combine(params, static), policy_map)(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    @eqx.filter_jit
    def step(params, static, opt_state):
        value, grads = jax.value_and_grad(loss)(params, static)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    params, static = eqx.partition(model, eqx.is_inexact_array)
    opt_state = tx.init(params)
    losses = []
    for _ in range(20):
        params, opt_state, value = step(params, static, opt_state)
        losses.append(float(value))
    assert np.isfinite(losses).all()
    assert losses[-1] < 0.5 * losses[0], losses


def test_the_model_is_not_modified(model):
    before = jax.tree.map(lambda x: x, model)
    jp.equinox.apply(model, "mixed_bfloat16")(tokens())
    assert jax.tree.all(jax.tree.map(lambda a, b: a is b, model, before))
    assert model.blocks.attn.query_proj.weight.dtype == jnp.float32


def test_current_policy_inside_a_submodule_is_its_policy():
    seen = {}

    class Probe(eqx.Module):
        def __call__(self, x):
            seen["policy"] = jp.current_policy().name
            return x

    class Outer(eqx.Module):
        probe: Probe

        def __call__(self, x):
            return self.probe(x)

    jp.equinox.apply(Outer(Probe()), {"probe": "bfloat16"})(jnp.ones(2))
    assert seen["policy"] == "bfloat16"


def test_a_model_that_is_not_an_equinox_module_is_a_type_error():
    with pytest.raises(TypeError, match=r"`model` must be an Equinox module.*model=\{'w': 1\}"):
        jp.equinox.apply({"w": 1}, "float32")


def test_delayed_float8_scaling_is_refused_naming_the_layer_and_current_scaling(model):
    with pytest.raises(ValueError, match=r"'blocks/attn/query_proj'.*float8_current_from"):
        jp.equinox.apply(model, "float8_from_mixed_bfloat16")(tokens())


def test_an_integer_policy_is_refused_as_apply_wrappers_do(model):
    with pytest.raises(ValueError, match="policy_or_map"):
        jp.equinox.apply(model, "int32")


@pytest.mark.filterwarnings("ignore:When `eqx.nn.BatchNorm")
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_batch_norm_state_stays_in_its_stored_dtype(jit):
    norm, state = eqx.nn.make_with_state(eqx.nn.BatchNorm)(4, axis_name="batch")
    x = jnp.arange(8.0).reshape(2, 4)
    for type_policies in ({}, jp.equinox.NORM_FLOAT32):
        run = jp.equinox.apply(norm, "mixed_bfloat16", type_policies=type_policies)
        batched = jax.vmap(run, axis_name="batch", in_axes=(0, None), out_axes=(0, None))
        out, new = (jax.jit(batched) if jit else batched)(x, state)
        assert [leaf.dtype for leaf in jax.tree.leaves(new)][1:] == [jnp.float32] * 2
        assert out.dtype == (jnp.float32 if type_policies else jnp.bfloat16)
        np.testing.assert_allclose(jax.tree.leaves(new)[1], jnp.array([2.0, 3.0, 4.0, 5.0]))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_convolution_computes_in_its_policy_and_is_never_quantized(jit):
    conv = eqx.nn.Conv2d(3, 4, 3, key=jax.random.key(0))
    x = jnp.ones((3, 8, 8))
    run = jp.equinox.apply(conv, "mixed_bfloat16")
    out = (jax.jit(run) if jit else run)(x)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(out.astype(jnp.float32), conv(x), atol=0.05)
    assert jp.equinox.quantize(conv, "int8_from_float32").weight.dtype == jnp.float32
