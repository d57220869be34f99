"""A small trained transformer LM and a structured synthetic task, for the quantization benchmarks.

Shared by ``search_bench.py`` (issue 33) and the GPTQ/AWQ benchmark (issue 32): both need
*trained* weights, on which the quality gap between formats shows (Gaussian initial weights
hide it), and the same held-out loss.

The model is a Flax Linen decoder: ``embed`` (token) and ``pos_embed`` (position)
embeddings, ``blocks_{i}`` (``norm1``, ``attn`` with ``query``/``key``/``value``/``out``,
``norm2``, ``mlp`` with ``up``/``down``), ``final_norm`` and the ``head`` Dense.

The task mixes three kinds of sequence, each opened by its own marker token, so that the
model learns real structure (attention, look-up and arithmetic), not only unigram counts:

- Markov (marker 1): a random first-order chain over 240 symbols, each with four likely
  successors (probabilities 0.6, 0.25, 0.1, 0.05);
- copy (marker 2): 4 random symbols, repeated (copy with an offset of 4): attention (an
  offset of 8 was not learned in the training budget: its loss stayed at chance);
- look-up (marker 3): pairs ``k table[k]`` for a fixed random permutation ``table`` of the
  symbols: a memorised table (the MLPs).

Everything is deterministic: the chain, the batches and the training follow their seeds;
``train`` caches its result within the process.

Usage::

    import lm_task                      # from benchmarks/ (or sys.path)
    model = lm_task.model()
    params = lm_task.train(lm_task.STEPS, seed=0)           # ~2 minutes on a 2-core CPU
    params = lm_task.train(lm_task.QUICK_STEPS, seed=0)     # a few seconds
    loss = lm_task.held_out_loss(model, params, lm_task.held_out_batches())  # 48 batches
    batches = lm_task.calibration_batches(4)

Run alone (``python benchmarks/lm_task.py [--quick]``) it trains and prints the losses.
"""

from __future__ import annotations

import argparse
import functools
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

VOCAB, SEQ, D, HEADS, MLP, LAYERS = 256, 64, 128, 4, 512, 4
BATCH = 16  # calibration and held-out batches
TRAIN_BATCH = 32
STEPS, QUICK_STEPS = 500, 12  # quick: a smoke run (its numbers mean nothing)
LEARNING_RATE = 3e-3
HELD_OUT = 48  # held-out batches by default: loss differences of 1e-3 nats resolved

# Token ranges: 0 pad (unused), 1..3 markers, 16..255 the symbols.
_MARKERS = {"markov": 1, "copy": 2, "lookup": 3}
_SYMBOLS = np.arange(16, VOCAB)  # 240 symbols
_SUCCESSOR_PROBS = np.array([0.6, 0.25, 0.1, 0.05])
_CHAIN_SEED = 1234
_OFFSET = 4  # the copy task repeats its first 4 symbols


class MLPBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(D, name="down")(nn.gelu(nn.Dense(MLP, name="up")(x)))


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm(name="norm1")(x)
        mask = nn.make_causal_mask(jnp.ones(x.shape[:-1], jnp.int32))
        x = x + nn.MultiHeadDotProductAttention(HEADS, name="attn")(h, mask=mask)
        return x + MLPBlock(name="mlp")(nn.LayerNorm(name="norm2")(x))


class LM(nn.Module):
    """The decoder: int tokens ``(batch, seq)`` to logits ``(batch, seq, VOCAB)``."""

    layers: int = LAYERS

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, D, name="embed")(tokens)
        x = x + nn.Embed(SEQ, D, name="pos_embed")(jnp.arange(tokens.shape[-1]))
        for i in range(self.layers):
            x = Block(name=f"blocks_{i}")(x)
        return nn.Dense(VOCAB, name="head")(nn.LayerNorm(name="final_norm")(x))


def model() -> LM:
    """The benchmark's model (the same architecture at every training length)."""
    return LM()


@functools.cache
def _chain() -> tuple[np.ndarray, np.ndarray]:
    """Successors (240, 4) as indices into _SYMBOLS, and the start distribution."""
    rng = np.random.default_rng(_CHAIN_SEED)
    n = len(_SYMBOLS)
    successors = np.stack([rng.choice(n, size=4, replace=False) for _ in range(n)])
    return successors, np.full(n, 1.0 / n)


def _markov(rng: np.random.Generator, length: int) -> np.ndarray:
    successors, start = _chain()
    out = np.empty(length, np.int64)
    state = rng.choice(len(start), p=start)
    picks = rng.choice(4, size=length, p=_SUCCESSOR_PROBS)
    for t in range(length):
        out[t] = state
        state = successors[state, picks[t]]
    return _SYMBOLS[out]


def _copy(rng: np.random.Generator, length: int) -> np.ndarray:
    first = rng.choice(_SYMBOLS, size=_OFFSET)
    return np.tile(first, -(-length // _OFFSET))[:length]


@functools.cache
def _table() -> np.ndarray:
    return np.random.default_rng(_CHAIN_SEED + 1).permutation(len(_SYMBOLS))


def _lookup(rng: np.random.Generator, length: int) -> np.ndarray:
    keys = rng.integers(0, len(_SYMBOLS), -(-length // 2))
    return _SYMBOLS[np.stack([keys, _table()[keys]], 1).reshape(-1)][:length]


_MAKERS = {"markov": _markov, "copy": _copy, "lookup": _lookup}


def sample(seed: int, batch: int = BATCH) -> np.ndarray:
    """One batch of sequences ``(batch, SEQ)`` int32: a marker, then its task's tokens."""
    rng = np.random.default_rng(seed)
    kinds = list(_MAKERS)
    rows = []
    for _ in range(batch):
        kind = kinds[rng.integers(len(kinds))]
        body = _MAKERS[kind](rng, SEQ - 1)
        rows.append(np.concatenate([[_MARKERS[kind]], body]))
    return np.asarray(rows, np.int32)


# Disjoint seed ranges: training batches, calibration batches, held-out batches.
_TRAIN_SEED, _CALIB_SEED, _HELD_OUT_SEED = 0, 10_000_000, 20_000_000


def calibration_batches(n: int, batch: int = BATCH) -> list[np.ndarray]:
    """``n`` calibration batches ``(batch, SEQ)`` int32 (never seen in training or held out)."""
    return [sample(_CALIB_SEED + i, batch) for i in range(n)]


def held_out_batches(n: int = HELD_OUT, batch: int = BATCH) -> list[np.ndarray]:
    """``n`` held-out batches ``(batch, SEQ)`` int32, for :func:`held_out_loss`.

    The same fixed batches for every call, so that variants are compared on the same
    tokens (a paired comparison: see :func:`held_out_losses`).
    """
    return [sample(_HELD_OUT_SEED + i, batch) for i in range(n)]


def loss_fn(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy (nats) of ``logits`` for ``tokens``."""
    logits = logits[:, :-1].astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


_CACHE: dict[tuple[int, int], Any] = {}


def train(steps: int = STEPS, seed: int = 0) -> Any:
    """The ``params`` collection after ``steps`` of adam (batches of ``TRAIN_BATCH``, warmup
    then cosine decay, no weight decay) on the task (cached per process)."""
    key = (int(steps), int(seed))
    if key in _CACHE:
        return _CACHE[key]
    net = model()
    params = jax.jit(net.init)(jax.random.key(seed), jnp.zeros((1, SEQ), jnp.int32))["params"]
    schedule = optax.warmup_cosine_decay_schedule(0.0, LEARNING_RATE, max(steps // 10, 1), steps)
    opt = optax.adam(schedule)
    state = opt.init(params)

    @jax.jit
    def step(params, state, tokens):
        loss, grads = jax.value_and_grad(
            lambda p: loss_fn(net.apply({"params": p}, tokens), tokens)
        )(params)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    for i in range(steps):
        params, state, _ = step(
            params, state, sample(_TRAIN_SEED + seed * 1_000_003 + i, TRAIN_BATCH)
        )
    params = jax.device_get(params)
    _CACHE[key] = params
    return params


def held_out_losses(
    model: nn.Module | Callable[..., Any],
    params: Any,
    batches: Sequence[np.ndarray],
) -> np.ndarray:
    """Mean next-token cross-entropy of each of ``batches`` (float64 array).

    ``model`` is the Linen module (run with ``model.apply``) or any apply function taking
    ``(variables, tokens)`` (for example ``jp.linen.apply(model, policy_map)``);
    ``params`` is the ``params`` collection (or full variables with a ``params`` key).
    Two variants' per-batch losses on the same batches give a paired difference, whose
    standard error is that of the difference, not of the losses.
    """
    variables = params if isinstance(params, dict) and "params" in params else {"params": params}
    apply_fn = model.apply if isinstance(model, nn.Module) else model

    @jax.jit
    def one(variables, tokens):
        return loss_fn(apply_fn(variables, tokens), tokens)

    return np.asarray([float(one(variables, b)) for b in batches], np.float64)


def held_out_loss(
    model: nn.Module | Callable[..., Any],
    params: Any,
    batches: Sequence[np.ndarray],
) -> float:
    """Mean next-token cross-entropy over ``batches`` (see :func:`held_out_losses`)."""
    return float(np.mean(held_out_losses(model, params, batches)))


def paired_difference(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """Mean of ``a - b`` (per-batch losses on the same batches) and its standard error."""
    d = np.asarray(a, np.float64) - np.asarray(b, np.float64)
    return float(d.mean()), float(d.std(ddof=1) / np.sqrt(len(d))) if len(d) > 1 else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_STEPS} steps")
    args = parser.parse_args()
    steps = QUICK_STEPS if args.quick else STEPS
    start = time.perf_counter()
    params = train(steps)
    took = time.perf_counter() - start
    net = model()
    held = held_out_batches()
    n = sum(x.size for x in jax.tree.leaves(params))
    print(f"LM: {LAYERS} blocks, d={D}, MLP {MLP}, vocab {VOCAB}, seq {SEQ}; {n:,} parameters")
    print(
        f"trained {steps} steps in {took:.1f} s; held-out loss {held_out_loss(net, params, held):.4f}"
    )
    rows = np.concatenate(held)
    for kind, floor in task_floors().items():  # per task, to see what was learned
        mine = rows[rows[:, 0] == _MARKERS[kind]]
        chunks = [mine[i : i + BATCH] for i in range(0, len(mine) - BATCH + 1, BATCH)]
        loss = held_out_loss(net, params, chunks)
        print(f"  {kind:7} {loss:.4f} (the task's floor {floor:.4f}, chance {np.log(240):.4f})")


def task_floors() -> dict[str, float]:
    """The lowest mean next-token loss each task allows (its entropy per predicted token)."""
    p = _SUCCESSOR_PROBS
    chance, n = float(np.log(len(_SYMBOLS))), SEQ - 1
    return {
        "markov": (chance + (n - 1) * float(-(p * np.log(p)).sum())) / n,
        "copy": _OFFSET * chance / n,
        "lookup": -(-n // 2) * chance / n,
    }


if __name__ == "__main__":
    main()
