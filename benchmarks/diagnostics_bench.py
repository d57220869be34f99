"""The cost of `jmp_policy.linen.diagnose` against `jmp_policy.linen.apply`, per training step.

A small Flax transformer under `mixed_float16`, its `value_and_grad` training step compiled
with `jax.jit` three ways: with `jp.linen.apply`; with `jp.linen.diagnose`, every submodule
tapped (the step differentiates with respect to the probe too, so it gathers the backward
statistics); and with `diagnose(..., every=10)`, the step counter passed as a traced
argument (one compiled program; the statistics are computed on one step in 10). Each
variant runs blocks of 10 consecutive steps (for `every=10`, steps 0..9: one sampled,
nine not), interleaved in one process so that load changes hit all alike. It prints the
median over blocks of the mean step time, wall-clock and the process's CPU time (the
steadier of the two on a shared machine, where other processes stretch the wall time),
each with its ratio to `apply`. It also checks that `apply`'s program holds no statistics op (plain `apply` pays
nothing) and counts the reduce ops diagnose adds against the tensors it taps. The
numbers go into the README's diagnostics part.

Run: `python benchmarks/diagnostics_bench.py [--dims 256 1024 --layers 4 --batch 8 --seq 128]`.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import statistics
import time
from collections.abc import Iterator

import flax.linen as nn
import jax
import jax.numpy as jnp

import jmp_policy as jp
from jmp_policy._src.diagnostics import taps

EVERY = 10
KEPT = f"every={EVERY}, conds kept"


@contextlib.contextmanager
def conds_kept() -> Iterator[None]:
    """While tracing: each statistic's ``lax.cond`` with an ``optimization_barrier`` in its
    taken branch. XLA's GPU compiler turns the library's per-statistic conds into selects
    (computing every statistic on every step); the barrier keeps them conditionals. Which
    is faster on a GPU (a skipped reduction against a predicate read per conditional) is
    what this variant measures."""
    gated = taps._gated

    def kept(sample, leaves, dtype):
        if sample is None:
            return gated(sample, leaves, dtype)
        leaves = [jax.lax.stop_gradient(x) for x in leaves]

        def stats(v):
            return taps.stats_of(jax.lax.optimization_barrier(v), dtype)

        return jax.lax.cond(sample, stats, lambda v: taps.no_stats(), leaves)

    taps._gated = kept
    try:
        yield
    finally:
        taps._gated = gated


def conditionals(compiled: jax.stages.Compiled) -> int:
    """The conditionals left in the compiled program (XLA may turn a cond into a select)."""
    return len(re.findall(r"\bconditional\(", compiled.as_text()))


class Block(nn.Module):
    dim: int
    heads: int

    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm(name="norm1")(x)
        x = x + nn.MultiHeadDotProductAttention(self.heads, name="attention")(h, h)
        h = nn.LayerNorm(name="norm2")(x)
        h = nn.Dense(4 * self.dim, name="mlp_in")(h)
        return x + nn.Dense(self.dim, name="mlp_out")(nn.gelu(h))


class Transformer(nn.Module):
    layers: int
    dim: int
    heads: int

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(self.dim, name="embed")(x)
        for i in range(self.layers):
            x = Block(self.dim, self.heads, name=f"layers_{i}")(x)
        return nn.Dense(self.dim, name="head")(nn.LayerNorm(name="final_norm")(x))


def _loss(y: jax.Array) -> jax.Array:
    return jnp.mean(jnp.square(y.astype(jnp.float32)))


def _reductions(compiled: jax.stages.Compiled) -> int:
    return len(re.findall(r"\breduce(?:-window)?\(", compiled.as_text()))


def measure(args: argparse.Namespace, dim: int) -> None:
    model = Transformer(args.layers, dim, args.heads)
    x = jax.random.normal(jax.random.key(0), (args.batch, args.seq, dim), jnp.float32)
    params = jax.jit(model.init)(jax.random.key(1), x)["params"]
    plain = jp.linen.apply(model, "mixed_float16")

    def step_apply(p, q, x, step):
        return jax.value_and_grad(lambda p: _loss(plain({"params": p}, x)))(p)

    def diagnosed_step(diag):
        def step(p, q, x, step):
            def loss(p, q):
                out, report = diag({"params": p}, x, probe=q, step=step)
                return _loss(out), report

            grad = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)
            (value, report), (grads, probe_grad) = grad(p, q)
            return value, grads, report.with_gradients(probe_grad)

        return step

    diag = jp.linen.diagnose(model, "mixed_float16")
    probe = diag.probe({"params": params}, x)
    variants = {
        "apply": step_apply,
        "diagnose": diagnosed_step(diag),
        f"diagnose every={EVERY}": diagnosed_step(
            jp.linen.diagnose(model, "mixed_float16", every=EVERY)
        ),
        KEPT: diagnosed_step(jp.linen.diagnose(model, "mixed_float16", every=EVERY)),
    }
    step0 = jnp.zeros((), jnp.int32)
    jaxpr = str(jax.make_jaxpr(step_apply)(params, probe, x, step0))
    assert "is_finite" not in jaxpr and "custom_vjp" not in jaxpr, "apply holds taps"
    compiled = {}
    for k, f in variants.items():
        with conds_kept() if k == KEPT else contextlib.nullcontext():
            compiled[k] = jax.jit(f).lower(params, probe, x, step0).compile()
    steps = [jnp.asarray(i, jnp.int32) for i in range(EVERY)]
    for c in compiled.values():
        for s in steps[:2]:
            jax.block_until_ready(c(params, probe, x, s))
    wall: dict[str, list[float]] = {k: [] for k in compiled}
    cpu: dict[str, list[float]] = {k: [] for k in compiled}
    for _ in range(args.repeats):  # interleaved blocks of EVERY steps
        for k, c in compiled.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            for s in steps:
                jax.block_until_ready(c(params, probe, x, s))
            wall[k].append((time.perf_counter() - start) / EVERY)
            cpu[k].append((time.process_time() - start_cpu) / EVERY)
    medians = {k: statistics.median(v) for k, v in wall.items()}
    cpu_medians = {k: statistics.median(v) for k, v in cpu.items()}
    extra = _reductions(compiled["diagnose"]) - _reductions(compiled["apply"])
    print(
        f"{jax.devices()[0].device_kind}; {args.layers} layers, dim {dim}, batch "
        f"{args.batch}, seq {args.seq}; {len(probe)} submodules tapped; "
        f"+{extra} reduce ops; conditionals left by the compiler: "
        f"{conditionals(compiled[f'diagnose every={EVERY}'])} (every={EVERY}), "
        f"{conditionals(compiled[KEPT])} ({KEPT})"
    )
    print(f"  {'step':<24} {'wall ms':>10} {'ratio':>7} {'CPU ms':>10} {'ratio':>7}")
    for k, t in medians.items():
        c = cpu_medians[k]
        print(
            f"  {k:<24} {1e3 * t:>10.2f} {t / medians['apply']:>6.2f}x "
            f"{1e3 * c:>10.2f} {c / cpu_medians['apply']:>6.2f}x"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dims", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5, help="blocks of 10 steps")
    args = parser.parse_args()
    for dim in args.dims:
        measure(args, dim)


if __name__ == "__main__":
    main()
