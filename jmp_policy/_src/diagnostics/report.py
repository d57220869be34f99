"""The diagnostics report: per-submodule statistics of one model run, as a pytree."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jmp_policy._src.diagnostics.stats import NUM_STATS, Stats


class PathInfo(NamedTuple):
    """What the report knows statically of a path: in execution order, with its dtype."""

    path: str
    dtype: str  # the compute dtype that defines underflow and near-overflow
    calls: int  # how many calls were tapped
    input_seq: int  # the sequence number of its first input tap (execution order)
    output_seq: int  # the sequence number of its first output tap


_DIRECTIONS = ("inputs", "outputs", "gradients")


def _pack(stats: Mapping[str, Stats]) -> tuple[tuple[str, ...], Any, Any]:
    """``(paths, max_abs [..., n] float32, counts [..., n, 5] int32)`` of a direction."""
    keys = tuple(stats)
    if not keys:
        return keys, jnp.zeros((0,), jnp.float32), jnp.zeros((0, NUM_STATS - 1), jnp.int32)
    maxes = jnp.stack([jnp.asarray(stats[k].max_abs, jnp.float32) for k in keys], axis=-1)
    counts = jnp.stack(
        [
            jnp.stack([jnp.asarray(v, jnp.int32) for v in dataclasses.astuple(stats[k])[1:]], -1)
            for k in keys
        ],
        axis=-2,
    )
    return keys, maxes, counts


def _unpack(keys: tuple[str, ...], maxes: Any, counts: Any) -> dict[str, Stats]:
    """The statistics of each path, sliced from the packed arrays (on the host when they
    are concrete: one transfer, no device op per value; ``ShapeDtypeStruct``s, as
    ``jax.eval_shape`` gives, become the shapes of the statistics)."""
    if isinstance(maxes, jax.ShapeDtypeStruct) and isinstance(counts, jax.ShapeDtypeStruct):
        m: Any = jax.ShapeDtypeStruct(maxes.shape[:-1], maxes.dtype)
        c: Any = jax.ShapeDtypeStruct(counts.shape[:-2], counts.dtype)
        return {k: Stats(m, c, c, c, c, c) for k in keys}
    if _concrete(maxes, counts):
        maxes, counts = np.asarray(maxes), np.asarray(counts)
    n = len(keys)
    shapes = (getattr(maxes, "shape", None), getattr(counts, "shape", None))
    if (
        shapes[0] is None
        or shapes[1] is None
        or shapes[0][-1:] != (n,)
        or shapes[1][-2:] != (n, NUM_STATS - 1)
        or shapes[0][:-1] != shapes[1][:-2]
    ):
        raise ValueError(
            f"This report's statistics are packed as arrays [..., {n}] and [..., {n}, "
            f"{NUM_STATS - 1}] (one row per path), but hold shapes {shapes}: a report can "
            "be stacked (scan, vmap) on leading axes only (vmap's out_axes=0), and its "
            "leaves mapped to arrays of the same trailing shape."
        )
    return {
        k: Stats(maxes[..., i], *(counts[..., i, j] for j in range(NUM_STATS - 1)))
        for i, k in enumerate(keys)
    }


def _concrete(*arrays: Any) -> bool:
    """Whether none of ``arrays`` is traced."""
    return not any(isinstance(a, jax.core.Tracer) for a in arrays)


def _rebuild(aux: tuple[Any, ...], leaves: tuple[Any, ...]) -> Report:
    """A report from its pytree parts (pickle and copy call this)."""
    return Report._unflatten(aux, leaves)


class Report:
    """Per-submodule statistics of one run of a model (a pytree).

    ``inputs``, ``outputs`` and ``gradients`` map module paths (``""`` is the root) to
    :class:`Stats`: of the floating leaves of the calls' arguments, of their outputs,
    and of the cotangents reaching their outputs (empty until :meth:`with_gradients`).
    ``paths`` lists each tapped path in execution order with its compute dtype and how
    many calls were tapped; ``skipped`` the paths called inside a transform of their own;
    ``untapped`` those the ``paths`` filter left out. With ``every > 1``, ``sampled`` is a
    bool (one per step when stacked by ``scan``): whether the statistics were computed;
    a step that was not sampled holds zeros. :func:`format_report` renders it.

    As a pytree the statistics are packed, two arrays per direction (the largest values,
    float32, and the counts, int32), so a jitted step returns a handful of arrays, not six
    scalars per tapped tensor: each output is a buffer, and on a GPU each scalar output
    was a kernel of its own (700 kernels against 257 for the undiagnosed step, compiled
    for an H100, against 289 packed). ``inputs`` and friends are unpacked when read: on
    the host as NumPy values when the report is concrete, as slices of the traced arrays
    inside ``jit``. A report stacks (``scan``, ``vmap``) on leading axes only.
    """

    __slots__ = ("_cache", "_packed", "every", "paths", "sampled", "skipped", "untapped")
    _cache: dict[int, dict[str, Stats]]
    _packed: tuple[tuple[tuple[str, ...], Any, Any], ...]
    every: int
    paths: tuple[PathInfo, ...]
    sampled: Any
    skipped: tuple[str, ...]
    untapped: tuple[str, ...]

    def __init__(
        self,
        inputs: Mapping[str, Stats],
        outputs: Mapping[str, Stats],
        gradients: Mapping[str, Stats],
        paths: tuple[PathInfo, ...] = (),
        skipped: tuple[str, ...] = (),
        untapped: tuple[str, ...] = (),
        every: int = 1,
        sampled: Any = None,
    ) -> None:
        packed = tuple(_pack(d) for d in (inputs, outputs, gradients))
        self._init(packed, paths, skipped, untapped, every, sampled)

    def _init(
        self, packed: Any, paths: Any, skipped: Any, untapped: Any, every: int, sampled: Any
    ) -> None:
        for name, value in (
            ("_packed", packed), ("paths", tuple(paths)), ("skipped", tuple(skipped)),
            ("untapped", tuple(untapped)), ("every", every), ("sampled", sampled),
            ("_cache", {}),
        ):  # fmt: skip
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: Any) -> None:
        raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}")

    def _direction(self, index: int) -> dict[str, Stats]:
        cache = self._cache
        if index in cache:
            return dict(cache[index])
        stats = _unpack(*self._packed[index])
        if _concrete(*self._packed[index][1:]):
            cache[index] = stats  # concrete only: a tracer must not outlive its trace
        return dict(stats)

    def __reduce__(self) -> tuple[Any, ...]:
        leaves, aux = self._flatten()
        return (_rebuild, (aux, leaves))

    @property
    def inputs(self) -> dict[str, Stats]:
        return self._direction(0)

    @property
    def outputs(self) -> dict[str, Stats]:
        return self._direction(1)

    @property
    def gradients(self) -> dict[str, Stats]:
        return self._direction(2)

    def __repr__(self) -> str:
        counts = ", ".join(
            f"{d}: {len(p[0])} paths" for d, p in zip(_DIRECTIONS, self._packed, strict=True)
        )
        return f"Report({counts}; every={self.every})"

    def _flatten(self) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        leaves = (*(a for _, m, c in self._packed for a in (m, c)), self.sampled)
        aux = (
            tuple(k for k, _, _ in self._packed),
            self.paths,
            self.skipped,
            self.untapped,
            self.every,
        )
        return leaves, aux

    @classmethod
    def _of(cls, packed: Any, *rest: Any) -> Report:
        """A report of already packed statistics (``rest``: as :meth:`_init` takes)."""
        report = object.__new__(cls)
        report._init(packed, *rest)
        return report

    @classmethod
    def _unflatten(cls, aux: tuple[Any, ...], leaves: Any) -> Report:
        keys, paths, skipped, untapped, every = aux
        leaves = tuple(leaves)
        packed = tuple((keys[i], leaves[2 * i], leaves[2 * i + 1]) for i in range(3))
        return cls._of(packed, paths, skipped, untapped, every, leaves[6])

    def probe(self) -> dict[str, jax.Array]:
        """A zero-valued probe for this model: ``{path: zeros((calls, 6))}`` (float32).

        Pass it to the ``diagnose`` function (``probe=``) and differentiate with respect
        to it; its gradient goes to :meth:`with_gradients`. Reads static metadata only,
        so it works on a report from ``jax.eval_shape`` too.
        """
        return {p.path: jnp.zeros((p.calls, NUM_STATS), jnp.float32) for p in self.paths}

    def with_gradients(self, probe_gradient: Mapping[str, jax.Array]) -> Report:
        """This report with the backward statistics carried by the probe's gradient."""
        known = {p.path: p for p in self.paths}
        if not isinstance(probe_gradient, Mapping):
            raise TypeError(
                "`probe_gradient` must be the gradient with respect to a probe from "
                f"`Report.probe()` (a dict of paths). Received: {type(probe_gradient).__name__}"
            )
        unknown = sorted(set(probe_gradient) - set(known))
        if unknown:
            raise ValueError(
                f"`probe_gradient` holds paths this report does not know: {unknown}. Use "
                "the probe of the same model and the same diagnose function."
            )
        gradients = {}
        for path, rows in probe_gradient.items():
            rows = jnp.asarray(rows)
            if rows.shape[-2:] != (known[path].calls, NUM_STATS):
                raise ValueError(
                    f"`probe_gradient[{path!r}]` has shape {rows.shape}; expected "
                    f"{(known[path].calls, NUM_STATS)} (one row per call of {path!r})."
                )
            per_call = [Stats.from_row(rows[..., i, :]) for i in range(known[path].calls)]
            gradients[path] = functools.reduce(Stats.merge, per_call)
        packed = (*self._packed[:2], _pack(gradients))
        return Report._of(packed, self.paths, self.skipped, self.untapped, self.every, self.sampled)


_LEAF_NAMES = (*(f"{d}_{f}" for d in _DIRECTIONS for f in ("max_abs", "counts")), "sampled")


def _flatten_with_keys(report: Report) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    leaves, aux = report._flatten()
    keyed = tuple(
        (jax.tree_util.GetAttrKey(name), leaf)
        for name, leaf in zip(_LEAF_NAMES, leaves, strict=True)
    )
    return keyed, aux


jax.tree_util.register_pytree_with_keys(
    Report, _flatten_with_keys, Report._unflatten, Report._flatten
)
