"""What a ``diagnose`` function taps: which submodules, and on which steps.

A :class:`Selection` (``every=``, ``paths=``) taps only the submodules whose path a key
names (exact, else ``re.fullmatch``, as a ``DTypePolicyMap`` key) and computes the
statistics on one step in ``every``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jmp_policy._src.int_arguments import check_int
from jmp_policy._src.path_patterns import PathPattern, compile_pattern, is_literal

_ENTRY = "entry {key} of `paths`"
#: The largest ``every`` and ``|step|``: steps are computed in int32 under ``jit``.
MAX_INT = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class Selection:
    """What a ``diagnose`` function taps: the submodules named by ``paths`` (``None``: all)
    on one step in ``every``. Made (and checked) by :func:`selection`."""

    every: int = 1
    paths: tuple[str, ...] | None = None

    @functools.cached_property
    def _patterns(self) -> tuple[frozenset[str], tuple[PathPattern, ...]]:
        keys = self.paths or ()
        return (
            frozenset(k for k in keys if is_literal(k)),
            tuple(compile_pattern(k, _ENTRY) for k in keys if not is_literal(k)),
        )

    def taps(self, path: str) -> bool:
        """Whether the submodule at ``path`` is tapped (an exact key, else a fullmatch)."""
        if self.paths is None:
            return True
        exact, patterns = self._patterns
        return path in exact or any(p.fullmatch(path) for p in patterns)

    def sample(self, step: Any) -> jax.Array | None:
        """``step % every == 0`` as a bool scalar (traced under ``jit``); ``None`` when
        every step is sampled."""
        if step is not None:
            integer = isinstance(step, (int, np.integer)) and not isinstance(step, bool)
            if not integer and not (
                isinstance(step, (jax.Array, np.ndarray))
                and step.shape == ()
                and jnp.issubdtype(step.dtype, jnp.integer)
            ):
                raise TypeError(
                    "`step` must be the training step, an int or an integer scalar array "
                    f"(traced under jit). Received: step={step!r}"
                )
            if integer and not -MAX_INT <= step <= MAX_INT:
                raise ValueError(
                    f"`step` must fit in an int32 (|step| <= {MAX_INT}), the dtype it is "
                    f"computed in. Received: step={step!r}"
                )
        if self.every == 1:
            return None
        if step is None:
            raise ValueError(
                f"`step` is required with `every={self.every}`: pass the training step "
                "(an int, or an integer scalar array inside a jitted loop); the statistics "
                f"are computed when `step % {self.every} == 0`."
            )
        return jnp.asarray(step) % self.every == 0


def selection(every: Any = 1, paths: Any = None) -> Selection:
    """Checks ``diagnose``'s ``every`` and ``paths`` arguments and returns a :class:`Selection`."""
    why = " (compute the statistics on one step in `every`; steps are int32)"
    every = check_int(every, "every", 1, MAX_INT, why=why)
    if paths is None:
        return Selection(every, None)
    keys = (paths,) if isinstance(paths, str) else paths
    if not isinstance(keys, (list, tuple)) or not all(isinstance(k, str) for k in keys):
        raise TypeError(
            "`paths` must be None (tap every submodule), a module path or regular "
            "expression, or a list of them (the keys of a DTypePolicyMap, e.g. "
            f"['head', 'encoder/layers_1(/.*)?']). Received: paths={paths!r}"
        )
    if not keys:
        raise ValueError(
            "`paths` is empty, so nothing would be tapped; pass None to tap every "
            f"submodule. Received: paths={paths!r}"
        )
    for key in keys:  # exact module paths or patterns matched as a DTypePolicyMap's keys
        compile_pattern(key, _ENTRY, f"paths={paths!r}")
    return Selection(every, tuple(keys))
