"""A QuantizedArray as a pytree (#46): unflatten takes any leaves and checks nothing, shape
and stacked axes follow the leaves (vmap and scan stack it), value equality (#44), and the
checks of a user's construction (a NaN scale refused)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_policy as jp
from jmp_policy._src.quantization import awq

F32 = np.dtype("float32")
FORMATS = ["int8", "int4", "int4/8"]


def _kernel(seed, shape=(16, 8)):
    return jax.random.normal(jax.random.key(seed), shape)


def _quantize(mode, w, **kwargs):
    return jp.get(f"{mode}_from_float32").quantize(w, **kwargs)


def _stack(*qs):
    return jax.tree.map(lambda *xs: jnp.stack(xs), *qs)


# Ids by kind, not repr: an object's repr holds its address, which differs between the
# pytest-xdist workers that must collect the same tests.
@pytest.mark.parametrize(
    "leaf",
    ["s", None, 0, object(), jax.ShapeDtypeStruct((3,), jnp.float32)],
    ids=["str", "None", "int", "object", "ShapeDtypeStruct"],
)
@pytest.mark.parametrize("mode", FORMATS)
def test_unflatten_takes_any_leaf_and_keeps_the_settings(mode, leaf):
    q = _quantize(mode, _kernel(0))
    placeholder = jax.tree.map(lambda _: leaf, q)
    assert type(placeholder) is jp.QuantizedArray
    assert (placeholder.mode, placeholder.block_size) == (q.mode, q.block_size)
    assert placeholder.values is leaf and placeholder.scale is leaf
    none = lambda x: x is None  # noqa: E731  (None is a leaf here, as optax's masks use it)
    assert jax.tree.structure(placeholder, is_leaf=none) == jax.tree.structure(q)
    back = jax.tree.map(lambda _, x: x, placeholder, q, is_leaf=none)  # and back to arrays
    assert back == q and back.shape == (16, 8) and back.stacked == 0


def test_orbax_style_string_leaves_unflatten_with_their_names():
    q = _quantize("int4/8", _kernel(0))
    named = jax.tree_util.tree_map_with_path(lambda p, _: jax.tree_util.keystr(p), {"k": q})
    assert (named["k"].values, named["k"].scale) == ("['k'].values", "['k'].scale")
    assert repr(named["k"]) == "QuantizedArray(int4/8, shape=(16, 8), original_dtype=float32)"


def test_an_awq_kernel_unflattens_any_leaf_too():
    q = awq.awq_quantize(_kernel(0), jnp.ones(16), jnp.eye(16), group_size=8)
    s = jax.tree.map(lambda _: "s", q)
    assert type(s) is awq.InputScaledArray and s.input_scale == "s"
    assert jax.tree.map(lambda x: x, q) == q


@pytest.mark.parametrize("mode", FORMATS)
def test_stacked_leaves_make_a_stacked_quantized_array(mode, maybe_jit):
    ws = jnp.stack([_kernel(0), _kernel(1)])
    stacked = _stack(_quantize(mode, ws[0]), _quantize(mode, ws[1]))
    assert (stacked.shape, stacked.stacked) == ((2, 16, 8), 1)
    # the same as quantizing the stack per layer
    assert stacked == _quantize(mode, ws, stacked_axes=1)
    same = maybe_jit(jax.vmap(lambda p: p))(stacked)
    assert same == stacked and (same.shape, same.stacked) == ((2, 16, 8), 1)
    made = maybe_jit(jax.vmap(lambda w: _quantize(mode, w)))(ws)
    assert made == stacked
    fields = (made.values, made.scale, made.mode, made.block_size, made.shape)
    assert jp.QuantizedArray(*fields, F32, made.stacked) == made  # valid as a user's
    np.testing.assert_array_equal(
        maybe_jit(lambda q: q.dequantize())(stacked),
        jnp.stack([q.dequantize() for q in _layers(stacked)]),
    )


def _layers(stacked):
    return [jax.tree.map(lambda x, i=i: x[i], stacked) for i in range(stacked.shape[0])]


def test_indexing_a_layer_out_of_a_stack_gives_an_unstacked_one():
    stacked = _quantize("int4/8", jnp.stack([_kernel(0), _kernel(1)]), stacked_axes=1)
    first = _layers(stacked)[0]
    assert (first.shape, first.stacked) == ((16, 8), 0)
    assert first == _quantize("int4/8", _kernel(0))


@pytest.mark.parametrize("mode", FORMATS)
def test_scan_over_a_stack_sees_one_layer_per_step(mode, maybe_jit):
    stacked = _quantize(mode, jnp.stack([_kernel(0, (8, 8)), _kernel(1, (8, 8))]), stacked_axes=1)
    x = jnp.ones((2, 8))

    def step(h, q):
        assert (q.shape, q.stacked) == ((8, 8), 0)
        return h @ q.dequantize(), q

    out, again = maybe_jit(lambda x, s: jax.lax.scan(step, x, s))(x, stacked)
    expected = x
    for q in _layers(stacked):
        expected = expected @ q.dequantize()
    np.testing.assert_allclose(out, expected, rtol=1e-6)
    assert again == stacked  # ys stack back to the same stacked QuantizedArray


class _Block(nn.Module):
    @nn.compact
    def __call__(self, h, _):
        return nn.relu(nn.Dense(8, use_bias=False)(h)), None


class _Stack(nn.Module):
    @nn.compact
    def __call__(self, x):
        scan = nn.scan(_Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=2)
        return scan(name="layers")(x, None)[0]


@pytest.mark.parametrize("mode", FORMATS)
def test_a_stack_built_by_stacking_serves_through_the_scanned_matmul(mode, maybe_jit):
    model, x = _Stack(), jnp.ones((3, 8))
    params = model.init(jax.random.key(0), x)["params"]
    kernels = params["layers"]["Dense_0"]["kernel"]  # (2, 8, 8)
    built = _stack(*[_quantize(mode, kernels[i]) for i in range(2)])
    policy = f"{mode}_from_float32"
    by_model = jp.linen.quantize(model, policy, {"params": params}, x)["params"]
    assert built == by_model["layers"]["Dense_0"]["kernel"]
    variables = {"params": {"layers": {"Dense_0": {"kernel": built}}}}
    forms = jp.linen.explain(model, policy, variables, x).split("matmuls:")[1]
    assert "per layer, in the stack's loop" in forms and "dequantized" not in forms
    run = maybe_jit(jp.linen.apply(model, policy))
    served = run(variables, x)
    np.testing.assert_array_equal(served, run({"params": by_model}, x))
    floats = {"layers": {"Dense_0": {"kernel": built.dequantize()}}}
    np.testing.assert_allclose(served, model.apply({"params": floats}, x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", FORMATS)
def test_equality_compares_values(mode, maybe_jit):
    q = _quantize(mode, _kernel(0))
    eq = maybe_jit(lambda a, b: a == b)
    assert bool(eq(q, jax.tree.map(jnp.copy, q)))
    assert not bool(eq(q, _quantize(mode, _kernel(1))))
    assert not bool(eq(q, _quantize(mode, _kernel(0, (8, 8)))))  # another shape
    assert q != _quantize(mode, _kernel(0).astype(jnp.bfloat16))  # another original dtype
    assert q != _quantize("int8" if mode != "int8" else "int4", _kernel(0))
    assert q != "q" and q != 3 and q != None  # noqa: E711
    with pytest.raises(TypeError, match="not an array: dequantize it first"):
        _ = q == q.values  # the array's own `==` asks for an array
    assert [q] == [q] and {"k": q} == {"k": jax.tree.map(jnp.copy, q)}


def test_equality_is_a_plain_bool_when_concrete():
    q = _quantize("int8", _kernel(0))
    assert (q == q) is True and (q != _quantize("int8", _kernel(1))) is True


def test_an_awq_kernel_never_equals_its_plain_quantized_form():
    q = awq.awq_quantize(_kernel(0), jnp.ones(16), jnp.eye(16), group_size=8)
    assert q == jax.tree.map(jnp.copy, q)
    assert q != q.scaled_kernel() and q.scaled_kernel() != q


def test_a_quantized_array_is_unhashable_like_an_array():
    q = _quantize("int8", _kernel(0))
    with pytest.raises(TypeError, match="unhashable"):
        hash(q)


def test_a_users_nan_scale_is_refused_and_quantizes_nan_kept(maybe_jit):
    w = _kernel(0).at[0, 3].set(jnp.nan)
    q = _quantize("int8", w)
    assert np.isnan(np.asarray(q.scale)[3])
    assert maybe_jit(lambda q: q)(q) == q  # crossing jit rebuilds it unchecked
    with pytest.raises(ValueError, match=r"`scale` must be finite.*scale\[3\]=nan"):
        jp.QuantizedArray(q.values, q.scale, "int8", None, (16, 8), F32)


def test_a_users_construction_still_checks_the_fields():
    values = jnp.zeros((4, 3), jnp.int8)
    with pytest.raises(ValueError, match=r"`values` must have shape \(2, 3\)"):
        jp.QuantizedArray(values, jnp.ones(3), "int8", None, (2, 3), F32)
    with pytest.raises(ValueError, match=r"`original_dtype` must be .*original_dtype=None"):
        jp.QuantizedArray(values, jnp.ones(3), "int8", None, (4, 3), None)
