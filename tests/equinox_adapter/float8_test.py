"""Float8 delayed scaling in Equinox: ``jp.equinox.init_float8`` puts each float8 layer's
state in the per-layer state slot (a field of the ``eqx.nn.Linear``), ``apply`` reads it,
and the new state comes back as its gradient (``jp.equinox.split_gradients``)."""

import itertools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_policy as jp
from equinox_adapter.models import DEPTH, Transformer, dot_operand_dtypes, tokens

HEAD_F32 = {"head": "float32"}
DELAYED = jp.DTypePolicyMap("float8_from_mixed_bfloat16", HEAD_F32)
PROJECTIONS = ("attn/query_proj", "attn/key_proj", "attn/value_proj", "attn/output_proj")
PROJECTIONS += ("mlp/layers/0", "mlp/layers/1")


@pytest.fixture(scope="module")
def model():
    return Transformer(jax.random.key(0))


@pytest.fixture(scope="module")
def fp8(model):
    return jp.equinox.init_float8(model, DELAYED)


def _layer(model, path):
    node = model.blocks
    for part in path.split("/"):
        node = node[int(part)] if part.isdigit() else getattr(node, part)
    return node


def _history(model, path, name="input_amax_history"):
    return np.asarray(_layer(model, path).float8.value[name])


def test_init_float8_gives_every_block_projection_a_stacked_state_and_not_the_head(model, fp8):
    for path in PROJECTIONS:
        layer = _layer(fp8, path)
        assert isinstance(layer, eqx.nn.Linear) and isinstance(layer.float8, jp.equinox.Float8State)
        assert _history(fp8, path).shape == (DEPTH, 1024)  # one state per stacked layer
        assert not _history(fp8, path).any()
        assert not hasattr(_layer(model, path), "float8")  # the model is not modified
    assert not hasattr(fp8.head, "float8")
    assert DELAYED.unused_keys(fp8) == []  # the paths are unchanged
    rows = jp.equinox.explain(fp8, DELAYED).splitlines()
    assert not [row for row in rows if "float8/" in row]  # the state is not a parameter


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_every_projection_runs_its_forward_dot_on_e4m3_operands(model, fp8, jit):
    fn = lambda m, t: jp.equinox.apply(m, DELAYED)(t)  # noqa: E731
    run = eqx.filter_jit(fn) if jit else fn
    jaxpr = jax.make_jaxpr(lambda t: run(fp8, t))(tokens()).jaxpr
    dots = dot_operand_dtypes(jaxpr)
    assert dots.count(("float8_e4m3fn", "float8_e4m3fn")) == 6  # q, k, v, out, 2 MLP
    assert dots[-1] == ("float32", "float32")  # the float32 head
    out = run(fp8, tokens())
    np.testing.assert_allclose(out, model(tokens()), atol=0.15)


def _train(model, policy_map, jit, steps=20):
    tx = optax.adam(1e-2)
    x, y = tokens(1), jnp.roll(tokens(1), 1)

    def loss(params, static):
        logits = jp.equinox.apply(eqx.combine(params, static), policy_map)(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def step(params, static, opt_state):
        value, grads = jax.value_and_grad(loss)(params, static)
        float8_state = None
        if policy_map is DELAYED:
            grads, float8_state = jp.equinox.split_gradients(grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        if float8_state is not None:  # the new state replaces the old one
            params = eqx.combine(float8_state, params)
        return params, opt_state, value

    step = eqx.filter_jit(step) if jit else step
    params, static = eqx.partition(model, eqx.is_inexact_array)
    opt_state = tx.init(params)
    losses, histories = [], []
    for _ in range(steps):
        params, opt_state, value = step(params, static, opt_state)
        losses.append(float(value))
        if float8_layer := getattr(params.blocks.attn.query_proj, "float8", None):
            histories.append(np.asarray(float8_layer.value["input_amax_history"]))
    return losses, histories


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_twenty_training_steps_with_optax_follow_bfloat16_and_update_the_state(model, fp8, jit):
    steps = 20 if jit else 4  # eager steps are slow; the jit run trains the 20
    bf16, _ = _train(model, jp.DTypePolicyMap("mixed_bfloat16", HEAD_F32), jit, steps)
    losses, histories = _train(fp8, DELAYED, jit, steps)
    assert np.isfinite(losses).all()
    np.testing.assert_allclose(losses, bf16, rtol=0.1, atol=0.1)
    if jit:
        assert losses[-1] < 0.5 * losses[0], losses
    # The history rolls by -1: step k's amax at [0], the older ones from the end.
    assert (histories[0][:, 0] > 0).all() and not histories[0][:, 1:].any()
    for before, after in itertools.pairwise(histories):
        np.testing.assert_array_equal(after[:, 1:], np.roll(before, -1, axis=1)[:, 1:])
        assert (after[:, 0] > 0).all()
    assert len({tuple(row) for row in histories[-1][:, :2]}) == DEPTH  # each layer its own


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_stack_under_scan_gets_each_layers_own_amax_of_the_whole_batch(fp8, jit):
    def loss(m, t):
        return jp.equinox.apply(m, DELAYED)(t).astype(jnp.float32).mean()

    grad = eqx.filter_grad(loss)
    grads = (eqx.filter_jit(grad) if jit else grad)(fp8, tokens())
    _, state = jp.equinox.split_gradients(grads)
    new = np.asarray(state.blocks.attn.query_proj.float8.value["input_amax_history"])
    # The first block's query input: the normed embeddings, every position at once (the
    # layer runs per position under `jax.vmap`: one amax over the batch, not a sum).
    x = jax.vmap(fp8.embed)(tokens())
    norm = jax.tree.map(lambda a: a[0] if eqx.is_array(a) else a, fp8.blocks.norm1)
    expected = float(jnp.abs(jax.vmap(norm)(x).astype(jnp.bfloat16)).max())
    np.testing.assert_allclose(new[0, 0], expected, rtol=0.02)
    assert new.shape == (DEPTH, 1024) and len(set(new[:, 0])) == DEPTH


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_model_without_init_float8_is_refused_naming_init_float8(model, jit):
    fn = lambda m, t: jp.equinox.apply(m, DELAYED)(t)  # noqa: E731
    with pytest.raises(ValueError, match=r"'blocks/attn/query_proj'.*init_float8"):
        (eqx.filter_jit(fn) if jit else fn)(model, tokens())


def test_a_state_of_another_history_length_is_refused_naming_it(fp8):
    policy = jp.QuantizedFloat8DTypePolicy("float8", "mixed_bfloat16", amax_history_length=16)
    with pytest.raises(ValueError, match=r"amax_history_length=16.*init_float8"):
        jp.equinox.apply(fp8, jp.DTypePolicyMap(policy, HEAD_F32))(tokens())


def test_init_float8_without_a_float8_layer_is_refused_quoting_the_map(model):
    with pytest.raises(ValueError, match=r"No layer.*policy_or_map='mixed_bfloat16'"):
        jp.equinox.init_float8(model, "mixed_bfloat16")


def test_split_gradients_of_a_tree_without_state_is_a_type_error(model):
    with pytest.raises(TypeError, match=r"`grads`.*Float8State"):
        jp.equinox.split_gradients(eqx.filter(model, eqx.is_array))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_layer_under_vmap_and_on_the_whole_batch_gets_the_same_new_state(jit):
    layer = jp.equinox.init_float8(eqx.nn.Linear(4, 3, key=jax.random.key(1)), DELAYED)
    x = jnp.array([[1.0, -2.0, 0.5, 0.0], [0.25, 3.0, -1.0, 2.0]])

    def loss(m, x, per_example):
        run = jp.equinox.apply(m, DELAYED)
        y = jax.vmap(run)(x) if per_example else run(x)
        return y.astype(jnp.float32).sum()

    grad = eqx.filter_grad(loss)
    grad = eqx.filter_jit(grad) if jit else grad
    for per_example in (False, True):
        _, state = jp.equinox.split_gradients(grad(layer, x, per_example))
        history = state.float8.value["input_amax_history"]
        assert float(history[0]) == 3.0 and not history[1:].any()  # max |x|, not a sum
