"""Quantized trees restored without a target: plain dicts of arrays back to QuantizedArrays.

Restored with a target (a tree of arrays or ``jax.ShapeDtypeStruct``s of the saved tree's
structure), orbax and ``flax.serialization`` give QuantizedArrays back as they were. Without
one, orbax gives each as a dict of its arrays (``{"values": ..., "scale": ...}``, an AWQ
kernel with its ``"input_scale"``, an asymmetric one with its ``"zero_point"``) and ``flax.serialization.msgpack_restore`` as the state
dict it wrote (the same, with its settings). Orbax saves arrays only, so a QuantizedArray's
settings (mode, int4 block, original dtype) go beside the checkpoint as JSON:
:func:`quantized_metadata` gives them and :func:`rebuild_quantized` puts the QuantizedArrays
back from the dicts and those settings. Nothing here imports flax or orbax.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax

from jmp_policy._src import dtypes as dt
from jmp_policy._src.quantization.awq import InputScaledArray
from jmp_policy._src.quantization.quantized_array import QuantizedArray, is_quantized
from jmp_policy._src.quantization.quantized_tree import make, settings_of, stack_layout
from jmp_policy._src.tree_paths import leaf_path

_ARRAYS = ("values", "scale", "input_scale", "zero_point")
_SETTINGS = ("mode", "block_size", "original_dtype", "shape", "stacked", "stacked_at")


def quantized_metadata(tree: Any) -> dict[str, dict[str, Any]]:
    """The settings of every :class:`~jmp_policy.QuantizedArray` in ``tree``, as JSON.

    Orbax saves a tree's arrays; a QuantizedArray's settings are no arrays. Save these beside
    the checkpoint (``ocp.args.JsonSave``, a file) to restore it without a target.

    Args:
        tree: a pytree that may hold QuantizedArrays (quantized or calibrated parameters).

    Returns:
        ``{path: {"mode", "block_size", "original_dtype", "shape", "stacked",
        "stacked_at"}}``, the path of each QuantizedArray as jmp_policy writes paths
        (``"Dense_0/kernel"``). Metadata saved without ``"stacked_at"`` (before it
        existed) reads as ``0``: stacked axes leading.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jmp_policy as jp
        >>> params = jp.get("int4/8_from_float32").quantize({"kernel": jnp.ones((16, 4))})
        >>> jp.quantized_metadata(params)  # doctest: +NORMALIZE_WHITESPACE
        {'kernel': {'mode': 'int4', 'block_size': 8, 'original_dtype': 'float32',
                    'shape': [16, 4], 'stacked': 0, 'stacked_at': 0}}
    """
    found = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_quantized)[0]
    return {leaf_path(path): settings_of(q) for path, q in found if is_quantized(q)}


def _is_fields(x: Any) -> bool:
    """A dict that holds a QuantizedArray's arrays (and maybe its settings), nothing else."""
    return (
        isinstance(x, Mapping)
        and "values" in x
        and "scale" in x
        and hasattr(x["values"], "shape")  # not a submodule named "values"
        and all(k in _ARRAYS or k in _SETTINGS for k in x)
    )


def rebuild_quantized(tree: Any, metadata: Mapping[str, Any] | None = None) -> Any:
    """``tree`` with each dict of a QuantizedArray's arrays made a QuantizedArray again.

    What orbax restores without a target (``{"values": ..., "scale": ...}`` dicts) or
    ``flax.serialization.msgpack_restore`` gives (the same, with the settings). The
    settings come from the dict where it has them, else from ``metadata`` (what
    :func:`quantized_metadata` gave when the tree was saved). The QuantizedArrays are
    checked as ``quantize`` checks them, and are equal to the saved ones.

    Args:
        tree: a restored pytree (nested dicts of arrays).
        metadata: ``{path: settings}`` from :func:`quantized_metadata`; ``None`` when the
            dicts carry their settings (``msgpack_restore``).

    Returns:
        ``tree`` with QuantizedArrays (AWQ kernels, which have an ``"input_scale"``, as
        theirs); every other leaf as it was.

    Raises:
        ValueError: a dict of arrays whose settings neither it nor ``metadata`` has, or a
            path of ``metadata`` that holds no such dict.
        TypeError: ``metadata`` is not a mapping.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jmp_policy as jp
        >>> params = jp.get("int8_from_float32").quantize({"kernel": jnp.ones((16, 4))})
        >>> plain = {"kernel": {"values": params["kernel"].values,
        ...                     "scale": params["kernel"].scale}}  # as orbax restores it
        >>> again = jp.rebuild_quantized(plain, jp.quantized_metadata(params))
        >>> again["kernel"] == params["kernel"]
        True
    """
    if metadata is not None and not isinstance(metadata, Mapping):
        raise TypeError(
            "`metadata` must be a mapping from path to settings, as `quantized_metadata` "
            f"gives, or None. Received: metadata={dt.bounded_repr(metadata)}"
        )
    given = dict(metadata or {})
    seen: set[str] = set()

    def rebuild(key_path: Any, x: Any) -> Any:
        path = leaf_path(key_path)
        if is_quantized(x):
            seen.add(path)
        if not _is_fields(x):
            return x
        seen.add(path)
        own = {k: x[k] for k in _SETTINGS if k in x}
        settings = own or given.get(path)
        if not isinstance(settings, Mapping) or "mode" not in settings:
            raise ValueError(
                f"`tree` holds the arrays of a quantized kernel at {path!r} ({sorted(x)}) "
                "without its settings, and `metadata` has none for it: pass "
                "`metadata=jp.quantized_metadata(tree)` as saved with the checkpoint. "
                f"Received: metadata for {sorted(given)[:8]}"
            )
        return _rebuild_one(path, x, settings)

    out = jax.tree_util.tree_map_with_path(
        rebuild, tree, is_leaf=lambda x: is_quantized(x) or _is_fields(x)
    )
    unused = sorted(set(given) - seen)
    if unused:
        raise ValueError(
            f"`metadata` names quantized kernels that `tree` does not hold: {unused[:8]}"
            f" ({len(unused)} paths). Received: a tree whose kernels are at {sorted(seen)[:8]}"
        )
    return out


def _rebuild_one(path: str, x: Mapping[str, Any], settings: Mapping[str, Any]) -> Any:
    values = x["values"]
    shape = settings.get("shape")
    at = int(settings.get("stacked_at", 0))  # metadata older than `stacked_at`: leading
    if shape is None:  # a layer's rank is not known: the scale's rank says how many stack
        k = max(len(getattr(x["scale"], "shape", ())) - (1 if settings["mode"] == "int8" else 2), 0)
        shape = tuple(getattr(values, "shape", ()))
        at = at if k else 0
    else:
        shape = tuple(shape)
        k = int(settings.get("stacked", 0))
        layer = (*shape[:at], *shape[at + k :])
        # a checkpoint of a stack made after saving: the stacked axes as the values have them
        shape, k, at = stack_layout(values, layer, at)
    cls = InputScaledArray if "input_scale" in x else QuantizedArray
    extra = {k: x[k] for k in ("input_scale", "zero_point") if k in x}
    try:
        return make(
            cls, values=values, scale=x["scale"], mode=settings["mode"],
            block_size=settings.get("block_size"), shape=shape,
            original_dtype=settings.get("original_dtype"), stacked=k, stacked_at=at, **extra,
        )  # fmt: skip
    except (TypeError, ValueError) as e:
        raise ValueError(f"Cannot rebuild the quantized kernel at {path!r} of `tree`: {e}") from e
