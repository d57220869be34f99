"""Root test setup, loaded before any test module or doctest imports jax.

Gives JAX 8 CPU devices, so sharding, shard_map and pmap paths run on every machine, and
makes the doctests of `jmp_policy/` run in the same process as the tests.
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
