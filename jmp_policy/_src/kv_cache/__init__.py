"""Quantized KV caches: the stored pytree and its formats (framework-independent)."""

from jmp_policy._src.kv_cache.cache import QuantizedKVCache as QuantizedKVCache
from jmp_policy._src.kv_cache.formats import KVCacheFormat as KVCacheFormat
from jmp_policy._src.kv_cache.formats import KVCacheSpec as KVCacheSpec
from jmp_policy._src.kv_cache.formats import make_spec as make_spec
