"""``jp.compile_for_serving``: the program compiled with the variables' layouts chosen by
XLA, the variables put in them. On a CPU XLA's choice is the default layout; what it
chooses for an H100 (int8 kernels stored ``[out, in]``, no transpose) is checked in
``tests/h100_forms_test.py``."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jmp_policy as jp


class Stack(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(64, name="up")(x)
        return nn.Dense(32, use_bias=False, name="down")(nn.gelu(x))


def _setup(rows=128, stored="int8_from_float32"):
    model = Stack()
    x = jax.random.normal(jax.random.key(1), (rows, 32)).astype(jnp.bfloat16)
    variables = model.init(jax.random.key(0), x)
    return model, x, jp.get(stored).quantize(variables)


@pytest.mark.parametrize("rows", [1, 128])  # the weight-only form, then int8 x int8
@pytest.mark.parametrize("layouts", ["auto", "keep"])
def test_the_compiled_program_computes_what_jit_computes(rows, layouts):
    model, x, variables = _setup(rows)
    serve = jp.linen.apply(model, "int8_from_mixed_bfloat16")
    compiled, placed = jp.compile_for_serving(serve, variables, x, layouts=layouts)
    want = jax.jit(serve)(variables, x)
    got = compiled(placed, x)
    assert got.dtype == jnp.bfloat16 and got.shape == (rows, 32)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_the_variables_come_back_as_they_went_in_and_are_not_changed():
    model, x, variables = _setup()
    before = jax.tree.map(np.asarray, variables)
    serve = jp.linen.apply(model, "int8_from_mixed_bfloat16")
    compiled, placed = jp.compile_for_serving(serve, variables, x)
    assert jax.tree.structure(placed) == jax.tree.structure(variables)
    kernel = placed["params"]["up"]["kernel"]
    assert isinstance(kernel, jp.QuantizedArray)
    assert kernel.values.dtype == jnp.int8 and kernel.shape == (32, 64)
    for a, b, original in zip(
        jax.tree.leaves(placed), jax.tree.leaves(variables), jax.tree.leaves(before), strict=True
    ):
        assert (a.shape, a.dtype) == (b.shape, b.dtype)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        np.testing.assert_array_equal(np.asarray(b), original)  # the input is untouched
    # the returned arrays carry the compiled program's formats
    formats = compiled.input_formats[0][0]
    for a, fmt in zip(jax.tree.leaves(placed), jax.tree.leaves(formats), strict=True):
        assert a.format.layout == fmt.layout


def test_a_second_shape_keeps_the_layouts_of_the_first():
    model, x, variables = _setup(rows=128)
    serve = jp.linen.apply(model, "int8_from_mixed_bfloat16")
    _, placed = jp.compile_for_serving(serve, variables, x)
    one = x[:1]
    compiled, again = jp.compile_for_serving(serve, placed, one, layouts="keep")
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(placed), strict=True):
        assert a.format == b.format
    np.testing.assert_array_equal(
        np.asarray(compiled(again, one), np.float32),
        np.asarray(jax.jit(serve)(variables, one), np.float32),
    )


def test_shardings_are_kept_on_8_devices():
    assert jax.device_count() == 8
    mesh = jax.make_mesh((8,), ("model",))
    model, x, variables = _setup(rows=128)

    def shard(path, leaf):
        # the kernels' values and scales split over their output axis, the rest replicated
        name = jax.tree_util.keystr(path)
        spec = P(None, "model") if "kernel" in name and leaf.ndim == 2 else P()
        return jax.device_put(leaf, NamedSharding(mesh, spec))

    sharded = jax.tree_util.tree_map_with_path(shard, variables)
    serve = jp.linen.apply(model, "int8_from_mixed_bfloat16")
    compiled, placed = jp.compile_for_serving(serve, sharded, x)
    for a, b in zip(jax.tree.leaves(placed), jax.tree.leaves(sharded), strict=True):
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim), (a.sharding, b.sharding)
    kernel = placed["params"]["up"]["kernel"].values
    assert kernel.sharding.spec == P(None, "model")
    # the same sharded program as jit's (unsharded, the sums run in another order)
    np.testing.assert_array_equal(
        np.asarray(compiled(placed, x), np.float32),
        np.asarray(jax.jit(serve)(sharded, x), np.float32),
    )


def test_a_plain_function_of_a_pytree():
    """The core takes any function of (variables, *args): no Flax needed."""
    w = jp.get("int8_from_float32").quantize({"w": jnp.linspace(-1, 1, 32 * 8).reshape(32, 8)})
    x = jnp.ones((4, 32), jnp.float32)

    def fn(v, x):
        return x @ v["w"].dequantize(jnp.float32)

    compiled, placed = jp.compile_for_serving(fn, w, x)
    np.testing.assert_allclose(compiled(placed, x), fn(w, x), rtol=1e-6)


@pytest.mark.parametrize("layouts", ["AUTO", "default", "", None, 1])
def test_an_unknown_layouts_value_is_a_value_error(layouts):
    model, x, variables = _setup()
    with pytest.raises(ValueError, match=r"`layouts` must be 'auto' .* or 'keep' .*; got "):
        jp.compile_for_serving(
            jp.linen.apply(model, "mixed_bfloat16"), variables, x, layouts=layouts
        )


def test_fn_must_be_callable():
    _, x, variables = _setup()
    with pytest.raises(TypeError, match=r"`fn` must be a function of \(variables, \*args\).*'up'"):
        jp.compile_for_serving("up", variables, x)


def test_it_is_called_outside_jit():
    model, x, variables = _setup()
    serve = jp.linen.apply(model, "mixed_bfloat16")

    def inside(v, x):
        return jp.compile_for_serving(serve, v, x)[0]

    with pytest.raises(TypeError, match=r"outside jax.jit.*variables\['params'\]\['down'\]"):
        jax.jit(inside)(variables, x)
    with pytest.raises(TypeError, match=r"traced value was given in args\[0\]"):
        jax.jit(lambda x: jp.compile_for_serving(serve, variables, x)[0])(x)


@pytest.mark.parametrize("stored", ["int4_from_float32", "int4/128_from_float32"])
def test_int4_weights(stored):
    """int4 arrays: where this JAX cannot put them in the layout XLA asks for (jax 0.10 on
    a CPU keeps them unpacked), they keep theirs and the program is compiled for it."""
    model, x, variables = _setup(rows=16, stored=stored)
    serve = jp.linen.apply(model, "mixed_bfloat16")
    compiled, placed = jp.compile_for_serving(serve, variables, x)
    assert placed["params"]["up"]["kernel"].values.dtype == jnp.int4
    np.testing.assert_array_equal(
        np.asarray(compiled(placed, x), np.float32),
        np.asarray(jax.jit(serve)(variables, x), np.float32),
    )


def test_weak_types_and_python_scalars_compute_as_under_jit():
    """A weak-typed scalar variable keeps its weak type (the result's dtype is jit's), and
    a Python float is taken as jit takes it."""
    x = jnp.ones((4,), jnp.bfloat16)
    for t in (jnp.asarray(2.0), 2.0):
        variables = {"t": t}

        def fn(v, x):
            return x * v["t"]

        compiled, placed = jp.compile_for_serving(fn, variables, x)
        want = jax.jit(fn)(variables, x)
        got = compiled(placed, x)
        assert got.dtype == want.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_uncommitted_variables_go_where_a_sharded_input_goes():
    """Variables fresh from init (uncommitted) are not pinned to one device: with an input
    over 8 devices the program runs as jit's does."""
    mesh = jax.make_mesh((8,), ("data",))
    x = jax.device_put(jnp.ones((8, 16), jnp.float32), NamedSharding(mesh, P("data", None)))
    variables = {"w": jnp.ones((16, 4), jnp.float32), "b": jnp.zeros((4,), jnp.float32)}

    def fn(v, x):
        return x @ v["w"] + v["b"]

    for layouts in ("auto", "keep"):
        compiled, placed = jp.compile_for_serving(fn, variables, x, layouts=layouts)
        np.testing.assert_array_equal(compiled(placed, x), jax.jit(fn)(variables, x))


def test_a_variable_fn_never_reads_is_compiled_once():
    lowerings = []
    from jmp_policy._src import serving_layouts

    original = serving_layouts._lower

    def counting(*a, **k):
        lowerings.append(1)
        return original(*a, **k)

    variables = {"w": jnp.ones((16, 4)), "unused": jnp.zeros((3, 5))}
    x = jnp.ones((2, 16))
    serving_layouts._lower = counting
    try:
        compiled, placed = jp.compile_for_serving(lambda v, x: x @ v["w"], variables, x)
    finally:
        serving_layouts._lower = original
    assert len(lowerings) == 1
    np.testing.assert_array_equal(compiled(placed, x), x @ variables["w"])


def test_a_long_fn_is_not_quoted_whole():
    _, x, variables = _setup()
    with pytest.raises(TypeError, match=r"got \{.*\.\.\..* of type dict") as info:
        jp.compile_for_serving(variables, variables, x)
    assert len(str(info.value)) < 400


def test_big_vision_vit_scanned_and_quantized():
    """Model code nobody here wrote: big_vision's ViT (`scan=True`: its encoder blocks in
    an `nn.scan`), the blocks int8 under an int8 policy, the rest `mixed_bfloat16`."""
    from flax_examples import big_vision_vit as vit

    model = vit.Model(10, variant="mu/8", depth=2, scan=True)
    x = jax.random.normal(jax.random.key(1), (2, 16, 16, 3))
    variables = model.init(jax.random.key(0), x)
    policy_map = jp.DTypePolicyMap(
        "mixed_bfloat16", {r"Transformer/encoderblock/.*": "int8_from_mixed_bfloat16"}
    )
    q = jp.linen.quantize(model, policy_map, variables, x)
    fn = jp.linen.apply(model, policy_map, module_dtype="override")
    compiled, placed = jp.compile_for_serving(fn, q, x)
    got, want = compiled(placed, x)[0], jax.jit(fn)(q, x)[0]
    assert got.shape == (2, 10)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_an_nnx_model_served_from_its_state():
    """NNX: the served function takes the model's state (`nnx.split`), merges it and runs
    the model under the policy; the int8 kernels reach the int8 x int8 matmul."""
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.up = nnx.Linear(32, 64, rngs=rngs)
            self.down = nnx.Linear(64, 32, rngs=rngs)

        def __call__(self, x):
            return self.down(nnx.gelu(self.up(x)))

    model = jp.nnx.quantize(MLP(nnx.Rngs(0)), "int8_from_float32")
    graphdef, state = nnx.split(model)
    assert isinstance(state["up"]["kernel"].get_value(), jp.QuantizedArray)

    def serve(state, x):
        return jp.nnx.apply(nnx.merge(graphdef, state), "int8_from_mixed_bfloat16")(x)

    x = jax.random.normal(jax.random.key(1), (128, 32)).astype(jnp.bfloat16)
    compiled, placed = jp.compile_for_serving(serve, state, x)
    assert jax.tree.structure(placed) == jax.tree.structure(state)
    got, want = compiled(placed, x), jax.jit(serve)(state, x)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


class _NnxStack(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(32, 64, rngs=rngs)
        self.down = nnx.Linear(64, 32, use_bias=False, rngs=rngs)

    def __call__(self, x):
        return self.down(nnx.gelu(self.up(x)))


def _linen_serving(policy, x):
    model = Stack()
    variables = jp.linen.quantize(model, policy, model.init(jax.random.key(0), x), x)
    return jp.linen.apply(model, policy), variables


def _nnx_serving(policy, x):
    graphdef, state = nnx.split(jp.nnx.quantize(_NnxStack(nnx.Rngs(0)), policy))

    def serve(state, x):
        return jp.nnx.apply(nnx.merge(graphdef, state), policy)(x)

    return serve, state


@pytest.mark.parametrize("devices", [1, 8])
@pytest.mark.parametrize("glue", [_linen_serving, _nnx_serving], ids=["linen", "nnx"])
@pytest.mark.parametrize("mode", ["int8", "int4", "int4/128", "int4/16"])
def test_int8_and_int4_weights_serve_under_a_mesh(mode, glue, devices):
    """Under a mesh every array is committed, and an ahead-of-time compiled program checks
    committed arguments' layouts: int4 weights that jax 0.10's CPU client keeps unpacked
    were refused at the call (#47). They run, equal to ``jit``, on one device and on eight."""
    mesh = jax.make_mesh((devices,), ("data",))
    policy = f"{mode}_from_mixed_bfloat16"
    with jax.set_mesh(mesh):
        x = jax.device_put(
            jax.random.normal(jax.random.key(1), (16, 32)).astype(jnp.bfloat16),
            NamedSharding(mesh, P("data")),
        )
        serve, variables = glue(policy, x)
        variables = jax.device_put(variables, NamedSharding(mesh, P()))
        compiled, placed = jp.compile_for_serving(serve, variables, x)
        got = compiled(placed, x)
        want = jax.jit(serve)(variables, x)
        again = compiled(placed, x)  # the second call (a cached dispatch) too
    assert got.dtype == jnp.bfloat16 and got.shape == (16, 32)
    assert got.sharding.mesh.shape == {"data": devices}
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    np.testing.assert_array_equal(np.asarray(again, np.float32), np.asarray(want, np.float32))
    quantized = [
        leaf
        for leaf in jax.tree.leaves(placed, is_leaf=lambda a: isinstance(a, jp.QuantizedArray))
        if isinstance(leaf, jp.QuantizedArray)
    ]
    assert len(quantized) == 2 and {q.values.dtype for q in quantized} == {jnp.dtype(mode[:4])}
    for a, fmt in zip(
        jax.tree.leaves(placed), jax.tree.leaves(compiled.input_formats[0][0]), strict=True
    ):
        assert a.sharding.is_equivalent_to(fmt.sharding, a.ndim)  # sharded as compiled
