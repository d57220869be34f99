"""Quantized KV caches for Equinox: the caches a model keeps in ``eqx.nn.State``.

An Equinox model that decodes keeps its key and value caches as ``eqx.nn.StateIndex``
fields, reads them with ``state.get(index)``, writes each step's tokens with
``lax.dynamic_update_slice`` and stores them with ``state.set(index, new)``. A cache is
named by the path of its ``StateIndex`` field (``"blocks/0/attn/key_cache"``); the fields
named ``cached_key``/``cached_value`` (Flax's names) also by their module's path or the
default format. Before the call each such entry of every ``eqx.nn.State`` among the
arguments is handed to the model dequantized; the write quantizes the new tokens alone
(:mod:`jmp_policy._src.kv_cache.hook`); the ``State`` the model returns holds the
:class:`~jmp_policy.QuantizedKVCache`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax

from jmp_policy._src.kv_cache import KVCacheSpec, QuantizedKVCache, make_spec
from jmp_policy._src.kv_cache import report as kv_report
from jmp_policy._src.kv_cache.hook import CACHE_NAMES, CacheRun, Run
from jmp_policy._src.tree_paths import leaf_path

_WHERE = "the eqx.nn.State entries of"
_HINT = (
    "Name each cache by the path of its eqx.nn.StateIndex field (`kv_cache={'blocks/0/attn/"
    "key_cache': 'int8'}`), pass the model's eqx.nn.State to the call, or drop `kv_cache`."
)


def _is_state(x: Any) -> bool:
    return isinstance(x, eqx.nn.State)


def _indices(model: Any, run: Run) -> dict[Any, tuple[str, Any]]:
    """``{marker: (path, format)}`` for each ``StateIndex`` of ``model`` that the spec
    quantizes."""
    found = jax.tree_util.tree_flatten_with_path(
        model, is_leaf=lambda x: isinstance(x, eqx.nn.StateIndex)
    )[0]
    markers = {}
    for key_path, index in found:
        if not isinstance(index, eqx.nn.StateIndex):
            continue
        path = leaf_path(key_path)
        module_path, _, name = path.rpartition("/")
        fmt = run.format_of(module_path, name)
        if fmt is not None:
            markers[index.marker] = (path, fmt)
    return markers


def _map_states(tree: Any, entry: Callable[[Any, Any], Any]) -> Any:
    """``tree`` with each ``eqx.nn.State``'s entries ``entry(marker, value)``."""

    def one(x: Any) -> Any:
        if not _is_state(x):
            return x
        values, markers = x.tree_flatten()
        new = tuple(entry(m, v) for m, v in zip(markers, values, strict=True))
        return eqx.nn.State.tree_unflatten(markers, new)

    return jax.tree.map(one, tree, is_leaf=_is_state)


def _handed_out(run: Run, markers: dict[Any, tuple[str, Any]], tree: Any) -> Any:
    def entry(marker: Any, value: Any) -> Any:
        if marker not in markers:
            return value
        path, fmt = markers[marker]
        run.hooked.add(path)
        return run.hand_out(run.as_stored(value, fmt, path))

    return _map_states(tree, entry)


def _stored(run: Run, markers: dict[Any, tuple[str, Any]], tree: Any) -> Any:
    def entry(marker: Any, value: Any) -> Any:
        if marker not in markers:
            return value
        path, fmt = markers[marker]
        return run.stored(value, fmt, path, True)

    return _map_states(tree, entry)


def with_kv_caches(model: Any, spec: KVCacheSpec, run: Callable[..., Any]) -> Callable[..., Any]:
    """``run`` (the apply wrapper of ``model``) with the caches of every ``eqx.nn.State``
    in its arguments and its result stored as ``spec`` says."""

    def call(*args: Any, **kwargs: Any) -> Any:
        with CacheRun(spec, where=_WHERE, hint=_HINT) as cache_run:
            markers = _indices(model, cache_run)
            args, kwargs = _handed_out(cache_run, markers, (args, kwargs))
            return _stored(cache_run, markers, run(*args, **kwargs))

    return call


def quantize_caches(model: Any, state: Any, kv_cache: Any) -> Any:
    """A new ``eqx.nn.State`` whose KV caches are stored as ``kv_cache`` says.

    An Equinox model keeps its caches in ``eqx.nn.State`` (``eqx.nn.StateIndex`` fields,
    read with ``state.get``, written a step at a time with ``lax.dynamic_update_slice``
    and stored with ``state.set``). Give ``jp.equinox.apply(model, policy,
    kv_cache=...)`` the same ``kv_cache`` and pass the state to each call: the state
    comes back with the new tokens quantized into it (a token is quantized once, at its
    step), and the attention reads the cache dequantized elementwise, fused into its
    dot. Calling this first stores the caches quantized from the start (at the bytes of
    the format: int8 ``0.5 + 2 / head_dim`` of bf16's), not after the first call.

    Args:
        model: the ``eqx.Module`` whose ``StateIndex`` fields name the caches.
        state: its ``eqx.nn.State`` (``eqx.nn.make_with_state``); not modified.
        kv_cache: a format (``"int8"``, ``"float8_e4m3fn"``, vLLM's ``"fp8"``) for the
            fields named ``cached_key``/``cached_value``, or a mapping from paths to
            formats: a field's own path (``"blocks/0/attn/key_cache"``, a pattern as in a
            ``DTypePolicyMap``) for a field of any name.

    Returns:
        The new ``eqx.nn.State``, each named cache a :class:`~jmp_policy.QuantizedKVCache`.

    Raises:
        TypeError: ``state`` is not an ``eqx.nn.State``.
        ValueError: ``kv_cache`` names no ``StateIndex`` of ``model``, an unknown format,
            or a cache shape the format cannot scale.

    Examples:
        >>> import jax
        >>> import jax.numpy as jnp
        >>> import equinox as eqx
        >>> import jmp_policy as jp
        >>> class Cached(eqx.Module):
        ...     key_cache: eqx.nn.StateIndex
        ...     def __init__(self):
        ...         self.key_cache = eqx.nn.StateIndex(jnp.zeros((16, 2, 8), jnp.bfloat16))
        ...     def __call__(self, k, pos, state):  # k: [1 token, heads, head_dim]
        ...         cache = jax.lax.dynamic_update_slice(state.get(self.key_cache), k, (pos, 0, 0))
        ...         return cache.sum(), state.set(self.key_cache, cache)
        >>> model, state = eqx.nn.make_with_state(Cached)()
        >>> state = jp.equinox.quantize_caches(model, state, {"key_cache": "int8"})
        >>> step = jp.equinox.apply(model, "mixed_bfloat16", kv_cache={"key_cache": "int8"})
        >>> total, state = step(jnp.ones((1, 2, 8), jnp.bfloat16), 3, state)
        >>> stored = state.get(model.key_cache)
        >>> stored.values.dtype, float(total)
        (dtype('int8'), 16.0)
    """
    spec = make_spec(kv_cache)
    if not _is_state(state):
        raise TypeError(
            "`state` must be an eqx.nn.State (from eqx.nn.make_with_state). Received: "
            f"state of type {type(state).__name__}"
        )
    if spec is None:
        return state
    run = Run(spec)
    markers = _indices(model, run)
    if not markers:
        raise ValueError(
            f"kv_cache={spec.given!r} names no eqx.nn.StateIndex of this model: name each "
            f"cache by the path of its StateIndex field (fields named {' or '.join(CACHE_NAMES)} "
            "also by their module's path). Received: kv_cache="
            f"{spec.given!r}"
        )
    return _map_states(
        state,
        lambda m, v: run.as_stored(v, markers[m][1], markers[m][0]) if m in markers else v,
    )


def cache_table(model: Any, args: Any, spec: KVCacheSpec | None) -> str:
    """``explain``'s table of the caches in the ``eqx.nn.State`` among ``args``: each
    ``StateIndex`` entry stored quantized, or that ``spec`` stores so (``""``: none)."""
    found = jax.tree_util.tree_flatten_with_path(
        model, is_leaf=lambda x: isinstance(x, eqx.nn.StateIndex)
    )[0]
    paths = {i.marker: leaf_path(k) for k, i in found if isinstance(i, eqx.nn.StateIndex)}
    caches: dict[str, Any] = {}
    for state in jax.tree.leaves(args, is_leaf=_is_state):
        if _is_state(state):
            values, markers = state.tree_flatten()
            caches.update({paths[m]: v for m, v in zip(markers, values, strict=True) if m in paths})
    return kv_report.format_caches(kv_report.cache_rows(caches, spec, CACHE_NAMES))


def as_shapes(args: Any) -> Any:
    """``args`` with each stored cache of an ``eqx.nn.State`` as the float array's shape
    the model reads (``explain`` traces the model shape-only)."""

    def entry(marker: Any, value: Any) -> Any:
        if isinstance(value, QuantizedKVCache):
            return jax.ShapeDtypeStruct(value.shape, value.dtype)
        return value

    return _map_states(args, entry)
