"""Root test setup, loaded before any test module or doctest imports jax.

Gives JAX 8 CPU devices, so sharding, shard_map and pmap paths run on every machine, and
makes the doctests of `jmp_policy/` run in the same process as the tests.
"""

import atexit
import os
import shutil
import tempfile

# Under pytest-xdist each worker is a new process that loads this file before any test
# module imports jax; it inherits the flag from the controller, so add it only once.
_DEVICES = "--xla_force_host_platform_device_count=8"
if _DEVICES not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _DEVICES).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# One XLA compilation cache per test run, a folder per xdist worker (below), read by the
# subprocesses the tests start too: a program another test
# already compiled (the same model and policy wrapped anew, the same step rebuilt) is read
# back instead of compiled again. Fresh for each run and removed when it ends, so no run
# reads another's entries; a cache the caller set up is used as it is.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _XLA_CACHE = tempfile.mkdtemp(prefix="jmp_policy-tests-xla-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _XLA_CACHE
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    os.environ["JMP_POLICY_TESTS_XLA_CACHE"] = _XLA_CACHE
    atexit.register(shutil.rmtree, _XLA_CACHE, ignore_errors=True)

# Each xdist worker writes and reads its own folder of the run's cache (its subprocesses
# too). Shared, one worker once read an entry another was still writing (JAX writes the
# file in place and, without a size limit, locks nothing): an empty entry, JAX's "Error
# reading persistent compilation cache entry" warning, and a failed test that makes
# warnings errors. A size limit turns on JAX's lock, but its scan of the folder on every
# write made the suite several times slower.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
_BASE = os.environ.get("JMP_POLICY_TESTS_XLA_CACHE")
if _WORKER and _BASE and os.environ.get("JAX_COMPILATION_CACHE_DIR") == _BASE:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.join(_BASE, _WORKER)
