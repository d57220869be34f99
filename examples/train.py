"""Train a small Flax model on scikit-learn's digits under a mixed-precision policy.

The model (an MLP, ``hidden_0``, ``hidden_1``, ``norm`` and ``head``) is trained twice on the
same data, with the same initial parameters and the same batches: once under the policy you
choose (``--policy``, optionally refined per submodule with ``--policy-map``) and once in
float32. At the end a table compares the two runs (final loss and accuracy, step time,
activation bytes kept for the backward pass, parameter bytes, skipped steps and the final
loss scale) and a plot of the loss and the loss scale over the steps is written to a file
(in the temporary directory unless ``--plot`` says where; the script prints its path).
The bytes are read from the traced step (the residuals ``jax.vjp`` keeps for the backward
pass), so they are the same on a laptop's CPU as on a GPU or TPU.

A policy that computes in float16 anywhere turns on dynamic loss scaling
(``jp.loss_scaling(optimizer)`` with ``jp.scaled_value_and_grad``): float16's range is too
small for raw gradients. Other policies run the same code with no scaling (``"none"``),
which still skips any non-finite step.

Run:
    pip install -e ".[examples]"
    python examples/train.py                              # mixed_bfloat16
    python examples/train.py --policy mixed_float16       # float16 + dynamic loss scaling
    python examples/train.py --policy-map 'head=float32,norm=float32'
    python examples/train.py --policy-map '{"hidden_.*": "mixed_float16"}' --steps 200

On a CPU, XLA upcasts bfloat16 and float16 arithmetic to float32, so a 16-bit step is not
faster there; the activation bytes show what a GPU or TPU saves, and on one the step time
does too.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_cli import MAX_BATCH, MODULE_NAMES, make_parser, parse_policy_map  # noqa: F401

if __name__ == "__main__":
    # `--help` and a mistyped flag answer here, before jax, Flax, scikit-learn and
    # matplotlib load (tens of seconds on a busy 2-core machine); main parses them again.
    make_parser().parse_args()

import flax.linen as nn
import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
import optax
from sklearn.datasets import load_digits
from tqdm import tqdm

import jmp_policy as jp

matplotlib.use("Agg")  # writes files; needs no display
import matplotlib.pyplot as plt


class MLP(nn.Module):
    """A small classifier for 8x8 digit images (64 pixels in, 10 classes out)."""

    hidden: int = 512

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(self.hidden, name="hidden_0")(x))
        x = nn.relu(nn.Dense(self.hidden, name="hidden_1")(x))
        x = nn.LayerNorm(name="norm")(x)
        return nn.Dense(10, name="head")(x)


def uses_float16(policy: jp.DTypePolicyMap | jp.DTypePolicy | str) -> bool:
    """Whether any submodule computes in float16 (then the loss needs scaling)."""
    if isinstance(policy, jp.DTypePolicyMap):
        policies = [policy.default_policy, *policy.values()]
    else:
        policies = [jp.get(policy)]
    return any(p.compute_dtype == jnp.float16 for p in policies)


def load_data(seed: int) -> tuple[np.ndarray, ...]:
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    n_test = len(x) // 5
    return x[n_test:], y[n_test:], x[:n_test], y[:n_test]


def saved_bytes(fn, *args) -> int:
    """Bytes of the residuals that ``jax.vjp(fn, *args)`` keeps for the backward pass (the
    arguments themselves aside), read from the traced function: the same on any device."""

    def residuals(*args):
        _, backward = jax.vjp(fn, *args)  # a pytree whose leaves are the residuals
        inputs = {id(a) for a in jax.tree.leaves(args)}
        return [r for r in jax.tree.leaves(backward) if id(r) not in inputs]

    return sum(r.size * r.dtype.itemsize for r in jax.eval_shape(residuals, *args))


def run(policy, variables, args, data, progress_name: str) -> dict[str, Any]:
    """Trains ``MLP`` from ``variables`` under ``policy``; returns the history and measurements.

    ``variables`` are ``{"params": ...}``, plus the float8 state a float8 policy needs
    (``jp.linen.init`` creates it): its gradient is its new value, so it is split off the
    gradients and replaces the old state instead of going through the optimizer.
    """
    x_train, y_train, x_test, y_test = data
    model = MLP(args.hidden)
    apply = jp.linen.apply(model, policy)
    scaling = "dynamic" if uses_float16(policy) else "none"
    # Dynamic: start at 2**15, double after `period` finite steps, halve (and skip the step)
    # on a non-finite one. Keras and PyTorch wait 2000 steps; a short run shows more with less.
    loss_scale = jp.DynamicLossScale(2.0**15, period=args.loss_scale_period)
    optimizer = jp.loss_scaling(optax.adam(args.lr), loss_scale if scaling == "dynamic" else "none")
    opt_state = jax.jit(optimizer.init)(variables["params"])

    def loss_fn(variables, x, y):
        logits = apply(variables, x).astype(jnp.float32)  # the loss in float32
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    grad_fn = jp.scaled_value_and_grad(loss_fn)

    @jax.jit
    def step(variables, opt_state, x, y):
        loss, grads = grad_fn(jp.get_loss_scale(opt_state), variables, x, y)
        grads, float8_state = jp.linen.split_gradients(grads)  # {} without float8
        params = variables["params"]
        updates, opt_state = optimizer.update(grads["params"], opt_state, params)
        return {"params": optax.apply_updates(params, updates), **float8_state}, opt_state, loss

    @jax.jit
    def accuracy(variables, x, y):
        logits = apply(variables, x)
        return jnp.mean(jnp.argmax(logits, -1) == y)

    # Kept for the backward pass: what grows with the batch is activations; the rest, the
    # 16-bit copies of the parameters the matmuls read. (XLA's temp bytes on a CPU would
    # say more: it keeps 16-bit arithmetic in float32 there.)
    xb, yb = jnp.asarray(x_train[: 2 * args.batch]), jnp.asarray(y_train[: 2 * args.batch])
    saved = saved_bytes(loss_fn, variables, xb[: args.batch], yb[: args.batch])
    activation_bytes = saved_bytes(loss_fn, variables, xb, yb) - saved
    param_bytes = sum(p.nbytes for p in jax.tree.leaves(variables["params"]))

    rng = np.random.default_rng(args.seed)
    history: dict[str, list[float]] = {"loss": [], "scale": [], "skipped": []}
    times = []
    bar = tqdm(range(args.steps), desc=progress_name, leave=False, disable=args.no_progress)
    for _ in bar:
        idx = rng.integers(0, len(x_train), args.batch)
        start = time.perf_counter()
        variables, opt_state, loss = step(variables, opt_state, x_train[idx], y_train[idx])
        loss = float(loss)  # waits for the step
        times.append(time.perf_counter() - start)
        history["loss"].append(loss)
        history["scale"].append(float(jp.get_loss_scale(opt_state).loss_scale))
        history["skipped"].append(int(opt_state.total_skipped))
        if scaling == "dynamic":  # the scale written as the table writes it (2**15)
            bar.set_postfix(loss=f"{loss:.4f}", scale=_scale(history["scale"][-1]), refresh=False)
        else:
            bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
    bar.close()
    return {
        "history": history,
        "loss": history["loss"][-1],
        "accuracy": float(accuracy(variables, jnp.asarray(x_test), jnp.asarray(y_test))),
        "step_ms": statistics.median(times[1:] or times) * 1e3,  # the first step compiles
        "activation_bytes": activation_bytes,
        "copy_bytes": saved - activation_bytes,
        "param_bytes": param_bytes,
        "skipped": history["skipped"][-1],
        "scale": history["scale"][-1] if scaling == "dynamic" else None,
        "param_dtypes": sorted({str(p.dtype) for p in jax.tree.leaves(variables["params"])}),
    }


def what_ran(policy: jp.DTypePolicyMap | str) -> list[str]:
    """One line per kind of policy in use that a CPU run cannot show, saying what ran."""
    if isinstance(policy, jp.DTypePolicyMap):
        policies = [policy.default_policy, *policy.values()]
    else:
        policies = [jp.get(policy)]
    lines = []
    if any(isinstance(p, jp.QuantizedFloat8DTypePolicy) for p in policies):
        lines.append(
            "float8: the float8 layers ran explicit float8 matmuls (e4m3 x e4m3 forward, e5m2 "
            "gradients);\n  a CPU has no float8 units and emulates them (slower here), an "
            "H100-class GPU runs native fp8 GEMMs."
        )
    int8 = [p for p in policies if isinstance(p, jp.QuantizedDTypePolicy)]
    if any(not isinstance(p, jp.QuantizedFloat8DTypePolicy) for p in int8):
        lines.append(
            "int8: the int8 layers ran int8 matmuls (activations and kernels rounded to int8, "
            "quantization-\n  aware training); their weights stay float32 while training: "
            "`jp.linen.quantize` stores them\n  in int8 for serving, at a quarter of the bytes."
        )
    if jax.default_backend() == "cpu" and any(
        jnp.dtype(p.compute_dtype).itemsize == 2 for p in policies
    ):
        lines.append("No 16-bit speed-up on a CPU: XLA's CPU backend upcasts 16-bit arithmetic.")
    return lines


def _scale(scale: float | None) -> str:
    if scale is None:
        return "- (none)"
    exponent = np.log2(scale)
    return f"2**{exponent:.0f}" if exponent == round(exponent) else f"{scale:g}"


def format_table(name: str, ours: dict[str, Any], base: dict[str, Any]) -> str:
    """The comparison table, at most 100 columns wide."""

    def ratio(a: float, b: float) -> str:
        return f"{a / b:.3f}x" if b else "-"

    def mb(n: int) -> str:
        return f"{n / 1e6:.3f} MB"

    rows = [
        ("final train loss", f"{ours['loss']:.4f}", f"{base['loss']:.4f}", ""),
        ("test accuracy", f"{ours['accuracy']:.3f}", f"{base['accuracy']:.3f}", ""),
        (
            f"step time (median{', CPU' if jax.default_backend() == 'cpu' else ''})",
            f"{ours['step_ms']:.2f} ms",
            f"{base['step_ms']:.2f} ms",
            ratio(ours["step_ms"], base["step_ms"]),
        ),
        (
            "kept for backward, total",
            mb(ours["activation_bytes"] + ours["copy_bytes"]),
            mb(base["activation_bytes"] + base["copy_bytes"]),
            ratio(
                ours["activation_bytes"] + ours["copy_bytes"],
                base["activation_bytes"] + base["copy_bytes"],
            ),
        ),
        (
            "  activations (x batch)",
            mb(ours["activation_bytes"]),
            mb(base["activation_bytes"]),
            ratio(ours["activation_bytes"], base["activation_bytes"]),
        ),
        ("  fixed (parameter copies)", mb(ours["copy_bytes"]), mb(base["copy_bytes"]), ""),
        (
            "parameter bytes",
            mb(ours["param_bytes"]),
            mb(base["param_bytes"]),
            ratio(ours["param_bytes"], base["param_bytes"]),
        ),
        ("skipped steps", str(ours["skipped"]), str(base["skipped"]), ""),
        (
            "final loss scale",
            _scale(ours["scale"]),
            _scale(base["scale"]),
            "",
        ),
    ]
    name = name if len(name) <= 30 else name[:27] + "..."
    legend = (
        "kept for backward = activations, which grow with the batch, + a fixed part, mostly "
        "the\ncompute-dtype copies of the parameters the matmuls read (float32 reads the stored "
        "ones)."
    )
    header = ("", name, "float32", "ratio")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(4)]
    lines = []
    for i, row in enumerate([header, *rows]):
        cells = [row[0].ljust(widths[0])] + [
            c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)
        ]
        lines.append("  ".join(cells).rstrip())
        if i == 0:
            lines.append("-" * len(lines[0]))
    return "\n".join([*lines, legend])


def figure(name: str, ours: dict[str, Any], base: dict[str, Any]) -> Any:
    """The loss of both runs over the steps (float32 dashed on top), and below it our loss
    scale with the skipped steps; one panel, titled so, when the policy has no loss scale."""
    if ours["scale"] is None:  # one panel: the loss; the title says there is no scale
        fig, ax_loss = plt.subplots(1, 1, figsize=(8, 4))
        ax_scale = None
        ax_loss.set_title(f"{name}: no loss scaling (no float16)")
    else:
        fig, (ax_loss, ax_scale) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    steps = np.arange(1, len(ours["history"]["loss"]) + 1)
    ax_loss.plot(steps, ours["history"]["loss"], label=name, linewidth=2.5, alpha=0.6)
    # float32 on top, dashed: where the curves agree both stay visible.
    ax_loss.plot(steps, base["history"]["loss"], "k--", label="float32", linewidth=1)
    ax_loss.set_yscale("log")
    ax_loss.set_ylabel("training loss")
    ax_loss.legend()
    skipped = np.diff(np.asarray([0, *ours["history"]["skipped"]])) > 0
    if ax_scale is None:
        ax_loss.set_xlabel("step")
    else:
        ax_scale.plot(steps, ours["history"]["scale"], label="loss scale")
        ax_scale.set_yscale("log", base=2)
        if skipped.any():
            ax_scale.plot(
                steps[skipped],
                np.asarray(ours["history"]["scale"])[skipped],
                "rx",
                label="skipped step",
            )
        ax_scale.legend()
        ax_scale.set_ylabel("loss scale")
        ax_scale.set_xlabel("step")
    fig.tight_layout()
    return fig


def plot(path: str, name: str, ours: dict[str, Any], base: dict[str, Any]) -> None:
    fig = figure(name, ours, base)
    fig.savefig(path)
    plt.close(fig)


def module_names(hidden: int = 8) -> list[str]:
    """The model's submodule names, the keys ``--policy-map`` can use (traced, not run)."""
    shapes = jax.eval_shape(MLP(hidden).init, jax.random.key(0), jnp.zeros((1, 64)))
    return list(shapes["params"])


def main(argv: list[str] | None = None) -> None:
    args = make_parser().parse_args(argv)

    policy = parse_policy_map(args.policy_map, args.policy)
    name = args.policy if args.policy_map is None else f"{args.policy} + map"
    print(f"policy: {policy!r}" if isinstance(policy, str) else f"policy map: {policy!r}")
    print(f"loss scaling: {'dynamic' if uses_float16(policy) else 'none (no float16)'}")
    data = load_data(args.seed)
    # One initialisation for both runs: parameters in the policy's variable dtype (float32
    # for the mixed policies), created as `jp.linen.apply` will use them. Jitted: an eager
    # Flax init compiles one small program per op.
    init = jax.jit(jp.linen.init(MLP(args.hidden), policy))
    variables = init(jax.random.key(args.seed), jnp.asarray(data[0][:1]))  # + float8 state
    ours = run(policy, variables, args, data, name)
    float32 = jp.get_policy("float32")
    base = run(
        float32, {"params": float32.cast_to_param(variables["params"])}, args, data, "float32"
    )
    print(f"\n{args.steps} steps of batch {args.batch} on {jax.devices()[0].platform.upper()}:")
    print(format_table(name, ours, base))
    print(f"{name}: parameters stored in {', '.join(ours['param_dtypes'])}")
    for line in what_ran(policy):
        print(line)
    plot(args.plot, name, ours, base)
    print(f"plot of the loss and the loss scale written to {os.path.abspath(args.plot)}")


if __name__ == "__main__":
    main(sys.argv[1:])
