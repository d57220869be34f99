"""`jp.dtype_profile`: matmul FLOPs and bytes per dtype, from the jaxpr, checked by hand."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import jmp_policy as jp

B, T, V, D, H, LAYERS = 2, 8, 32, 64, 4, 2


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm(name="norm1")(x)
        x = x + nn.MultiHeadDotProductAttention(H, name="attention")(h, h)
        h = nn.LayerNorm(name="norm2")(x)
        return x + nn.Dense(D, name="mlp_out")(nn.gelu(nn.Dense(4 * D, name="mlp_in")(h)))


class Transformer(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(V, D, name="embed")(tokens)
        for i in range(LAYERS):
            x = Block(name=f"layers_{i}")(x)
        return nn.Dense(V, name="head")(nn.LayerNorm(name="final_norm")(x))


TOKENS = jnp.zeros((B, T), jnp.int32)
N = B * T  # tokens
# per layer: q, k, v and out projections (D x D), logits and weighted values (T x T x D),
# the MLP (D x 4D twice); the head D x V.
LAYER_FLOPS = 4 * 2 * N * D * D + 2 * 2 * B * T * T * D + 2 * 2 * N * D * 4 * D
HEAD_FLOPS = 2 * N * D * V


@pytest.fixture(scope="module")
def variables():
    return Transformer().init(jax.random.key(0), TOKENS)


def test_mixed_bfloat16_transformer_runs_its_matmuls_in_bfloat16(variables):
    fn = jp.linen.apply(Transformer(), "mixed_bfloat16")
    profile = jp.dtype_profile(fn, variables, TOKENS)
    assert profile.matmul_flops == {"bfloat16": LAYERS * LAYER_FLOPS + HEAD_FLOPS}
    assert profile.fraction("bfloat16") >= 0.95
    assert str(profile).splitlines()[0] == "100% of matmul FLOPs in bfloat16"


def test_float32_head_holds_exactly_the_heads_flops(variables):
    policy_map = jp.DTypePolicyMap("mixed_bfloat16", {"head": "float32"})
    fn = jp.linen.apply(Transformer(), policy_map)
    profile = jp.dtype_profile(fn, variables, TOKENS)
    assert profile.matmul_flops == {"bfloat16": LAYERS * LAYER_FLOPS, "float32": HEAD_FLOPS}
    assert profile.sources["float32"] == ("head",)
    share = 100 * HEAD_FLOPS / (LAYERS * LAYER_FLOPS + HEAD_FLOPS)
    assert profile.summary() == (
        f"{100 - share:.0f}% of matmul FLOPs in bfloat16, {share:.0f}% in float32 (head)"
    )
    # the training step: the head's forward matmul, and its two in the backward pass
    # (the gradients of its input and of its kernel)
    loss = lambda p: fn({"params": p}, TOKENS).astype(jnp.float32).mean()  # noqa: E731
    step = jp.dtype_profile(jax.value_and_grad(loss), variables["params"])
    assert step.matmul_flops["float32"] == 3 * HEAD_FLOPS


def test_scan_counts_every_iteration_and_bytes_are_per_dtype():
    def f(x, w):
        def body(c, _):
            return (c @ w).astype(jnp.bfloat16).astype(jnp.float32), None

        return jax.lax.scan(body, x, None, length=5)[0]

    profile = jp.dtype_profile(f, jnp.ones((4, 8)), jnp.ones((8, 8)))
    assert profile.matmul_flops == {"float32": 5 * 2 * 4 * 8 * 8}
    # per iteration: the f32 product, its bf16 copy, its f32 copy back; then scan's carry
    assert profile.bytes["bfloat16"] == 5 * 4 * 8 * 2
    assert profile.bytes["float32"] == 5 * 2 * 4 * 8 * 4 + 4 * 8 * 4


def test_convolution_flops():
    x = jnp.ones((2, 10, 10, 3), jnp.bfloat16)  # NHWC
    w = jnp.ones((3, 3, 3, 16), jnp.bfloat16)  # HWIO
    conv = lambda x, w: jax.lax.conv_general_dilated(  # noqa: E731
        x, w, (1, 1), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
    profile = jp.dtype_profile(conv, x, w)
    assert profile.matmul_flops == {"bfloat16": 2 * (2 * 8 * 8 * 16) * (3 * 3 * 3)}


def test_cond_counts_its_costliest_branch_and_mixed_operands_are_named():
    def f(p, x, w):
        return jax.lax.cond(p, lambda: (x @ w).sum(), lambda: (x @ w @ w.T).sum())

    profile = jp.dtype_profile(f, True, jnp.ones((2, 3)), jnp.ones((3, 4)))
    assert profile.matmul_flops == {"float32": 2 * 2 * 4 * 3 + 2 * 2 * 3 * 4}
    mixed = jp.dtype_profile(
        lambda a, b: jax.lax.dot(a, b, preferred_element_type=jnp.float32),
        jnp.ones((2, 3), jnp.int8),
        jnp.ones((3, 4), jnp.bfloat16),
    )
    assert mixed.matmul_flops == {"bfloat16+int8": 2 * 2 * 4 * 3}


def test_no_matmuls_and_bad_input():
    assert jp.dtype_profile(lambda x: x + 1, jnp.ones(3)).summary() == "no matmul FLOPs"
    with pytest.raises(TypeError, match="`fn` must be callable"):
        jp.dtype_profile(3)


def test_float8_matmuls_count_by_their_operands_dtypes():
    """A float8 layer's matmuls read float8 operands (e4m3 forward, e4m3 with e5m2 for a
    gradient): the profile counts them by those dtypes; a matmul on values converted from
    float8 counts as what they were converted to."""
    import flax.linen as nn

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(4, name="head")(nn.relu(nn.Dense(32, name="body")(x)))

    x = jnp.ones((8, 16))
    policy_map = jp.DTypePolicyMap("mixed_bfloat16", {"body": "float8_from_mixed_bfloat16"})
    variables = jp.linen.init(Net(), policy_map)(jax.random.key(0), x)
    fn = jp.linen.apply(Net(), policy_map)

    def step(v):
        return jax.grad(lambda v: fn(v, x).astype(jnp.float32).sum())(v)

    profile = jp.dtype_profile(step, variables)
    body, head = 2 * 8 * 32 * 16, 2 * 8 * 4 * 32
    # body: forward e4m3 x e4m3; backward: its kernel gradient on its e4m3 input and the
    # e5m2 output gradient (its input, the data, needs none). head: bfloat16 forward and
    # backward.
    assert profile.matmul_flops == {
        "float8_e4m3fn": body,
        "float8_e4m3fn+float8_e5m2": body,
        "bfloat16": 3 * head,
    }
    dequantized = jp.dtype_profile(
        lambda a, b: a.astype(jnp.float8_e4m3fn).astype(jnp.bfloat16) * 2 @ b,
        jnp.ones((4, 8), jnp.bfloat16),
        jnp.ones((8, 2), jnp.bfloat16),
    )
    assert dequantized.matmul_flops == {"bfloat16": 2 * 4 * 8 * 2}
    assert profile.summary() == (
        "36% of matmul FLOPs in float8_e4m3fn, 36% in float8_e4m3fn+float8_e5m2 (body), "
        "27% in bfloat16 (head)"
    )


class DropoutNet(nn.Module):
    @nn.compact
    def __call__(self, x, train=True):
        h = nn.Dropout(0.1, deterministic=not train)(nn.relu(nn.Dense(32, name="body")(x)))
        return nn.Dense(4, name="head")(h)


@pytest.mark.parametrize("make_key", [jax.random.key, jax.random.PRNGKey])
def test_profile_of_a_dropout_training_step_skips_prng_keys(make_key):
    """A training step with dropout creates key arrays (``key<fry>``): they are no number
    dtype, so the profile skips them instead of failing; the matmuls are all counted."""
    x = jnp.ones((8, 16))
    variables = DropoutNet().init(jax.random.key(0), x, train=False)
    fn = jp.linen.apply(DropoutNet(), "mixed_bfloat16")

    def step(params, key):
        def loss(p):
            out = fn({"params": p}, x, rngs={"dropout": jax.random.fold_in(key, 1)})
            return out.astype(jnp.float32).sum()

        return jax.value_and_grad(loss)(params)

    profile = jp.dtype_profile(step, variables["params"], make_key(0))
    body, head = 2 * 8 * 32 * 16, 2 * 8 * 4 * 32
    # forward, and the backward's input and kernel gradients (the body's input gradient
    # is not needed: x is no argument of the loss).
    assert profile.matmul_flops == {"bfloat16": 2 * body + 3 * head}
    assert all(not name.startswith("key") for name in profile.bytes)
    assert "bfloat16" in profile.bytes


@pytest.mark.parametrize("make_key", [jax.random.key, jax.random.PRNGKey])
def test_profile_of_the_issues_key_program(make_key):
    def f(k, x):
        return x @ jax.random.normal(jax.random.split(k)[0], x.shape)

    profile = jp.dtype_profile(f, make_key(0), jnp.ones((4, 4)))
    assert profile.matmul_flops == {"float32": 2 * 4 * 4 * 4}
    assert str(profile).splitlines()[0] == "100% of matmul FLOPs in float32"
