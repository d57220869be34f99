"""Collections of state among gradients (``jmp_policy._src.state_collections``)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from jmp_policy._src import state_collections

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_check_not_in_rejects_float8_state_among_gradients():
    state_collections.check_not_in({"params": {}}, "x")
    with pytest.raises(ValueError, match=r"jmp_policy\.linen\.split_gradients"):
        state_collections.check_not_in(
            {"params": {}, "_overwrite_with_gradient": {}}, "loss_scaling"
        )


def test_loss_scaling_refuses_the_collection_without_jmp_policy_linen_imported():
    # Flax's own fp8 layers fill the same collection: the check must not wait for the glue.
    code = (
        "import sys, jax.numpy as jnp, optax, jmp_policy as jp\n"
        "grads = {'params': {'w': jnp.ones(2)}, '_overwrite_with_gradient': {'s': jnp.ones(())}}\n"
        "tx = jp.loss_scaling(optax.sgd(0.1))\n"
        "try:\n"
        "    tx.update(grads, tx.init(grads))\n"
        "except ValueError as e:\n"
        "    assert 'split_gradients' in str(e), e\n"
        "    assert 'jmp_policy.linen' not in sys.modules\n"
        "    print('refused')\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "refused"
