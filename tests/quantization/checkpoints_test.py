"""Quantized trees in checkpoints (#46): int8, int4 per channel and in blocks of 128, GPTQ and
AWQ kernels with float8 state beside them save and restore bit-identically with orbax
(StandardCheckpointer, CheckpointManager; with a target and without; sharded over 8 devices
and restored onto another sharding) and with flax.serialization, and serve the same outputs.
"""

import pathlib
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import serialization
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jmp_policy as jp
from jmp_policy._src.quantization import awq


class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(16, name="blocks")(x))  # int4/128: a (256, 16) kernel
        x = nn.relu(nn.Dense(16, name="channels")(x))  # int4 per channel
        x = nn.relu(nn.Dense(16, name="gptq")(x))
        x = nn.relu(nn.Dense(16, name="awq")(x))
        x = nn.relu(nn.Dense(16, name="int8")(x))
        return nn.Dense(8, name="fp8")(x)


MAP = jp.DTypePolicyMap(
    "float32",
    {
        "blocks": "int4/128_from_float32",
        "channels": "int4_from_float32",
        "gptq": "gptq/4/8_from_float32",
        "awq": "awq/4/8_from_float32",
        "int8": "int8_from_float32",
        "fp8": "float8_from_float32",
    },
)


@pytest.fixture(scope="module")
def model():
    net, x = Net(), jax.random.normal(jax.random.key(1), (32, 256))
    variables = jp.linen.init(net, MAP)(jax.random.key(0), x)
    calibrated = jp.linen.calibrate(net, MAP, variables, [x])
    return net, x, jax.tree.map(jnp.asarray, dict(calibrated))


def _kernels(variables):
    return {n: variables["params"][n]["kernel"] for n in variables["params"]}


def test_the_tree_holds_every_format_and_float8_state(model):
    _, _, variables = model
    k = _kernels(variables)
    assert (k["blocks"].mode, k["blocks"].block_size, k["blocks"].scale.shape) == (
        "int4",
        128,
        (2, 16),
    )
    assert (k["channels"].mode, k["channels"].block_size) == ("int4", -1)
    assert (k["gptq"].block_size, k["int8"].values.dtype) == (8, jnp.int8)
    assert isinstance(k["awq"], awq.InputScaledArray)
    assert k["fp8"].dtype == jnp.float32
    assert "_overwrite_with_gradient" in variables


def _assert_identical(restored, saved):
    """The same structure (QuantizedArrays of the same classes and settings), leaves of the
    same dtypes, shapes and bits."""
    assert jax.tree.structure(restored) == jax.tree.structure(saved)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(saved), strict=True):
        assert (np.dtype(a.dtype), np.shape(a)) == (np.dtype(b.dtype), np.shape(b))
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    quantized, again = (
        [x for x in jax.tree.leaves(t, is_leaf=_is_quantized) if _is_quantized(x)]
        for t in (saved, restored)
    )
    assert quantized and all(q == r for q, r in zip(quantized, again, strict=True))


def _is_quantized(x):
    return isinstance(x, jp.QuantizedArray)


def _assert_serves_the_same(model, restored):
    net, x, variables = model
    run = jax.jit(jp.linen.apply(net, MAP))
    expected = run(variables, x)
    # sharded as restored: another program, sums in another order
    np.testing.assert_allclose(run(restored, x), expected, rtol=1e-5, atol=1e-6)
    # on the saved tree's device: the same program, the same bits
    np.testing.assert_array_equal(run(jax.device_put(restored, jax.devices()[0]), x), expected)


def _sharded(tree, spec):
    """``tree`` with every leaf whose first axis divides by 8 split along it over 8 devices."""
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(8), ("d",))

    def put(x):
        split = x.ndim and x.shape[0] % 8 == 0
        return jax.device_put(x, NamedSharding(mesh, spec(x) if split else P()))

    return jax.tree.map(put, tree)


def _abstract_on(tree, mesh_shape):
    """Restore targets on another mesh: the last axis split where it divides."""
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(mesh_shape), ("a", "b"))

    def spec(x):
        if x.ndim and x.shape[-1] % mesh_shape[1] == 0:
            return NamedSharding(mesh, P(*([None] * (x.ndim - 1)), "b"))
        return NamedSharding(mesh, P())

    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=spec(x)), tree)


def test_standard_checkpointer_restores_sharded_onto_another_sharding(model, tmp_path):
    _, _, variables = model
    saved = _sharded(variables, lambda x: P("d"))
    values = saved["params"]["blocks"]["kernel"].values
    assert values.sharding.device_set == set(jax.devices()[:8]) and values.dtype == jnp.int4
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(tmp_path / "q", saved)
        ckptr.wait_until_finished()
        target = _abstract_on(variables, (2, 4))
        restored = ckptr.restore(tmp_path / "q", target)
    _assert_identical(restored, variables)
    for leaf, want in zip(jax.tree.leaves(restored), jax.tree.leaves(target), strict=True):
        assert leaf.sharding == want.sharding
    _assert_serves_the_same(model, restored)


def test_standard_checkpointer_without_a_target_gives_dicts_that_rebuild(model, tmp_path):
    _, _, variables = model
    metadata = jp.quantized_metadata(variables)
    assert metadata["params/blocks/kernel"] == {
        "mode": "int4", "block_size": 128, "original_dtype": "float32", "shape": [256, 16],
        "stacked": 0, "stacked_at": 0,
    }  # fmt: skip
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(tmp_path / "q", _sharded(variables, lambda x: P("d")))
        ckptr.wait_until_finished()
        plain = ckptr.restore(tmp_path / "q")
    assert sorted(plain["params"]["awq"]["kernel"]) == ["input_scale", "scale", "values"]
    restored = jp.rebuild_quantized(plain, metadata)
    _assert_identical(restored, variables)
    _assert_serves_the_same(model, restored)


def test_checkpoint_manager_saves_the_settings_beside_the_arrays(model, tmp_path):
    _, _, variables = model
    with ocp.CheckpointManager(tmp_path) as manager:
        manager.save(
            3,
            args=ocp.args.Composite(
                params=ocp.args.StandardSave(variables),
                quantization=ocp.args.JsonSave(jp.quantized_metadata(variables)),
            ),
        )
        manager.wait_until_finished()
    with ocp.CheckpointManager(tmp_path) as manager:
        step = manager.latest_step()
        plain = manager.restore(step)  # no target: dicts of arrays and the JSON
        abstract = _abstract_on(variables, (4, 2))
        targeted = manager.restore(
            step, args=ocp.args.Composite(params=ocp.args.StandardRestore(abstract))
        )
    assert step == 3
    restored = jp.rebuild_quantized(plain["params"], plain["quantization"])
    _assert_identical(restored, variables)
    _assert_identical(targeted["params"], variables)
    _assert_serves_the_same(model, targeted["params"])


def test_flax_msgpack_restores_with_and_without_a_target(model):
    _, _, variables = model
    data = serialization.to_bytes(variables)
    restored = serialization.from_bytes(variables, data)
    _assert_identical(restored, variables)
    _assert_serves_the_same(model, restored)
    plain = serialization.msgpack_restore(data)  # the settings travel in the state dict
    assert plain["params"]["blocks"]["kernel"]["mode"] == "int4"
    rebuilt = jp.rebuild_quantized(plain)
    _assert_identical(rebuilt, variables)
    _assert_serves_the_same(model, rebuilt)


def test_flax_restore_into_a_target_of_another_format_is_refused(model):
    _, _, variables = model
    state = serialization.to_state_dict(variables["params"]["int8"]["kernel"])
    target = variables["params"]["channels"]["kernel"]
    with pytest.raises(ValueError, match=r"of another format or shape: it holds .*'mode': 'int8'"):
        serialization.from_state_dict(target, state)
    with pytest.raises(ValueError, match=r"without the fields \['scale'\]"):
        serialization.from_state_dict(target, {"values": target.values})


def test_a_stacked_kernel_round_trips(tmp_path):
    w = jax.random.normal(jax.random.key(0), (2, 16, 8))
    tree = {"layers": {"kernel": jp.get("int4/8_from_float32").quantize(w, stacked_axes=1)}}
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(tmp_path / "s", tree)
        ckptr.wait_until_finished()
        plain = ckptr.restore(tmp_path / "s")
    restored = jp.rebuild_quantized(plain, jp.quantized_metadata(tree))
    assert restored == tree and restored["layers"]["kernel"].stacked == 1
    assert serialization.from_bytes(tree, serialization.to_bytes(tree)) == tree


def test_rebuild_without_settings_says_to_pass_the_metadata():
    q = jp.get("int8_from_float32").quantize(jnp.ones((4, 2)))
    plain = {"k": {"values": q.values, "scale": q.scale}}
    with pytest.raises(ValueError, match=r"at 'k' .* pass `metadata=jp.quantized_metadata"):
        jp.rebuild_quantized(plain)
    with pytest.raises(ValueError, match=r"`metadata` names quantized kernels .*\['x'\]"):
        jp.rebuild_quantized(plain, {**jp.quantized_metadata({"k": q}), "x": {"mode": "int8"}})
    with pytest.raises(TypeError, match=r"`metadata` must be a mapping.*metadata='int8'"):
        jp.rebuild_quantized(plain, "int8")
    # a submodule named "values" beside one named "scale" is no quantized kernel
    modules = {"values": {"kernel": q.values}, "scale": {"kernel": q.scale}}
    assert jp.rebuild_quantized(modules)["values"]["kernel"] is q.values
    bad = {"k": {"mode": "int4", "block_size": -1, "original_dtype": "float32"}}
    with pytest.raises(ValueError, match=r"kernel at 'k' of `tree`: `values` of a int4"):
        jp.rebuild_quantized(plain, bad)


def test_a_nan_scale_from_quantize_survives_the_round_trip(tmp_path):
    q = jp.get("int8_from_float32").quantize(jnp.ones((4, 2)).at[0, 1].set(jnp.nan))
    tree = {"k": q}
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(tmp_path / "n", tree)
        ckptr.wait_until_finished()
        plain = ckptr.restore(tmp_path / "n")
    assert jp.rebuild_quantized(plain, jp.quantized_metadata(tree)) == tree
    assert serialization.from_bytes(tree, serialization.to_bytes(tree)) == tree


def test_an_eval_shape_of_quantize_is_a_restore_target(tmp_path):
    policy_map = jp.DTypePolicyMap(
        "float32", {"a": "int4/8_from_float32", "b": "int8_from_float32"}
    )
    params = {n: {"kernel": jax.random.normal(jax.random.key(0), (16, 8))} for n in "ab"}
    quantized = policy_map.quantize(params)
    target = jax.eval_shape(policy_map.quantize, params)  # nothing computed
    assert isinstance(target["a"]["kernel"].values, jax.ShapeDtypeStruct)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(tmp_path / "e", quantized)
        ckptr.wait_until_finished()
        restored = ckptr.restore(tmp_path / "e", target)
    assert restored == quantized


_FLAX_FIRST = """
from flax import serialization
import jax.numpy as jnp
import sys
import jmp_policy as jp
q = jp.get("int4/8_from_float32").quantize({"k": jnp.ones((16, 4))})
assert "jmp_policy.linen" not in sys.modules and "jmp_policy.nnx" not in sys.modules
print(serialization.from_bytes(q, serialization.to_bytes(q)) == q)
"""


@pytest.mark.heavy(5)
def test_flax_serialization_knows_the_class_without_the_flax_glue():
    # The core never imports flax: a QuantizedArray built while flax is loaded registers
    # the class with flax.serialization itself.
    result = subprocess.run(
        [sys.executable, "-c", _FLAX_FIRST],
        capture_output=True,
        text=True,
        cwd=pathlib.Path(__file__).resolve().parents[2],
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "True"


def test_an_nnx_models_quantized_state_round_trips(tmp_path):
    from flax import nnx

    class Mlp(nnx.Module):
        def __init__(self, rngs):
            self.up = nnx.Linear(256, 16, rngs=rngs)
            self.down = nnx.Linear(16, 8, rngs=rngs)

        def __call__(self, x):
            return self.down(nnx.relu(self.up(x)))

    policy_map = jp.DTypePolicyMap(
        "float32", {"up": "int4/128_from_float32", "down": "int8_from_float32"}
    )
    model = jp.nnx.quantize(Mlp(nnx.Rngs(0)), policy_map)
    x = jax.random.normal(jax.random.key(1), (4, 256))
    graphdef, state = nnx.split(model)
    assert isinstance(state["up"]["kernel"].get_value(), jp.QuantizedArray)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(tmp_path / "nnx", state)
        ckptr.wait_until_finished()
        restored = ckptr.restore(
            tmp_path / "nnx", jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
        )
    _assert_identical(restored, state)
    again = nnx.merge(graphdef, restored)
    run = jp.nnx.apply
    np.testing.assert_array_equal(run(again, policy_map)(x), run(model, policy_map)(x))
