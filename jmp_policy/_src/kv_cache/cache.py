"""The quantized KV cache: a pytree of stored values and float32 scales, written token by
token with ``dynamic_update_slice`` and read as a product the attention's dot consumes.

``values`` has the cache's shape (``[batch..., length, heads, head_dim]``, as Flax's
attention caches are laid out) in the format's dtype; ``scale`` the same shape with the
format's trailing axes kept as 1 (int8: ``[..., length, heads, 1]``, one scale per token and
head; float8: ``[..., length, 1, 1]``, one per token), so a write updates both at the same
indices and a token written once is never quantized again. A read is ``values * scale`` cast
to the dtype the model wrote: elementwise on the stored arrays, which XLA fuses into the
attention's dot operands (no float copy of the cache is materialised).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jmp_policy._src.kv_cache.formats import FORMATS, KVCacheFormat, format_named
from jmp_policy._src.state_pytree import register_state, replace_leaves, tree_equal


@register_state
@dataclasses.dataclass(frozen=True, eq=False)
class QuantizedKVCache:
    """An attention cache stored quantized: ``values`` and float32 ``scale``.

    What ``jmp_policy.linen.apply(..., kv_cache="int8")`` keeps in the ``"cache"``
    collection in place of a float ``cached_key``/``cached_value``. ``values``
    (``[batch..., length, heads, head_dim]``) are int8 or float8_e4m3fn; ``scale`` has the
    same rank, its trailing axes that one scale spans kept as 1 (int8: one scale per token
    and head; float8: one per token). ``real ~ values * scale``. ``format`` and ``dtype``
    (the dtype reads return, the one the model wrote) are static. A pytree: it crosses
    ``jit``, ``scan`` and ``vmap``, and its unflatten accepts any leaves.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jmp_policy as jp
        >>> k = jnp.ones((1, 16, 2, 128), jnp.bfloat16)   # [batch, length, heads, head_dim]
        >>> cache = jp.QuantizedKVCache.quantize(k, "int8")
        >>> cache.values.dtype, cache.scale.shape
        (dtype('int8'), (1, 16, 2, 1))
        >>> cache.nbytes / k.nbytes   # 0.5 + 2 / head_dim
        0.515625
        >>> bool((cache.dequantize() == k).all())
        True
    """

    values: Any
    scale: Any
    format: str = dataclasses.field(default="int8", metadata={"static": True})
    dtype: str = dataclasses.field(default="float32", metadata={"static": True})

    __eq__ = tree_equal
    __hash__ = None  # type: ignore[assignment]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape)

    @property
    def nbytes(self) -> int:
        """Stored bytes: the values and the scales."""
        return int(_nbytes(self.values) + _nbytes(self.scale))

    @classmethod
    def quantize(cls, x: Any, format: Any = "int8") -> QuantizedKVCache:
        """``x`` (a whole cache, ``[..., length, heads, head_dim]``) stored in ``format``."""
        fmt = _format(format)
        check_shape(getattr(x, "shape", None), fmt, "x")
        values, scale = quantize_slices(jnp.asarray(x), fmt)
        return cls(values, scale, fmt.name, np.dtype(x.dtype).name)

    def dequantize(self) -> jax.Array:
        """The cache in ``dtype``: elementwise on the stored arrays (fused into a dot)."""
        real = self.values.astype(jnp.float32) * self.scale
        return real.astype(self.dtype)

    def write(self, update: Any, indices: Sequence[Any]) -> QuantizedKVCache:
        """The cache with ``update`` (new tokens, in float) quantized and written at
        ``indices`` (as ``lax.dynamic_update_slice`` takes them); other tokens untouched.
        Works under ``jit``."""
        fmt = FORMATS[self.format]
        values, scale = quantize_slices(jnp.asarray(update), fmt)
        return replace_leaves(
            self,
            values=jax.lax.dynamic_update_slice(self.values, values, tuple(indices)),
            scale=jax.lax.dynamic_update_slice(self.scale, scale, tuple(indices)),
        )


def _nbytes(x: Any) -> int:
    return int(np.prod(x.shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize


def _format(format: Any) -> KVCacheFormat:
    fmt = format_named(format, "format")
    if fmt is None:
        raise ValueError(
            "`format` must name a quantized KV cache format ('int8', 'float8_e4m3fn' or "
            f"'fp8'). Received: format={format!r}"
        )
    return fmt


def check_shape(shape: Any, fmt: KVCacheFormat, argument: str) -> None:
    """A cache must have ``[batch..., length, heads, head_dim]`` axes for its scales."""
    if shape is None or len(shape) < 3:
        raise ValueError(
            f"A {fmt.name} KV cache scales per token{' and head' if fmt.scale_axes == 1 else ''} "
            f"and needs `{argument}` laid out [batch..., length, heads, head_dim] (rank 3 or "
            f"more). Received: {argument} of shape {shape}"
        )


def quantize_slices(x: jax.Array, fmt: KVCacheFormat) -> tuple[jax.Array, jax.Array]:
    """``x`` as ``(values, scale)``: symmetric, one float32 scale per slice of the last
    ``fmt.scale_axes`` axes (abs-max over them). A zero slice gets scale 1; a non-finite
    one a non-finite scale, so it reads back non-finite."""
    axes = tuple(range(x.ndim - fmt.scale_axes, x.ndim))
    real = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(real), axis=axes, keepdims=True)
    scale = jnp.where(amax == 0, jnp.float32(1), amax / jnp.float32(fmt.max_value))
    scaled = real / scale
    if fmt.rounds:
        scaled = jnp.clip(jnp.round(scaled), -fmt.max_value, fmt.max_value)
    return scaled.astype(fmt.dtype), scale
