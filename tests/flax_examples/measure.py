"""What the tests of issue #8 measure on the example models.

`rel_err` is the relative L2 error against a float32 reference; `dot_dtypes` lists the operand
dtypes of every `dot_general` a function traces to (sub-jaxprs of scans and loops included),
which says how many matmuls really run in 16 bits; `count` tallies them. Also the small Linen
and NNX models (a body and a head, at depth 1 or 2) several test modules share, and lm1b's
config at test size.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flax_examples import lm1b_models as lm

BF16, F16, F32 = np.dtype(jnp.bfloat16), np.dtype("float16"), np.dtype("float32")
RTOL_BF16 = 3e-2  # tiny models in bfloat16 vs float32; Flax's own bf16 lm1b measures 0.5-0.9%
B, L, VOCAB = 2, 8, 48


def rel_err(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def equations(jaxpr, primitive):
    """Every ``primitive`` equation of a jaxpr (a ``jax.extend.core.Jaxpr``), sub-jaxprs
    (scan, while, cond, custom_vjp) included."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == primitive:
            yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    yield from equations(sub.jaxpr, primitive)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    yield from equations(sub, primitive)


def dot_equations(jaxpr):
    """Every dot_general equation of a jaxpr, sub-jaxprs included."""
    return equations(jaxpr, "dot_general")


def converts(fn, *args, **kwargs):
    """``(from dtype, to dtype, shape)`` of every conversion ``fn`` traces to."""
    jaxpr = jax.make_jaxpr(lambda *a: fn(*a, **kwargs))(*args).jaxpr
    return [
        (str(e.invars[0].aval.dtype), str(e.params["new_dtype"]), e.invars[0].aval.shape)
        for e in equations(jaxpr, "convert_element_type")
    ]


def dot_dtypes(fn, *args, **kwargs):
    """Operand dtypes of every dot_general `fn` traces to, sub-jaxprs (scan, while) included."""
    jaxpr = jax.make_jaxpr(lambda *a: fn(*a, **kwargs))(*args).jaxpr
    return [tuple(str(v.aval.dtype) for v in eqn.invars) for eqn in dot_equations(jaxpr)]


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


def int8_scoped(eqn):
    """Whether a dot_general runs inside jmp_policy's int8 matmul (its name scope)."""
    return "int8_matmul" in str(eqn.source_info.name_stack)


def dot_kinds(jaxpr):
    """(operand dtypes, preferred_element_type or None) of every dot_general in a jaxpr
    (a ``jax.extend.core.Jaxpr``), sub-jaxprs included: int8 matmuls read
    ``(("int8", "int8"), "int32")``, and so do jmp_policy's int8 matmuls, whose integer
    operands ride in the compute dtype (found by their name scope)."""
    found = []
    for eqn in dot_equations(jaxpr):
        pref = eqn.params.get("preferred_element_type")
        if int8_scoped(eqn):  # integers in the compute dtype: an int8 x int8 product
            found.append((("int8", "int8"), "int32"))
            continue
        found.append(
            (tuple(str(v.aval.dtype) for v in eqn.invars), None if pref is None else str(pref))
        )
    return found
