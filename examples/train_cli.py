"""``examples/train.py``'s command line, apart so that ``--help`` and a mistyped flag answer at
once: this module imports only the standard library (jmp_policy, and with it jax, only to check
a policy name), while the training script imports jax, Flax, scikit-learn and matplotlib.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
from typing import Any

DOC = "Train a small Flax model on scikit-learn's digits under a mixed-precision policy."


# Outside the working directory (a checkout stays clean); --plot puts it elsewhere.
DEFAULT_PLOT = os.path.join(tempfile.gettempdir(), "jmp_policy_train_loss.png")
_JMP_KEYS = ("p", "c", "o", "params", "compute", "output")


def parse_policy_map(text: str | None, default: str) -> Any:
    """``--policy-map``: JSON (``{"head": "float32"}``) or ``key=policy,key=policy``: a
    ``jp.DTypePolicyMap`` over ``default``, or ``default`` itself when ``text`` is empty."""
    if not text:
        return default
    if text.lstrip().startswith(("{", "[")):
        try:
            entries = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"not valid JSON ({e.msg} at character {e.pos}): {text!r}; expected "
                """'{"head": "float32"}' or 'head=float32,norm=float32'"""
            ) from None
        if not isinstance(entries, dict) or not all(isinstance(v, str) for v in entries.values()):
            raise ValueError(
                f"expected a JSON object of policy names such as "
                f"""'{{"head": "float32"}}'; got {text!r}"""
            )
    else:
        # Items are `key=policy`; a jmp name's own parts ("p=f32,c=f16,o=f32") are joined
        # back to the item they belong to.
        items: list[str] = []
        for part in text.split(","):
            if items and part.strip().partition("=")[0] in _JMP_KEYS:
                items[-1] += "," + part
            else:
                items.append(part)
        entries = {}
        for item in items:
            key, sep, value = item.partition("=")
            if not sep or not key.strip() or not value.strip():
                raise ValueError(
                    f"expected JSON or 'key=policy,key=policy'; got the item {item!r} in {text!r}"
                )
            entries[key.strip()] = value.strip()
    import jmp_policy as jp

    return jp.DTypePolicyMap(default, entries)


def _short(error: Exception) -> str:
    """The library's message, cut after its "did you mean" where it has one."""
    message = str(error)
    start = message.find("Did you mean")
    end = message.find("?", start)
    return message if start < 0 or end < 0 else message[: end + 1]


TRAINABLE = (
    "float32, bfloat16, float16, mixed_bfloat16, mixed_float16, a jmp string such as "
    "'p=f32,c=bf16,o=f32', or 'int8_from_mixed_bfloat16', 'int4/128_from_mixed_bfloat16', "
    "'float8_from_mixed_bfloat16' (quantization-aware training)"
)


def _check_trainable(policy: Any, text: str) -> None:
    """A policy the script can train under: a floating compute dtype, and no format that
    chooses its weights on calibration inputs (GPTQ, AWQ: ``calibrate`` after training)."""
    import jax.numpy as jnp

    compute = policy.compute_dtype
    if compute is None or not jnp.issubdtype(compute, jnp.floating):
        raise argparse.ArgumentTypeError(
            f"{text!r} computes in {compute}: training needs a floating compute dtype. "
            f"Valid choices: {TRAINABLE}."
        )
    if policy.quantization_mode and policy.quantization_mode.startswith(("gptq", "awq")):
        raise argparse.ArgumentTypeError(
            f"{text!r} is calibrated after training (jp.linen.calibrate), not trained under. "
            f"Valid choices: {TRAINABLE}."
        )


def _policy_name(text: str) -> str:
    """``--policy``: any name ``jp.get`` reads (an unknown one says "did you mean") that
    the script can train under."""
    import jmp_policy as jp

    try:
        policy = jp.get(text)
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(_short(e)) from e
    _check_trainable(policy, text)
    return text


def _policy_map_text(text: str) -> str:
    """``--policy-map``: checked here, so a mistake is one line of ``--help``'s kind."""
    import jmp_policy as jp

    try:
        policy_map = parse_policy_map(text, "float32")
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(_short(e)) from e
    if isinstance(policy_map, jp.DTypePolicyMap):
        for key, policy in policy_map.items():
            _check_trainable(policy, f"{key}={policy.name}")
    return text


def _int_in(low: int, high: int, why: str = ""):
    """An argparse type: an int from ``low`` to ``high``."""

    def check(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer; got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(
                f"expected an integer from {low} to {high:,}{why}; got {text!r}"
            )
        return value

    return check


def _learning_rate(text: str) -> float:
    """``--lr``: a finite positive float."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number; got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a finite number above 0; got {text!r}")
    return value


def _plot_path(text: str) -> str:
    """``--plot``: a file path whose directory exists (checked before training)."""
    directory = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(directory):
        raise argparse.ArgumentTypeError(f"the directory {directory!r} does not exist")
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is a directory; expected a file path")
    return text


# The model's submodule names, for `--help` (which must not trace the model): the test
# holds them to `module_names()`.
MODULE_NAMES = ("head", "hidden_0", "hidden_1", "norm")
# Half of the 1,438 training images: the memory measurement takes two batches of them.
MAX_BATCH = 719


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults after every help line; the epilog as written."""


def make_parser() -> argparse.ArgumentParser:
    names = MODULE_NAMES
    parser = argparse.ArgumentParser(
        description=DOC,
        formatter_class=_HelpFormatter,
        epilog=(
            f"--policy-map keys: the model's submodules, {', '.join(names)}, or regular\n"
            "expressions over their paths (hidden_.*). Examples:\n"
            "  python examples/train.py --policy mixed_float16\n"
            "  python examples/train.py --policy-map 'head=float32,norm=float32'\n"
            """  python examples/train.py --policy-map '{"hidden_.*": "mixed_float16"}'"""
        ),
    )
    parser.add_argument(
        "--policy",
        default="mixed_bfloat16",
        type=_policy_name,
        metavar="NAME",
        help="a policy name: Keras (mixed_float16, float8_from_mixed_bfloat16), jmp "
        "(p=f32,c=bf16,o=f32) or a dtype",
    )
    parser.add_argument(
        "--policy-map",
        default=None,
        type=_policy_map_text,
        metavar="MAP",
        help="a policy per submodule, over --policy (keys listed below): JSON "
        '{"head": "float32"} or head=float32,norm=float32',
    )
    parser.add_argument(
        "--steps", type=_int_in(1, 10**7), default=600, help="training steps of each run"
    )
    parser.add_argument(
        "--batch",
        type=_int_in(1, MAX_BATCH, " (half the training images)"),
        default=128,
        help="examples per step",
    )
    parser.add_argument(
        "--hidden", type=_int_in(1, 65536), default=512, help="width of the hidden layers"
    )
    parser.add_argument("--lr", type=_learning_rate, default=1e-3, help="adam's learning rate")
    parser.add_argument(
        "--seed",
        type=_int_in(0, 2**32 - 1),
        default=0,
        help="seeds the data split, the init and the batches",
    )
    parser.add_argument(
        "--loss-scale-period",
        type=_int_in(1, 2**31 - 1),
        default=100,
        help="float16: finite steps before the loss scale doubles (Keras and PyTorch: 2000)",
    )
    parser.add_argument(
        "--plot",
        default=DEFAULT_PLOT,
        type=_plot_path,
        metavar="PATH",
        help="where to write the plot of the loss and the loss scale (a PNG file)",
    )
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return parser
