"""A policy never breaks a loop: Flax's recurrent layers, scans and loops under 16-bit policies.

Issue #8: `nn.RNN(nn.LSTMCell(8))` under `"mixed_bfloat16"` crashed with "scan body function
carry input and carry output must have equal types". DESIGN's loop rule: the carry of any loop
(`nn.scan` as class or decorator, `nn.RNN` with any cell, `nn.Bidirectional`, `nn.while_loop`,
NNX's `nnx.scan`, `nnx.RNN`, `nnx.fori_loop`/`nnx.while_loop`) keeps the dtype it entered with.

Tolerances: a bfloat16 computation keeps 8 significant bits (relative step 2**-8 = 0.4%);
over a few recurrent steps of a tiny model its outputs stay within 3% (relative L2 error)
of the same model in float32; float16 (11 bits) within 0.5%.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from flax_examples import seq2seq_models
from flax_examples.measure import dot_dtypes

import jmp_policy as jp

BF16, F16, F32 = np.dtype(jnp.bfloat16), np.dtype("float16"), np.dtype("float32")
RTOL = {BF16: 3e-2, F16: 5e-3}  # relative L2 error against the float32 run (see above)
B, T, D, H = 2, 5, 6, 8


def rel_err(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def dtypes(tree):
    return {np.dtype(leaf.dtype) for leaf in jax.tree.leaves(tree)}


def seq(shape=(B, T, D), seed=0):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


# --------------------------------------------------------------------------- nn.RNN, each cell

CELLS = {
    "LSTMCell": (lambda: nn.LSTMCell(H), (B, T, D)),
    "OptimizedLSTMCell": (lambda: nn.OptimizedLSTMCell(H), (B, T, D)),
    "GRUCell": (lambda: nn.GRUCell(H), (B, T, D)),
    "SimpleCell": (lambda: nn.SimpleCell(H), (B, T, D)),
    "MGUCell": (lambda: nn.MGUCell(H), (B, T, D)),
}
# ConvLSTMCell is left out: the same carry path as LSTMCell, and its scanned convolution alone
# costs about 5 s of XLA compilation on CI's 2-core CPU.


@pytest.mark.parametrize("cell", list(CELLS))
def test_rnn_with_each_flax_cell_keeps_float32_carry_under_mixed_bfloat16(cell):
    make, shape = CELLS[cell]
    model = nn.RNN(make(), return_carry=True)
    x = seq(shape)
    variables = model.init(jax.random.key(1), x)
    carry32, y32 = model.apply(variables, x)

    carry, y = jax.jit(jp.linen.apply(model, "mixed_bfloat16"))(variables, x)

    assert dtypes(carry) == {F32}, f"{cell}: the carry entered float32 and must leave float32"
    assert y.shape == y32.shape
    assert np.isfinite(np.asarray(y, np.float32)).all()
    assert rel_err(y, y32) < RTOL[BF16], cell
    for c, c32 in zip(jax.tree.leaves(carry), jax.tree.leaves(carry32), strict=True):
        assert rel_err(c, c32) < RTOL[BF16], cell


def test_rnn_gradients_reach_float32_params_under_mixed_bfloat16():
    model = nn.RNN(nn.LSTMCell(H))
    x = seq()
    variables = model.init(jax.random.key(1), x)
    fn = jp.linen.apply(model, "mixed_bfloat16")

    def loss_of(apply):
        return lambda params: jnp.mean(apply({"params": params}, x).astype(jnp.float32) ** 2)

    g = jax.jit(jax.grad(loss_of(fn)))(variables["params"])
    g32 = jax.jit(jax.grad(loss_of(model.apply)))(variables["params"])
    assert dtypes(g) == {F32}
    assert rel_err(g["cell"]["hi"]["kernel"], g32["cell"]["hi"]["kernel"]) < 5e-2


@pytest.mark.parametrize(
    ("policy", "jit"),
    [
        ("mixed_bfloat16", False),
        ("mixed_bfloat16", True),
        ("mixed_float16", True),
        ("p=f32,c=bf16,o=f32", True),
    ],
)
def test_bidirectional_rnn_under_each_16_bit_policy(policy, jit):
    model = nn.Bidirectional(nn.RNN(nn.LSTMCell(H)), nn.RNN(nn.GRUCell(H)), return_carry=True)
    x = seq()
    variables = model.init(jax.random.key(2), x)
    (fwd32, bwd32), y32 = model.apply(variables, x)

    fn = jp.linen.apply(model, policy)
    (fwd, bwd), y = (jax.jit(fn) if jit else fn)(variables, x)  # with and without jit

    compute = jp.get(policy).compute_dtype
    assert dtypes(fwd) == {F32} and dtypes(bwd) == {F32}
    assert y.shape == (B, T, 2 * H)
    assert rel_err(y, y32) < RTOL[compute]
    assert rel_err(bwd, bwd32) < RTOL[compute]
    assert rel_err(fwd, fwd32) < RTOL[compute]
    if policy == "p=f32,c=bf16,o=f32":
        assert y.dtype == F32  # the output dtype differs from the compute dtype: cast


# --------------------------------------------------------------------------- seq2seq example
# (its training under each 16-bit policy is in training_curves_test.py)

VOCAB, HIDDEN = 8, 16


def seq2seq_batch():
    """The seq2seq example's shapes: one-hot queries and answers, EOS id 1."""
    rng = np.random.default_rng(0)
    enc = rng.integers(2, VOCAB, size=(4, 6))
    enc[:, 4] = 1  # EOS: sequence lengths 4
    dec = np.concatenate([np.zeros((4, 1), int), enc[:, ::-1][:, 2:]], axis=1)  # reverse
    return (
        jax.nn.one_hot(enc, VOCAB, dtype=jnp.float32),
        jax.nn.one_hot(dec, VOCAB, dtype=jnp.float32),
    )


def test_seq2seq_decoder_carry_keeps_the_dtype_it_entered_with():
    # The decoder's carry holds the previous prediction, a float32 one-hot the cell makes
    # itself, and enters as `decoder_inputs[:, 0]` (cast to bfloat16 with the root's inputs).
    model = seq2seq_models.Seq2seq(teacher_force=False, hidden_size=HIDDEN, vocab_size=VOCAB)
    enc, dec = seq2seq_batch()
    rngs = {"params": jax.random.key(0), "lstm": jax.random.key(1)}
    variables = model.init(rngs, enc, dec)
    logits, predictions = jp.linen.apply(model, "mixed_bfloat16")(
        variables, enc, dec, rngs={"lstm": jax.random.key(2)}
    )
    assert logits.shape == (4, dec.shape[1] - 1, VOCAB)
    assert np.isfinite(np.asarray(logits, np.float32)).all()
    steps = dec.shape[1] - 1
    assert np.asarray(predictions, np.float32).sum(-1).tolist() == [[1.0] * steps] * 4


# --------------------------------------------------------------------------- nn.scan, decorator


class DecoratorScan(nn.Module):
    """`nn.scan` as a function over a plain body (Flax's documented decorator form)."""

    @nn.compact
    def __call__(self, xs):
        dense = nn.Dense(H, name="dense")

        @functools.partial(
            nn.scan,
            variable_broadcast="params",
            split_rngs={"params": False},
            in_axes=1,
            out_axes=1,
        )
        def body(mdl, c, x):
            c = jnp.tanh(mdl(jnp.concatenate([c, x], axis=-1)))
            return c, c

        c0 = jnp.zeros((xs.shape[0], H), jnp.float32)  # the user's choice: a float32 carry
        return body(dense, c0, xs)


def test_decorator_form_of_nn_scan_keeps_float32_carry(maybe_jit):
    model, x = DecoratorScan(), seq()
    variables = model.init(jax.random.key(0), x)
    c32, ys32 = model.apply(variables, x)
    c, ys = maybe_jit(jp.linen.apply(model, "mixed_bfloat16"))(variables, x)
    assert c.dtype == F32
    assert ys.shape == (B, T, H)
    assert rel_err(ys, ys32) < RTOL[BF16]
    assert rel_err(c, c32) < RTOL[BF16]


# --------------------------------------------------------------------------- nn.while_loop


class WhileLoop(nn.Module):
    """`nn.while_loop` with a module call in its body (Flax's documented pattern)."""

    steps: int = 3

    @nn.compact
    def __call__(self, x):
        dense = nn.Dense(x.shape[-1], name="dense")
        h = x.astype(jnp.float32)  # a float32 carry, as the user wrote it
        if self.is_initializing():
            dense(h)

        def cond_fn(mdl, c):
            return c[0] < self.steps

        def body_fn(mdl, c):
            i, h = c
            return i + 1, jnp.tanh(mdl(h))

        _, h = nn.while_loop(cond_fn, body_fn, dense, (jnp.array(0), h))
        return h


class ForiLoop(nn.Module):
    """A fori loop in Linen (Flax 0.12 has no `nn.fori_loop`: it is `nn.while_loop` on a counter,
    the form `jax.lax.fori_loop` lowers to), with the float32 carry built from the inputs."""

    steps: int = 3

    @nn.compact
    def __call__(self, x):
        dense = nn.Dense(x.shape[-1], name="dense")
        h = x.astype(jnp.float32)
        if self.is_initializing():
            dense(h)

        def body_fn(mdl, c):
            i, h = c
            return i + 1, jnp.tanh(mdl(h)) * (i + 1)  # int32 * bfloat16 is bfloat16

        _, h = nn.while_loop(lambda _, c: c[0] < self.steps, body_fn, dense, (jnp.array(0), h))
        return h


@pytest.mark.parametrize("cls", [WhileLoop, ForiLoop])
def test_linen_while_loop_keeps_float32_carry(cls, maybe_jit):
    model, x = cls(), seq((B, D))
    variables = model.init(jax.random.key(0), x)
    y32 = model.apply(variables, x)
    y = maybe_jit(jp.linen.apply(model, "mixed_bfloat16"))(variables, x)
    assert y.dtype == F32
    assert rel_err(y, y32) < RTOL[BF16]


# --------------------------------------------------------------------------- NNX loops


class NNXLoops(nnx.Module):
    def __init__(self, kind, *, rngs):
        self.kind = kind
        self.dense = nnx.Linear(D, D, rngs=rngs)

    def __call__(self, x):
        h = x.astype(jnp.float32)
        if self.kind == "fori_loop":

            def body(i, carry):
                dense, h = carry
                return dense, jnp.tanh(dense(h))

            _, h = nnx.fori_loop(0, 3, body, (self.dense, h))
        else:

            def cond(carry):
                return carry[0] < 3

            def body(carry):
                i, dense, h = carry
                return i + 1, dense, jnp.tanh(dense(h))

            _, _, h = nnx.while_loop(cond, body, (jnp.array(0), self.dense, h))
        return h


@pytest.mark.parametrize("kind", ["fori_loop", "while_loop"])
def test_nnx_fori_and_while_loop_keep_float32_carry(kind):
    model, x = NNXLoops(kind, rngs=nnx.Rngs(0)), seq((B, D))
    y32 = model(x)
    y = jp.nnx.apply(model, "mixed_bfloat16")(x)
    assert y.dtype == F32
    assert rel_err(y, y32) < RTOL[BF16]


@pytest.mark.filterwarnings("ignore:.*set their own `dtype`:UserWarning")  # the cells' own
@pytest.mark.parametrize(
    "cell",
    [
        lambda rngs: nnx.LSTMCell(D, H, rngs=rngs),
        lambda rngs: nnx.GRUCell(D, H, rngs=rngs),
        lambda rngs: nnx.SimpleCell(D, H, rngs=rngs),
    ],
    ids=["LSTMCell", "GRUCell", "SimpleCell"],
)
def test_nnx_rnn_keeps_float32_carry_under_mixed_bfloat16(cell):
    model = nnx.RNN(cell(nnx.Rngs(0)), return_carry=True)
    x = seq()
    carry32, y32 = model(x)
    carry, y = jp.nnx.apply(model, "mixed_bfloat16")(x)
    assert dtypes(carry) == {F32}
    assert rel_err(y, y32) < RTOL[BF16]
    for c, c32 in zip(jax.tree.leaves(carry), jax.tree.leaves(carry32), strict=True):
        assert rel_err(c, c32) < RTOL[BF16]


def test_nnx_rnn_under_jit_gives_float32_gradients():
    model = nnx.RNN(nnx.LSTMCell(D, H, rngs=nnx.Rngs(0)))
    x = seq()

    @nnx.jit
    def grads(model):
        def loss(m):
            return jnp.mean(jp.nnx.apply(m, "mixed_bfloat16")(x).astype(jnp.float32) ** 2)

        return nnx.grad(loss)(model)

    g = grads(model)
    assert dtypes(nnx.state(g, nnx.Param)) == {F32}


# --------------------------------------------------------------------------- nnx.scan over layers
# Flax's examples/nnx_toy_examples/06_scan_over_layers.py, as written there (Block: Linear,
# BatchNorm, Dropout; ScanMLP: layers made with nnx.vmap, run with nnx.scan).


class Block(nnx.Module):
    def __init__(self, dim: int, *, rngs: nnx.Rngs):
        self.linear = nnx.Linear(dim, dim, rngs=rngs)
        self.bn = nnx.BatchNorm(dim, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x: jax.Array):
        return jax.nn.gelu(self.dropout(self.bn(self.linear(x))))


class ScanMLP(nnx.Module):
    def __init__(self, dim: int, *, n_layers: int, rngs: nnx.Rngs):
        self.n_layers = n_layers

        @nnx.split_rngs(splits=n_layers)
        @nnx.vmap(axis_size=n_layers)
        def create_block(rngs: nnx.Rngs):
            return Block(dim, rngs=rngs)

        self.layers = create_block(rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        @nnx.scan
        def scan_fn(x: jax.Array, block: Block):
            x = block(x)
            return x, None

        x, _ = scan_fn(x, self.layers)
        return x


@pytest.mark.parametrize(
    ("root", "layers", "dot"),
    [("float32", "mixed_bfloat16", "bfloat16"), ("mixed_bfloat16", "float32", "float32")],
)
def test_nnx_scan_over_layers_under_a_map_giving_layers_another_policy(root, layers, dot):
    model = ScanMLP(D, n_layers=3, rngs=nnx.Rngs(0))
    model.eval()
    x = seq((B, D))
    y32 = model(x)
    policy_map = jp.DTypePolicyMap(root, {"layers": layers})
    fn = jp.nnx.apply(model, policy_map)

    y = fn(x)

    # the carry entered in the root's compute dtype and leaves in it
    assert y.dtype == jp.get(root).compute_dtype
    assert rel_err(y, y32) < RTOL[BF16]
    # the one Linear in the scanned body runs in the layers' compute dtype
    graphdef, state = nnx.split(model)

    def pure(state, x):
        return jp.nnx.apply(nnx.merge(graphdef, state), policy_map)(x)

    assert dot_dtypes(pure, state, x) == [(dot, dot)]
