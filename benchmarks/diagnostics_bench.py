"""The cost of `jmp_policy.linen.diagnose` against `jmp_policy.linen.apply`.

A small Flax transformer under `mixed_float16`, compiled with `jax.jit` four ways: the
forward pass and the `value_and_grad` training step, each with `jp.linen.apply` and with
`jp.linen.diagnose` (the step differentiates with respect to the probe too, so it gathers
the backward statistics). Prints the median step time of runs interleaved in one process
and the ratio to `apply`, and checks that `apply`'s program holds no statistics op (plain
`apply` pays nothing). The numbers go into `diagnose`'s docstring.

Run: `python benchmarks/diagnostics_bench.py [--layers 4 --dim 256 --batch 8 --seq 128]`.
"""

from __future__ import annotations

import argparse
import statistics
import time

import flax.linen as nn
import jax
import jax.numpy as jnp

import jmp_policy as jp


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()

    model = Transformer(args.layers, args.dim, args.heads)
    x = jax.random.normal(jax.random.key(0), (args.batch, args.seq, args.dim), jnp.float32)
    params = jax.jit(model.init)(jax.random.key(1), x)["params"]
    plain = jp.linen.apply(model, "mixed_float16")
    diag = jp.linen.diagnose(model, "mixed_float16")
    probe = diag.probe({"params": params}, x)

    def forward_apply(p, q, x):
        return plain({"params": p}, x)

    def forward_diagnose(p, q, x):
        return diag({"params": p}, x, probe=q)

    def step_apply(p, q, x):
        return jax.value_and_grad(lambda p: _loss(plain({"params": p}, x)))(p)

    def step_diagnose(p, q, x):
        def loss(p, q):
            out, report = diag({"params": p}, x, probe=q)
            return _loss(out), report

        grad = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)
        (value, report), (grads, probe_grad) = grad(p, q)
        return value, grads, report.with_gradients(probe_grad)

    variants = {
        "forward: apply": forward_apply,
        "forward: diagnose": forward_diagnose,
        "step: apply": step_apply,
        "step: diagnose": step_diagnose,
    }
    jaxpr = str(jax.make_jaxpr(step_apply)(params, probe, x))
    assert "is_finite" not in jaxpr and "custom_vjp" not in jaxpr, "apply holds taps"
    compiled = {k: jax.jit(f).lower(params, probe, x).compile() for k, f in variants.items()}
    for c in compiled.values():
        jax.block_until_ready(c(params, probe, x))
    times: dict[str, list[float]] = {k: [] for k in compiled}
    for _ in range(args.repeats):  # interleaved, so load changes hit every variant alike
        for k, c in compiled.items():
            start = time.perf_counter()
            jax.block_until_ready(c(params, probe, x))
            times[k].append(time.perf_counter() - start)
    medians = {k: statistics.median(v) for k, v in times.items()}
    print(
        f"{jax.devices()[0].device_kind}; {args.layers} layers, dim {args.dim}, batch "
        f"{args.batch}, seq {args.seq}; {len(probe)} submodules tapped"
    )
    print(f"{'variant':<20} {'median ms':>10} {'vs apply':>9}")
    for k, t in medians.items():
        base = medians[k.split(":")[0] + ": apply"]
        print(f"{k:<20} {1e3 * t:>10.2f} {t / base:>8.2f}x")


if __name__ == "__main__":
    main()
