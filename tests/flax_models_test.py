"""Per-submodule policies on real Flax models (issue #8): lm1b, a Gemma-style NNX decoder, ViTs.

Covers, on Flax's own example code (tests/flax_examples/): decoding with a bfloat16 KV cache
and float32 QK-norms (`NORM_FLOAT32`), a stock config whose layers all set `dtype=float32`
(the warning, `module_dtype="override"`), the output rule at depths 1 and 2, `autocast_exclude`,
root variables and the variable-key rule alike in every tree method and wrapper, the typo
warning, `explain` on `jax.eval_shape` variables, and non-float policies rejected.

Tolerance: logits of these tiny models computed in bfloat16 stay within 3% (relative L2
error) of float32; Flax's own `dtype=bfloat16` lm1b config measures 0.5-0.9%.
"""

from __future__ import annotations

import functools
import re
import warnings
from typing import Any

import flax.linen as nn
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from flax_examples import gemma_nnx
from flax_examples import lm1b_models as lm
from jaxpr_counts import dot_dtypes

import jmp_policy as jp

BF16, F16, F32 = np.dtype(jnp.bfloat16), np.dtype("float16"), np.dtype("float32")
RTOL_BF16 = 3e-2
B, L, VOCAB = 2, 8, 48


def rel_err(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def count(pairs):
    out: dict[str, int] = {}
    for pair in pairs:
        key = pair[0] if pair[0] == pair[1] else "/".join(pair)
        out[key] = out.get(key, 0) + 1
    return out


def tokens(shape=(B, L), seed=0):
    return jax.random.randint(jax.random.key(seed), shape, 1, VOCAB)


def lm1b_config(**overrides):
    """lm1b's TransformerConfig at test size (its own dtype default: float32 everywhere)."""
    kw: dict[str, Any] = dict(
        vocab_size=VOCAB,
        output_vocab_size=VOCAB,
        emb_dim=16,
        num_heads=2,
        num_layers=2,
        qkv_dim=16,
        mlp_dim=32,
        max_len=16,
        deterministic=True,
    )
    kw.update(overrides)
    return lm.TransformerConfig(**kw)


# --------------------------------------------------------------------------- Linen decoding


class QKNormBlock(nn.Module):
    """lm1b's EncoderDecoder1DBlock with Flax's QK-norm (`normalize_qk=True`) turned on."""

    config: lm.TransformerConfig

    @nn.compact
    def __call__(self, inputs, decoder_mask=None):
        cfg = self.config
        x = nn.LayerNorm(dtype=cfg.dtype)(inputs)
        x = nn.MultiHeadDotProductAttention(
            num_heads=cfg.num_heads,
            dtype=cfg.dtype,
            qkv_features=cfg.qkv_dim,
            use_bias=False,
            broadcast_dropout=False,
            deterministic=True,
            decode=cfg.decode,
            normalize_qk=True,
        )(x, mask=decoder_mask)
        x = x + inputs
        z = nn.LayerNorm(dtype=cfg.dtype)(x)
        return x + lm.MlpBlock(config=cfg)(z)


class QKNormLM(nn.Module):
    """lm1b's TransformerLM (its embedding, AddPositionEmbs with a decode cache index, MlpBlock)
    with QK-norm attention blocks."""

    config: lm.TransformerConfig

    @nn.compact
    def __call__(self, inputs):
        cfg = self.config
        mask = None
        if not cfg.decode:
            mask = nn.combine_masks(
                nn.make_attention_mask(inputs > 0, inputs > 0), nn.make_causal_mask(inputs)
            )
        y = inputs.astype("int32")
        if not cfg.decode:
            y = lm.shift_inputs(y)
        y = nn.Embed(cfg.vocab_size, cfg.emb_dim, embedding_init=nn.initializers.normal(1.0))(y)
        y = lm.AddPositionEmbs(config=cfg, decode=cfg.decode, name="posembed_output")(y)
        for i in range(cfg.num_layers):
            y = QKNormBlock(cfg, name=f"block_{i}")(y, mask)
        y = nn.LayerNorm(dtype=cfg.dtype, name="final_norm")(y)
        return nn.Dense(cfg.vocab_size, dtype=cfg.dtype, name="logitdense")(y)


def test_linen_decoder_with_bfloat16_cache_and_float32_qk_norms_decodes_several_tokens():
    cfg = lm1b_config(num_layers=1, dtype=None)
    model, decoder = QKNormLM(cfg), QKNormLM(cfg.replace(decode=True))
    seq = tokens()
    params = model.init(jax.random.key(0), seq)["params"]
    logits32 = jax.jit(model.apply)({"params": params}, seq)  # teacher-forced float32 reference
    policy, norms = "mixed_bfloat16", jp.linen.NORM_FLOAT32

    init = jax.jit(jp.linen.init(decoder, policy, type_policies=norms))
    cache = init(jax.random.key(0), seq)["cache"]
    cache_leaves = jax.tree_util.tree_leaves_with_path(cache)
    kv = [leaf for path, leaf in cache_leaves if "cached_" in jax.tree_util.keystr(path)]
    assert len(kv) == 2 and {np.dtype(leaf.dtype) for leaf in kv} == {BF16}

    cache_dtypes = jax.tree.map(lambda a: a.dtype, cache)
    fn = jp.linen.apply(decoder, policy, type_policies=norms)
    step = jax.jit(lambda variables, tok: fn(variables, tok, mutable=["cache"]))
    tok, decoded = jnp.zeros((B, 1), jnp.int32), []  # lm1b's decoding starts from token 0
    for t in range(4):
        logits, mutated = step({"params": params, "cache": cache}, tok)
        cache = mutated["cache"]
        assert jax.tree.map(lambda a: a.dtype, cache) == cache_dtypes
        decoded.append(logits[:, 0])
        tok = seq[:, t : t + 1]  # teacher forcing, so the float32 reference applies
    kv = [
        leaf for path, leaf in jax.tree_util.tree_leaves_with_path(cache) if "cached_" in str(path)
    ]
    assert {np.dtype(leaf.dtype) for leaf in kv} == {BF16}
    assert int(jax.tree.leaves(cache["posembed_output"])[0]) == 4
    decoded = jnp.stack(decoded, axis=1)
    assert np.isfinite(np.asarray(decoded, np.float32)).all()
    assert rel_err(decoded, logits32[:, :4]) < RTOL_BF16
    # q·kᵀ and every other matmul stay bfloat16: the float32 norms hand back bfloat16
    dots = dot_dtypes(fn, {"params": params, "cache": cache}, tok, mutable=["cache"])
    assert count(dots) == {"bfloat16": 9}  # q, k, v, out, q·kᵀ, p·v, 2 MLP, logits


# --------------------------------------------------------------------------- NNX decoding


def gemma_decode(step, seq, cache):
    """Decodes token by token with Gemma's left-aligned cache, fed `seq` (teacher forcing)."""
    steps, out = seq.shape[1], []
    for t in range(steps):
        pos = jnp.full((B, 1), t)
        mask = jnp.broadcast_to(jnp.arange(steps) <= t, (B, 1, steps))
        logits, cache = step(seq[:, t : t + 1], pos, cache, mask)
        out.append(logits[:, 0])
    return jnp.stack(out, axis=1), cache


def test_nnx_gemma_decoder_with_bfloat16_cache_and_float32_qk_norms():
    model = gemma_nnx.Transformer(vocab_size=VOCAB, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)

    @jax.jit
    def step32(state, *args):
        return nnx.merge(graphdef, state)(*args)

    @jax.jit
    def step(state, *args):  # the wrapper called inside jit, as a decoding loop does
        m = nnx.merge(graphdef, state)
        return jp.nnx.apply(m, "mixed_bfloat16", type_policies=jp.nnx.NORM_FLOAT32)(*args)

    seq = tokens((B, 4))
    logits32, _ = gemma_decode(
        functools.partial(step32, state), seq, model.init_cache(4, B, jnp.float32)
    )
    logits, cache = gemma_decode(
        functools.partial(step, state), seq, model.init_cache(4, B, jnp.bfloat16)
    )

    for layer in cache.values():
        assert layer["k"].dtype == BF16 and layer["v"].dtype == BF16
        assert layer["end_index"].tolist() == [4, 4]
    assert np.isfinite(np.asarray(logits, np.float32)).all()
    assert rel_err(logits, logits32) < RTOL_BF16


def test_nnx_gemma_every_matmul_bfloat16_with_float32_qk_norms():
    model = gemma_nnx.Transformer(vocab_size=VOCAB, rngs=nnx.Rngs(0))
    cache = model.init_cache(4, B, dtype=jnp.bfloat16)
    mask = jnp.ones((B, 1, 4), bool)
    graphdef, state = nnx.split(model)

    def step(state, tok, pos, cache):
        m = nnx.merge(graphdef, state)
        fn = jp.nnx.apply(m, "mixed_bfloat16", type_policies=jp.nnx.NORM_FLOAT32)
        return fn(tok, pos, cache, mask)

    dots = dot_dtypes(step, state, tokens((B, 1)), jnp.zeros((B, 1), jnp.int32), cache)
    # per layer: qkv, q·kᵀ, p·v, output, gate, up, down; then the tied-embedding logits
    assert count(dots) == {"bfloat16": 2 * 7 + 1}


# --------------------------------------------------------------------------- stock configs


def override_warnings(record):
    return [w for w in record if "module_dtype" in str(w.message)]


def test_stock_lm1b_config_warns_once_that_modules_own_dtype_override_the_policy():
    model, x = lm.TransformerLM(lm1b_config()), tokens()
    variables = model.init(jax.random.key(0), x)
    fn = jp.linen.apply(model, "mixed_bfloat16")

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fn(variables, x)
        fn(variables, x)

    found = override_warnings(record)
    assert len(found) == 1, [str(w.message) for w in record]
    assert found[0].category is UserWarning
    message = str(found[0].message)
    # 4 MLP Dense, 2 attention + 8 of their projections, 5 LayerNorm, the logits Dense
    assert re.search(r"\b20\b", message), message
    assert 'module_dtype="override"' in message
    # respected: every matmul of the model stays float32
    assert count(dot_dtypes(fn, variables, x)) == {"float32": 17}


def test_module_dtype_override_puts_every_lm1b_matmul_in_bfloat16(maybe_jit):
    model, x = lm.TransformerLM(lm1b_config()), tokens()
    variables = model.init(jax.random.key(0), x)
    reference = model.apply(variables, x)

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fn = jp.linen.apply(model, "mixed_bfloat16", module_dtype="override")
        out = maybe_jit(fn)(variables, x)
    assert override_warnings(record) == []

    assert count(dot_dtypes(fn, variables, x)) == {"bfloat16": 17}
    assert out.dtype == F32  # lm1b's own `logits.astype(config.dtype)` at the end
    assert rel_err(out, reference) < RTOL_BF16


def test_float32_output_spellings_on_stock_lm1b_with_override():
    model, x = lm.TransformerLM(lm1b_config()), tokens()
    variables = model.init(jax.random.key(0), x)
    # the recommended spelling: float32 outputs from the root only
    recommended = jp.DTypePolicyMap("mixed_bfloat16", {"": "p=f32,c=bf16,o=f32"})
    fn = jp.linen.apply(model, recommended, module_dtype="override")
    assert count(dot_dtypes(fn, variables, x)) == {"bfloat16": 17}
    # With override, every module's dtype is bfloat16, so even float32 outputs from every
    # module are cast back where Flax promotes to its dtype: all 17 in bf16.
    fn = jp.linen.apply(model, "p=f32,c=bf16,o=f32", module_dtype="override")
    assert count(dot_dtypes(fn, variables, x)) == {"bfloat16": 17}
    # Without module dtypes (Flax promotes), float32 outputs from every module make
    # q·kᵀ and p·v float32: the spelling the README recommends against.
    free = lm.TransformerLM(lm1b_config(dtype=None))
    fn = jp.linen.apply(free, "p=f32,c=bf16,o=f32")
    assert count(dot_dtypes(fn, variables, x)) == {"bfloat16": 13, "float32": 4}
    fn = jp.linen.apply(free, recommended)
    assert count(dot_dtypes(fn, variables, x)) == {"bfloat16": 17}


def test_stock_resnet_and_gemma_configs_warn_too():
    from flax_examples import imagenet_models

    resnet = imagenet_models.ResNet(
        stage_sizes=[1], block_cls=imagenet_models.ResNetBlock, num_classes=4, num_filters=4
    )
    x = jnp.ones((2, 8, 8, 3))
    variables = resnet.init(jax.random.key(0), x, train=False)
    with pytest.warns(UserWarning, match='module_dtype="override"'):
        jp.linen.apply(resnet, "mixed_bfloat16")(variables, x, train=False)

    gemma = gemma_nnx.Transformer(vocab_size=VOCAB, rngs=nnx.Rngs(0), dtype=jnp.float32)
    cache = gemma.init_cache(4, B, dtype=jnp.float32)
    args = (tokens((B, 1)), jnp.zeros((B, 1), jnp.int32), cache, jnp.ones((B, 1, 4), bool))
    # Respected, the float32 layers write float32 keys into the cache that the
    # bfloat16 attention module received: the warning, naming the way out, comes first.
    with (
        pytest.warns(UserWarning, match='module_dtype="override"'),
        pytest.raises(TypeError, match="dynamic_update_slice"),
    ):
        jp.nnx.apply(gemma, "mixed_bfloat16")(*args)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        logits, _ = jp.nnx.apply(gemma, "mixed_bfloat16", module_dtype="override")(*args)
    assert override_warnings(record) == []
    assert logits.dtype == BF16


# --------------------------------------------------------------------------- the output rule


class Encoder(nn.Module):
    head_dtype: Any = None

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(8, name="body")(x))
        return nn.Dense(4, dtype=self.head_dtype, name="head")(x)


class Depth2(nn.Module):
    head_dtype: Any = None

    @nn.compact
    def __call__(self, x):
        return Encoder(self.head_dtype, name="encoder")(x)


class NNXEncoder(nnx.Module):
    def __init__(self, head_dtype=None, *, rngs):
        self.body = nnx.Linear(6, 8, rngs=rngs)
        self.head = nnx.Linear(8, 4, dtype=head_dtype, rngs=rngs)

    def __call__(self, x):
        return self.head(nnx.relu(self.body(x)))


class NNXDepth2(nnx.Module):
    def __init__(self, head_dtype=None, *, rngs):
        self.encoder = NNXEncoder(head_dtype, rngs=rngs)

    def __call__(self, x):
        return self.encoder(x)


OUTPUT_CASES = [
    # (policy or map builder taking the head's path, the head's own dtype, logits dtype)
    ("mixed_bfloat16", None, BF16),
    ("p=f32,c=bf16,o=f32", None, F32),
    ("head float32 in a map", None, F32),
    ("mixed_bfloat16", jnp.float32, F32),
]


def output_policy(spec, head_path):
    if spec == "head float32 in a map":
        return jp.DTypePolicyMap("mixed_bfloat16", {head_path: "float32"})
    return spec


@pytest.mark.parametrize(("spec", "head_dtype", "expected"), OUTPUT_CASES)
@pytest.mark.parametrize("depth", [1, 2])
def test_output_rule_linen(depth, spec, head_dtype, expected, maybe_jit):
    model = Encoder(head_dtype) if depth == 1 else Depth2(head_dtype)
    head_path = "head" if depth == 1 else "encoder/head"
    x = jax.random.normal(jax.random.key(0), (B, 6))
    variables = model.init(jax.random.key(1), x)
    fn = jp.linen.apply(model, output_policy(spec, head_path))

    out = maybe_jit(fn)(variables, x)

    assert out.dtype == expected
    assert rel_err(out, model.apply(variables, x)) < RTOL_BF16
    head = "float32" if head_dtype is not None or spec == "head float32 in a map" else "bfloat16"
    assert dot_dtypes(fn, variables, x) == [("bfloat16",) * 2, (head,) * 2]


@pytest.mark.parametrize(("spec", "head_dtype", "expected"), OUTPUT_CASES)
@pytest.mark.parametrize("depth", [1, 2])
def test_output_rule_nnx(depth, spec, head_dtype, expected):
    cls = NNXEncoder if depth == 1 else NNXDepth2
    model = cls(head_dtype, rngs=nnx.Rngs(0))
    head_path = "head" if depth == 1 else "encoder/head"
    x = jax.random.normal(jax.random.key(0), (B, 6))

    out = jp.nnx.apply(model, output_policy(spec, head_path))(x)

    assert out.dtype == expected
    assert rel_err(out, model(x)) < RTOL_BF16


def test_output_rule_in_cast_apply():
    params = {"body": {"kernel": jnp.ones((6, 4))}}

    def apply(params, x):
        return x @ params["body"]["kernel"]

    x = jnp.ones((B, 6))
    assert jp.cast_apply("mixed_bfloat16")(apply)(params, x).dtype == BF16
    assert jp.cast_apply("p=f32,c=bf16,o=f32")(apply)(params, x).dtype == F32


# --------------------------------------------------------------------------- autocast_exclude

TIMESTEPS = [257.0, 999.0, 1001.0]  # not representable in bfloat16: 256, 1000, 1000
SEEN_T: list[np.ndarray] = []


def record_t(t):
    if not isinstance(t, jax.core.Tracer):  # the shape-only pre-pass sees tracers
        SEEN_T.append(np.asarray(t))


def sinusoidal(t, dim=8):
    freqs = jnp.exp(-jnp.log(10000.0) * jnp.arange(dim // 2) / (dim // 2)).astype(t.dtype)
    angles = t[:, None] * freqs[None]
    return jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1)


class TimestepEmbedding(nn.Module):
    @nn.compact
    def __call__(self, t):
        record_t(t)
        return nn.Dense(8)(sinusoidal(t))


class Denoiser(nn.Module):
    @nn.compact
    def __call__(self, x, timesteps):
        t = timesteps.astype(jnp.float32)  # integer timesteps made float32 by the model
        return nn.Dense(8)(x) + TimestepEmbedding(name="time_embed")(t)


class NNXTimestepEmbedding(nnx.Module):
    def __init__(self, *, rngs):
        self.dense = nnx.Linear(8, 8, rngs=rngs)

    def __call__(self, t):
        record_t(t)
        return self.dense(sinusoidal(t))


class NNXDenoiser(nnx.Module):
    def __init__(self, *, rngs):
        self.dense = nnx.Linear(8, 8, rngs=rngs)
        self.time_embed = NNXTimestepEmbedding(rngs=rngs)

    def __call__(self, x, timesteps):
        return self.dense(x) + self.time_embed(timesteps.astype(jnp.float32))


@pytest.mark.parametrize(
    ("exclude", "expected"),
    [
        ((), [256.0, 1000.0, 1000.0]),
        (("CLASS",), TIMESTEPS),
        (("time_embed",), TIMESTEPS),
        ((".*_embed",), TIMESTEPS),
    ],
    ids=["none", "class", "path", "regex"],
)
@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_autocast_exclude_keeps_timesteps_exact(api, exclude, expected):
    x, timesteps = jnp.ones((3, 8)), jnp.array([257, 999, 1001])
    SEEN_T.clear()
    if api == "linen":
        exclude = tuple(TimestepEmbedding if e == "CLASS" else e for e in exclude)
        model = Denoiser()
        variables = model.init(jax.random.key(0), x, timesteps)
        SEEN_T.clear()
        out = jp.linen.apply(model, "mixed_bfloat16", autocast_exclude=exclude)(
            variables, x, timesteps
        )
    else:
        exclude = tuple(NNXTimestepEmbedding if e == "CLASS" else e for e in exclude)
        model = NNXDenoiser(rngs=nnx.Rngs(0))
        out = jp.nnx.apply(model, "mixed_bfloat16", autocast_exclude=exclude)(x, timesteps)
    assert SEEN_T, "the timestep embedding was not called with concrete values"
    seen = SEEN_T[-1]
    assert seen.astype(np.float32).tolist() == expected
    assert seen.dtype == (BF16 if not exclude else F32)
    assert np.isfinite(np.asarray(out, np.float32)).all()


# --------------------------------------------------------------------------- root variables

SEEN_DTYPES: dict[str, np.dtype] = {}


class ViTish(nn.Module):
    """A ViT's root: a learned `pos_embedding` on the root module, then an encoder."""

    @nn.compact
    def __call__(self, x):
        pos = self.param("pos_embedding", nn.initializers.normal(0.02), (1, *x.shape[1:]))
        SEEN_DTYPES["pos_embedding"] = np.dtype(pos.dtype)
        return Encoder(name="encoder")(x + pos)


class NNXViTish(nnx.Module):
    def __init__(self, *, rngs):
        self.pos_embedding = nnx.Param(jax.random.normal(rngs.params(), (1, 3, 6)) * 0.02)
        self.encoder = NNXEncoder(rngs=rngs)

    def __call__(self, x):
        pos = self.pos_embedding[...]
        SEEN_DTYPES["pos_embedding"] = np.dtype(pos.dtype)
        return self.encoder(x + pos)


def vit_params():
    x = jnp.ones((B, 3, 6))
    return ViTish().init(jax.random.key(0), x)["params"], x


def test_root_variable_follows_the_root_policy_in_every_tree_method_and_wrapper(maybe_jit):
    policy_map = jp.DTypePolicyMap("mixed_bfloat16", {"": "float32"})
    params, x = vit_params()

    tree = policy_map.policy_tree(params)
    assert tree["pos_embedding"].compute_dtype == F32
    assert tree["encoder"]["body"]["kernel"].compute_dtype == BF16
    cast = policy_map.cast_to_compute(params)
    assert cast["pos_embedding"].dtype == F32
    assert cast["encoder"]["body"]["kernel"].dtype == BF16

    seen = {}

    @jp.cast_apply(policy_map)
    def apply(params, x):
        seen.update(jax.tree.map(lambda a: np.dtype(a.dtype), params))
        return x + params["pos_embedding"]

    maybe_jit(apply)(params, x)
    assert seen["pos_embedding"] == F32
    assert seen["encoder"]["body"]["kernel"] == BF16

    SEEN_DTYPES.clear()
    maybe_jit(jp.linen.apply(ViTish(), policy_map))({"params": params}, x)
    assert SEEN_DTYPES["pos_embedding"] == F32

    SEEN_DTYPES.clear()
    jp.nnx.apply(NNXViTish(rngs=nnx.Rngs(0)), policy_map)(x)
    assert SEEN_DTYPES["pos_embedding"] == F32


@pytest.mark.parametrize("module_key", ["encoder/.*", r"encoder(/\w+)*"])
def test_variable_key_rule_is_the_same_in_every_tree_method_and_wrapper(module_key):
    # Both keys name modules (they match "encoder/head"), so neither overrides the exact key
    # of encoder/head for its kernel: the kernel stays float32, the body's goes bfloat16.
    policy_map = jp.DTypePolicyMap(
        "float32", {module_key: "mixed_bfloat16", "encoder/head": "float32"}
    )
    params, x = vit_params()
    head, body = ("encoder", "head", "kernel"), ("encoder", "body", "kernel")

    def at(tree, path):
        for key in path:
            tree = tree[key]
        return tree

    tree = policy_map.policy_tree(params)
    assert at(tree, head).compute_dtype == F32
    assert at(tree, body).compute_dtype == BF16
    cast = policy_map.cast_to_compute(params)
    assert at(cast, head).dtype == F32
    assert at(cast, body).dtype == BF16

    seen = {}

    @jp.cast_apply(policy_map)
    def apply(params):
        seen.update(jax.tree.map(lambda a: np.dtype(a.dtype), params))
        return 0.0

    apply(params)
    assert at(seen, head) == F32 and at(seen, body) == BF16

    fn = jp.linen.apply(ViTish(), policy_map)
    assert dot_dtypes(fn, {"params": params}, x) == [("bfloat16",) * 2, ("float32",) * 2]

    model = NNXViTish(rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    pure = lambda state, x: jp.nnx.apply(nnx.merge(graphdef, state), policy_map)(x)  # noqa: E731
    assert dot_dtypes(pure, state, x) == [("bfloat16",) * 2, ("float32",) * 2]


# --------------------------------------------------------------------------- typos


def typo_warnings(record):
    return [w for w in record if "haed" in str(w.message)]


@pytest.mark.parametrize("wrapper", ["linen.apply", "linen.init", "nnx.apply"])
def test_a_key_that_resolves_nothing_warns_once_naming_it(wrapper):
    policy_map = jp.DTypePolicyMap("mixed_bfloat16", {"haed": "float32"})
    x = jax.random.normal(jax.random.key(0), (B, 6))
    if wrapper == "linen.apply":
        model = Encoder()
        variables = model.init(jax.random.key(0), x)
        fn, args = jp.linen.apply(model, policy_map), (variables, x)
        assert policy_map.unused_keys(variables["params"]) == ["haed"]
    elif wrapper == "linen.init":
        fn, args = jp.linen.init(Encoder(), policy_map), (jax.random.key(0), x)
    else:
        fn, args = jp.nnx.apply(NNXEncoder(rngs=nnx.Rngs(0)), policy_map), (x,)

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fn(*args)
        fn(*args)

    found = typo_warnings(record)
    assert len(found) == 1, [str(w.message) for w in record]
    assert found[0].category is UserWarning
    assert "unused_keys" in str(found[0].message)


def test_no_typo_warning_when_every_key_resolves():
    policy_map = jp.DTypePolicyMap("mixed_bfloat16", {"head": "float32", ".*/kernel": "float32"})
    x = jax.random.normal(jax.random.key(0), (B, 6))
    model = Encoder()
    variables = model.init(jax.random.key(0), x)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        jp.linen.apply(model, policy_map)(variables, x)
    assert [str(w.message) for w in record if "unused_keys" in str(w.message)] == []
    assert policy_map.unused_keys(variables["params"]) == []


# --------------------------------------------------------------------------- explain


@pytest.mark.parametrize("config", ["policy-friendly", "stock"])
def test_linen_explain_takes_eval_shape_variables_and_fits_100_columns(config):
    cfg = lm1b_config(dtype=None) if config == "policy-friendly" else lm1b_config()
    model, x = lm.TransformerLM(cfg), tokens()
    abstract = jax.eval_shape(model.init, jax.random.key(0), x)
    assert isinstance(jax.tree.leaves(abstract)[0], jax.ShapeDtypeStruct)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the stock config warns: not what this test is about
        table = jp.linen.explain(model, "mixed_bfloat16", abstract, x)
        concrete = jp.linen.explain(
            model, "mixed_bfloat16", jax.jit(model.init)(jax.random.key(0), x), x
        )

    assert isinstance(table, str)
    assert table == concrete
    width = max(len(line) for line in table.splitlines())
    assert width <= 100, f"{width} columns:\n{table}"
    assert "logitdense" in table
    assert "encoderdecoderblock_1" in table


def test_nnx_explain_fits_100_columns():
    model = gemma_nnx.Transformer(vocab_size=VOCAB, rngs=nnx.Rngs(0))
    table = jp.nnx.explain(model, "mixed_bfloat16", type_policies=jp.nnx.NORM_FLOAT32)
    assert isinstance(table, str)
    width = max(len(line) for line in table.splitlines())
    assert width <= 100, f"{width} columns:\n{table}"
    assert "_query_norm" in table and "qkv_einsum" in table and "RMSNorm" in table


# --------------------------------------------------------------------------- non-float policies


@pytest.mark.parametrize("wrapper", ["linen.apply", "linen.init", "nnx.apply"])
def test_non_float_policy_is_rejected(wrapper):
    make = {
        "linen.apply": lambda p: jp.linen.apply(Encoder(), p),
        "linen.init": lambda p: jp.linen.init(Encoder(), p),
        "nnx.apply": lambda p: jp.nnx.apply(NNXEncoder(rngs=nnx.Rngs(0)), p),
    }[wrapper]
    with pytest.raises(ValueError, match=r"int8") as info:
        make("int8")
    assert re.search(r"float", str(info.value)), str(info.value)
