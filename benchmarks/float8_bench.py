"""float8 training against bfloat16 and float32: step time, memory, float8 ops, loss.

A stack of pre-norm residual MLP blocks (``LayerNorm -> Dense(hidden) -> gelu ->
Dense(width)``, the matmuls of a transformer's MLP) trained on a fixed regression task
(random tokens, a random ``tanh`` teacher) with a jitted step: ``value_and_grad``,
``jp.linen.split_gradients`` and optax adam. Six variants, measured side by side in one
run (the same initial parameters and data):

* ``float8``: the Dense layers under ``"float8_from_mixed_bfloat16"`` (explicit float8
  GEMMs: inputs and kernels in e4m3, output gradients in e5m2, delayed scaling), the
  rest ``"mixed_bfloat16"``;
* ``f8_cur``: the same under ``"float8_current_from_mixed_bfloat16"`` (current scaling);
* ``int8_qat``: the Dense layers under ``"int8_from_mixed_bfloat16"`` with float kernels
  (quantization-aware training: both operands rounded to the int8 grid, bf16 matmuls);
* ``flax_f8``: Flax's own ``nn.Fp8DirectDotGeneralOp`` on every Dense, the peer a user
  would pick;
* ``bf16``: ``"mixed_bfloat16"`` everywhere;
* ``float32``: ``"float32"`` everywhere.

For each: the step time (median of interleaved repeats), the compiled temp bytes
(``memory_analysis()``), the ``convert`` ops to or from float8 in the optimized HLO
(``f8 cvt``), the dots of the unoptimized HLO in the form XLA's GPU GemmRewriter turns into
native float8 GEMMs (``f8 dots``: both operands ``convert(f8) * broadcast(scalar)``), the
GEMMs XLA did lower to native float8 (``f8 GEMMs``: ``__cublas$lt$matmul$f8`` custom
calls, on GPUs with float8 units, H100 and later), the forward time of one Dense layer
alone, and the loss after ``--steps`` steps, and its distance to bf16's as a fraction of
the first loss (float8 should track bf16; the issue's fidelity measure).

A CPU has no float8 units: there XLA emulates the quantize-dequantize and float8 costs time;
only the loss, the op counts and the memory mean something. On an H100 XLA folds each
``convert(f8) * scale`` into the GEMM. Run on a GPU:
``JAX_PLATFORMS=cuda python benchmarks/float8_bench.py --tokens 8192 --width 8192
--hidden 8192 --layers 2``.

Run: ``python benchmarks/float8_bench.py [--quick]``.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jmp_policy as jp

FP8_GEMM = "__cublas$lt$matmul$f8"
VARIANTS = {
    "float8": jp.DTypePolicyMap(
        "mixed_bfloat16", {r"block_\d+/(up|down)": "float8_from_mixed_bfloat16"}
    ),
    "f8_cur": jp.DTypePolicyMap(
        "mixed_bfloat16", {r"block_\d+/(up|down)": "float8_current_from_mixed_bfloat16"}
    ),
    # int8 quantization-aware training: float kernels, both operands rounded to the int8
    # grid in the compute dtype (straight-through gradient), then a bf16 matmul.
    "int8_qat": jp.DTypePolicyMap(
        "mixed_bfloat16", {r"block_\d+/(up|down)": "int8_from_mixed_bfloat16"}
    ),
    # The peer a user would pick: Flax's own explicit float8 op on every Dense.
    "flax_f8": "mixed_bfloat16",
    "bf16": "mixed_bfloat16",
    "float32": "float32",
}
# Run only when --variants names it: delayed scaling with a one-step amax history (on the
# CPU reproduction of delayed scaling's divergence it tracks bf16; the default 1,024 steps
# does not).
EXTRA_VARIANTS = {
    "f8_h1": jp.DTypePolicyMap(
        "mixed_bfloat16",
        {
            r"block_\d+/(up|down)": jp.QuantizedFloat8DTypePolicy(
                "float8", source_name="mixed_bfloat16", amax_history_length=1
            )
        },
    ),
}
ALL_VARIANTS = {**VARIANTS, **EXTRA_VARIANTS}
SINGLE = {
    "float8": "float8_from_mixed_bfloat16",
    "f8_cur": "float8_current_from_mixed_bfloat16",
    "int8_qat": "int8_from_mixed_bfloat16",
}


class Block(nn.Module):
    width: int
    hidden: int
    op: Any = None  # a Dense's dot_general_cls (Flax's float8 op), or None

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(self.hidden, name="up", dot_general_cls=self.op)(nn.LayerNorm(name="norm")(x))
        return x + nn.Dense(self.width, name="down", dot_general_cls=self.op)(nn.gelu(h))


class MLPStack(nn.Module):
    width: int
    hidden: int
    layers: int
    op: Any = None

    @nn.compact
    def __call__(self, x):
        for i in range(self.layers):
            x = Block(self.width, self.hidden, self.op, name=f"block_{i}")(x)
        return x


def model_for(name: str, args: argparse.Namespace) -> nn.Module:
    op = nn.Fp8DirectDotGeneralOp if name == "flax_f8" else None
    return MLPStack(args.width, args.hidden, args.layers, op)


def make_data(args: argparse.Namespace) -> tuple[jax.Array, jax.Array]:
    """Tokens ``(tokens, width)`` and a teacher's targets ``tanh(x @ A)``."""
    kx, ka = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (args.tokens, args.width), jnp.float32)
    a = jax.random.normal(ka, (args.width, args.width), jnp.float32) / np.sqrt(args.width)
    return x, jnp.tanh(x @ a)


def make_step(model: nn.Module, policy: Any, tx: Any) -> Any:
    fn = jp.linen.apply(model, policy)

    def loss_fn(variables, x, y):
        return jnp.mean(jnp.square(fn(variables, x).astype(jnp.float32) - y))

    def step(variables, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(variables, x, y)
        grads, float8_state = jp.linen.split_gradients(grads)
        updates, opt_state = tx.update(grads["params"], opt_state, variables["params"])
        params = optax.apply_updates(variables["params"], updates)
        return {"params": params, **float8_state}, opt_state, loss

    return step


_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.-]+) = (\w+)\[([^\]]*)\]\S* ([\w-]+)\(([^)]*)\)")
# Ops GemmRewriter lets stand between a dequantization and the dot (it moves them before).
_COMMUTATIVE = {"bitcast", "broadcast", "copy", "reshape", "slice", "transpose", "pad"}
Op = tuple[str, str, str, list[str]]  # dtype, dims, opcode, operand names


def computations(hlo: str) -> list[dict[str, Op]]:
    """HLO text as one ``{name: (dtype, dims, opcode, operands)}`` per computation (names
    are unique within a computation, not across fused ones)."""
    result: list[dict[str, Op]] = [{}]
    for line in hlo.splitlines():
        if line.rstrip().endswith("{") and not line.startswith(" "):
            result.append({})
        m = _INSTRUCTION.match(line)
        if m:
            name, dtype, dims, op, args = m.groups()
            names = [a.split()[-1].lstrip("%") for a in args.split(",") if a.strip()]
            result[-1][name] = (dtype, dims, op, names)
    return result


def _is_fp8(ops: dict[str, Op], name: str) -> bool:
    return name in ops and ops[name][0].startswith("f8")


def float8_converts(hlo: str) -> int:
    """``convert`` ops whose result or operand is float8."""
    return sum(
        1
        for ops in computations(hlo)
        for name, (_, _, op, args) in ops.items()
        if op == "convert" and (_is_fp8(ops, name) or _is_fp8(ops, args[0]))
    )


def _dequantized(ops: dict[str, Op], name: str) -> bool:
    """Whether ``name`` is float8, or ``convert(f8) [* or /] broadcast(scalar)``, through
    ops that commute with it (GemmRewriter's ``MatchFp8Param``)."""
    while name in ops and ops[name][2] in _COMMUTATIVE:
        name = ops[name][3][0]
    if name not in ops:
        return False
    _, _, op, args = ops[name]
    if _is_fp8(ops, name) or (op == "convert" and _is_fp8(ops, args[0])):
        return True
    if op not in ("multiply", "divide") or len(args) != 2:
        return False
    converted = [a for a in args if a in ops and ops[a][2] == "convert"]
    scalars = [
        a
        for a in args
        if a in ops and ops[a][2] == "broadcast" and ops.get(ops[a][3][0], ("", "x"))[1] == ""
    ]
    return len(converted) == 1 and _is_fp8(ops, ops[converted[0]][3][0]) and len(scalars) == 1


def fp8_form_dots(hlo: str) -> tuple[int, int]:
    """(dots whose two operands are float8 or ``convert(f8) * broadcast(scalar)``, all dots)
    in unoptimized HLO text: the form XLA's GPU GemmRewriter makes native float8 GEMMs of,
    already before any simplification (Flax's ``fp8_ops``, whose scales have shape ``(1,)``,
    reach it only after XLA's simplifier: this check is sufficient, not necessary)."""
    found = total = 0
    for ops in computations(hlo):
        for _, _, op, args in ops.values():
            if op == "dot":
                total += 1
                found += all(_dequantized(ops, a) for a in args[:2])
    return found, total


def fp8_gemms(hlo: str) -> tuple[int, int]:
    """(native float8 GEMMs, all GEMMs) in optimized HLO text: float8 GEMMs are cuBLASLt's
    ``__cublas$lt$matmul$f8`` calls and dots of two float8 operands (Triton's); all GEMMs
    add the other cuBLAS calls and dots."""
    fp8 = total = 0
    for ops in computations(hlo):
        for _, _, op, args in ops.values():
            if op == "dot":
                total += 1
                fp8 += all(_is_fp8(ops, a) for a in args[:2])
    fp8 += hlo.count(f'custom_call_target="{FP8_GEMM}"')
    total += len(re.findall(r'custom_call_target="__cublas\$(lt\$)?(matmul|gemm)[^"]*"', hlo))
    return fp8, total


def _time(fns: dict[str, Any], repeats: int) -> dict[str, list[float]]:
    """Interleaved wall times of ``fns`` (no-argument callables), after one warm-up."""
    for fn in fns.values():
        jax.block_until_ready(fn())
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):  # interleaved: load changes hit every variant alike
        for name, fn in fns.items():
            start = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append(time.perf_counter() - start)
    return times


def measure(
    args: argparse.Namespace, names: tuple[str, ...] | None = None, forward: bool = True
) -> dict[str, dict[str, Any]]:
    """Each variant's figures (all of :data:`VARIANTS`, or those ``names``, which must
    include ``"float32"``: every variant starts from its parameters); ``forward=False``
    skips timing one Dense's forward alone (``"forward"`` is then absent)."""
    variants = VARIANTS if names is None else {n: ALL_VARIANTS[n] for n in names}
    x, y = make_data(args)
    tx = optax.adam(args.lr)
    results: dict[str, dict[str, Any]] = {}
    steps, states = {}, {}
    for name, policy in variants.items():
        model = model_for(name, args)
        variables = jax.jit(jp.linen.init(model, policy))(jax.random.key(1), x[:8])
        opt_state = tx.init(variables["params"])
        step = jax.jit(make_step(model, policy, tx))
        lowered = step.lower(variables, opt_state, x, y)
        compiled = lowered.compile()
        hlo = compiled.as_text()
        if os.environ.get("BENCH_HLO_DIR"):  # the optimized step, to read its GEMMs later
            path = os.path.join(os.environ["BENCH_HLO_DIR"], f"step_{args.width}_{name}.hlo")
            with open(path, "w") as f:
                f.write(hlo)
        steps[name], states[name] = compiled, (variables, opt_state)
        fp8, gemms = fp8_gemms(hlo)
        results[name] = {
            "temp": compiled.memory_analysis().temp_size_in_bytes,
            "f8_converts": float8_converts(hlo),
            # What the library asks for, before XLA fuses (and may repeat) the converts.
            "f8_traced": float8_converts(lowered.as_text(dialect="hlo")),
            "fp8_gemms": fp8,
            "fp8_form": fp8_form_dots(lowered.as_text(dialect="hlo")),
            "gemms": gemms,
        }
    # The same initial parameters for every variant (init casts "params" to float32).
    first = jax.tree.leaves(states["float32"][0]["params"])
    for name in variants:
        leaves = jax.tree.leaves(states[name][0]["params"])
        assert all(bool(jnp.array_equal(a, b)) for a, b in zip(first, leaves, strict=True))

    def run_step(name: str) -> Any:
        compiled, (variables, opt_state) = steps[name], states[name]
        return lambda: compiled(variables, opt_state, x, y)

    times = _time({name: run_step(name) for name in variants}, args.repeats)
    for name in variants:
        results[name]["times"] = times[name]
    # The forward matmul of one Dense (tokens x width -> width) alone.
    forwards = {}
    for name, policy in variants.items() if forward else ():
        dense = nn.Dense(args.width, dot_general_cls=model_for(name, args).op)
        single = SINGLE.get(name, policy)
        variables = jax.jit(jp.linen.init(dense, single))(jax.random.key(2), x[:8])
        fwd = jax.jit(jp.linen.apply(dense, single)).lower(variables, x).compile()
        forwards[name] = lambda fwd=fwd, variables=variables: fwd(variables, x)
    times = _time(forwards, args.repeats)
    for name in forwards:
        results[name]["forward"] = times[name]
    # Training: the loss after `steps` steps of each variant from the same start.
    for name in variants:
        compiled, (variables, opt_state) = steps[name], states[name]
        losses = []
        for i in range(args.steps):
            variables, opt_state, loss = compiled(variables, opt_state, x, y)
            losses.append(loss)
            if i < args.log_steps:  # where a run diverges: the loss and each tensor's scale
                print(f"  {name} step {i}: loss {float(loss):.4f}{_scales(variables)}")
        results[name]["losses"] = [float(v) for v in losses]
        state = jax.tree.leaves(variables.get("_overwrite_with_gradient", {}))
        results[name]["state_finite"] = all(bool(jnp.all(jnp.isfinite(v))) for v in state)
    return results


def _scales(variables: Any) -> str:
    """The float8 state's scales of the first block's layers, ``"" `` when there is none."""
    state = variables.get("_overwrite_with_gradient", {})
    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    cells = [
        f"{jax.tree_util.keystr(path[-3:-1], simple=True, separator='/')}.{path[-1].key[:-6]}"
        f"={float(np.max(v)):.3g}"
        for path, v in flat
        if str(path[-1].key).endswith("_scale") and "block_0" in jax.tree_util.keystr(path)
    ]
    return ("; " + " ".join(cells)) if cells else ""


def format_table(results: dict[str, dict[str, Any]], steps: int) -> str:
    med = statistics.median
    bf16 = results["bf16"]
    header = [
        "variant",
        "step ms",
        "/bf16",
        "fwd ms",
        "/bf16",
        "temp MB",
        "/bf16",
        "f8 cvt",
        "f8 dots",
        "f8 GEMMs",
        f"loss@{steps}",
        "-bf16",
    ]
    table = [header]
    for name, r in results.items():
        table.append(
            [
                name,
                f"{med(r['times']) * 1e3:.2f}",
                f"{med(r['times']) / med(bf16['times']):.3f}",
                f"{med(r['forward']) * 1e3:.3f}" if "forward" in r else "-",
                f"{med(r['forward']) / med(bf16['forward']):.3f}" if "forward" in r else "-",
                f"{r['temp'] / 1e6:.1f}",
                f"{r['temp'] / bf16['temp']:.3f}",
                str(r["f8_converts"]),
                "{}/{}".format(*r["fp8_form"]),
                f"{r['fp8_gemms']}/{r['gemms']}",
                f"{r['losses'][-1]:.5f}",
                f"{(r['losses'][-1] - bf16['losses'][-1]) / bf16['losses'][0]:+.4f}",
            ]
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = []
    for row in table:
        cells = [row[0].ljust(widths[0])]
        cells += [c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)]
        lines.append("  ".join(cells))
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (CI)")
    parser.add_argument("--tokens", type=int, default=512, help="batch x sequence")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=200, help="training steps for the loss")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument(
        "--log-steps",
        type=int,
        default=0,
        help="print the loss and the first block's float8 scales at each of the first N steps",
    )
    parser.add_argument(
        "--sweep",
        type=str,
        default="",
        help="comma-separated widths: step time per width (hidden 4x) against bf16, to find "
        "where float8 starts to pay (the crossover)",
    )
    parser.add_argument(
        "--variants",
        type=str,
        default="",
        help=f"comma-separated, of {','.join(ALL_VARIANTS)} (float32 is always run: every "
        "variant starts from its parameters); the forward of one Dense alone is then not timed",
    )
    args = parser.parse_args(argv)
    if args.variants:
        unknown = sorted(set(args.variants.split(",")) - set(ALL_VARIANTS))
        if unknown:
            parser.error(f"--variants: unknown {unknown}; known: {list(ALL_VARIANTS)}")
    if args.quick:
        args.tokens, args.width, args.hidden, args.layers = 64, 32, 64, 2
        args.steps, args.repeats = 30, 3
    return args


def sweep(args: argparse.Namespace) -> None:
    """One row per width: each variant's step time over bf16's, and its float8 GEMMs."""
    names = [n for n in VARIANTS if n not in ("float32", "int8_qat")]
    print(f"crossover: {args.layers} blocks, hidden 4x width, {args.tokens} tokens, adam")
    print("width  " + "  ".join(f"{n:>14s}" for n in names) + "   f8 GEMMs (float8)")
    for width in (int(w) for w in args.sweep.split(",")):
        sub = argparse.Namespace(**{**vars(args), "width": width, "hidden": 4 * width})
        sub.steps = 1
        results = measure(sub, (*names, "float32"))
        base = statistics.median(results["bf16"]["times"])
        cells = [f"{statistics.median(results[n]['times']) / base:14.3f}" for n in names]
        r = results["float8"]
        print(f"{width:5d}  " + "  ".join(cells) + f"   {r['fp8_gemms']}/{r['gemms']}", flush=True)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.sweep:
        sweep(args)
        return
    print(
        f"MLP stack: {args.layers} blocks, width {args.width}, hidden {args.hidden}, "
        f"{args.tokens} tokens, adam; median of {args.repeats} interleaved runs"
    )
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}")
    # Quick sizes are too small to time: the forward alone is left out (six compiles fewer).
    names = None
    if args.variants:
        names = tuple(dict.fromkeys([*args.variants.split(","), "float32"]))
    results = measure(args, names, forward=not (args.quick or args.variants))
    print(format_table(results, args.steps))
    if args.quick:
        print("quick sizes: too small to time (fwd not measured; step times are fixed costs)")
    print("f8_cur: current scaling; flax_f8: Flax's nn.Fp8DirectDotGeneralOp on every Dense")
    print("int8_qat: int8 quantization-aware training (float kernels rounded to int8, bf16 GEMMs)")
    print(
        f"-bf16: the loss minus bf16's, over the first loss ({results['bf16']['losses'][0]:.4f}); "
        f"float8 state finite: {results['float8']['state_finite']}"
    )


if __name__ == "__main__":
    main()
