"""The zero point as a field of the stored weights (#49): ``QuantizedArray.zero_point`` is a
pytree child only where there is one; it survives tree operations, ``jit``, ``vmap``,
``scan``, stack slicing, flax serialization and orbax, and its checks name it."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import serialization

import jmp_policy as jp
from jmp_policy._src.quantization import awq, stack_layers

ASYM = ["int4/8/asym", "int4/-1/asym"]


def _kernel(seed, shape=(16, 8)):
    return jax.random.normal(jax.random.key(seed), shape) + 0.3


def _quantize(mode, w, **kwargs):
    return jp.get(f"{mode}_from_float32").quantize(w, **kwargs)


def test_a_symmetric_array_has_no_zero_point_child():
    q = _quantize("int4/8", _kernel(0))
    assert q.zero_point is None and len(jax.tree.leaves(q)) == 2
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(q)]
    assert paths == [".values", ".scale"]
    assert "zero_point" not in repr(q)


@pytest.mark.parametrize("mode", ASYM)
def test_the_zero_point_is_a_child_with_its_key(mode):
    q = _quantize(mode, _kernel(0))
    assert type(q) is jp.QuantizedArray and q.zero_point.dtype == jnp.int8
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(q)]
    assert paths == [".values", ".scale", ".zero_point"]
    assert jax.tree.structure(q) != jax.tree.structure(_quantize("int4/8", _kernel(0)))
    assert q != _quantize(mode.replace("/asym", ""), _kernel(0))


@pytest.mark.parametrize(
    "leaf",
    ["s", None, 0, object(), jax.ShapeDtypeStruct((3,), jnp.float32)],
    ids=["str", "None", "int", "object", "ShapeDtypeStruct"],
)
def test_unflatten_takes_any_leaf_and_keeps_the_zero_point_child(leaf):
    q = _quantize("int4/8/asym", _kernel(0))
    placeholder = jax.tree.map(lambda _: leaf, q)
    assert type(placeholder) is jp.QuantizedArray and placeholder.zero_point is leaf
    none = lambda x: x is None  # noqa: E731
    assert jax.tree.structure(placeholder, is_leaf=none) == jax.tree.structure(q)
    assert jax.tree.structure(jax.tree.map(lambda x: x, placeholder, is_leaf=none)) == (
        jax.tree.structure(placeholder)
    )
    back = jax.tree.map(lambda _, x: x, placeholder, q, is_leaf=none)
    assert back == q and back.zero_point is q.zero_point


def test_an_awq_kernel_with_zero_points_unflattens_any_leaf():
    w = _kernel(0)
    q = awq.awq_quantize(w, jnp.ones(16), jnp.eye(16), group_size=8, symmetric=False)
    assert [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(q)] == [
        ".values", ".scale", ".zero_point", ".input_scale",
    ]  # fmt: skip
    s = jax.tree.map(lambda _: "s", q)
    assert type(s) is awq.InputScaledArray and s.zero_point == "s" and s.input_scale == "s"
    assert jax.tree.map(lambda x: x, q) == q
    plain = q.scaled_kernel()
    assert type(plain) is jp.QuantizedArray and plain.zero_point is q.zero_point


@pytest.mark.parametrize("mode", ASYM)
def test_jit_vmap_and_scan_keep_the_zero_point(mode, maybe_jit):
    ws = jnp.stack([_kernel(0), _kernel(1)])
    layers = [_quantize(mode, ws[i]) for i in range(2)]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *layers)
    assert (stacked.stacked, stacked.zero_point.shape) == (1, (2, *layers[0].scale.shape))
    assert stacked == _quantize(mode, ws, stacked_axes=1)
    assert maybe_jit(lambda t: t)(stacked) == stacked
    assert maybe_jit(jax.vmap(lambda w: _quantize(mode, w)))(ws) == stacked
    np.testing.assert_array_equal(
        maybe_jit(lambda q: q.dequantize())(stacked), jnp.stack([q.dequantize() for q in layers])
    )

    def step(h, q):
        assert q.stacked == 0 and q.zero_point is not None
        return h @ q.dequantize(), q

    x = jnp.ones((2, 16))
    ws8 = jnp.stack([_kernel(0, (16, 16)), _kernel(1, (16, 16))])
    stack8 = _quantize(mode, ws8, stacked_axes=1)
    out, again = maybe_jit(lambda x, s: jax.lax.scan(step, x, s))(x, stack8)
    expected = x
    for i in range(2):
        expected = expected @ _quantize(mode, ws8[i]).dequantize()
    np.testing.assert_allclose(out, expected, rtol=1e-5)
    assert again == stack8


def test_stack_slicing_reads_the_zero_point_of_each_layer():
    stacked = _quantize("int4/8/asym", jnp.stack([_kernel(0), _kernel(1)]), stacked_axes=1)
    leaves = stack_layers.extra_leaves(stacked)
    assert sorted(leaves) == ["scale", "zero_point"]
    one = stack_layers.layer_of(stacked, stacked.values[1], {k: v[1] for k, v in leaves.items()})
    assert one == _quantize("int4/8/asym", _kernel(1))
    symmetric = _quantize("int4/8", jnp.stack([_kernel(0), _kernel(1)]), stacked_axes=1)
    assert sorted(stack_layers.extra_leaves(symmetric)) == ["scale"]


class _Block(nn.Module):
    @nn.compact
    def __call__(self, h, _):
        return nn.relu(nn.Dense(16, use_bias=False)(h)), None


class _Stack(nn.Module):
    @nn.compact
    def __call__(self, x):
        scan = nn.scan(_Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=2)
        return scan(name="layers")(x, None)[0]


def test_a_scanned_stack_serves_its_zero_points_in_the_loop(maybe_jit):
    model, x = _Stack(), jax.random.normal(jax.random.key(3), (3, 16))
    params = model.init(jax.random.key(0), x)["params"]
    policy = "int4/8/asym_from_float32"
    q = jp.linen.quantize(model, policy, {"params": params}, x)["params"]
    kernel = q["layers"]["Dense_0"]["kernel"]
    assert kernel.stacked == 1 and kernel.zero_point.shape == (2, 2, 16)
    forms = " ".join(jp.linen.explain(model, policy, {"params": q}, x).split("matmuls:")[1].split())
    assert "per layer, in the stack's loop" in forms and "with zero points" in forms
    served = maybe_jit(jp.linen.apply(model, policy))({"params": q}, x)
    floats = {"layers": {"Dense_0": {"kernel": kernel.dequantize()}}}
    np.testing.assert_allclose(served, model.apply({"params": floats}, x), rtol=1e-5, atol=1e-5)


def test_flax_serialization_round_trips_and_refuses_a_mismatched_target():
    q = {"k": _quantize("int4/8/asym", _kernel(0)), "s": _quantize("int4/8", _kernel(1))}
    data = serialization.to_bytes(q)
    assert serialization.from_bytes(q, data) == q
    plain = serialization.msgpack_restore(data)
    assert sorted(plain["k"]) == sorted(
        ["values", "scale", "zero_point", "mode", "block_size", "original_dtype", "shape",
         "stacked", "stacked_at"]
    )  # fmt: skip
    assert jp.rebuild_quantized(plain) == q
    state = serialization.to_state_dict(q["k"])
    with pytest.raises(ValueError, match=r"with the fields \['zero_point'\] that the target"):
        serialization.from_state_dict(_quantize("int4/8", _kernel(0)), state)
    del state["zero_point"]
    with pytest.raises(ValueError, match=r"without the fields \['zero_point'\]"):
        serialization.from_state_dict(q["k"], state)


def test_orbax_round_trips_with_and_without_a_target(tmp_path):
    tree = {
        "k": _quantize("int4/8/asym", _kernel(0)),
        "stack": _quantize("int4/-1/asym", jnp.stack([_kernel(1), _kernel(2)]), stacked_axes=1),
    }
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(tmp_path / "z", tree)
        ckptr.wait_until_finished()
        plain = ckptr.restore(tmp_path / "z")
        target = jax.eval_shape(lambda: tree)
        restored = ckptr.restore(tmp_path / "z", target)
    assert restored == tree
    assert sorted(plain["k"]) == ["scale", "values", "zero_point"]
    assert jp.rebuild_quantized(plain, jp.quantized_metadata(tree)) == tree


def test_a_users_zero_point_is_checked_and_counted():
    q = _quantize("int4/8/asym", _kernel(0))
    fields = dict(
        values=q.values, scale=q.scale, mode="int4", block_size=8, shape=(16, 8),
        original_dtype=jnp.float32,
    )  # fmt: skip
    with pytest.raises(TypeError, match="`zero_point` must be None or an integer array"):
        jp.QuantizedArray(**fields, zero_point="z")
    made = jp.QuantizedArray(**fields, zero_point=q.zero_point)
    assert made == q and made.nbytes == q.nbytes == 16 * 8 // 2 + 2 * 8 * 4 + 2 * 8
    assert jp.QuantizedArray(**fields) != q  # no zero point: another array
