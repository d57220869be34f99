"""float8 training with delayed scaling in Flax Linen, per submodule through a map (issue #12).

What a float8 policy does to a Linen model under ``jmp_policy.linen.init``/``apply``: the
state it creates (only for float8 layers, one per call), the conversions a training step
compiles to (e4m3 and e5m2 exactly where expected), training curves close to bfloat16 with
history lengths 1 and 1024, fidelity on a task where precision matters, nn.scan, loss
scaling with flax's TrainState, Flax's own lm1b model, and the errors.
"""

from __future__ import annotations

import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state
from flax_examples import lm1b_models as lm
from flax_examples import measure

import jmp_policy as jp

F8 = "float8_from_mixed_bfloat16"
COLLECTION = "_overwrite_with_gradient"
FAST_COMPILE = {"xla_backend_optimization_level": 0}


class MLP(nn.Module):
    up_scale: float = 1.0  # scales the first kernel's initial values (for tiny inputs)

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.variance_scaling(self.up_scale**2, "fan_in", "truncated_normal")
        h = nn.gelu(nn.Dense(32, kernel_init=init, name="up")(x))
        h = nn.gelu(nn.DenseGeneral((2, 16), name="split")(h))
        h = nn.Einsum((2, 16, 32), "bhi,hio->bo", name="merge")(h)
        return nn.Dense(4, name="head")(nn.gelu(h))


HIDDEN = ("up", "split", "merge")


def hidden_map(policy=F8, default="mixed_bfloat16"):
    return jp.DTypePolicyMap(default, {"up|split|merge": policy, "head": "float32"})


def data(seed=0, n=64, scale=1.0):
    x = jax.random.normal(jax.random.key(seed), (n, 8)) * scale
    teacher = jax.random.normal(jax.random.key(99), (8, 4))
    y = jnp.tanh((x / scale) @ teacher)
    return x, y


def state_of(variables, layer, call=0):
    return variables[COLLECTION][layer][f"float8_{call}"]


# -- the state --------------------------------------------------------------------------------


def test_init_creates_float32_state_for_the_float8_layers_only():
    x, _ = data()
    policy = jp.QuantizedFloat8DTypePolicy("float8", "mixed_bfloat16", amax_history_length=16)
    variables = jp.linen.init(MLP(), hidden_map(policy))(jax.random.key(0), x)
    assert sorted(variables) == [COLLECTION, "params"]
    assert sorted(variables[COLLECTION]) == sorted(HIDDEN)  # not the float32 head
    for layer in HIDDEN:
        assert list(variables[COLLECTION][layer]) == ["float8_0"]
        state = state_of(variables, layer)
        assert {k: (v.shape, v.dtype) for k, v in state.items()} == {
            f"{t}_{k}": (shape, np.dtype("float32"))
            for t in ("input", "kernel", "output_grad")
            for k, shape in (("scale", ()), ("amax_history", (16,)))
        }
        assert all(float(state[f"{t}_scale"]) == 1.0 for t in ("input", "kernel", "output_grad"))
        assert not any(np.any(np.asarray(v)) for k, v in state.items() if "history" in k)
    assert {leaf.dtype for leaf in jax.tree.leaves(variables["params"])} == {np.dtype("float32")}


@pytest.mark.filterwarnings("ignore:Keys of the DTypePolicyMap resolve no module:UserWarning")
def test_plain_module_init_then_float8_apply_raises_naming_linen_init():
    x, _ = data()
    variables = MLP().init(jax.random.key(0), x)
    with pytest.raises(ValueError, match=r"Dense at 'up' runs under the float8 policy") as info:
        jp.linen.apply(MLP(), hidden_map())(variables, x)
    assert "jmp_policy.linen.init(module, policy_or_map)" in str(info.value)
    assert "'_overwrite_with_gradient'/'float8_0'" in str(info.value)


def test_float8_forward_is_close_to_bfloat16_and_keeps_the_output_rule(maybe_jit):
    x, _ = data()
    variables = jp.linen.init(MLP(), hidden_map())(jax.random.key(0), x)
    f8 = maybe_jit(jp.linen.apply(MLP(), hidden_map()))(variables, x)
    bf16 = jp.linen.apply(MLP(), hidden_map("mixed_bfloat16"))({"params": variables["params"]}, x)
    assert f8.dtype == bf16.dtype == np.float32  # the float32 head's logits
    assert 1e-3 < measure.rel_err(f8, bf16) < 0.1  # e4m3 has 3 mantissa bits


def test_one_step_state_matches_a_hand_computation(maybe_jit):
    """One Dense: the new state is fp8_max / amax of its input, kernel and output gradient."""
    x = jnp.array([[0.5, -2.0, 1.0]], jnp.float32)
    model = nn.Dense(2, kernel_init=nn.initializers.constant(0.25))
    variables = jp.linen.init(model, F8)(jax.random.key(0), x)
    fn = jp.linen.apply(model, F8)
    grads = maybe_jit(jax.grad(lambda v: (fn(v, x).astype(jnp.float32) * 3.0).sum()))(variables)
    new = grads[COLLECTION]["float8_0"]
    assert new["input_amax_history"][:2].tolist() == [2.0, 0.0]
    assert float(new["input_scale"]) == 448.0 / 2.0
    assert new["kernel_amax_history"][0] == 0.25 and float(new["kernel_scale"]) == 448.0 * 4
    assert new["output_grad_amax_history"][0] == 3.0
    assert float(new["output_grad_scale"]) == pytest.approx(57344.0 / 3.0)
    # The gradient of the kernel is the straight-through one, in float32 master weights.
    assert grads["params"]["kernel"].dtype == np.float32
    np.testing.assert_allclose(grads["params"]["kernel"], np.outer(x[0], [3.0, 3.0]), rtol=0.07)


def test_a_module_called_twice_keeps_one_state_per_call(maybe_jit):
    class Twice(nn.Module):
        @nn.compact
        def __call__(self, x):
            shared = nn.Dense(3, name="shared")
            return shared(jnp.tanh(shared(x)))

    x = jnp.full((2, 3), 0.01)
    variables = jp.linen.init(Twice(), F8)(jax.random.key(0), x)
    assert sorted(variables[COLLECTION]["shared"]) == ["float8_0", "float8_1"]
    fn = jp.linen.apply(Twice(), F8)
    grads = maybe_jit(jax.grad(lambda v: fn(v, x).astype(jnp.float32).sum()))(variables)
    first, second = (state_of(grads, "shared", i) for i in (0, 1))
    # Each call's own amax, not their sum (what summing the gradients would give).
    assert float(first["input_amax_history"][0]) == pytest.approx(0.01, rel=1e-2)
    h = jp.linen.apply(nn.Dense(3), F8)(
        {"params": variables["params"]["shared"], COLLECTION: variables[COLLECTION]["shared"]}, x
    )
    expected = float(jnp.max(jnp.abs(jnp.tanh(h.astype(jnp.float32)))))
    assert float(second["input_amax_history"][0]) == pytest.approx(expected, rel=1e-2)
    assert first["kernel_amax_history"][0] == second["kernel_amax_history"][0]
    # Applying with one state only: the second call says what it needs.
    one = {"params": variables["params"], COLLECTION: {"shared": {"float8_0": first}}}
    with pytest.raises(ValueError, match="It is call 2 of this module in one step"):
        fn(one, x)


class ScanBody(nn.Module):
    @nn.compact
    def __call__(self, c, _):
        return jnp.tanh(nn.Dense(8)(c)), None


def scanned(variable_axes):
    class Stack(nn.Module):
        @nn.compact
        def __call__(self, x):
            layers = nn.scan(
                ScanBody, variable_axes=variable_axes, split_rngs={"params": True}, length=3
            )
            return layers()(x, None)[0]

    return Stack()


def test_under_nn_scan_the_state_is_stacked_per_layer(maybe_jit):
    x, _ = data()
    model = scanned({"params": 0, COLLECTION: 0})
    variables = jp.linen.init(model, F8)(jax.random.key(0), x)
    state = variables[COLLECTION]["ScanScanBody_0"]["Dense_0"]["float8_0"]
    assert state["input_amax_history"].shape == (3, 1024) and state["input_scale"].shape == (3,)
    fn = jp.linen.apply(model, F8)
    grads = maybe_jit(jax.grad(lambda v: fn(v, x).astype(jnp.float32).sum()))(variables)
    new = grads[COLLECTION]["ScanScanBody_0"]["Dense_0"]["float8_0"]
    amax = new["input_amax_history"][:, 0]
    assert float(amax[0]) == pytest.approx(float(jnp.abs(x).max()), rel=1e-2)
    assert float(amax[1]) <= 1.0 and float(amax[2]) <= 1.0  # tanh outputs, layer by layer
    assert float(amax[1]) != float(amax[2])
    np.testing.assert_allclose(new["input_scale"], 448.0 / amax, rtol=1e-6)


def test_under_nn_scan_without_the_collection_in_variable_axes_the_error_says_so():
    x, _ = data()
    with pytest.raises(ValueError, match=r"list '_overwrite_with_gradient' in `variable_axes`"):
        jp.linen.init(scanned({"params": 0}), F8)(jax.random.key(0), x)


# -- the compiled step ----------------------------------------------------------------------


def train_step(model, policy_map, optimizer):
    fn = jp.linen.apply(model, policy_map)

    def loss_fn(variables, x, y):
        return jnp.mean((fn(variables, x).astype(jnp.float32) - y) ** 2)

    def step(carry, batch):
        variables, opt_state = carry
        loss, grads = jax.value_and_grad(loss_fn)(variables, *batch)
        grads, float8_state = jp.linen.split_gradients(grads)
        updates, opt_state = optimizer.update(grads["params"], opt_state)
        params = optax.apply_updates(variables["params"], updates)
        return ({"params": params, **float8_state}, opt_state), loss

    return step, loss_fn


def test_a_training_step_converts_to_e4m3_and_e5m2_exactly_where_expected():
    x, y = data()
    variables = jp.linen.init(MLP(), hidden_map())(jax.random.key(0), x)
    optimizer = optax.adam(1e-3)
    step, _ = train_step(MLP(), hidden_map(), optimizer)
    carry = (variables, optimizer.init(variables["params"]))
    found = measure.converts(step, carry, (x, y))
    to = {d: sum(1 for _, b, _ in found if b == d) for d in ("float8_e4m3fn", "float8_e5m2")}
    back = [c for c in found if c[0].startswith("float8")]
    # Per float8 layer: its input and kernel to e4m3 (forward), its output gradient to
    # e5m2 (backward); none for the float32 head. Nothing converts back: the float8
    # operands go into the matmuls themselves.
    assert to == {"float8_e4m3fn": 2 * len(HIDDEN), "float8_e5m2": len(HIDDEN)}
    assert back == []
    # The operands are the layers' own, in the compute dtype, laid out with one
    # contracting dimension: (M, K) inputs and (K, N) kernels.
    e4m3 = sorted((a, s) for a, b, s in found if b == "float8_e4m3fn")
    assert e4m3 == sorted([
        ("bfloat16", (64, 8)), ("bfloat16", (8, 32)),  # up: input, kernel
        ("bfloat16", (64, 32)), ("bfloat16", (32, 32)),  # split: kernel (32, 2, 16)
        ("bfloat16", (64, 32)), ("bfloat16", (32, 32)),  # merge: (64, 2, 16), (2, 16, 32)
    ])  # fmt: skip
    assert {(a, s) for a, b, s in found if b == "float8_e5m2"} == {("bfloat16", (64, 32))}
    # Compiled, XLA's CPU backend may fuse a convert into each of its consumers rather than
    # keep one float8 copy: jax 0.10.2 compiles the 9 traced converts to 9, jax 0.12.0.1 to
    # 14 (each input and output gradient converted again inside the fusion of the gradient
    # matmul that reads it too; the same 11 dots). Never more than once per float8 matmul
    # that reads the operand: 3 layers x (forward, two gradients).
    hlo = jax.jit(step).lower(carry, (x, y)).compile().as_text()
    compiled = re.findall(r"= (f8e4m3fn|f8e5m2)\[[^\]]*\]\S* convert\(", hlo)
    assert sum(to.values()) <= len(compiled) <= 2 * 3 * len(HIDDEN), compiled
    # A bfloat16 map: no float8 anywhere.
    step_bf16, _ = train_step(MLP(), hidden_map("mixed_bfloat16"), optimizer)
    bf16_carry = ({"params": variables["params"]}, carry[1])
    assert not [c for c in measure.converts(step_bf16, bf16_carry, (x, y)) if "float8" in str(c)]


def run_training(policy_map, steps, variables=None, x=None, y=None, lr=3e-3):
    if x is None:
        x, y = data()
    if variables is None:
        variables = jp.linen.init(MLP(), policy_map)(jax.random.key(0), x)
    optimizer = optax.adam(lr)
    step, loss_fn = train_step(MLP(), policy_map, optimizer)

    @functools.partial(jax.jit, compiler_options=FAST_COMPILE)
    def run(variables):
        carry = (variables, optimizer.init(variables["params"]))
        (variables, _), losses = jax.lax.scan(
            lambda c, _: step(c, (x, y)), carry, None, length=steps
        )
        return variables, losses

    return run(variables), loss_fn


@pytest.mark.parametrize("history", [1, 1024])
def test_mlp_trained_in_float8_ends_near_the_bfloat16_loss(history):
    policy = jp.QuantizedFloat8DTypePolicy("float8", "mixed_bfloat16", history)
    (trained, losses), _ = run_training(hidden_map(policy), 300)
    (_, losses_bf16), _ = run_training(hidden_map("mixed_bfloat16"), 300)
    assert float(losses_bf16[-1]) < 0.2 * float(losses_bf16[0])  # it learnt
    assert abs(float(losses[-1]) - float(losses_bf16[-1])) <= 0.05 * float(losses_bf16[0])
    # The whole curve, to within 3% of the initial loss (float8 levels off a little higher).
    np.testing.assert_allclose(losses, losses_bf16, atol=0.03 * float(losses_bf16[0]))
    state = trained[COLLECTION]
    assert all(bool(jnp.isfinite(leaf).all()) for leaf in jax.tree.leaves(state))
    up = state["up"]["float8_0"]
    assert up["input_amax_history"].shape == (history,)
    # After 300 steps the input's scale is fp8_max over the history's maximum.
    top = float(up["input_amax_history"].max())
    assert float(up["input_scale"]) == pytest.approx(448.0 / top, rel=1e-6)
    assert int(jnp.count_nonzero(up["output_grad_amax_history"])) == min(history, 300)


def test_fidelity_on_tiny_inputs_and_a_tiny_loss_float8_tracks_float32():
    """Inputs around 1e-3 and a loss scaled by 2**-20: float16 without loss scaling does
    not learn (its gradients underflow), float8 with delayed scaling does, within 5% of
    the initial loss of float32's held-out loss."""
    x, y = data(0, scale=1e-3)
    x_test, y_test = data(1, scale=1e-3)
    tiny = 2.0**-20

    model = MLP(up_scale=1e3)  # a first layer that brings 1e-3 inputs to order 1

    def held_out(policy_map, trained):
        fn = jp.linen.apply(model, policy_map)
        return float(jnp.mean((fn(trained, x_test).astype(jnp.float32) - y_test) ** 2))

    def trained_with(policy_map):
        fn = jp.linen.apply(model, policy_map)
        variables = jp.linen.init(model, policy_map)(jax.random.key(0), x)
        # adam ignores the loss's scale, except through eps: an eps far below the
        # gradients lets a run learn from gradients of any size, and none from zeros.
        optimizer = optax.adam(3e-3, eps=1e-30)

        def loss_fn(v):
            return tiny * jnp.mean((fn(v, x).astype(jnp.float32) - y) ** 2)

        @functools.partial(jax.jit, compiler_options=FAST_COMPILE)
        def run(variables):
            def step(carry, _):
                v, s = carry
                grads, state = jp.linen.split_gradients(jax.grad(loss_fn)(v))
                updates, s = optimizer.update(grads["params"], s)
                return ({"params": optax.apply_updates(v["params"], updates), **state}, s), None

            carry = (variables, optimizer.init(variables["params"]))
            return jax.lax.scan(step, carry, None, length=300)[0][0]

        return held_out(policy_map, variables), held_out(policy_map, run(variables))

    initial, f32 = trained_with(hidden_map("float32", "float32"))
    _, f16 = trained_with(jp.DTypePolicyMap("mixed_float16"))
    _, f8 = trained_with(hidden_map(F8))
    _, f8_current = trained_with(hidden_map("float8_current_from_mixed_bfloat16"))
    assert f32 < 0.5 * initial  # float32 learns
    assert f16 > 0.9 * initial  # the control: float16 gradients underflow, nothing learnt
    assert abs(f8 - f32) <= 0.05 * initial
    assert abs(f8_current - f32) <= 0.05 * initial


def test_current_scaling_ends_near_bfloat16_on_the_mlp():
    (_, losses), _ = run_training(hidden_map("float8_current_from_mixed_bfloat16"), 300)
    (_, losses_bf16), _ = run_training(hidden_map("mixed_bfloat16"), 300)
    assert abs(float(losses[-1]) - float(losses_bf16[-1])) <= 0.05 * float(losses_bf16[0])


def test_at_a_large_learning_rate_delayed_scaling_holds_stale_scales_and_ends_worse():
    """The CPU reproduction of the H100 case (adam at lr 1e-3, width 8192): at lr 0.1 on
    benchmarks/float8_bench.py's MLP stack (width 64), delayed scaling with its default
    1,024-step amax history keeps the scale of the early steps' jump long after the tensors
    have shrunk again (the H200 trace: the gradients' scales held at the step-1 jump's amax),
    and ends above bfloat16's loss and above delayed scaling with a one-step history; current
    scaling, each tensor by its own amax, stays with bfloat16, and so does the one-step
    history.

    How far the 1,024-step runs end above hangs on the last bits of the arithmetic (the runs
    are chaotic at this learning rate): the mean over these 4 initialisations was 8.5x
    bfloat16's loss on jax 0.10.2 and 1.1x on 0.12.0.1, whose XLA CPU rounds each bfloat16
    operation of a fusion to bfloat16 where 0.10.2's kept float32 between them (see
    tests/optax_wrapper_test.py's float16 test). What both show, and this test states: the
    held scales (every layer's gradient amax history ends 8-31x above its latest amax),
    and the ordering of the final losses.
    """
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
    import float8_bench as bench

    args = bench.parse_args(["--tokens", "256", "--width", "64", "--hidden", "256", "--lr", "0.1"])
    model = bench.MLPStack(args.width, args.hidden, args.layers)
    x, y = bench.make_data(args)
    tx = optax.adam(args.lr)
    # The mean over 4 initialisations of the mean loss of the last 10 of 60 steps (one
    # run is chaotic at this learning rate; the mean is not).
    final = dict.fromkeys(("float8", "f8_cur", "bf16", "history_1"), 0.0)
    held = []  # per run and layer of the 1,024-step history: its maximum over its latest amax
    policies = {
        **bench.VARIANTS,
        "history_1": jp.DTypePolicyMap(
            "mixed_bfloat16",
            {
                r"block_\d+/(up|down)": jp.QuantizedFloat8DTypePolicy(
                    "float8", source_name="mixed_bfloat16", amax_history_length=1
                )
            },
        ),
    }
    # LLVM at XLA's default optimization level (the suite compiles at 0; its fusion code
    # generator stays the suite's): which runs diverge at this learning rate hangs on the
    # last bits of the arithmetic.
    default_level = {"xla_backend_optimization_level": 3}
    steps = {
        name: jax.jit(bench.make_step(model, policies[name], tx), compiler_options=default_level)
        for name in final
    }
    for seed in range(1, 5):
        for name in final:
            policy = policies[name]
            variables = jp.linen.init(model, policy)(jax.random.key(seed), x[:8])
            step = steps[name]  # compiled once per variant, not once per seed
            opt_state = tx.init(variables["params"])
            for i in range(60):
                variables, opt_state, loss = step(variables, opt_state, x, y)
                final[name] += float(loss) / 40 if i >= 50 else 0.0
            if name == "float8":
                for layer in jax.tree.leaves(
                    variables[COLLECTION],
                    is_leaf=lambda t: isinstance(t, dict) and "output_grad_amax_history" in t,
                ):
                    history = np.asarray(layer["output_grad_amax_history"])
                    held.append(float(history.max() / history[0]))
    assert abs(final["f8_cur"] - final["bf16"]) < 0.1 * final["bf16"], final
    assert final["history_1"] < 1.2 * final["bf16"], final  # a one-step history tracks bf16
    # The 1,024-step history: every layer's gradient scale still the early jump's (its
    # latest amax 8-31x below the history's maximum, measured), and its runs end higher.
    assert len(held) == 4 * 2 * args.layers and min(held) > 4, held
    assert final["float8"] > 1.1 * final["history_1"], final
    assert final["float8"] > final["bf16"], final


# -- loss scaling ------------------------------------------------------------------------------


def test_with_loss_scaling_and_train_state_the_state_is_never_unscaled_or_skipped():
    """float16 compute and float8 layers under dynamic loss scaling, through flax's
    TrainState: the float8 state goes around the optimizer (never unscaled), records the
    scaled output gradients, and an overflowing step skips the update and leaves the
    output-gradient history as it was while the forward histories still record."""
    policy_map = jp.DTypePolicyMap("mixed_float16", {"up|split|merge": "float8_from_mixed_float16"})
    x, y = data()
    variables = jp.linen.init(MLP(), policy_map)(jax.random.key(0), x)
    fn = jp.linen.apply(MLP(), policy_map)
    tx = jp.loss_scaling(optax.adam(1e-3), jp.DynamicLossScale(2.0**10, period=1000))
    state = train_state.TrainState.create(apply_fn=fn, params=variables, tx=tx)

    def loss_fn(v):
        return jnp.mean((fn(v, x).astype(jnp.float32) - y) ** 2)

    @jax.jit
    def step(state):
        loss_scale = jp.get_loss_scale(state.opt_state)
        _, grads = jp.scaled_value_and_grad(loss_fn)(loss_scale, state.params)
        return state.apply_gradients(grads=grads), grads

    unscaled = jax.grad(loss_fn)(variables)[COLLECTION]["up"]["float8_0"]
    new_state, grads = step(state)
    up = new_state.params[COLLECTION]["up"]["float8_0"]
    # The state is the new state itself (TrainState replaced it), and its output-gradient
    # amax is that of the scaled gradients: 2**10 times the unscaled one.
    assert (
        up["output_grad_amax_history"][0]
        == grads[COLLECTION]["up"]["float8_0"]["output_grad_amax_history"][0]
    )
    ratio = float(up["output_grad_amax_history"][0] / unscaled["output_grad_amax_history"][0])
    assert ratio == pytest.approx(2.0**10, rel=0.1)  # (float8 rounding differs a little)
    assert float(jp.get_loss_scale(new_state.opt_state).loss_scale) == 2.0**10  # finite step

    # An overflowing step: a loss scale float16's gradients cannot hold.
    huge = new_state.replace(
        opt_state=new_state.opt_state._replace(loss_scale=jp.DynamicLossScale(2.0**24))
    )
    after, _ = step(huge)
    assert float(jp.get_loss_scale(after.opt_state).loss_scale) == 2.0**23  # backed off
    same = jax.tree.map(jnp.array_equal, after.params["params"], new_state.params["params"])
    assert all(jax.tree.leaves(same))  # skipped
    old, up2 = up, after.params[COLLECTION]["up"]["float8_0"]
    np.testing.assert_array_equal(up2["output_grad_amax_history"], old["output_grad_amax_history"])
    assert float(up2["output_grad_scale"]) == float(old["output_grad_scale"])
    # The forward recorded its amax (the ring rolled: the previous one went last).
    assert up2["input_amax_history"][-1] == old["input_amax_history"][0]
    assert up2["input_amax_history"][0] > 0
    assert all(bool(jnp.isfinite(leaf).all()) for leaf in jax.tree.leaves(after.params))


def test_loss_scaling_refuses_gradients_that_carry_float8_state():
    x, _ = data()
    variables = jp.linen.init(MLP(), hidden_map())(jax.random.key(0), x)
    fn = jp.linen.apply(MLP(), hidden_map())
    grads = jax.grad(lambda v: fn(v, x).astype(jnp.float32).sum())(variables)
    tx = jp.loss_scaling(optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"jmp_policy\.linen\.split_gradients"):
        tx.update(grads, tx.init(variables))
    rest, state = jp.linen.split_gradients(grads)
    assert sorted(rest) == ["params"] and sorted(state) == [COLLECTION]
    assert state[COLLECTION] is grads[COLLECTION]
    tx.update(rest, tx.init(rest))  # no error


def test_split_gradients_rejects_non_mappings_and_passes_through_without_state():
    with pytest.raises(TypeError, match="`grads` must be a mapping of variable collections"):
        jp.linen.split_gradients([1.0])
    grads = {"params": {"w": jnp.ones(2)}}
    rest, state = jp.linen.split_gradients(grads)
    assert rest == grads and rest is not grads and state == {}


# -- Flax's own lm1b model ------------------------------------------------------------------


def test_lm1b_with_float8_mlps_trains_like_bfloat16():
    config = measure.lm1b_config(dtype=None, num_layers=1)
    model = lm.TransformerLM(config)
    tokens = measure.tokens()
    mlps = r".*/MlpBlock_0/Dense_\d"
    f8 = jp.DTypePolicyMap("mixed_bfloat16", {mlps: F8})
    bf16 = jp.DTypePolicyMap("mixed_bfloat16")
    variables = jp.linen.init(model, f8)(jax.random.key(0), tokens)
    state = variables[COLLECTION]["decoder"]["encoderdecoderblock_0"]["MlpBlock_0"]
    assert sorted(state) == ["Dense_0", "Dense_1"]

    def train(policy_map, variables, steps=60):
        fn = jp.linen.apply(model, policy_map)
        optimizer = optax.adam(3e-3)

        def loss_fn(v):
            logits = fn(v, tokens).astype(jnp.float32)
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens).mean()

        @functools.partial(jax.jit, compiler_options=FAST_COMPILE)
        def run(variables):
            def step(carry, _):
                v, s = carry
                loss, grads = jax.value_and_grad(loss_fn)(v)
                grads, st = jp.linen.split_gradients(grads)
                updates, s = optimizer.update(grads["params"], s)
                return ({"params": optax.apply_updates(v["params"], updates), **st}, s), loss

            carry = (variables, optimizer.init(variables["params"]))
            (v, _), losses = jax.lax.scan(step, carry, None, length=steps)
            return v, losses

        return run(variables)

    trained, losses = train(f8, variables)
    _, losses_bf16 = train(bf16, {"params": variables["params"]})
    assert float(losses_bf16[-1]) < 0.5 * float(losses_bf16[0])
    assert abs(float(losses[-1]) - float(losses_bf16[-1])) <= 0.05 * float(losses_bf16[0])
    new = trained[COLLECTION]["decoder"]["encoderdecoderblock_0"]["MlpBlock_0"]["Dense_1"]
    assert int(jnp.count_nonzero(new["float8_0"]["output_grad_amax_history"])) == 60
    assert all(bool(jnp.isfinite(leaf).all()) for leaf in jax.tree.leaves(trained[COLLECTION]))


# -- sharding --------------------------------------------------------------------------------


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_data_parallel_on_8_devices_gives_the_single_device_state(axis_type):
    """Under jit with the batch sharded over 8 devices (classic or explicit sharding), the
    amaxes are global reductions: the new state equals the one computed on one device."""
    from jax.sharding import AxisType, NamedSharding, PartitionSpec

    assert len(jax.devices()) == 8
    mesh = jax.make_mesh((8,), ("batch",), axis_types=(getattr(AxisType, axis_type),))
    x, y = data(n=64)
    variables = jp.linen.init(MLP(), hidden_map())(jax.random.key(0), x)
    fn = jp.linen.apply(MLP(), hidden_map())

    @jax.jit
    def new_state(variables, x, y):
        grads = jax.grad(lambda v: jnp.mean((fn(v, x).astype(jnp.float32) - y) ** 2))(variables)
        return jp.linen.split_gradients(grads)[1]

    single = new_state(variables, x, y)
    sharded_x = jax.device_put(x, NamedSharding(mesh, PartitionSpec("batch")))
    sharded_y = jax.device_put(y, NamedSharding(mesh, PartitionSpec("batch")))
    assert len(sharded_x.sharding.device_set) == 8
    with jax.set_mesh(mesh):
        sharded = new_state(variables, sharded_x, sharded_y)
    # Equal up to bfloat16 rounding (2**-8): a sharded backward sums in another order.
    for a, b in zip(jax.tree.leaves(sharded), jax.tree.leaves(single), strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-2)
    up = sharded[COLLECTION]["up"]["float8_0"]
    assert float(up["input_amax_history"][0]) == pytest.approx(float(jnp.abs(x).max()), rel=1e-2)


# -- the matmuls are float8 GEMMs (issue #18) -----------------------------------------------


@pytest.mark.parametrize("scaling", ["delayed", "current"])
def test_every_float8_matmul_is_a_dot_general_of_two_float8_operands(scaling):
    """Forward e4m3 x e4m3; gradients e5m2 with the saved e4m3 operand; two matmuls for
    the first layer (its input, the data, needs no gradient); none on bf16 operands."""
    policy = jp.QuantizedFloat8DTypePolicy("float8", "mixed_bfloat16", scaling=scaling)
    x, y = data()
    variables = jp.linen.init(MLP(), hidden_map(policy))(jax.random.key(0), x)
    step, _ = train_step(MLP(), hidden_map(policy), optax.adam(1e-3))
    carry = (variables, optax.adam(1e-3).init(variables["params"]))
    dots = measure.count(measure.dot_dtypes(step, carry, (x, y)))
    assert dots == {
        "float8_e4m3fn": 3,  # forward of up, split, merge
        "float8_e5m2/float8_e4m3fn": 2,  # input gradients of split and merge
        "float8_e4m3fn/float8_e5m2": 3,  # kernel gradients of the three
        "float32": 3,  # the float32 head: forward and both gradients
    }


def test_several_contracting_axes_become_one_and_the_result_keeps_its_layout():
    """DenseGeneral over two input axes and an Einsum whose kernel einsum puts first:
    the same values as the float matmul within float8's error, in the layer's layout."""
    # NumPy's draw: jax.random.normal compiles once per shape, seconds for a rank-4 one on CPU
    x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 6, 2, 16), np.float32))
    for module in (
        nn.DenseGeneral((3, 8), axis=(-2, -1)),
        nn.Einsum((2, 16, 24), "bthi,hio->bto"),
    ):
        variables = jp.linen.init(module, F8)(jax.random.key(1), x)
        for jit in (False, True):
            fn = jp.linen.apply(module, F8)
            fn = jax.jit(fn) if jit else fn
            got = fn(variables, x)
            want = module.apply({"params": variables["params"]}, x)
            assert got.shape == want.shape and got.dtype == jnp.bfloat16
            err = float(jnp.abs(got.astype(jnp.float32) - want).max() / jnp.abs(want).max())
            assert err < 0.1, err
        dots = measure.dot_dtypes(jp.linen.apply(module, F8), variables, x)
        assert dots == [("float8_e4m3fn", "float8_e4m3fn")]
