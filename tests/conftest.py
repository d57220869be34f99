"""Test fixtures. The 8 CPU devices are set up by the root `conftest.py`."""

import jax
import pytest

import jmp_policy as jp


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
