"""The casting rule: which leaves `cast_to_*` casts, and what it costs under `jit`."""

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jmp_policy as jp

F16, BF16, F32, F64 = (np.dtype(d) for d in ("float16", ml_dtypes.bfloat16, "float32", "float64"))
E4M3, E5M2 = np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2)
FLOAT_DTYPES = [F16, BF16, F32]
NUMPYS = [np, jnp]

# (method, attribute with the target dtype)
CASTS = [
    ("cast_to_compute", "compute_dtype"),
    ("cast_to_variable", "variable_dtype"),
    ("cast_to_param", "param_dtype"),
    ("cast_to_output", "output_dtype"),
]
# Each cast goes to a different dtype, so a mix-up between them shows.
POLICY = jp.get_policy("p=f16,c=bf16,o=f32")


@pytest.fixture(autouse=True)
def _strict_promotion():
    # Any silent upcast in the core is an error here.
    with jax.numpy_dtype_promotion("strict"):
        yield


@pytest.mark.parametrize(("method", "attribute"), CASTS)
@pytest.mark.parametrize("source", [*FLOAT_DTYPES, F64], ids=str)
@pytest.mark.parametrize("np_", NUMPYS, ids=["numpy", "jax"])
def test_cast_casts_floating_arrays_to_target(method, attribute, source, np_):
    target = getattr(POLICY, attribute)
    # float64 JAX arrays exist only with x64 enabled.
    with jax.enable_x64(np_ is jnp and source == F64):
        x = np_.arange(6, dtype=source).reshape(2, 3)
        assert x.dtype == source
        out = getattr(POLICY, method)({"x": x, "nested": [x, (x,)]})
    for leaf in (out["x"], out["nested"][0], out["nested"][1][0]):
        assert leaf.dtype == target
        if np_ is np:
            assert type(leaf) is np.ndarray
        else:
            assert isinstance(leaf, jax.Array)
        np.testing.assert_array_equal(np.asarray(leaf, np.float32), np.arange(6.0).reshape(2, 3))


@pytest.mark.parametrize(("method", "attribute"), CASTS)
def test_cast_leaves_non_floating_leaves_untouched(method, attribute):
    obj = object()
    tree = {
        "int": jnp.arange(3, dtype=jnp.int32),
        "np_int": np.arange(3, dtype=np.int64),
        "uint8": jnp.ones(2, jnp.uint8),
        "bool": jnp.array([True, False]),
        "np_bool": np.array([True]),
        "complex": jnp.ones(2, jnp.complex64),
        "np_complex": np.ones(2, np.complex128),
        "py_float": 1.5,
        "py_int": 3,
        "py_bool": True,
        "py_complex": 1j,
        "np_scalar": np.float32(2.0),
        "string": "text",
        "object": obj,
        "none": None,
    }
    out = getattr(POLICY, method)(tree)
    assert out.keys() == tree.keys()
    for key, value in tree.items():
        assert out[key] is value, key


@pytest.mark.parametrize(("method", "attribute"), CASTS)
@pytest.mark.parametrize("np_", NUMPYS, ids=["numpy", "jax"])
def test_leaf_already_in_target_dtype_is_same_object(method, attribute, np_):
    target = getattr(POLICY, attribute)
    x = np_.ones((2, 2), dtype=target)
    assert getattr(POLICY, method)(x) is x
    assert getattr(POLICY, method)({"x": x})["x"] is x


def test_numpy_arrays_stay_numpy():
    tree = {
        "a": np.ones(3, np.float32),
        "b": np.ones(3, np.float64),
        "c": np.ones(3, ml_dtypes.bfloat16),
    }
    out = jp.DTypePolicy("float16").cast_to_compute(tree)
    for leaf in out.values():
        assert type(leaf) is np.ndarray
        assert leaf.dtype == F16


@pytest.mark.parametrize("np_", NUMPYS, ids=["numpy", "jax"])
@pytest.mark.parametrize("source", [E4M3, E5M2], ids=str)
def test_float8_leaves_are_floating_and_cast(np_, source):
    x = np_.asarray(np.array([1.0, 2.0, -4.0], np.float32).astype(source))
    out = jp.DTypePolicy("float32").cast_to_compute({"x": x})["x"]
    assert out.dtype == F32
    np.testing.assert_array_equal(np.asarray(out), [1.0, 2.0, -4.0])
    to_f8 = jp.get_policy(f"p=f32,c={source.name}").cast_to_compute(np_.ones(2, np_.float32))
    assert to_f8.dtype == source


def test_cast_keeps_tree_structure_and_custom_nodes():
    from typing import NamedTuple

    class Pair(NamedTuple):
        a: object
        b: object

    tree = {"p": Pair(jnp.ones(2), None), "l": [jnp.ones(1), {"z": np.zeros(1)}], "t": ()}
    out = jp.DTypePolicy("bfloat16").cast_to_compute(tree)
    assert jax.tree.structure(out) == jax.tree.structure(tree)
    assert type(out["p"]) is Pair
    assert out["p"].a.dtype == BF16
    assert out["p"].b is None
    assert out["l"][1]["z"].dtype == BF16


@pytest.mark.parametrize(("method", "attribute"), CASTS)
@pytest.mark.parametrize("source", FLOAT_DTYPES, ids=str)
def test_cast_with_and_without_jit(maybe_jit, method, attribute, source):
    target = getattr(POLICY, attribute)
    tree = {
        "w": jnp.full((2, 3), 1.5, source),
        "step": jnp.array(7, jnp.int32),
        "mask": jnp.array([True, False]),
    }
    out = maybe_jit(getattr(POLICY, method))(tree)
    assert out["w"].dtype == target
    assert out["step"].dtype == jnp.int32
    assert out["mask"].dtype == jnp.bool_
    np.testing.assert_array_equal(np.asarray(out["w"], np.float32), np.full((2, 3), 1.5))
    assert int(out["step"]) == 7


@pytest.mark.parametrize(("method", "attribute"), CASTS)
def test_cast_preserves_sharding(maybe_jit, method, attribute):
    mesh = jax.make_mesh((8,), ("data",))
    assert jax.device_count() == 8
    sharding = NamedSharding(mesh, P("data"))
    x = jax.device_put(jnp.arange(32, dtype=jnp.float32).reshape(16, 2), sharding)
    policy = jp.get_policy("p=bf16,c=bf16,o=f16")
    out = maybe_jit(getattr(policy, method))({"x": x})["x"]
    assert out.dtype == getattr(policy, attribute)
    assert out.sharding.is_equivalent_to(x.sharding, x.ndim)
    assert [s.data.shape for s in out.addressable_shards] == [(2, 2)] * 8
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(x))


@pytest.mark.parametrize("stored", [F32, F16, BF16], ids=str)
def test_gradient_through_cast_comes_back_in_stored_dtype(maybe_jit, stored):
    policy = jp.get_policy("p=f32,c=bf16,o=f32")
    params = {"w": jnp.arange(4, dtype=stored), "n": jnp.array(2, jnp.int32)}

    def loss(p):
        compute = policy.cast_to_compute(p)
        assert compute["w"].dtype == BF16
        out = policy.cast_to_output(jnp.sum(compute["w"] * compute["w"]))
        return out

    grads = maybe_jit(jax.grad(loss, allow_int=True))(params)
    assert grads["w"].dtype == stored
    np.testing.assert_allclose(np.asarray(grads["w"], np.float32), [0.0, 2.0, 4.0, 6.0])


def _convert_ops(text):
    return sorted(re.findall(r"stablehlo\.convert .*", text))


@pytest.mark.parametrize(("method", "attribute"), CASTS)
def test_jitted_cast_is_same_code_as_hand_written_astype(method, attribute):
    target = getattr(POLICY, attribute)
    tree = {
        "a": jnp.ones((3, 4), jnp.float32),
        "b": jnp.ones((2,), jnp.float16),
        "c": jnp.ones((5,), jnp.bfloat16),
        "i": jnp.ones((3,), jnp.int32),
        "m": jnp.ones((3,), jnp.bool_),
        "z": [jnp.zeros((2, 2), jnp.float32), None],
    }

    def by_hand(t):
        return jax.tree.map(
            lambda x: x.astype(target) if jnp.issubdtype(x.dtype, jnp.floating) else x, t
        )

    ours = jax.jit(getattr(POLICY, method)).lower(tree).as_text()
    reference = jax.jit(by_hand).lower(tree).as_text()
    assert _convert_ops(ours) == _convert_ops(reference)
    expected = sum(
        1
        for leaf in jax.tree.leaves(tree)
        if jnp.issubdtype(leaf.dtype, jnp.floating) and leaf.dtype != target
    )
    assert len(_convert_ops(ours)) == expected
    # Beyond the module's name the two programs are identical.
    assert ours.split("\n", 1)[1] == reference.split("\n", 1)[1]


def test_cast_of_empty_and_leafless_trees():
    policy = jp.DTypePolicy("bfloat16")
    assert policy.cast_to_compute({}) == {}
    assert policy.cast_to_compute([]) == []
    assert policy.cast_to_compute(None) is None


def test_weak_typed_array_in_target_dtype_is_same_object():
    x = jnp.asarray(1.0)  # weakly typed float32
    assert jp.DTypePolicy("float32").cast_to_compute(x) is x
    y = jp.DTypePolicy("bfloat16").cast_to_compute(x)
    assert y.dtype == BF16


def test_cast_inside_strict_promotion_scope_raises_nothing():
    policy = jp.DTypePolicy("mixed_bfloat16")

    @jax.jit
    def f(params, x):
        p = policy.cast_to_compute(params)
        x = policy.cast_to_compute(x)
        return policy.cast_to_output(x @ p["w"])

    out = f({"w": jnp.ones((3, 2))}, np.ones((4, 3), np.float32))
    assert out.dtype == BF16
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.full((4, 2), 3.0))


def test_jmp_half_and_full_helpers(maybe_jit):
    assert jp.half_dtype() == jnp.bfloat16  # never device-dependent here
    tree = {"w": jnp.ones(2), "n": np.ones(2, np.float32), "i": jnp.arange(2)}
    half = maybe_jit(jp.cast_to_half)(tree)
    assert half["w"].dtype == jnp.bfloat16
    assert half["n"].dtype == jnp.bfloat16
    assert half["i"].dtype == jnp.int32
    full = maybe_jit(jp.cast_to_full)(half)
    assert full["w"].dtype == jnp.float32
    assert full["i"].dtype == jnp.int32
    np.testing.assert_array_equal(full["w"], np.ones(2))
