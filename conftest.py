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
# The tests' programs are small, and compiling them is most of the suite's time. Two XLA
# settings make that compile cheaper without changing a program's HLO (every form, dtype and
# op count a test reads is the same): LLVM's optimization level 0, and XLA CPU's older
# fusion code generator (its newer MLIR fusion emitters compile about twice as slowly). On
# 2 cores the suite took 12:22 with neither, 10:09 with the first, 8:04 with both. The few
# tests whose outcome hangs on the last bits of arithmetic (a chaotic training run) compile
# at the default level with `compiler_options`. A setting the caller gave is kept; the
# fusion flag is given only to an XLA that has it (an unknown flag aborts XLA).
_FAST_COMPILE = {
    "--xla_backend_optimization_level": "0",
    "--xla_cpu_use_fusion_emitters": "false",
}


def _xla_knows(flag: str) -> bool:
    import importlib.util
    import mmap

    spec = importlib.util.find_spec("jaxlib")
    if spec is None or not spec.submodule_search_locations:
        return False
    library = os.path.join(spec.submodule_search_locations[0], "libjax_common.so")
    try:
        with open(library, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as m:
            return m.find(b"\0" + flag[2:].encode() + b"\0") != -1  # the name alone
    except (OSError, ValueError):
        return False


for _flag, _value in _FAST_COMPILE.items():
    if _flag not in os.environ["XLA_FLAGS"] and (
        _flag == "--xla_backend_optimization_level" or _xla_knows(_flag)
    ):
        os.environ["XLA_FLAGS"] += f" {_flag}={_value}"

# One XLA compilation cache per test run, shared by the xdist workers (below), read by
# the subprocesses the tests start too: a program another test
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

# The xdist workers share the run's cache, so a program one worker compiled is read back by
# the others. JAX writes an entry in place and, without a
# size limit, locks nothing: a worker once read an entry another was still writing (an empty
# entry, JAX's "Error reading persistent compilation cache entry" warning, and a failed test
# that makes warnings errors). A size limit turns on JAX's lock, but its scan of the folder
# on every write made the suite several times slower. So in the test processes an entry is
# written to a temporary file beside it and renamed into place (atomic on one file system):
# a reader finds no entry or a whole one. The subprocesses the tests start write in place,
# so they get a folder of the run's cache per worker, which only they write and read.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
_BASE = os.environ.get("JMP_POLICY_TESTS_XLA_CACHE")
if _BASE and os.environ.get("JAX_COMPILATION_CACHE_DIR", "").startswith(_BASE):
    import jax
    from jax._src import lru_cache as _lru_cache

    _put_in_place = _lru_cache.LRUCache.put

    def _put_atomically(self, key: str, value: bytes) -> None:
        if getattr(self, "eviction_enabled", True) or not key:
            return _put_in_place(self, key, value)
        entry = os.path.join(os.fspath(self.path), f"{key}{_lru_cache._CACHE_SUFFIX}")
        if os.path.exists(entry):
            return None
        handle, temporary = tempfile.mkstemp(dir=os.path.dirname(entry), prefix=".writing-")
        try:
            with os.fdopen(handle, "wb") as file:
                file.write(value)
            os.replace(temporary, entry)
        except BaseException:
            os.unlink(temporary)
            raise
        return None

    _lru_cache.LRUCache.put = _put_atomically  # type: ignore[method-assign]
    jax.config.update("jax_compilation_cache_dir", _BASE)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.join(
        _BASE, "subprocesses", _WORKER or "controller"
    )
