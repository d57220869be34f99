"""Small Equinox models for the tests: a transformer block, and a stack of blocks made
with ``eqx.filter_vmap`` and run with ``jax.lax.scan`` (Equinox's scan-over-layers idiom)."""

import equinox as eqx
import jax
import jax.extend
import jax.numpy as jnp

VOCAB, WIDTH, HEADS, DEPTH, SEQ = 32, 32, 4, 3, 8


class Block(eqx.Module):
    norm1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    norm2: eqx.nn.LayerNorm
    mlp: eqx.nn.MLP

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.norm1 = eqx.nn.LayerNorm(WIDTH)
        self.attn = eqx.nn.MultiheadAttention(HEADS, WIDTH, key=k1)
        self.norm2 = eqx.nn.LayerNorm(WIDTH)
        self.mlp = eqx.nn.MLP(WIDTH, WIDTH, 2 * WIDTH, depth=1, activation=jax.nn.gelu, key=k2)

    def __call__(self, x):  # x: [seq, width]
        h = jax.vmap(self.norm1)(x)
        x = x + self.attn(h, h, h)
        h = jax.vmap(self.norm2)(x)
        return x + jax.vmap(self.mlp)(h)


class Transformer(eqx.Module):
    embed: eqx.nn.Embedding
    blocks: Block  # DEPTH blocks, every array with a leading [DEPTH] axis
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.embed = eqx.nn.Embedding(VOCAB, WIDTH, key=k1)
        self.blocks = eqx.filter_vmap(Block)(jax.random.split(k2, DEPTH))
        self.head = eqx.nn.Linear(WIDTH, VOCAB, key=k3)

    def __call__(self, tokens):  # tokens: [seq] int32
        x = jax.vmap(self.embed)(tokens)
        dynamic, static = eqx.partition(self.blocks, eqx.is_array)

        def step(x, layer):
            return eqx.combine(layer, static)(x), None

        x, _ = jax.lax.scan(step, x, dynamic)
        return jax.vmap(self.head)(x)


def tokens(seed=0):
    return jax.random.randint(jax.random.key(seed), (SEQ,), 0, VOCAB, dtype=jnp.int32)


def dot_operand_dtypes(jaxpr):
    """The ``(lhs, rhs)`` dtypes of every ``dot_general`` of ``jaxpr``, inside loops too."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            found.append(tuple(str(v.aval.dtype) for v in eqn.invars[:2]))
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    found += dot_operand_dtypes(inner)
    return found


def rounded_dots(jaxpr, depth=4):
    """The ``dot_general`` eqns of ``jaxpr`` (loops included) both of whose operands come
    from a ``round`` within ``depth`` ops: matmuls on values put on an integer grid."""
    produced, found = {}, 0
    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            produced[v] = eqn
        if eqn.primitive.name == "dot_general":
            found += all(_from_round(v, produced, depth) for v in eqn.invars[:2])
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    found += rounded_dots(inner, depth)
    return found


def _from_round(var, produced, depth):
    eqn = produced.get(var) if isinstance(var, jax.extend.core.Var) else None
    if eqn is None or depth == 0:
        return False
    if "round" in (eqn.primitive.name, eqn.params.get("name")):  # jnp.round is a jit
        return True
    return any(_from_round(v, produced, depth - 1) for v in eqn.invars)
