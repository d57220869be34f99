"""Test fixtures. The 8 CPU devices are set up by the root `conftest.py`."""

import jax
import pytest

import jmp_policy as jp


@pytest.fixture(autouse=True)
def _reset_global_policy():
    """Every test starts and ends with the default global policy."""
    jp.set_dtype_policy("float32")
    yield
    jp.set_dtype_policy("float32")


@pytest.fixture(params=[False, True], ids=["eager", "jit"])
def maybe_jit(request):
    """Runs a function as is and under `jax.jit` (the check that catches jmp's bug)."""
    return jax.jit if request.param else (lambda f, **kwargs: f)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``heavy(seconds)`` (a subprocess, a notebook, a benchmark) are handed out
    first, the longest first: pytest-xdist gives tests to its workers in this order, so the
    long ones spread over the workers from the start instead of one worker ending the run
    alone with them. The seconds are a rough guess on 2 quiet cores, used for this order only
    (nothing is timed). Without xdist the order does not matter; the rest keep theirs."""

    def seconds(item):
        marker = item.get_closest_marker("heavy")
        return marker.args[0] if marker is not None else None

    heavy = sorted((item for item in items if seconds(item) is not None), key=seconds, reverse=True)
    if heavy:
        items[:] = heavy + [item for item in items if seconds(item) is None]


def pytest_configure(config):
    """With pytest-xdist, hand out tests one at a time (``--maxschedchunk=1``) rather than
    in chunks of a quarter of each worker's share: with the heavy tests first, each worker
    then takes the next longest as it frees up. Given on the command line, it is kept."""
    if getattr(config.option, "maxschedchunk", 0) is None:
        config.option.maxschedchunk = 1
