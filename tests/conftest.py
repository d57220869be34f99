"""Test setup: 8 CPU devices, so sharding, shard_map and pmap paths run everywhere."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

import jmp_policy as jp  # noqa: E402


@pytest.fixture(autouse=True)
def _reset_global_policy():
    """Every test starts and ends with the default global policy."""
    jp.set_dtype_policy(None)
    yield
    jp.set_dtype_policy(None)


@pytest.fixture(params=[False, True], ids=["eager", "jit"])
def maybe_jit(request):
    """Runs a function as is and under `jax.jit` (the check that catches jmp's bug)."""
    return jax.jit if request.param else (lambda f, **kwargs: f)
