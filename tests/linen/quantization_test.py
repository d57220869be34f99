"""Quantized policies in Flax: quantized weights and int8 compute in Linen and NNX models."""

import os

import flax.linen as nn
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax_examples.measure import dot_kinds as _dots
from flax_examples.measure import equations as equations_of

import jmp_policy as jp
from jmp_policy._src.quantization import matmuls

X = jax.random.normal(jax.random.key(1), (16, 32))
INT8 = "int8_from_float32"


def _rel(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _int8_dots(fn, *args):
    dots = _dots(jax.make_jaxpr(fn)(*args).jaxpr)
    int8 = [d for d in dots if d == (("int8", "int8"), "int32")]
    # No other matmul touches int8 or accumulates in int32.
    assert all("int8" not in d[0] and d[1] != "int32" for d in dots if d not in int8)
    return len(int8), len(dots)


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(64, name="up")(x))
        h = nn.relu(nn.DenseGeneral((4, 16), name="split")(h))  # several output axes
        h = nn.DenseGeneral(64, axis=(-2, -1), name="merge")(h)  # several contracting axes
        h = nn.Einsum((64, 32), "bi,io->bo", name="ein")(h)
        return nn.Dense(4, name="head")(h)


LINEN_LAYERS = ("up", "split", "merge", "ein", "head")


@pytest.fixture(scope="module")
def linen_mlp():
    model = MLP()
    return model, model.init(jax.random.key(0), X)


# -- Linen --------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["int8_from_float32", "int4/32_from_float32"])
def test_linen_mlp_with_quantized_weights_is_close_to_float(linen_mlp, mode):
    model, variables = linen_mlp
    ref = model.apply(variables, X)
    policy_map = jp.DTypePolicyMap("float32", {".*": mode})
    quantized = policy_map.quantize(variables["params"], stacked_axes=0)  # DenseGeneral
    assert isinstance(quantized["up"]["kernel"], jp.QuantizedArray)
    # Weight-only: the dequantized tree through plain Flax.
    weight_only = model.apply({"params": policy_map.cast_to_compute(quantized)}, X)
    # int8: about 1% through five layers; int4 (4 bits, about 10% per kernel): about 25%.
    bound = 0.03 if mode.startswith("int8") else 0.3
    assert 0 < _rel(weight_only, ref) < bound
    # Through the wrapper, which dequantizes each kernel (and runs int8 matmuls for int8).
    out = jax.jit(jp.linen.apply(model, policy_map))({"params": quantized}, X)
    assert 0 < _rel(out, ref) < bound


def test_linen_int8_compute_is_close_to_float_and_grads_reach_float_kernels(linen_mlp, maybe_jit):
    model, variables = linen_mlp
    fn = jp.linen.apply(model, jp.DTypePolicyMap("float32", {".*": INT8}))
    ref = model.apply(variables, X)
    assert 0 < _rel(maybe_jit(fn)(variables, X), ref) < 0.03

    def loss(apply):
        return lambda p: jnp.sum(apply({"params": p}, X) ** 2)

    grads = maybe_jit(jax.grad(loss(fn)))(variables["params"])
    ref_grads = jax.grad(loss(model.apply))(variables["params"])
    for name in LINEN_LAYERS:
        g = grads[name]["kernel"]
        assert g.dtype == jnp.float32 and g.shape == variables["params"][name]["kernel"].shape
        assert _rel(g, ref_grads[name]["kernel"]) < 0.2


def test_linen_int8_step_has_int8_matmuls_for_exactly_the_int8_layers(linen_mlp):
    model, variables = linen_mlp
    policy_map = jp.DTypePolicyMap("mixed_bfloat16", {"up": INT8, "merge": INT8, "ein": INT8})
    fn = jp.linen.apply(model, policy_map)

    def step(params):
        return jax.value_and_grad(lambda p: jnp.sum(fn({"params": p}, X).astype(jnp.float32)))(
            params
        )

    int8, total = _int8_dots(step, variables["params"])
    assert int8 == 3  # forward only: the backward pass is the float matmul's
    assert total == 3 * 5  # each layer: one forward and two backward matmuls
    # Without an int8 policy, no int8 matmul at all.
    plain = jp.linen.apply(model, "mixed_bfloat16")
    assert _int8_dots(lambda p: plain({"params": p}, X), variables["params"])[0] == 0


def test_linen_layer_with_its_own_dot_general_is_left_alone():
    calls = []

    def own(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
        calls.append(lhs.dtype)
        return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision)

    model = nn.Dense(4, dot_general=own)
    variables = model.init(jax.random.key(0), X)
    calls.clear()
    fn = jp.linen.apply(model, "int8_from_mixed_bfloat16")
    assert _int8_dots(lambda v: fn(v, X), variables) == (0, 1)
    assert calls == [jnp.bfloat16]
    assert model.dot_general is own


def test_linen_dot_general_is_restored_after_the_call(linen_mlp):
    model, variables = linen_mlp
    jp.linen.apply(model, INT8)(variables, X)
    assert jnp.einsum is jax.numpy.einsum and jnp.einsum.__name__ == "einsum"
    from jmp_policy._src.quantization import quantized_matmul

    assert jnp.einsum is quantized_matmul.JNP_EINSUM
    # An Einsum outside a wrapper is float again.
    ein = nn.Einsum((32, 8), "bi,io->bo")
    v = ein.init(jax.random.key(0), X)
    assert _int8_dots(lambda v: ein.apply(v, X), v)[0] == 0


# -- NNX ----------------------------------------------------------------------------------


class NnxMLP(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(32, 64, rngs=rngs)
        self.mid = nnx.LinearGeneral(64, (4, 16), rngs=rngs)
        self.merge = nnx.LinearGeneral((4, 16), 64, axis=(-2, -1), rngs=rngs)
        self.ein = nnx.Einsum("bi,io->bo", (64, 32), (32,), rngs=rngs)
        self.head = nnx.Linear(32, 4, rngs=rngs)

    def __call__(self, x):
        h = nnx.relu(self.up(x))
        h = self.merge(nnx.relu(self.mid(h)))
        return self.head(self.ein(h))


def test_nnx_int8_compute_and_quantized_weights_are_close_to_float():
    model = NnxMLP(nnx.Rngs(0))
    ref = model(X)
    policy_map = jp.DTypePolicyMap("float32", {".*": INT8})
    out = nnx.jit(lambda m, x: jp.nnx.apply(m, policy_map)(x))(model, X)
    assert 0 < _rel(out, ref) < 0.03
    layers = ("up", "mid", "merge", "ein", "head")
    assert _int8_dots(lambda x: jp.nnx.apply(model, policy_map)(x), X)[0] == len(layers)
    half = jp.DTypePolicyMap("float32", {"up": INT8, "ein": INT8})
    assert _int8_dots(lambda x: jp.nnx.apply(model, half)(x), X) == (2, 5)

    grads = nnx.grad(lambda m: jnp.sum(jp.nnx.apply(m, policy_map)(X) ** 2))(model)
    ref_grads = nnx.grad(lambda m: jnp.sum(m(X) ** 2))(model)
    for name in layers:
        g = grads[name]["kernel"].get_value()
        assert g.dtype == jnp.float32
        assert _rel(g, ref_grads[name]["kernel"].get_value()) < 0.2

    # Quantized weights stored in the model: int4 weight-only, then int8.
    for mode, bound in (("int4/32_from_float32", 0.3), (INT8, 0.03)):
        copy = NnxMLP(nnx.Rngs(0))
        qmap = jp.DTypePolicyMap("float32", {".*": mode})
        nnx.update(copy, qmap.quantize(nnx.state(copy, nnx.Param), stacked_axes=0))
        assert isinstance(copy.up.kernel.get_value(), jp.QuantizedArray)
        assert copy.up.bias.get_value().dtype == jnp.float32
        assert 0 < _rel(jp.nnx.apply(copy, qmap)(X), ref) < bound


def test_nnx_linear_with_its_own_dot_general_is_left_alone():
    def own(lhs, rhs, dimension_numbers, **kwargs):
        return jax.lax.dot_general(lhs, rhs, dimension_numbers)

    model = nnx.Linear(32, 4, dot_general=own, rngs=nnx.Rngs(0))
    assert _int8_dots(lambda x: jp.nnx.apply(model, INT8)(x), X) == (0, 1)
    assert model.dot_general is own


# -- Keras's configs ----------------------------------------------------------------------


def test_keras_quantized_configs_drive_the_same_layers(linen_mlp):
    os.environ.setdefault("KERAS_BACKEND", "jax")
    import keras  # the `test` extra installs it

    model, variables = linen_mlp
    theirs = keras.dtype_policies.DTypePolicyMap(
        "mixed_bfloat16",
        {
            "up": keras.dtype_policies.QuantizedDTypePolicy("int8", "mixed_bfloat16"),
            "head": keras.dtype_policies.get("int4/128_from_float32"),
        },
    )
    policy_map = jp.deserialize(keras.saving.serialize_keras_object(theirs))
    assert policy_map["up"] == jp.get("int8_from_mixed_bfloat16")
    assert policy_map["head"].block_size == 128
    quantized = policy_map.quantize(variables["params"])
    assert quantized["up"]["kernel"].mode == "int8"
    assert quantized["head"]["kernel"].mode == "int4"
    assert quantized["head"]["kernel"].block_size == 128
    assert not isinstance(quantized["merge"]["kernel"], jp.QuantizedArray)
    fn = jp.linen.apply(model, policy_map)
    # From 128 rows on, int8 weights under an int8 policy run int8 x int8: "up" only.
    rows = jnp.tile(X, (8, 1))
    assert _int8_dots(lambda p: fn({"params": p}, rows), quantized)[0] == 1
    assert _int8_dots(lambda p: fn({"params": p}, X), quantized)[0] == 0  # weight-only
    out = fn({"params": quantized}, X)
    assert out.dtype == jnp.float32  # the int4 head computes in float32
    # Was < 0.1 on int4's narrow grid (0.090 here); on the full-range grid, the default since
    # #49, the head's weights are closer (checked below) but this draw's 16 x 4 outputs come
    # out at 0.126 (the output error of a single group of 32 rows per output, not the grid's).
    assert _rel(out, model.apply(variables, X)) < 0.15
    head = variables["params"]["head"]["kernel"]
    narrow = jp.get("int4/128/narrow_from_float32").quantize(head)
    assert _rel(quantized["head"]["kernel"].dequantize(), head) < _rel(narrow.dequantize(), head)


# -- quantization-aware training of a small transformer LM ---------------------------------


class Block(nn.Module):
    dim: int

    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm(name="norm1")(x)
        h = nn.SelfAttention(num_heads=2, name="attn")(h, mask=nn.make_causal_mask(x[..., 0]))
        x = x + h
        h = nn.LayerNorm(name="norm2")(x)
        h = nn.Dense(4 * self.dim, name="up")(h)
        return x + nn.Dense(self.dim, name="down")(nn.gelu(h))


class TinyLM(nn.Module):
    vocab: int = 16
    dim: int = 32

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab, self.dim, name="embed")(tokens)
        x = Block(self.dim, name="block_0")(x)
        return nn.Dense(self.vocab, name="lm_head")(nn.LayerNorm(name="final_norm")(x))


def _train(policy_map, steps=200):
    model = TinyLM()
    # Sequences k, k+1, k+2, ... (mod vocab): the next token is learnable exactly.
    starts = jax.random.randint(jax.random.key(0), (16, 1), 0, 16)
    tokens = (starts + jnp.arange(9)) % 16
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    params = jax.jit(model.init)(jax.random.key(1), inputs)["params"]
    fn = jp.linen.apply(model, policy_map, type_policies=jp.linen.NORM_FLOAT32)
    optimizer = optax.adam(1e-3)

    def loss(p):
        logits = fn({"params": p}, inputs).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    @jax.jit
    def train(params):
        def step(carry, _):
            p, s = carry
            value, grads = jax.value_and_grad(loss)(p)
            updates, s = optimizer.update(grads, s, p)
            return (optax.apply_updates(p, updates), s), value

        (p, _), losses = jax.lax.scan(step, (params, optimizer.init(params)), length=steps)
        return loss(p), losses, p

    return train, params, fn


def test_transformer_lm_trained_with_int8_mlps_ends_near_the_bf16_loss():
    bf16 = jp.DTypePolicyMap("mixed_bfloat16", {"lm_head": "float32"})
    int8 = jp.DTypePolicyMap(
        "mixed_bfloat16",
        {"lm_head": "float32", "block_\\d+/(up|down)": "int8_from_mixed_bfloat16"},
    )
    train_int8, params, _ = _train(int8)
    tokens = jnp.zeros((2, 8), jnp.int32)
    forward = jp.linen.apply(TinyLM(), int8)
    assert _int8_dots(lambda p: forward({"params": p}, tokens), params) == (2, 9)  # up, down
    train_bf16, _, _ = _train(bf16)
    final_bf16, losses_bf16, _ = train_bf16(params)
    final_int8, losses_int8, trained = train_int8(params)
    assert float(losses_int8[0]) > 2.0  # it started near log(16)
    assert float(final_bf16) < 0.5 * float(losses_bf16[0])  # and learnt
    assert abs(float(final_int8) - float(final_bf16)) <= 0.05 * float(final_bf16)
    # The whole curve, not only its end (step 20: loss about 0.8).
    np.testing.assert_allclose(np.asarray(losses_int8[::20]), np.asarray(losses_bf16[::20]), 0.05)
    assert trained["block_0"]["up"]["kernel"].dtype == jnp.float32
    assert _rel(trained["block_0"]["up"]["kernel"], params["block_0"]["up"]["kernel"]) > 0.01


# -- stacked layers: nn.scan / nnx.scan stacks quantized per layer (issue 21 item 3) -------

DEPTH, WIDTH = 3, 64
NORMS = 10.0 ** np.arange(DEPTH, dtype=np.float32)  # layers of different norms
XS = jax.random.normal(jax.random.key(2), (16, WIDTH))


class ScanBlock(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return nn.Dense(WIDTH)(x), None  # linear: errors add up, no saturation


class ScanStack(nn.Module):
    @nn.compact
    def __call__(self, x):
        layers = nn.scan(
            ScanBlock, variable_axes={"params": 0}, split_rngs={"params": True}, length=DEPTH
        )
        x, _ = layers(name="layers")(x, None)
        return nn.DenseGeneral((4, 2), name="head")(x)  # [in, 4, 2]: not a stack


class NnxStack(nnx.Module):
    def __init__(self, rngs, vmap_call=False):
        @nnx.split_rngs(splits=DEPTH)
        @nnx.vmap
        def make(rngs):
            return nnx.Linear(WIDTH, WIDTH, rngs=rngs)

        self.layers = make(rngs)
        self.head = nnx.LinearGeneral(WIDTH, (4, 2), rngs=rngs)
        self.vmap_call = vmap_call

    def __call__(self, x):
        if self.vmap_call:  # every layer on the same input (nnx.vmap over the stack)
            ys = nnx.vmap(lambda layer, x: layer(x), in_axes=(0, None))(self.layers, x)
            # Each layer's output normalized (an RMS norm per branch), then summed.
            ys = ys / jnp.sqrt(jnp.mean(ys**2, axis=-1, keepdims=True) + 1e-6)
            return self.head(ys.sum(0))

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def body(x, layer):
            return layer(x)

        return self.head(body(x, self.layers))


def _linen_stack():
    model = ScanStack()
    variables = model.init(jax.random.key(0), XS)
    kernel = variables["params"]["layers"]["Dense_0"]["kernel"]
    variables["params"]["layers"]["Dense_0"]["kernel"] = kernel * NORMS[:, None, None]
    return model, variables


def _nnx_stack(vmap_call=False):
    model = NnxStack(nnx.Rngs(0), vmap_call)
    model.layers.kernel.set_value(model.layers.kernel.get_value() * NORMS[:, None, None])
    return model


def _assert_per_layer(q, kernel, mode, block):
    assert isinstance(q, jp.QuantizedArray) and q.stacked == 1
    for i in range(DEPTH):
        alone = jp.get(f"{mode}_from_float32").quantize(kernel[i])
        assert alone.block_size == q.block_size
        np.testing.assert_array_equal(q.scale[i], alone.scale)
        np.testing.assert_array_equal(q.values[i], alone.values)
    if mode.startswith("int4"):  # blocks along each layer's input axis, not the layer axis
        assert q.scale.shape == (DEPTH, WIDTH // block, WIDTH)


@pytest.mark.parametrize(("mode", "block"), [("int8", None), ("int4/16", 16)])
def test_linen_scan_stack_is_quantized_per_layer_and_runs(mode, block):
    model, variables = _linen_stack()
    ref = model.apply(variables, XS)
    policy = f"{mode}_from_float32"
    q = jp.linen.quantize(model, policy, variables, XS)
    kernel = variables["params"]["layers"]["Dense_0"]["kernel"]
    _assert_per_layer(q["params"]["layers"]["Dense_0"]["kernel"], kernel, mode, block)
    assert q["params"]["layers"]["Dense_0"]["bias"].dtype == jnp.float32  # stacked bias
    head = q["params"]["head"]["kernel"]
    assert head.stacked == 0 and head.shape == (WIDTH, 4, 2)  # DenseGeneral: not a stack
    # Runs through the wrapper (the stack dequantized ahead of nn.scan), under jit too.
    out = jax.jit(jp.linen.apply(model, policy))(q, XS)
    # One scale across the layers, with a warning that names the way out.
    with pytest.warns(UserWarning, match=r"quantize: the kernel 'head/kernel' .*\(and 1 more"):
        shared = jp.get(policy).quantize(variables["params"])
    matmuls._WARNED_AHEAD.clear()  # given once per process: as if this were the first
    with pytest.warns(UserWarning, match=r"'layers/Dense_0' is dequantized ahead .*stacked=0"):
        out_shared = jax.jit(jp.linen.apply(model, policy))({"params": shared}, XS)
    err, err_shared = _rel(out, ref), _rel(out_shared, ref)
    assert 0 < err * 5 < err_shared, (err, err_shared)
    # The same with a map, and with stacked_axes given by hand.
    qmap = jp.DTypePolicyMap("float32", {"layers/.*": policy})
    by_map = jp.linen.quantize(model, qmap, variables, XS)["params"]
    assert by_map["layers"]["Dense_0"]["kernel"].stacked == 1
    assert by_map["head"]["kernel"].dtype == jnp.float32
    by_hand = qmap.quantize(variables["params"], stacked_axes={"layers/.*": 1})
    hand, found = by_hand["layers"]["Dense_0"]["kernel"], by_map["layers"]["Dense_0"]["kernel"]
    assert hand.stacked == found.stacked == 1
    np.testing.assert_array_equal(hand.scale, found.scale)


@pytest.mark.parametrize("vmap_call", [False, True])
@pytest.mark.parametrize(("mode", "block"), [("int8", None), ("int4/16", 16)])
def test_nnx_scan_and_vmap_stacks_are_quantized_per_layer_and_run(mode, block, vmap_call):
    model = _nnx_stack(vmap_call)
    ref = model(XS)
    policy = f"{mode}_from_float32"
    q = jp.nnx.quantize(model, policy)
    assert not isinstance(model.layers.kernel.get_value(), jp.QuantizedArray)  # a copy
    _assert_per_layer(q.layers.kernel.get_value(), model.layers.kernel.get_value(), mode, block)
    assert q.layers.bias.get_value().dtype == jnp.float32
    assert q.head.kernel.get_value().stacked == 0
    out = nnx.jit(lambda m, x: jp.nnx.apply(m, policy)(x))(q, XS)
    # The shared-scale layout, as `map.quantize(nnx.state(...))` makes it without
    # stacked_axes: it runs too (dequantized ahead of the stack), with a worse error.
    shared = nnx.clone(model)
    with pytest.warns(UserWarning, match=r"quantize: the kernel 'head/kernel' .*\(and 1 more"):
        nnx.update(shared, jp.get(policy).quantize(nnx.state(shared, nnx.Param)))
    matmuls._WARNED_AHEAD.clear()  # given once per process: as if this were the first
    with pytest.warns(UserWarning, match=r"'layers' is dequantized ahead .*stacked=0"):
        out_shared = jp.nnx.apply(shared, policy)(XS)
    err, err_shared = _rel(out, ref), _rel(out_shared, ref)
    assert 0 < err * 5 < err_shared, (err, err_shared)


def _dequantized_tree(tree):
    return jax.tree.map(
        lambda a: a.dequantize() if isinstance(a, jp.QuantizedArray) else a,
        tree,
        is_leaf=lambda a: isinstance(a, jp.QuantizedArray),
    )


def _assert_no_activation_rounding(jaxpr):
    """No rounding or clipping anywhere (dequantizing is a convert and a multiply; the int8
    rule of float kernels rounds and clips the activations), no int8 matmul."""
    for primitive in ("round", "clamp"):
        assert list(equations_of(jaxpr, primitive)) == [], primitive
    assert all(d[0] == ("float32", "float32") for d in _dots(jaxpr)), _dots(jaxpr)


@pytest.mark.parametrize("policy", [INT8, jp.DTypePolicyMap("float32", {"layers.*": INT8})])
def test_linen_int8_weights_in_a_scanned_stack_are_served_not_trained(policy):
    """int8 weights in an nn.scan stack: each layer reads its own slice of the int8 values
    and scales inside the loop, in the weight-only form at these rows (as an unstacked
    layer), never the int8 rule of float kernels, so the error is the weights' rounding
    alone."""
    model, variables = _linen_stack()
    q = jp.linen.quantize(model, INT8, variables, XS)
    assert q["params"]["layers"]["Dense_0"]["kernel"].stacked == 1
    fn = jp.linen.apply(model, policy)
    _assert_no_activation_rounding(jax.make_jaxpr(fn)(q, XS).jaxpr)
    # The float model whose weights are the dequantized ones (the head runs weight-only).
    ref = model.apply({"params": _dequantized_tree(q["params"])}, XS)
    for run in (fn, jax.jit(fn)):
        np.testing.assert_allclose(run(q, XS), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    table = jp.linen.explain(model, policy, q, XS)
    assert (
        "layers/Dense_0  int8 weights: weight-only, scale after; per layer, in the stack's loop"
        in table
    )
    # Float weights in the same stack still train under the int8 rule (QAT).
    assert list(equations_of(jax.make_jaxpr(fn)(variables, XS).jaxpr, "round"))


@pytest.mark.parametrize("policy", [INT8, jp.DTypePolicyMap("float32", {"layers": INT8})])
def test_nnx_int8_weights_in_a_scanned_stack_are_served_not_trained(policy):
    model = _nnx_stack()
    q = jp.nnx.quantize(model, INT8)
    assert q.layers.kernel.get_value().stacked == 1
    fn = lambda m, x: jp.nnx.apply(m, policy)(x)  # noqa: E731
    _assert_no_activation_rounding(jax.make_jaxpr(lambda x: fn(q, x))(XS).jaxpr)
    reference = nnx.clone(q)
    nnx.update(reference, _dequantized_tree(nnx.state(reference, nnx.Param)))
    ref = reference(XS)
    for run in (fn, nnx.jit(fn)):
        np.testing.assert_allclose(run(q, XS), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    table = jp.nnx.explain(q, policy, XS)
    assert "layers  int8 weights: weight-only, scale after; per layer, in the stack's loop" in table
    assert list(equations_of(jax.make_jaxpr(lambda x: fn(model, x))(XS).jaxpr, "round"))


def test_quantize_helpers_reject_bad_arguments():
    with pytest.raises(TypeError, match=r"`model` must be an `nnx.Module`"):
        jp.nnx.quantize({"a": 1}, INT8)
    with pytest.raises(ValueError, match=r"quantizes nothing.*Received: policy_or_map='float32'"):
        jp.nnx.quantize(_nnx_stack(), "float32")
    model, variables = _linen_stack()
    with pytest.raises(TypeError, match=r"`module` must be a flax.linen Module"):
        jp.linen.quantize("model", INT8, variables, XS)
    with pytest.raises(ValueError, match=r"no 'params'.*\['batch_stats'\]"):
        jp.linen.quantize(model, INT8, {"batch_stats": {}}, XS)
    with pytest.raises(TypeError, match=r"`variables` must be a mapping"):
        jp.linen.quantize(model, INT8, [1], XS)
