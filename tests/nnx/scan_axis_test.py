"""An NNX stack that keeps its layers on axis 1 (``nnx.vmap(..., out_axes=1)`` to make
them, ``nnx.scan(in_axes=(nnx.Carry, 1))`` to run them) is quantized, calibrated and served
per layer along axis 1, each layer equal to that layer quantized alone. The axis is read
from the layer's own kernel shape (NNX names it at the call, not in the module): where
more than one axis could be it, the kernel is quantized whole with a warning at quantize
time and runs, never an error at apply (#47)."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jmp_policy as jp

D, DH, DEPTH = 32, 16, 2
X = jax.random.normal(jax.random.key(0), (4, 8, D))


class Block(nnx.Module):
    def __init__(self, heads, rngs):
        self.qkv = nnx.LinearGeneral(D, (heads, DH), rngs=rngs)
        self.out = nnx.LinearGeneral((heads, DH), D, axis=(-2, -1), rngs=rngs)
        self.mlp = nnx.Linear(D, D, rngs=rngs)

    def __call__(self, x):
        x = x + self.out(self.qkv(x))
        return x + self.mlp(nnx.gelu(x))


class Stack(nnx.Module):
    def __init__(self, heads, rngs):
        @nnx.split_rngs(splits=DEPTH)
        @nnx.vmap(in_axes=0, out_axes=1)
        def make(rngs):
            return Block(heads, rngs)

        self.blocks = make(rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 1), out_axes=nnx.Carry)
        def body(x, block):
            return block(x)

        return body(x, self.blocks)


def _alone(stack, heads, i):
    """Layer ``i`` of the stack as a module of its own (slice ``i`` of axis 1)."""
    block = Block(heads, nnx.Rngs(9))
    state = jax.tree.map(lambda a: a[:, i], nnx.state(stack.blocks, nnx.Param))
    nnx.update(block, state)
    return block


def _layers(model, name):
    return getattr(model.blocks, name).kernel.get_value()


@pytest.mark.parametrize(
    "policy",
    [
        "int8_from_float32",
        "int4/16_from_float32",
        "gptq/4/16_from_float32",
        "awq/4/16_from_float32",
    ],
)
@pytest.mark.parametrize("heads", [DEPTH, 3], ids=["heads==depth", "heads!=depth"])
def test_an_axis_1_stack_is_quantized_and_served_per_layer(policy, heads, maybe_jit):
    model = Stack(heads, nnx.Rngs(0))
    assert model.blocks.qkv.kernel.get_value().shape == (D, DEPTH, heads, DH)
    calibrated = policy.startswith(("gptq", "awq"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make = jp.nnx.calibrate if calibrated else (lambda m, p, _: jp.nnx.quantize(m, p))
        q = make(model, policy, [X])
        run = jp.nnx.apply(q, policy)
        got = maybe_jit(lambda x: run(x))(X)
    h, h_float = X, X
    for i in range(DEPTH):
        block = _alone(model, heads, i)
        alone = make(block, policy, [h_float])  # on the inputs it sees in the float stack
        h_float = block(h_float)
        for name in ("qkv", "out", "mlp"):
            k = _layers(q, name)
            assert (k.stacked, k.stacked_at) == (1, 1), name
            mine = getattr(alone, name).kernel.get_value()
            np.testing.assert_array_equal(k.values[:, i], mine.values)
            np.testing.assert_allclose(k.scale[i], mine.scale, rtol=1e-6)
        h = jp.nnx.apply(alone, policy)(h)
        assert q.blocks.qkv.bias.get_value().dtype == jnp.float32
    assert got.shape == X.shape and got.dtype == jnp.float32
    np.testing.assert_allclose(got, h, rtol=1e-5, atol=1e-5)


class Heads(nnx.Module):
    """Only a stacked projection to heads: as many heads as layers, axis 1 and axis 2 of
    its kernel ``[in, depth, heads, dim]`` both fit, and no sibling layer tells which."""

    def __init__(self, rngs):
        @nnx.split_rngs(splits=DEPTH)
        @nnx.vmap(in_axes=0, out_axes=1)
        def make(rngs):
            return nnx.LinearGeneral(D, (DEPTH, DH), rngs=rngs)

        self.qkv = make(rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 1), out_axes=nnx.Carry)
        def body(x, layer):
            return x + layer(x).reshape(x.shape)

        return body(x, self.qkv)


def test_an_axis_the_kernels_cannot_tell_is_quantized_whole_with_a_warning():
    model = Heads(nnx.Rngs(0))
    with pytest.warns(UserWarning, match=r"'qkv' .* more than one axis"):
        q = jp.nnx.quantize(model, "int8_from_float32")
    assert q.qkv.kernel.get_value().stacked == 0
    got = jp.nnx.apply(q, "int8_from_float32")(X)  # runs (dequantized ahead of the stack)
    want = model(X)
    assert got.shape == X.shape and got.dtype == jnp.float32
    assert float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)) < 0.02


def test_search_scores_an_axis_1_stack_per_layer():
    heads = 3
    model = Stack(heads, nnx.Rngs(0))
    result = jp.nnx.search_map(
        model, [X], lambda out, batch: jnp.mean((out - batch) ** 2),
        budget={"effective_bits": 16}, base="float32", candidates=("int4/16_from_float32",),
    )  # fmt: skip
    assert "shared by" not in str(result)
    rows = {row.path: row for row in result.table}
    assert set(rows) == {"blocks/qkv", "blocks/out", "blocks/mlp"}
    for row in rows.values():
        assert row.why.startswith(f"per stack (scanned: {DEPTH} layers)")
        assert row.scores["int4/16_from_float32"] > 0
    q = jp.nnx.quantize(model, "int4/16_from_float32")
    is_q = lambda a: isinstance(a, jp.QuantizedArray)  # noqa: E731
    nbytes = sum(
        a.nbytes for a in jax.tree.leaves(nnx.state(q, nnx.Param), is_leaf=is_q) if is_q(a)
    )
    assert result.at({"weight_bytes": nbytes}).weight_bytes == nbytes  # its layers' bytes
