"""The docstring text the three adapters' entry points share, written once.

Each adapter's public function keeps its own summary, framework-specific arguments and
runnable example, and names a shared block with a ``{placeholder}`` line; :func:`fill`
puts the block there at import time, indented as the placeholder is, so ``help()`` and
the API reference show the whole text in each framework's words.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

#: The shared blocks by placeholder name: argument descriptions the entry points of
#: Linen, NNX and Equinox have in common (one source for the three adapters' docs).
BLOCKS: dict[str, str] = {
    "calibrate_options": """\
hessian_damping: GPTQ's damping, a fraction of the mean Hessian diagonal.
num_grid_points: AWQ's exponent grid ``0, 1/n, ..., 1``.
clip_search: choose each int4/int8 group's scale by a clipping search (GPTQ's
    reference ``mse=True`` grid on the weights; AWQ's ``auto_clip`` by the group's
    output error on the calibration inputs) instead of abs-max; ``False`` for
    abs-max scales, as Keras 3.15.
return_report: also return the per-layer report (a list of ``LayerReport``: per
    calibrated kernel, the relative output error of round-to-nearest and of the
    method on the calibration inputs, and seconds).
progress: ``True`` shows a progress bar over the calibrated layers (``tqdm`` when
    installed, else a line per layer on stderr); a callable is given each
    ``LayerReport`` as its layer is solved; ``False`` (default) is quiet.
max_statistics_bytes: bounds the device memory the gathered statistics take
    (each layer's ``XᵀX`` and ``mean |x|``, float32): the layers are gathered in
    groups that fit, one pass over the batches per group, each group's moved to
    host memory before the next (a layer larger than the bound alone). ``None``
    (default): every layer in one pass. The result is the same.""",
    "policy_or_map": """\
policy_or_map: a policy (or name), a :class:`~jmp_policy.DTypePolicyMap` or a dict.""",
    "batches": """\
batches: an iterable of calls' arguments (a tuple per call, or one array).""",
    "calibrate_warns": """\
UserWarning: a GPTQ/AWQ key of the map chooses the policy of no layer.""",
}

_PLACEHOLDER = re.compile(r"^([ \t]*)\{(\w+)\}[ \t]*$", re.MULTILINE)


def fill(fn: F) -> F:
    """Puts each shared block named by a ``{name}`` line of ``fn``'s docstring there.

    Args:
        fn: a function whose docstring has lines holding only ``{name}`` (a key of
            :data:`BLOCKS`), indented where the block goes.

    Returns:
        ``fn``, its ``__doc__`` filled.

    Raises:
        ValueError: a placeholder names no block.

    Examples:
        >>> @fill
        ... def f(policy_or_map):
        ...     '''Does f.
        ...
        ...     Args:
        ...         {policy_or_map}
        ...     '''
        >>> print(f.__doc__.strip().splitlines()[-1].strip())
        policy_or_map: a policy (or name), a :class:`~jmp_policy.DTypePolicyMap` or a dict.
    """

    def block(match: re.Match[str]) -> str:
        indent, name = match.groups()
        if name not in BLOCKS:
            raise ValueError(
                f"{fn.__qualname__}'s docstring names the shared block {name!r}, which "
                f"does not exist; the blocks are {sorted(BLOCKS)}."
            )
        return "\n".join(indent + line if line else "" for line in BLOCKS[name].splitlines())

    fn.__doc__ = _PLACEHOLDER.sub(block, fn.__doc__ or "")
    return fn
