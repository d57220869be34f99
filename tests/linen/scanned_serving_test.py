"""Quantized kernels of a scanned stack (``nn.scan``, ``nn.vmap`` in it, nested scans,
``nn.remat`` bodies) reach their layers' matmuls a layer at a time: each loop body reads
its own slice of the integer values and scales, with the matmul an unstacked layer runs,
and no float copy of the stack's weights is made ahead of the loop."""

import warnings

import flax.linen as nn
import jax
import numpy as np
import pytest
from quantization.loop_reads import assert_read_in_loop, integer_dots

import jmp_policy as jp
from jmp_policy._src.quantization import matmuls

DEPTH, WIDTH = 3, 64
X = jax.random.normal(jax.random.key(1), (8, WIDTH))


def _assert_read_in_loop(fn, variables, kernel, dtype):
    assert_read_in_loop(jax.make_jaxpr(fn)(variables, X).jaxpr, kernel, dtype)


class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return nn.relu(nn.Dense(WIDTH)(x)), None


class Stack(nn.Module):
    remat: bool = False

    @nn.compact
    def __call__(self, x):
        block = nn.remat(Block) if self.remat else Block
        layers = nn.scan(
            block, variable_axes={"params": 0}, split_rngs={"params": True}, length=DEPTH
        )
        return layers(name="layers")(x, None)[0]


class Unrolled(nn.Module):
    @nn.compact
    def __call__(self, x):
        for i in range(DEPTH):
            x = nn.relu(nn.Dense(WIDTH, name=f"layer_{i}")(x))
        return x


def _unrolled(stack_params):
    """The stack's parameters as separate layers: each its own slice of every kernel."""
    dense = stack_params["layers"]["Dense_0"]
    q = dense["kernel"]

    def layer(i):
        fields = (q.values[i], q.scale[i], q.mode, q.block_size, q.shape[1:], q.original_dtype)
        if hasattr(q, "input_scale"):  # AWQ's: the layer's input scale too
            return type(q)(*fields, 0, q.input_scale[i])
        return jp.QuantizedArray(*fields)

    return {f"layer_{i}": {"kernel": layer(i), "bias": dense["bias"][i]} for i in range(DEPTH)}


def _quantized_stack(policy, remat=False):
    model = Stack(remat)
    variables = model.init(jax.random.key(0), X)
    return model, jp.linen.quantize(model, policy, variables, X)


@pytest.mark.parametrize(
    ("mode", "dtype", "form"),
    [
        ("int4", "int4", "weight-only, scale after"),
        ("int4/16", "int4", "int4 blocks"),
        ("int8", "int8", "weight-only, scale after"),
    ],
)
def test_each_scanned_layer_reads_its_slice_of_the_quantized_values(mode, dtype, form, maybe_jit):
    policy = f"{mode}_from_float32"
    model, q = _quantized_stack(policy)
    kernel = q["params"]["layers"]["Dense_0"]["kernel"]
    assert kernel.stacked == 1 and kernel.shape == (DEPTH, WIDTH, WIDTH)
    fn = jp.linen.apply(model, policy)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing is dequantized ahead
        _assert_read_in_loop(maybe_jit(fn), q, kernel, dtype)
        out = maybe_jit(fn)(q, X)
    ref = jp.linen.apply(Unrolled(), policy)({"params": _unrolled(q["params"])}, X)
    np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-6 * float(np.abs(ref).max()))
    table = jp.linen.explain(model, policy, q, X)
    assert f"layers/Dense_0  {mode} weights: {form}; per layer, in the stack's loop" in table
    assert "dequantized ahead" not in table


@pytest.mark.parametrize("method", ["gptq", "awq"])
@pytest.mark.parametrize("remat", [False, True])
def test_a_calibrated_scanned_stack_serves_on_its_quantized_values(method, remat, maybe_jit):
    model = Stack(remat)
    variables = model.init(jax.random.key(0), X)
    policy = f"{method}/4/16_from_float32"
    q = jp.linen.calibrate(model, policy, variables, [X])
    kernel = q["params"]["layers"]["Dense_0"]["kernel"]
    assert kernel.stacked == 1 and hasattr(kernel, "input_scale") == (method == "awq")
    fn = jp.linen.apply(model, policy)
    _assert_read_in_loop(maybe_jit(fn), q, kernel, "int4")
    ref = jp.linen.apply(Unrolled(), policy)({"params": _unrolled(q["params"])}, X)
    out = maybe_jit(fn)(q, X)
    np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-6 * float(np.abs(ref).max()))
    assert "int4/16 weights: int4 blocks; per layer, in the stack's loop" in (
        jp.linen.explain(model, policy, q, X)
    )


class Inner(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        ensemble = nn.vmap(
            Block,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            in_axes=(None, None),
            axis_size=2,
        )
        return ensemble(name="ensemble")(x, None)[0].mean(0), None


class Nested(nn.Module):
    """Scans of scans (kernels ``[3, 2, in, out]``) or of remat'd vmap ensembles."""

    vmap: bool = False

    @nn.compact
    def __call__(self, x):
        if self.vmap:
            inner = nn.remat(Inner)
        else:
            inner = nn.scan(
                Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=2
            )
            inner = _as_body(inner)
        layers = nn.scan(
            inner, variable_axes={"params": 0}, split_rngs={"params": True}, length=DEPTH
        )
        return layers(name="layers")(x, None)[0]


def _as_body(scan):
    class Body(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            return scan(name="inner")(x, None)[0], None

    return Body


@pytest.mark.parametrize("vmap", [False, True])
def test_nested_stacks_read_each_layer_in_the_innermost_body(vmap, maybe_jit):
    model = Nested(vmap)
    variables = model.init(jax.random.key(0), X)
    policy = "int4/16_from_float32"
    q = jp.linen.quantize(model, policy, variables, X)
    (kernel,) = [
        leaf
        for leaf in jax.tree.leaves(q, is_leaf=lambda a: isinstance(a, jp.QuantizedArray))
        if isinstance(leaf, jp.QuantizedArray)
    ]
    assert kernel.stacked == 2 and kernel.shape == (DEPTH, 2, WIDTH, WIDTH)
    fn = jp.linen.apply(model, policy)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _assert_read_in_loop(maybe_jit(fn), q, kernel, "int4")
        out = maybe_jit(fn)(q, X)
    dequantized = jax.tree.map(
        lambda a: a.dequantize() if isinstance(a, jp.QuantizedArray) else a,
        q,
        is_leaf=lambda a: isinstance(a, jp.QuantizedArray),
    )
    ref = model.apply(dequantized, X)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5 * float(np.abs(ref).max()))


def test_mutable_params_come_back_as_stored():
    policy = "int4/16_from_float32"
    model, q = _quantized_stack(policy)
    _, state = jp.linen.apply(model, policy)(q, X, mutable=["params"])
    dense = state["params"]["layers"]["Dense_0"]
    assert sorted(dense) == ["bias", "kernel"]  # the scales passed beside it are gone
    assert dense["kernel"] is q["params"]["layers"]["Dense_0"]["kernel"]


class OwnMatmulBlock(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return nn.Dense(WIDTH, dot_general=jax.lax.dot_general)(x), None


class OwnMatmulStack(nn.Module):
    @nn.compact
    def __call__(self, x):
        layers = nn.scan(
            OwnMatmulBlock, variable_axes={"params": 0}, split_rngs={"params": True}, length=DEPTH
        )
        return layers(name="stack")(x, None)[0]


def test_a_stack_dequantized_ahead_warns_once_naming_the_layer_and_the_way_out():
    matmuls._WARNED_AHEAD.clear()  # given once per process: as if this were the first
    # A layer with its own matmul cannot read a slice: dequantized ahead, with a warning.
    model = OwnMatmulStack()
    variables = model.init(jax.random.key(0), X)
    policy = "int8_from_float32"
    q = jp.linen.quantize(model, policy, variables, X)
    fn = jp.linen.apply(model, policy)
    match = (
        r"The int8 kernel \(3, 64, 64\) of the stacked layer 'stack/Dense_0' is dequantized "
        r"ahead of its stack: the layer runs from a compute-dtype copy of the whole stack's "
        r"weights.*Flax's own matmul.*unroll the stack.*given once"
    )
    with pytest.warns(UserWarning, match=match):
        out = fn(q, X)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once
        np.testing.assert_allclose(jax.jit(fn)(q, X), out, rtol=1e-6)
    assert "stack/Dense_0  int8 weights: dequantized ahead (a stack)" in (
        jp.linen.explain(model, policy, q, X)
    )
    # A stack quantized as one kernel (stacked=0) is dequantized ahead, and says how to fix it.
    model, variables = Stack(), Stack().init(jax.random.key(3), X)
    with pytest.warns(UserWarning, match="quantize: the kernel"):
        shared = jp.get("int4/32_from_float32").quantize(variables["params"])
    with pytest.warns(UserWarning, match=r"quantized as one kernel \(`stacked=0`\).*jp.linen"):
        jp.linen.apply(model, "int4/32_from_float32")({"params": shared}, X)


@pytest.mark.parametrize(
    ("mode", "dtype", "maybe_jit"),
    [("int8", "int8", lambda f: f), ("int4/32", "int4", jax.jit)],  # one eager, one jitted
    ids=["int8-eager", "int4/32-jit"],
)
def test_big_vision_vit_scanned_encoder_serves_on_its_quantized_values(mode, dtype, maybe_jit):
    """Model code nobody here wrote: big_vision's ViT with `scan=True` (its encoder blocks
    under `nn.remat` in an `nn.scan`, attention and MLP `Dense` layers) quantized by the
    map. Every block's matmul reads its own slice of the int8/int4 values in the loop, no
    warning, and the output is the dequantized model's up to bfloat16 rounding."""
    from flax_examples import big_vision_vit as vit

    model = vit.Model(10, variant="mu/8", depth=3, scan=True)
    x = jax.random.normal(jax.random.key(1), (2, 16, 16, 3))
    variables = model.init(jax.random.key(0), x)
    policy_map = jp.DTypePolicyMap(
        "mixed_bfloat16", {r"Transformer/encoderblock/.*": f"{mode}_from_mixed_bfloat16"}
    )
    q = jp.linen.quantize(model, policy_map, variables, x)
    kernel = q["params"]["Transformer"]["encoderblock"]["MlpBlock_0"]["Dense_0"]["kernel"]
    assert kernel.stacked == 1 and kernel.shape == (3, 32, 128)  # mu/8's width, 3 blocks
    fn = jp.linen.apply(model, policy_map, module_dtype="override")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dots = integer_dots(jax.make_jaxpr(maybe_jit(fn))(q, x).jaxpr)
        encoded = maybe_jit(fn)(q, x)[1]["encoded"]
    assert len(dots) == 6 and set(dots) == {(dtype, True)}, dots  # q, k, v, out, 2 MLP
    dequantized = jax.tree.map(
        lambda a: a.dequantize() if isinstance(a, jp.QuantizedArray) else a,
        q,
        is_leaf=lambda a: isinstance(a, jp.QuantizedArray),
    )
    ref = jp.linen.apply(model, "mixed_bfloat16", module_dtype="override")(dequantized, x)
    ref = np.asarray(ref[1]["encoded"], np.float32)
    err = np.linalg.norm(np.asarray(encoded, np.float32) - ref) / np.linalg.norm(ref)
    assert err < 2e-2, err
