"""KV cache formats and the ``kv_cache=`` option: which format each attention cache is
stored in, chosen by module path.

A format is one frozen value (its stored dtype, the largest stored magnitude, how many
trailing axes one scale spans). The option is a format name (vLLM's ``kv_cache_dtype``
spellings accepted), or a mapping from module paths (exact, or regular expressions matched
whole, as :class:`~jmp_policy.DTypePolicyMap` keys) to format names or ``None``; a path no
key matches inherits its nearest ancestor's entry, else stores its cache as written.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

from jmp_policy._src.path_patterns import PathPattern, compile_pattern


@dataclasses.dataclass(frozen=True)
class KVCacheFormat:
    """How a cache is stored: ``values`` in ``dtype``, one float32 scale per slice of the
    last ``scale_axes`` axes (``real ~ values * scale``), ``|values| <= max_value``."""

    name: str
    dtype: np.dtype
    max_value: float
    scale_axes: int
    rounds: bool  # an integer grid: round to nearest, then clip

    @property
    def layout(self) -> str:
        return "per token and head" if self.scale_axes == 1 else "per token"


FORMATS: Mapping[str, KVCacheFormat] = {
    # MaxText's int8 KV cache with one scale per token and head (its `kv_quant_axis`
    # "dkv"): the scale spans head_dim only.
    "int8": KVCacheFormat("int8", np.dtype(jnp.int8), 127.0, 1, True),
    # vLLM's and ModelOpt's fp8 cache, one scale per token over all heads.
    "float8_e4m3fn": KVCacheFormat(
        "float8_e4m3fn",
        np.dtype(jnp.float8_e4m3fn),
        float(jnp.finfo(jnp.float8_e4m3fn).max),
        2,
        False,
    ),
}
ALIASES: Mapping[str, str] = {
    "int8": "int8",
    "float8_e4m3fn": "float8_e4m3fn",
    "fp8": "float8_e4m3fn",  # vLLM's `kv_cache_dtype="fp8"`
    "fp8_e4m3": "float8_e4m3fn",
    "float8_e4m3": "float8_e4m3fn",
}


def format_named(name: Any, argument: str = "kv_cache") -> KVCacheFormat | None:
    """The format a name gives (``None``, and vLLM's ``"auto"``: the cache as written)."""
    if name is None or (isinstance(name, str) and name == "auto"):
        return None
    if isinstance(name, KVCacheFormat):
        return name
    if not isinstance(name, str):
        raise TypeError(
            f"`{argument}` must be a format name ({', '.join(repr(n) for n in ALIASES)}), "
            f"None, or a mapping of module paths to those. Received: {argument}={name!r} "
            f"(of type {type(name).__name__})"
        )
    key = name.strip().lower()
    if key in ALIASES:
        return FORMATS[ALIASES[key]]
    close = difflib.get_close_matches(key, list(ALIASES), n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise ValueError(
        f"Unknown KV cache format {name!r} in `{argument}`; expected one of "
        f"{', '.join(repr(n) for n in ALIASES)}, 'auto' or None (the cache as written).{hint}"
    )


@dataclasses.dataclass(frozen=True, eq=False)
class KVCacheSpec:
    """The checked ``kv_cache=`` option. Hashes by identity (warnings are once per spec)."""

    default: KVCacheFormat | None
    entries: tuple[tuple[str, PathPattern, KVCacheFormat | None], ...] = ()
    given: Any = None

    def resolve(self, path: str) -> KVCacheFormat | None:
        """The format of the cache of the module at ``path``."""
        exact = {key: fmt for key, _, fmt in self.entries}
        probe: str | None = path
        while probe is not None:
            if probe in exact:
                return exact[probe]
            matches = [(key, fmt) for key, p, fmt in self.entries if p.fullmatch(probe)]
            if len(matches) > 1:
                raise ValueError(
                    f"Module path {probe!r} matches several keys of `kv_cache`: "
                    f"{[key for key, _ in matches]}. Make the keys disjoint. Received: "
                    f"kv_cache={self.given!r}"
                )
            if matches:
                return matches[0][1]
            probe = None if not probe else probe.rpartition("/")[0]
        return self.default

    def resolve_variable(self, path: str) -> KVCacheFormat | None:
        """The format of a model's own cache variable (a name other than Flax's): only a
        key naming its whole path (``"blocks/attn/k_cache"``) quantizes it."""
        for key, pattern, fmt in self.entries:
            if key == path or pattern.fullmatch(path):
                return fmt
        return None


def make_spec(kv_cache: Any) -> KVCacheSpec | None:
    """``kv_cache=`` checked: ``None`` (off), a format name, or a mapping of paths."""
    if kv_cache is None or isinstance(kv_cache, KVCacheSpec):
        return kv_cache
    if isinstance(kv_cache, Mapping):
        entries = []
        for key, value in kv_cache.items():
            if not isinstance(key, str):
                raise TypeError(
                    f"Keys of `kv_cache` must be module paths (str). Received key {key!r} in "
                    f"kv_cache={kv_cache!r}"
                )
            pattern = compile_pattern(key, "key {key} of `kv_cache`", f"kv_cache={kv_cache!r}")
            entries.append((key, pattern, format_named(value, f"kv_cache[{key!r}]")))
        return KVCacheSpec(None, tuple(entries), dict(kv_cache))
    fmt = format_named(kv_cache)
    return None if fmt is None else KVCacheSpec(fmt, (), kv_cache)
