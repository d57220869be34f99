"""Root test setup, loaded before any test module or doctest imports jax.

Gives JAX 8 CPU devices, so sharding, shard_map and pmap paths run on every machine, and
makes the doctests of `jmp_policy/` run in the same process as the tests.
"""

import atexit
import importlib.util
import os
import shutil
import tempfile

# Under pytest-xdist each worker is a new process that loads this file before any test
# module imports jax; it inherits the flag from the controller, so add it only once.
_DEVICES = "--xla_force_host_platform_device_count=8"
if _DEVICES not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _DEVICES).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# One XLA compilation cache per test run, shared by the xdist workers (which inherit this
# process's environment) and the subprocesses the tests start: a program another test
# already compiled (the same model and policy wrapped anew, the same step rebuilt) is read
# back instead of compiled again. Fresh for each run and removed when it ends, so no run
# reads another's entries; a cache the caller set up is used as it is.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _XLA_CACHE = tempfile.mkdtemp(prefix="jmp_policy-tests-xla-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _XLA_CACHE
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    # A size limit turns on JAX's file lock around each read and write of the cache
    # (`filelock`, in the test extra). Without it one worker can read an entry another is
    # still writing: an empty entry, JAX's "Error reading persistent compilation cache
    # entry" warning, and a failure in a test that makes warnings errors (seen once in CI).
    if importlib.util.find_spec("filelock") is not None:  # else JAX refuses a size limit
        os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(16 * 2**30))
    atexit.register(shutil.rmtree, _XLA_CACHE, ignore_errors=True)
