"""Cost of `jmp_policy.loss_scaling` against the plain optimizer update.

On a ~20M-parameter float32 tree with adam, times in one run (interleaved, median over
repetitions, after warm-up, every variant jitted with the same donation):

- the plain ``adam.update`` (gradients already unscaled),
- the floor for any wrapper: the plain update plus one finiteness reduction (``isfinite``;
  and the same with the former ``sum(x - x)`` check, which fast-math compilation folds away),
- ``jmp_policy.loss_scaling(adam)`` (unscale, global finiteness, skip, adjust), with the
  default floor ``2**-14`` and with ``min_loss_scale=1`` (the same program: scales below 1
  are handled by checking the unscaled gradients, not by a second code path),
- the same steps with ``lax.cond`` around the inner update instead of selects,
- a jmp-style hand-written composition (``unscale`` + ``all_finite`` + ``select_tree`` +
  ``adjust``, as jmp's README does it),
- ``optax.apply_if_finite(adam)`` on unscaled gradients,

then a whole training step (forward, backward, update). Prints milliseconds, ratios to the
plain update and to the floor, XLA's ``cost_analysis`` bytes and whether the program holds a
conditional. Run: ``python benchmarks/loss_scaling_bench.py [--reps 30] [--params 20e6]
[--hlo]``.

What stops the wrapper at the floor (``--hlo`` prints the kernels):

- No wrapper that skips non-finite steps can reach the floor's bytes where XLA fuses the
  floor's reduction into the update as a sibling output (GPU: floor 1.000x plain). Skipping
  means the update's writes depend on the *global* reduction, so the reduction is its own
  kernel and reads the gradients once more: at least 7 of adam's 6 array reads and writes,
  1.167x. That is what the wrapper compiles to on GPU, two kernels per leaf::

    %input_reduce_fusion = pred[512] fusion(%updates__w__, %loss_scale), kind=kInput
    %loop_select_fusion = (f32[256,1024], f32[256,1024], f32[256,1024])
        fusion(%count.., %mu__w__, %updates__w__, %nu__w__, %finite, %loss_scale), kind=kLoop

  (one multi-output kernel reads g, mu, nu once and writes the update and the selected
  moments). Its time is 1.10x the floor's on an H100, the whole step 1.07x plain: the extra
  reduction kernels (two stages per leaf) and scalar kernels for the scale, the counters and
  the skipped-step counts. The ``lax.cond`` variant, a jmp-style step and
  ``apply_if_finite`` measure the same there (1.19-1.22x plain).
- XLA:CPU has no multi-output fusion, so adam's update kernel recomputes the new moments
  from g, mu and nu (the materialised moments are the *selected* ones, which differ from the
  update's inputs when a step is skipped)::

    %broadcast_select_fusion = f32[256,1024] fusion(%bias_nu, %nu, %bias_mu, %mu, %g,
        %inverse_scale, %finite_sum)   # reads g, mu, nu again: 4 arrays instead of 2

  so the wrapper moves 1.278x the plain update's bytes against the floor's 1.167x (1.095x).
  Inner optimizers are opaque to the wrapper, so it cannot hand the update the selected
  moments. On CPU the ``isfinite`` reduction also materialises a bool array (XLA:CPU fuses
  only arithmetic into its reductions): the floor is 1.167x with ``isfinite`` against 1.111x
  with ``sum(x - x)``, the price of a check that fast math cannot fold away. On GPU both
  checks fuse into one read.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

import jmp_policy as jp


def make_tree(num_params: int) -> dict[str, jax.Array]:
    """A transformer-like tree: a few large matrices and many small vectors."""
    d = 1024
    layers = max(1, int(num_params // (2 * d * d * 4 + 6 * d)))
    tree: dict[str, jax.Array] = {}
    key = jax.random.key(0)
    rest = int(num_params) - layers * (2 * d * d * 4 + 7 * d)
    if rest >= d:
        tree["embed"] = jax.random.normal(key, (rest // d, d)) * 0.02
    for i in range(layers):
        key, k1, k2 = jax.random.split(key, 3)
        tree[f"layer_{i}/mlp_in"] = jax.random.normal(k1, (d, 4 * d)) * 0.02
        tree[f"layer_{i}/mlp_out"] = jax.random.normal(k2, (4 * d, d)) * 0.02
        for name in ("ln_scale", "ln_bias", "bias_out"):
            tree[f"layer_{i}/{name}"] = jnp.ones((d,))
        tree[f"layer_{i}/bias_in"] = jnp.zeros((4 * d,))
    return tree


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--params", type=float, default=20e6)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--hlo", action="store_true", help="print the default wrapper's kernels")
    parser.add_argument("--full-reps", type=int, default=10)
    parser.add_argument(
        "--donate", action="store_true", help="donate the optimizer state (XLA:CPU then copies)"
    )
    args = parser.parse_args()

    params = make_tree(int(args.params))
    num = sum(x.size for x in jax.tree.leaves(params))
    grads = jax.tree.map(lambda x: x * 1e-3, params)
    scale = jp.DynamicLossScale(2.0**15)
    scaled_grads = scale.scale(grads)

    adam = optax.adam(1e-3)
    wrapped = jp.loss_scaling(adam, scale)  # the default floor, 2**-14
    # Scales below 1 cost nothing extra: the same program as with a floor of 1.
    wrapped_min1 = jp.loss_scaling(adam, jp.DynamicLossScale(2.0**15, min_loss_scale=1.0))
    guarded = optax.apply_if_finite(adam, max_consecutive_errors=5)

    def plain_step(g: Any, state: Any, p: Any) -> Any:
        return adam.update(g, state, p)

    def wrapped_step(g: Any, state: Any, p: Any) -> Any:
        return wrapped.update(g, state, p)

    def wrapped_min1_step(g: Any, state: Any, p: Any) -> Any:
        return wrapped_min1.update(g, state, p)

    def jmp_style_step(g: Any, state: Any, p: Any) -> Any:
        inner_state, loss_scale = state
        g = loss_scale.unscale(g)
        finite = jp.all_finite(g)
        updates, new_inner = adam.update(g, inner_state, p)
        updates = jp.select_tree(finite, updates, jax.tree.map(jnp.zeros_like, updates))
        new_inner = jp.select_tree(finite, new_inner, inner_state)
        return updates, (new_inner, loss_scale.adjust(finite))

    def if_finite_step(g: Any, state: Any, p: Any) -> Any:
        return guarded.update(g, state, p)

    def cond_step(g: Any, state: Any, p: Any) -> Any:
        # What the wrapper does, with `lax.cond` instead of selects around the inner update.
        inner_state, loss_scale = state
        finite = jp.all_finite(g)

        def run(operands: Any) -> Any:
            return adam.update(loss_scale.unscale(operands[0]), operands[1], p)

        def skip(operands: Any) -> Any:
            return jax.tree.map(jnp.zeros_like, operands[0]), operands[1]

        updates, new_inner = jax.lax.cond(finite, run, skip, (g, inner_state))
        return updates, (new_inner, loss_scale.adjust(finite))

    def check_only_step(g: Any, state: Any, p: Any) -> Any:
        # The floor for any wrapper: the plain update plus one finiteness reduction.
        updates, state = adam.update(scale.unscale(g), state, p)
        return (updates, jp.all_finite(g)), state

    def old_check_step(g: Any, state: Any, p: Any) -> Any:
        # The same floor with the former check, `sum(x - x)` (wrong under fast math).
        updates, state = adam.update(scale.unscale(g), state, p)
        finite = jnp.array(True)
        for x in jax.tree.leaves(g):
            finite = finite & jnp.isfinite(jnp.sum(x - x))
        return (updates, finite), state

    variants: dict[str, tuple[Callable[..., Any], Any, Any]] = {
        "plain adam": (plain_step, grads, adam.init(params)),
        "plain + finiteness check": (check_only_step, scaled_grads, adam.init(params)),
        "  same, sum(x - x) check": (old_check_step, scaled_grads, adam.init(params)),
        "jp.loss_scaling(adam)": (wrapped_step, scaled_grads, wrapped.init(params)),
        "  same, min_loss_scale=1": (wrapped_min1_step, scaled_grads, wrapped_min1.init(params)),
        "same with lax.cond": (cond_step, scaled_grads, (adam.init(params), scale)),
        "jmp-style hand-written": (jmp_style_step, scaled_grads, (adam.init(params), scale)),
        "optax.apply_if_finite(adam)": (if_finite_step, grads, guarded.init(params)),
    }

    # Every variant donates the optimizer state, or none does (the default: on XLA:CPU a
    # donated adam state makes even the plain update insert copies).
    compiled = {}
    states = {}
    memory = {}
    traffic = {}
    for name, (fn, g, state) in variants.items():
        jitted = jax.jit(fn, donate_argnums=(1,) if args.donate else ())
        lowered = jitted.lower(g, state, params)
        exe = lowered.compile()
        compiled[name] = exe
        states[name] = jax.tree.map(jnp.copy, state)  # donation must not share buffers
        try:
            stats = exe.memory_analysis()
            memory[name] = stats.temp_size_in_bytes / 2**20 if stats is not None else float("nan")
        except Exception:  # memory_analysis is optional per backend
            memory[name] = float("nan")
        try:
            cost = exe.cost_analysis()
            cost = cost[0] if isinstance(cost, list) else cost
            traffic[name] = float(cost["bytes accessed"])
        except Exception:  # cost_analysis is optional per backend
            traffic[name] = float("nan")

    def run(name: str) -> tuple[float, float]:
        g = variants[name][1]
        start, cpu_start = time.perf_counter(), time.process_time()
        updates, states[name] = compiled[name](g, states[name], params)
        jax.block_until_ready((updates, states[name]))
        return time.perf_counter() - start, time.process_time() - cpu_start

    for name in variants:  # warm-up
        for _ in range(3):
            run(name)
    # Wall time, and CPU time of this process (all XLA threads): the second is robust to other
    # processes competing for the cores.
    times: dict[str, list[float]] = {name: [] for name in variants}
    cpu_times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.reps):
        for name in variants:  # interleaved, so drifts hit every variant alike
            wall, cpu = run(name)
            times[name].append(wall)
            cpu_times[name].append(cpu)

    def ratio(samples: dict[str, list[float]], name: str, stat: Any, base: str) -> str:
        return f"{stat(samples[name]) / stat(samples[base]):7.3f}"

    median = statistics.median
    plain, floor = "plain adam", "plain + finiteness check"
    print(
        f"jax {jax.__version__}, {jax.devices()[0].device_kind} ({os.cpu_count()} cores), "
        f"{num / 1e6:.1f}M float32 params in {len(jax.tree.leaves(params))} leaves, adam, "
        f"state {'donated' if args.donate else 'not donated'}, {args.reps} interleaved reps"
    )
    print(
        f"{'variant':28s} {'wall ms':>8s} {'median':>7s} {'min':>7s} {'median':>7s} "
        f"{'cpu ms':>8s} {'median':>7s} {'temp MiB':>9s} {'bytes':>7s} {'bytes':>7s} {'cond':>5s}"
    )
    print(
        f"{'':28s} {'':8s} {'/plain':>7s} {'/plain':>7s} {'/floor':>7s} {'':8s} {'/plain':>7s} "
        f"{'':9s} {'/plain':>7s} {'/floor':>7s}"
    )
    for name in variants:
        has_cond = "conditional(" in compiled[name].as_text()
        print(
            f"{name:28s} {median(times[name]) * 1e3:8.2f} {ratio(times, name, median, plain)} "
            f"{ratio(times, name, min, plain)} {ratio(times, name, median, floor)} "
            f"{median(cpu_times[name]) * 1e3:8.1f} {ratio(cpu_times, name, median, plain)} "
            f"{memory[name]:9.1f} {traffic[name] / traffic[plain]:7.3f} "
            f"{traffic[name] / traffic[floor]:7.3f} {'yes' if has_cond else 'no':>5s}"
        )
    print(
        "bytes: XLA's compiled 'bytes accessed' (deterministic, unlike the times on a shared "
        "machine): per fused kernel, the bytes of its operands and results, summed over the "
        "program; it counts both branches of a conditional, of which one runs. cond: whether "
        "the program has a conditional (on GPU its predicate is read on the host)."
    )
    if args.hlo:
        # The kernels of the default wrapper on one 256x1024 leaf: what each reads and writes.
        small = {"w": jnp.ones((256, 1024))}
        exe = jax.jit(wrapped.update).lower(small, wrapped.init(small), small).compile()
        print("\nfused kernels of jp.loss_scaling(adam).update on one f32[256,1024] leaf:")
        for line in exe.as_text().split("ENTRY")[1].splitlines():
            if " fusion(" in line or "custom-call(" in line:
                print("  " + line.split(", metadata")[0].split(", backend_config")[0].strip())
    full_step(args.full_reps)


def full_step(reps: int) -> None:
    """The same comparison inside a whole training step (forward, backward, update).

    An MLP of ~20M parameters on a batch of 256: the plain step (``value_and_grad`` +
    adam), the floor (the same plus one finiteness check of the gradients) and the step with
    ``scaled_value_and_grad`` + ``jp.loss_scaling(adam)``. Here the finiteness reduction is a
    small part of the step.
    """
    d, layers, batch = 1024, 19, 256
    keys = jax.random.split(jax.random.key(1), layers)
    params = [jax.random.normal(k, (d, d)) * d**-0.5 for k in keys]
    x = jax.random.normal(jax.random.key(2), (batch, d))

    def loss_fn(p: Any, x: Any) -> Any:
        for w in p:
            x = jnp.tanh(x @ w)
        return jnp.mean(x**2)

    adam = optax.adam(1e-3)
    wrapped = jp.loss_scaling(adam)

    def plain(p: Any, s: Any, x: Any) -> Any:
        loss, g = jax.value_and_grad(loss_fn)(p, x)
        u, s = adam.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    def floor(p: Any, s: Any, x: Any) -> Any:
        loss, g = jax.value_and_grad(loss_fn)(p, x)
        u, s = adam.update(g, s, p)
        return optax.apply_updates(p, u), s, (loss, jp.all_finite(g))

    def scaled(p: Any, s: Any, x: Any) -> Any:
        loss, g = jp.scaled_value_and_grad(loss_fn)(jp.get_loss_scale(s), p, x)
        u, s = wrapped.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    runs = {
        "plain step": (plain, adam.init(params)),
        "plain step + finiteness": (floor, adam.init(params)),
        "jp.loss_scaling step": (scaled, wrapped.init(params)),
    }
    compiled, traffic = {}, {}
    for name, (fn, state) in runs.items():
        compiled[name] = jax.jit(fn).lower(params, state, x).compile()
        cost = compiled[name].cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        traffic[name] = float(cost["bytes accessed"]) if cost else float("nan")
    times: dict[str, list[float]] = {name: [] for name in runs}
    for i in range(reps + 3):
        for name, (_, state) in runs.items():  # interleaved
            start = time.perf_counter()
            jax.block_until_ready(compiled[name](params, state, x))
            if i >= 3:  # warm-up
                times[name].append(time.perf_counter() - start)
    base = statistics.median(times["plain step"])
    num = sum(w.size for w in params)
    print(f"\nwhole training step: {num / 1e6:.1f}M-parameter MLP, batch {batch}, adam")
    print(f"{'variant':28s} {'wall ms':>8s} {'median':>7s} {'min':>7s} {'bytes':>7s}")
    for name, samples in times.items():
        median = statistics.median(samples)
        low = min(samples) / min(times["plain step"])
        print(
            f"{name:28s} {median * 1e3:8.2f} {median / base:7.3f} {low:7.3f} "
            f"{traffic[name] / traffic['plain step']:7.3f}"
        )


if __name__ == "__main__":
    main()
