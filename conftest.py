"""Root test setup, loaded before any test module or doctest imports jax.

Gives JAX 8 CPU devices, so sharding, shard_map and pmap paths run on every machine, and
makes the doctests of `jmp_policy/` run in the same process as the tests.
"""

import os

# Under pytest-xdist each worker is a new process that loads this file before any test
# module imports jax; it inherits the flag from the controller, so add it only once.
_DEVICES = "--xla_force_host_platform_device_count=8"
if _DEVICES not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _DEVICES).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
