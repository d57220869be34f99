"""Two JAX processes on this machine: one process's non-finite shard makes both skip.

Each process runs `_WORKER` below with two CPU devices; `jax.distributed.initialize` joins them
into one four-device system over 127.0.0.1, with gloo CPU collectives.
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys

import pytest

_REPO = pathlib.Path(__file__).resolve().parent.parent

_WORKER = r"""
import json
import os
import sys

port, process_id = int(sys.argv[1]), int(sys.argv[2])

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(
    coordinator_address=f"127.0.0.1:{port}",
    num_processes=2,
    process_id=process_id,
    initialization_timeout=300,
)

import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jmp_policy as jp

assert jax.process_count() == 2 and jax.device_count() == 4, jax.devices()
mesh = jax.make_mesh((4,), ("d",))
sharding = NamedSharding(mesh, P("d"))
rows_per_process = 4


def global_array(local):
    return jax.make_array_from_process_local_data(sharding, np.asarray(local, np.float32))


def local_values(x):
    return np.concatenate([np.asarray(s.data) for s in x.addressable_shards]).tolist()


opt = jp.loss_scaling(optax.sgd(1.0), jp.DynamicLossScale(8.0, period=2))
params = global_array(np.ones(rows_per_process))
state = opt.init(params)
update = jax.jit(opt.update)

# A shard_map step with axis_name: each device holds only its shard of the gradients.
def shard_step(p, g):
    updates, s = opt_axis.update(g, opt_axis.init(p), p)
    return updates, s.loss_scale.loss_scale[None], s.total_skipped[None]

opt_axis = jp.loss_scaling(optax.sgd(1.0), jp.DynamicLossScale(8.0), axis_name="d")
sharded_step = jax.jit(
    jax.shard_map(shard_step, mesh=mesh, in_specs=(P("d"), P("d")), out_specs=(P("d"),) * 3)
)

results = {"jit": [], "shard_map": []}
# Step 2: only process 1 holds a NaN; step 4: only process 0 holds an inf.
poison = {1: (1, np.nan), 3: (0, np.inf)}
for step in range(5):
    # Gradients of the scaled loss: the loss scale times a true gradient of 1.
    local = np.full(rows_per_process, float(jp.get_loss_scale(state).loss_scale))
    if step in poison and poison[step][0] == process_id:
        local[2] = poison[step][1]
    grads = global_array(local)
    updates, state = update(grads, state, params)
    results["jit"].append(
        {
            "updates": local_values(updates),
            "scale": float(jp.get_loss_scale(state).loss_scale),
            "skipped": int(state.total_skipped),
        }
    )
    if step in (0, 1):
        u, scales, skipped = sharded_step(params, grads)
        results["shard_map"].append(
            {
                "updates": local_values(u),
                "scales": local_values(scales),
                "skipped": local_values(skipped),
            }
        )

print("RESULT " + json.dumps(results), flush=True)
jax.distributed.shutdown()
"""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_two_processes(tmp_path: pathlib.Path) -> list[dict]:
    worker = tmp_path / "worker.py"
    worker.write_text(_WORKER)
    env = dict(os.environ)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([str(_REPO), env.get("PYTHONPATH", "")])
    port = _free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(worker), str(port), str(i)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    outputs = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=600)  # a hang guard, not a time limit
            outputs.append(out)
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
        pytest.fail("the two JAX processes did not finish within 120 s")
    results = []
    for proc, out in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, out[-4000:]
        line = next(line for line in out.splitlines() if line.startswith("RESULT "))
        results.append(json.loads(line[len("RESULT ") :]))
    return results


def test_one_process_non_finite_shard_makes_both_processes_skip(tmp_path):
    results = _run_two_processes(tmp_path)
    # Scale sequence: 8 (finite, counter 1) -> skip: 4 -> finite: 4 -> skip: 2 -> finite: 2.
    expected_scales = [8.0, 4.0, 4.0, 2.0, 2.0]
    expected_skipped = [0, 1, 1, 2, 2]
    for r in results:
        steps = r["jit"]
        assert [s["scale"] for s in steps] == expected_scales
        assert [s["skipped"] for s in steps] == expected_skipped
        for i, s in enumerate(steps):
            want = 0.0 if i in (1, 3) else -1.0
            assert s["updates"] == [want] * 4, (i, s)
        # shard_map with axis_name: step 0 finite everywhere, step 1 skipped everywhere.
        first, second = r["shard_map"]
        assert first["updates"] == [-1.0] * 4 and first["skipped"] == [0.0, 0.0]
        assert second["updates"] == [0.0] * 4
        assert second["scales"] == [4.0, 4.0] and second["skipped"] == [1.0, 1.0]
    assert results[0] == results[1]
