"""``explain`` says what runs in a layer that holds a weight under a float8 policy yet runs
no float8 matmul: a tied head (``Embed.attend`` / ``nnx.Embed.attend``) stays in the compute
dtype, and its row no longer reads as float8 without a word (#47)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jmp_policy as jp

VOCAB, D = 96, 64
IDS = jnp.arange(16, dtype=jnp.int32).reshape(2, 8)
POLICY = jp.QuantizedFloat8DTypePolicy("float8", "mixed_bfloat16", scaling="current")
NOTE = "bfloat16, not float8: its lookup and `attend` (a tied head) stay in the compute dtype"


class LinenLM(nn.Module):
    @nn.compact
    def __call__(self, ids):
        embed = nn.Embed(VOCAB, D, name="embed")
        h = nn.Dense(D, name="mlp")(embed(ids))
        return embed.attend(h)


class NnxLM(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
        self.mlp = nnx.Linear(D, D, rngs=rngs)

    def __call__(self, ids):
        return self.embed.attend(self.mlp(self.embed(ids)))


def _lines(table):
    return {line.split()[0]: line for line in table.splitlines() if line.startswith("  ")}


def _assert_says_tied_head_runs_bf16(table):
    matmul = _lines(table)
    assert matmul["embed"].split(None, 1)[1] == NOTE
    assert matmul["mlp"].split(None, 1)[1].startswith("float8 (current), e4m3 x e4m3 GEMM")
    row = next(r for r in table.splitlines() if r.startswith("embed "))
    assert "float8_current_from_mixed_bfloat16" in row  # the policy row as resolved


@pytest.mark.filterwarnings("ignore:The float8 layer")
def test_linen_explain_says_tied_head_runs_in_compute_dtype(maybe_jit):
    model = LinenLM()
    variables = model.init(jax.random.key(0), IDS)
    _assert_says_tied_head_runs_bf16(jp.linen.explain(model, POLICY, variables, IDS))
    # What the note says is what runs: the logits come out of a bf16 matmul.
    logits = maybe_jit(jp.linen.apply(model, POLICY))(variables, IDS)
    assert logits.dtype == jnp.bfloat16 and logits.shape == (2, 8, VOCAB)
    jaxpr = str(jax.make_jaxpr(jp.linen.apply(model, POLICY))(variables, IDS))
    assert jaxpr.count("float8_e4m3fn") > 0  # the Dense runs float8
    tied = [e for e in jaxpr.splitlines() if "dot_general" in e and f",{VOCAB}]" in e]
    assert tied and all("bf16[2,8,96]" in e for e in tied)


def test_linen_explain_without_float8_adds_no_note():
    model = LinenLM()
    variables = model.init(jax.random.key(0), IDS)
    assert "not float8" not in jp.linen.explain(model, "mixed_bfloat16", variables, IDS)


@pytest.mark.filterwarnings("ignore:The float8 layer")
def test_nnx_explain_says_tied_head_runs_in_compute_dtype(maybe_jit):
    model = NnxLM(nnx.Rngs(0))
    _assert_says_tied_head_runs_bf16(jp.nnx.explain(model, POLICY, IDS))
    run = jp.nnx.apply(model, POLICY)
    logits = maybe_jit(lambda ids: run(ids))(IDS)
    assert logits.dtype == jnp.bfloat16 and logits.shape == (2, 8, VOCAB)
    assert np.isfinite(np.asarray(logits, np.float32)).all()
