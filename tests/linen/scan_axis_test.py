"""A scan stack that keeps its parameters on axis 1 (``nn.scan(..., variable_axes={"params":
1})``, as big_vision's decoders do) is quantized, calibrated, scored and served per layer
along the axis the scan slices, read from the scan's own ``variable_axes``, never guessed
from shapes: with as many heads as layers (where shapes cannot tell) and with other
counts. Each layer's output equals that layer quantized alone (#47)."""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_policy as jp

DH, D, DEPTH = 16, 32, 2
X = jax.random.normal(jax.random.key(0), (4, 8, D))


def _block(heads):
    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            h = nn.DenseGeneral((heads, DH), name="qkv")(x)
            x = x + nn.DenseGeneral(D, axis=(-2, -1), name="out")(h)
            return x + nn.Dense(D, name="mlp")(nn.gelu(x)), None

    return Block


def _models(heads):
    block = _block(heads)

    class Stack(nn.Module):
        @nn.compact
        def __call__(self, x):
            layers = nn.scan(
                block, variable_axes={"params": 1}, split_rngs={"params": True}, length=DEPTH
            )
            return layers(name="blocks")(x, None)[0]

    class Unrolled(nn.Module):  # the same layers, each its own module
        @nn.compact
        def __call__(self, x):
            for i in range(DEPTH):
                x = block(name=f"layer_{i}")(x, None)[0]
            return x

    return Stack(), Unrolled()


def _unrolled_params(params):
    """The stack's float parameters as separate layers: slice ``i`` of axis 1 of each."""
    blocks = params["blocks"]
    return {f"layer_{i}": jax.tree.map(lambda a, i=i: a[:, i], blocks) for i in range(DEPTH)}


def _dequantized(tree):
    is_q = lambda a: isinstance(a, jp.QuantizedArray)  # noqa: E731
    return jax.tree.map(lambda a: a.dequantize() if is_q(a) else a, tree, is_leaf=is_q)


def _setup(heads):
    stack, unrolled = _models(heads)
    variables = stack.init(jax.random.key(1), X)
    kernel = variables["params"]["blocks"]["qkv"]["kernel"]
    assert kernel.shape == (D, DEPTH, heads, DH)  # the layers on axis 1
    return stack, unrolled, variables, {"params": _unrolled_params(variables["params"])}


def _assert_per_layer(q, q_alone, heads):
    for name, shape in (("qkv", (D, DEPTH, heads, DH)), ("out", (heads, DEPTH, DH, D))):
        k = q["params"]["blocks"][name]["kernel"]
        assert isinstance(k, jp.QuantizedArray), name
        assert (k.shape, k.stacked, k.stacked_at) == (shape, 1, 1), name
        assert k.scale.shape[0] == DEPTH  # a scale per layer
        for i in range(DEPTH):
            alone = q_alone["params"][f"layer_{i}"][name]["kernel"]
            np.testing.assert_array_equal(k.values[:, i], alone.values)
            np.testing.assert_array_equal(k.scale[i], alone.scale)
            np.testing.assert_array_equal(k.dequantize()[:, i], alone.dequantize())
        assert q["params"]["blocks"][name]["bias"].dtype == jnp.float32


@pytest.mark.parametrize("heads", [DEPTH, 3], ids=["heads==depth", "heads!=depth"])
@pytest.mark.parametrize("mode", ["int8", "int4/16", "int4"])
def test_quantize_and_serve_an_axis_1_stack_per_layer(heads, mode, maybe_jit):
    stack, unrolled, variables, alone = _setup(heads)
    policy = jp.DTypePolicyMap("float32", {".*": f"{mode}_from_float32"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning: per layer, read in the loop
        q = jp.linen.quantize(stack, policy, variables, X)
        q_alone = jp.linen.quantize(unrolled, policy, alone, X)
        _assert_per_layer(q, q_alone, heads)
        got = maybe_jit(jp.linen.apply(stack, policy))(q, X)
    want = jp.linen.apply(unrolled, policy)(q_alone, X)
    assert got.dtype == jnp.float32 and got.shape == X.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # The stored layout is the model's: dequantized, it runs as float weights do.
    np.testing.assert_allclose(stack.apply(_dequantized(q), X), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads", [DEPTH, 3], ids=["heads==depth", "heads!=depth"])
@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_calibrate_an_axis_1_stack_per_layer(heads, method):
    stack, unrolled, variables, alone = _setup(heads)
    policy = jp.DTypePolicyMap("float32", {".*": f"{method}/4/16_from_float32"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no layer rounded to nearest, nothing at apply
        q, report = jp.linen.calibrate(stack, policy, variables, [X], return_report=True)
        q_alone = jp.linen.calibrate(unrolled, policy, alone, [X])
        got = jp.linen.apply(stack, policy)(q, X)
        jitted = jax.jit(jp.linen.apply(stack, policy))(q, X)
    assert len(report) == 3 * DEPTH  # every layer of every kernel solved on its own
    _assert_per_layer(q, q_alone, heads)
    want = jp.linen.apply(unrolled, policy)(q_alone, X)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(jitted, got, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("heads", [DEPTH, 3], ids=["heads==depth", "heads!=depth"])
def test_search_scores_an_axis_1_stack_per_layer(heads):
    stack, unrolled, variables, alone = _setup(heads)
    # The budget is the bytes of every layer quantized alone: only int4 everywhere fits.
    is_q = lambda a: isinstance(a, jp.QuantizedArray)  # noqa: E731
    q_alone = jp.linen.quantize(unrolled, "int4/16_from_float32", alone, X)
    nbytes = sum(a.nbytes for a in jax.tree.leaves(q_alone, is_leaf=is_q) if is_q(a))
    result = jp.linen.search_map(
        stack, variables, [X], lambda out, batch: jnp.mean((out - batch) ** 2),
        budget={"weight_bytes": nbytes}, base="float32", candidates=("int4/16_from_float32",),
    )  # fmt: skip
    assert "shared by" not in str(result)
    rows = {row.path: row for row in result.table}
    assert set(rows) == {"blocks/qkv", "blocks/out", "blocks/mlp"}
    for row in rows.values():
        assert row.why.startswith(f"per stack (scanned: {DEPTH} layers)")
        assert row.choice == "int4/16_from_float32" and row.scores["int4/16_from_float32"] > 0
    assert result.weight_bytes == nbytes  # its bytes are its layers' bytes
    q = jp.linen.quantize(stack, result.policy_map, variables, X)
    out = jp.linen.apply(stack, result.policy_map)(q, X)
    assert out.shape == X.shape and bool(jnp.all(jnp.isfinite(out)))


def test_nested_scans_on_different_axes_quantize_whole_and_run():
    """Where the stacked axes lie apart (an outer scan on axis 0 of an inner one's axis-1
    stack), no per-layer form fits: quantized whole, it runs dequantized ahead of the
    stack with the warning that says so, never an error at apply."""
    block = _block(3)

    class Inner(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            layers = nn.scan(
                block, variable_axes={"params": 1}, split_rngs={"params": True}, length=2
            )
            return layers(name="inner")(x, None)[0], None

    class Outer(nn.Module):
        @nn.compact
        def __call__(self, x):
            layers = nn.scan(
                Inner, variable_axes={"params": 0}, split_rngs={"params": True}, length=2
            )
            return layers(name="outer")(x, None)[0]

    model = Outer()
    variables = model.init(jax.random.key(1), X)
    policy = "int8_from_float32"
    q = jp.linen.quantize(model, policy, variables, X)
    k = q["params"]["outer"]["inner"]["qkv"]["kernel"]
    assert k.shape == (2, D, 2, 3, DH)
    with pytest.warns(UserWarning, match="dequantized ahead of its stack"):
        got = jp.linen.apply(model, policy)(q, X)
    np.testing.assert_allclose(got, model.apply(_dequantized(q), X), rtol=1e-5, atol=1e-5)
