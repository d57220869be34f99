"""The output rule and `autocast_exclude` (issue #8).

Outputs are cast only when the policy's output dtype differs from its compute dtype, so a
float32 head (by a map key or by the layer's own `dtype=`) gives float32 logits at depth 1 and
2, Linen and NNX; `autocast_exclude` (classes, paths, regexes) lets a diffusion timestep
embedding receive [257., 999., 1001.] exactly instead of bfloat16's [256., 1000., 1000.].
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from flax_examples.measure import (
    BF16,
    F32,
    RTOL_BF16,
    B,
    Depth2,
    Encoder,
    NNXDepth2,
    NNXEncoder,
    dot_dtypes,
    rel_err,
)

import jmp_policy as jp

# --------------------------------------------------------------------------- the output rule


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
