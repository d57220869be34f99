"""A QuantizedArray of a stack on axis 1 (#47's ``stacked_at``) under #46's pytree contract:
``stacked_at`` is static metadata that survives ``jax.tree.map``, ``jit``, unflattening with
any leaves, ``==``, flax msgpack and ``quantized_metadata`` / ``rebuild_quantized``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import serialization

import jmp_policy as jp

POLICIES = ["int8_from_float32", "int4_from_float32", "int4/8_from_float32"]


def _stack(name):
    """A ``[in, depth, out]`` kernel (values keep the model's layout), stacked on axis 1."""
    w = jax.random.normal(jax.random.key(0), (16, 3, 8))
    q = jp.get(name).quantize({"kernel": w}, stacked_axes={"kernel": (1, 1)})["kernel"]
    assert (q.shape, q.stacked, q.stacked_at) == ((16, 3, 8), 1, 1)
    return q


def _same(a, b):
    assert type(a) is type(b)
    assert (a.shape, a.stacked, a.stacked_at) == (b.shape, b.stacked, b.stacked_at)
    assert a == b
    np.testing.assert_array_equal(np.asarray(a.dequantize()), np.asarray(b.dequantize()))


@pytest.mark.parametrize("name", POLICIES)
def test_tree_map_and_jit_keep_stacked_at(name):
    q = _stack(name)
    _same(jax.tree.map(lambda x: x, q), q)
    _same(jax.jit(lambda t: t)(q), q)
    spec = jax.eval_shape(lambda t: t, q)
    assert (spec.shape, spec.stacked, spec.stacked_at) == ((16, 3, 8), 1, 1)
    # one layer's slices of the leaves (as the stack's loop sees them): one layer, leading
    layer = jax.tree.unflatten(jax.tree.structure(q), [q.values[:, 0], q.scale[0]])
    assert (layer.shape, layer.stacked, layer.stacked_at) == ((16, 8), 0, 0)
    # any leaves unflatten unchecked
    empty = jax.tree.unflatten(jax.tree.structure(q), [None, None])
    assert (empty.shape, empty.stacked, empty.stacked_at) == ((16, 8), 0, 0)


@pytest.mark.parametrize("name", POLICIES)
def test_stacked_at_is_part_of_the_structure_and_equality(name):
    q = _stack(name)
    front = q.front()
    assert front.stacked_at == 0 and front.shape == (3, 16, 8)
    assert jax.tree.structure(front) != jax.tree.structure(q)
    assert front != q
    _same(front.stacked_to(1), q)


@pytest.mark.parametrize("name", POLICIES)
def test_flax_msgpack_round_trip(name):
    q = _stack(name)
    data = serialization.to_bytes({"kernel": q})
    _same(serialization.from_bytes({"kernel": q}, data)["kernel"], q)
    restored = serialization.msgpack_restore(data)
    assert restored["kernel"]["stacked_at"] == 1
    _same(jp.rebuild_quantized(restored)["kernel"], q)


def test_a_state_dict_of_another_stacked_at_is_refused():
    q = _stack("int8_from_float32")
    state = serialization.to_state_dict(q)
    with pytest.raises(ValueError, match="another format or shape"):
        serialization.from_state_dict(q, {**state, "stacked_at": 0})


@pytest.mark.parametrize("name", POLICIES)
def test_quantized_metadata_round_trip(name):
    q = _stack(name)
    metadata = jp.quantized_metadata({"kernel": q})
    assert metadata["kernel"]["stacked_at"] == 1
    plain = {"kernel": {"values": jnp.asarray(q.values), "scale": jnp.asarray(q.scale)}}
    _same(jp.rebuild_quantized(plain, metadata)["kernel"], q)


def test_metadata_saved_before_stacked_at_reads_leading():
    w = jax.random.normal(jax.random.key(0), (3, 16, 8))
    q = jp.get("int8_from_float32").quantize({"kernel": w}, stacked_axes=1)["kernel"]
    old = {k: v for k, v in jp.quantized_metadata({"kernel": q})["kernel"].items()}
    del old["stacked_at"]
    plain = {"kernel": {"values": q.values, "scale": q.scale}}
    again = jp.rebuild_quantized(plain, {"kernel": old})["kernel"]
    assert (again.stacked, again.stacked_at) == (1, 0)
    assert again == q
