"""Quantization in the core: QuantizedArray, policy.quantize / map.quantize, the int8 matmul."""

import pickle
import warnings

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax_examples.measure import dot_kinds as _dots
from flax_examples.measure import equations

import jmp_policy as jp
from jmp_policy._src.quantization import int4_layout, quantized_matmul, symmetric_grid
from jmp_policy._src.quantization import quantized_array as quantization

INT8 = jp.QuantizedDTypePolicy("int8", "mixed_bfloat16")


def _kernel(shape, seed=0, dtype=jnp.float32):
    """Standard normal values, drawn by NumPy: `jax.random.normal` compiles once per shape
    and dtype, seconds each on CPU, for values that nothing here depends on."""
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32), dtype)


# -- round trips and bytes ----------------------------------------------------------------


@pytest.mark.parametrize("shape", [(64, 16), (128, 4, 8), (300, 33)])
def test_int8_round_trip_error_is_at_most_half_a_step_per_column(shape, maybe_jit):
    x = _kernel(shape)
    q = maybe_jit(lambda x: jp.QuantizedDTypePolicy("int8", "float32").quantize(x, stacked_axes=0))(
        x
    )
    assert q.values.dtype == jnp.int8
    assert q.scale.dtype == jnp.float32 and q.scale.shape == (shape[-1],)
    step = np.max(np.abs(np.asarray(x)).reshape(-1, shape[-1]), axis=0) / 127
    np.testing.assert_allclose(np.asarray(q.scale), step, rtol=1e-6)
    err = np.abs(np.asarray(q.dequantize()) - np.asarray(x)).reshape(-1, shape[-1]).max(axis=0)
    assert np.all(err <= step / 2 * (1 + 1e-5))
    assert np.all(err > 0)  # it did round something


@pytest.mark.parametrize("block", [32, 128, -1])
def test_int4_round_trip_error_is_bounded_per_block(block, maybe_jit):
    x = _kernel((256, 24))
    policy = jp.Int4DTypePolicy("int4", "float32", block_size=block)
    q = maybe_jit(policy.quantize)(x)
    rows = 256 if block == -1 else block
    assert q.values.dtype == jnp.int4 and q.values.shape == (256, 24)  # XLA packs int4
    assert q.scale.shape == (256 // rows, 24)
    blocks = np.asarray(x).reshape(256 // rows, rows, 24)
    step = np.abs(blocks).max(axis=1) / 7
    err = np.abs(np.asarray(q.dequantize()) - np.asarray(x)).reshape(256 // rows, rows, 24)
    assert np.all(err.max(axis=1) <= step / 2 * (1 + 1e-5))
    rel = np.linalg.norm(np.asarray(q.dequantize()) - np.asarray(x)) / np.linalg.norm(x)
    assert rel < 0.15  # abs-max over Gaussian rows: about 0.12 per channel


def test_int4_values_are_exact_and_the_old_packed_layout_still_loads():
    # Every int4 value -7..7, an odd number of rows. On the narrow grid (amax / 7), where
    # they are exact: the default full-range grid (#49) scales by amax / 7.5.
    x = jnp.asarray(np.arange(-7, 8, dtype=np.float32).reshape(15, 1) * np.ones((1, 3)))
    q = quantization.quantize(x, "int4", -1, grid=symmetric_grid.INT4_NARROW)
    assert q.values.shape == (15, 3) and q.values.dtype == jnp.int4 and not q.packed
    np.testing.assert_array_equal(np.asarray(q.dequantize()), np.asarray(x))
    # A checkpoint of the earlier layout: two values per uint8 byte along axis 0.
    old = quantization.QuantizedArray(
        int4_layout.pack_int4(q.values), q.scale, "int4", -1, (15, 3), np.dtype("float32")
    )
    assert old.values.shape == (8, 3) and old.values.dtype == jnp.uint8 and old.packed
    np.testing.assert_array_equal(np.asarray(old.dequantize()), np.asarray(x))
    assert old.nbytes == 8 * 3 + q.scale.nbytes
    # The default grid's -8 codes pack and load as well.
    full = quantization.quantize(x, "int4", -1)
    assert int(jnp.min(full.values.astype(jnp.int32))) == -8
    old = quantization.QuantizedArray(
        int4_layout.pack_int4(full.values), full.scale, "int4", -1, (15, 3), np.dtype("float32")
    )
    np.testing.assert_array_equal(np.asarray(old.dequantize()), np.asarray(full.dequantize()))


def test_int4_block_that_does_not_divide_the_axis_leaves_a_shorter_last_block():
    x = _kernel((100, 8))
    q = jp.get("int4/64_from_float32").quantize(x)
    assert q.scale.shape == (2, 8)
    last = np.abs(np.asarray(x)[64:]).max(axis=0) / 7.5  # the full-range grid (#49; was / 7)
    np.testing.assert_allclose(np.asarray(q.scale)[1], last, rtol=1e-6)
    assert q.dequantize().shape == (100, 8)
    err = np.abs(np.asarray(q.dequantize()) - np.asarray(x))[64:].max(axis=0)
    assert np.all(err <= last / 2 * (1 + 1e-5))


@pytest.mark.parametrize(
    ("policy", "bound"),
    [("int8_from_float32", 0.27), ("int4/128_from_float32", 0.16), ("int4/-1_from_float32", 0.16)],
)
def test_stored_bytes_of_a_kernel_against_float32(policy, bound):
    x = _kernel((512, 256))
    q = jp.get(policy).quantize(x)
    values_bytes = q.values.size // 2 if q.values.dtype == jnp.int4 else q.values.nbytes
    assert q.nbytes == values_bytes + q.scale.nbytes
    assert q.nbytes / x.nbytes <= bound
    assert q.nbytes / x.nbytes > bound - 0.05  # not an accounting trick


def test_all_zero_kernel_quantizes_to_zero_with_unit_scale():
    q = quantization.quantize(jnp.zeros((4, 3)), "int8")
    np.testing.assert_array_equal(np.asarray(q.scale), np.ones(3))
    np.testing.assert_array_equal(np.asarray(q.dequantize()), np.zeros((4, 3)))


# -- the pytree ---------------------------------------------------------------------------


def test_quantized_array_round_trips_through_tree_map_and_jit():
    q = jp.get("int4/32_from_bfloat16").quantize(_kernel((64, 8), dtype=jnp.bfloat16))
    same = jax.tree.map(lambda x: x, q)
    through_jit = jax.jit(lambda q: q)(q)
    for other in (same, through_jit):
        assert isinstance(other, jp.QuantizedArray)
        assert (other.mode, other.block_size, other.shape) == ("int4", 32, (64, 8))
        assert other.original_dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(other.values), np.asarray(q.values))
    assert q.dequantize().dtype == jnp.bfloat16
    assert len(jax.tree.leaves(q)) == 2  # values and scale are the children
    assert pickle.loads(pickle.dumps(q)).shape == (64, 8)


def test_quantized_array_given_to_jnp_says_to_dequantize():
    q = INT8.quantize(_kernel((8, 4)))
    with pytest.raises(TypeError, match=r"not an array: dequantize it first"):
        jnp.dot(jnp.ones((2, 8)), q)
    with pytest.raises(TypeError, match=r"not an array"):
        np.asarray(q)


# -- policy.quantize and map.quantize -----------------------------------------------------


def test_policy_quantize_keeps_rank_one_and_integer_leaves_float(maybe_jit):
    tree = {"kernel": _kernel((64, 8)), "bias": jnp.ones(8), "step": jnp.ones((2, 2), jnp.int32)}
    q = maybe_jit(INT8.quantize)(tree)
    assert isinstance(q["kernel"], jp.QuantizedArray)
    assert q["bias"].dtype == jnp.float32 and q["step"].dtype == jnp.int32
    assert INT8.quantize(q)["kernel"] is q["kernel"]  # already quantized: kept


def test_float_and_float8_policies_refuse_to_quantize():
    with pytest.raises(ValueError, match=r"Policy 'float32' does not quantize"):
        jp.DTypePolicy("float32").quantize({"k": jnp.ones((2, 2))})
    with pytest.raises(ValueError, match=r"float8 scales inputs and kernels at compute time"):
        jp.get("float8_from_mixed_bfloat16").quantize({"k": jnp.ones((2, 2))})


def _params():
    return {
        "embed": {"embedding": _kernel((32, 16), 1)},
        "mlp": {"up": {"kernel": _kernel((16, 64), 2), "bias": jnp.zeros(64)}},
        "head": {"kernel": _kernel((64, 8), 3)},
    }


def test_map_quantize_quantizes_only_kernels_under_int_policies(maybe_jit):
    m = jp.DTypePolicyMap(
        "mixed_bfloat16", {"mlp/.*": "int8_from_mixed_bfloat16", "head": "int4/32_from_float32"}
    )
    q = maybe_jit(m.quantize)(_params())
    assert isinstance(q["mlp"]["up"]["kernel"], jp.QuantizedArray)
    assert q["mlp"]["up"]["kernel"].mode == "int8"
    assert q["head"]["kernel"].mode == "int4" and q["head"]["kernel"].block_size == 32
    assert q["mlp"]["up"]["bias"].dtype == jnp.float32
    assert q["embed"]["embedding"].dtype == jnp.float32


def test_every_tree_walk_sees_a_quantized_array_at_its_kernel_path():
    m = jp.DTypePolicyMap("float32", {"mlp/up": "int8_from_mixed_bfloat16"})
    q = m.quantize(_params())
    policies = m.policy_tree(q)
    assert policies["mlp"]["up"]["kernel"] == jp.get("int8_from_mixed_bfloat16")
    compute = m.cast_to_compute(q)
    assert compute["mlp"]["up"]["kernel"].dtype == jnp.bfloat16
    assert compute["mlp"]["up"]["kernel"].shape == (16, 64)
    assert compute["head"]["kernel"].dtype == jnp.float32
    kept = m.cast_to_variable(q)
    assert kept["mlp"]["up"]["kernel"] is q["mlp"]["up"]["kernel"]
    assert jp.DTypePolicy("bfloat16").cast_to_output(q)["mlp"]["up"]["kernel"].scale.dtype == (
        jnp.float32
    )
    assert m.unused_keys(q) == []


def test_policy_cast_to_compute_dequantizes_to_the_compute_dtype(maybe_jit):
    q = INT8.quantize({"kernel": _kernel((64, 8))})
    out = maybe_jit(INT8.cast_to_compute)(q)
    assert out["kernel"].dtype == jnp.bfloat16
    ref = np.asarray(q["kernel"].dequantize(jnp.float32).astype(jnp.bfloat16), np.float32)
    np.testing.assert_array_equal(np.asarray(out["kernel"], np.float32), ref)


def test_explain_shows_stored_bytes_and_the_saving():
    m = jp.DTypePolicyMap("float32", {"mlp/up": "int8_from_float32"})
    table = m.explain(m.quantize(_params()))
    row = next(line for line in table.splitlines() if line.startswith("mlp/up"))
    # 16*64 int8 values + 64 float32 scales + a float32 bias of 64 (1536 bytes), against
    # 16*64*4 + 256 (4352 bytes) in compute.
    assert row.split()[-2:] == ["1.5K", "4.2K"]
    assert "i8" in row


def test_quantize_with_a_map_of_no_quantized_policy_raises():
    m = jp.DTypePolicyMap("mixed_bfloat16", {"head": "float32"})
    with pytest.raises(ValueError, match=r"holds no int8 or int4 policy.*'int8_from_mixed_bf"):
        m.quantize(_params())


def test_quantize_that_matches_no_kernel_warns_and_returns_the_tree():
    m = jp.DTypePolicyMap("float32", {"decoder/.*": "int8_from_float32"})
    params = _params()
    with pytest.warns(UserWarning, match=r"no floating leaf of rank >= 2.*unchanged"):
        q = m.quantize(params)
    assert q == params or jax.tree.all(jax.tree.map(lambda a, b: a is b, q, params))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jp.DTypePolicyMap("float32", {"head": "int8_from_float32"}).quantize(params)


def test_quantize_rejects_bad_arguments_of_the_core_function():
    with pytest.raises(ValueError, match=r"rank >= 2.*\(8,\)"):
        quantization.quantize(jnp.ones(8), "int8")
    with pytest.raises(TypeError, match=r"Only floating arrays.*int32"):
        quantization.quantize(jnp.ones((2, 2), jnp.int32), "int8")
    with pytest.raises(ValueError, match=r"`block_size` must be -1.*block_size=0"):
        quantization.quantize(jnp.ones((2, 2)), "int4", 0)
    with pytest.raises(ValueError, match=r"`mode` must be one of.*'int2'"):
        quantization.quantize(jnp.ones((2, 2)), "int2")


# -- stacked layers (issue 21 item 3) -----------------------------------------------------


def _stack(depth=3, shape=(64, 16), seed=0):
    """A [depth, in, out] stack whose layers' norms differ by 10x each."""
    norms = 10.0 ** jnp.arange(depth, dtype=jnp.float32)
    return _kernel((depth, *shape), seed) * norms.reshape(-1, *([1] * len(shape)))


@pytest.mark.parametrize(("mode", "block"), [("int8", None), ("int4", 16), ("int4", -1)])
def test_stacked_kernel_is_quantized_per_layer_as_each_layer_alone(mode, block, maybe_jit):
    x = _stack()
    q = maybe_jit(lambda x: quantization.quantize(x, mode, block, 1))(x)
    assert q.stacked == 1 and q.shape == x.shape
    blocks = () if mode == "int8" else (1 if block == -1 else 64 // block,)
    assert q.scale.shape == (3, *blocks, 16)
    real = maybe_jit(lambda q: q.dequantize())(q)
    for i in range(3):
        alone = quantization.quantize(x[i], mode, block)
        np.testing.assert_array_equal(q.scale[i], alone.scale)
        np.testing.assert_array_equal(q.values[i], alone.values)
        np.testing.assert_array_equal(real[i], alone.dequantize())


def test_int4_blocks_of_a_stack_are_cut_along_each_layers_input_axis():
    # Two layers of 8 rows, blocks of 4: each layer has its own 2 blocks. A block cut along
    # the layer axis (the unstacked layout) would mix layer 0's rows with layer 1's.
    x = jnp.concatenate([jnp.full((1, 8, 2), 0.01), jnp.full((1, 8, 2), 100.0)])
    x = x.at[0, :4].set(0.001)
    # On the narrow grid (amax / 7), where a constant block is exact; the default full-range
    # grid (#49) clips a block's amax to 7 steps of amax / 7.5 (checked after).
    q = quantization.quantize(x, "int4", 4, 1, grid=symmetric_grid.INT4_NARROW)
    assert q.scale.shape == (2, 2, 2)
    np.testing.assert_allclose(q.scale[:, :, 0], [[0.001 / 7, 0.01 / 7], [100 / 7, 100 / 7]])
    np.testing.assert_allclose(q.dequantize(), x, rtol=1e-6)  # every block is constant
    full = quantization.quantize(x, "int4", 4, 1)
    np.testing.assert_allclose(
        full.scale[:, :, 0], [[0.001 / 7.5, 0.01 / 7.5], [100 / 7.5, 100 / 7.5]], rtol=2e-7
    )  # float32's rounding of 0.001 / 7.5
    np.testing.assert_allclose(full.dequantize(), x * 7 / 7.5, rtol=1e-6)
    flat = quantization.quantize(x, "int4", 4)  # the shared layout: blocks of layers
    assert flat.scale.shape == (1, 2)


def test_stacked_layers_of_different_norms_keep_their_precision():
    x = _stack()
    for mode, block in (("int8", None), ("int4", 16)):
        shared = quantization.quantize(x, mode, block).dequantize()
        per_layer = quantization.quantize(x, mode, block, 1).dequantize()
        err_shared = float(jnp.linalg.norm(shared[0] - x[0]) / jnp.linalg.norm(x[0]))
        err_layer = float(jnp.linalg.norm(per_layer[0] - x[0]) / jnp.linalg.norm(x[0]))
        assert err_layer * 5 < err_shared, (mode, err_layer, err_shared)


def test_stacked_axes_of_policy_and_map_quantize():
    params = {
        "layers": {"kernel": _stack(), "bias": jnp.ones((3, 16))},
        "attn": {"kernel": _kernel((32, 4, 8))},  # DenseGeneral [in, heads, dim]: not stacked
    }
    policy = jp.get("int4/16_from_float32")
    q = policy.quantize(params, stacked_axes={"layers/.*": 1})
    assert q["layers"]["kernel"].stacked == 1 and q["layers"]["kernel"].scale.shape == (3, 4, 16)
    assert q["layers"]["bias"] is params["layers"]["bias"]  # a stacked bias stays float
    assert q["attn"]["kernel"].stacked == 0 and q["attn"]["kernel"].scale.shape == (2, 8)
    with pytest.warns(UserWarning, match=r"the kernel 'attn/kernel' .*\(and 1 more"):
        assert policy.quantize(params)["layers"]["kernel"].stacked == 0  # the default
    every = policy.quantize(params, stacked_axes=1)
    assert every["attn"]["kernel"].stacked == 1 and every["attn"]["kernel"].scale.shape == (
        32,
        1,
        8,
    )
    m = jp.DTypePolicyMap("float32", {"layers": "int8_from_float32"})
    qm = m.quantize(params, stacked_axes={"layers/kernel": 1})
    assert qm["layers"]["kernel"].scale.shape == (3, 16)
    # A path the mapping does not name has no stacked axes, yet a bias of rank 2 stays
    # float: it is added to a matmul's output, never read by one (#47).
    assert qm["layers"]["bias"] is params["layers"]["bias"]
    assert m.quantize(params, stacked_axes={"layers/.*": 1})["layers"]["bias"].dtype == jnp.float32
    np.testing.assert_array_equal(
        m.cast_to_compute(qm)["layers"]["kernel"][2],
        quantization.quantize(params["layers"]["kernel"][2], "int8").dequantize(),
    )


def test_stacked_axes_bad_values_are_errors_naming_the_argument():
    policy = jp.get("int8_from_float32")
    for bad, error in (
        (-1, ValueError), (True, TypeError), ("1", TypeError), ({"a": -2}, ValueError),
        ({"a": 1.5}, ValueError), ({3: 1}, TypeError), ({"(": 1}, ValueError),
    ):  # fmt: skip
        with pytest.raises(error, match=r"`stacked_axes`") as info:
            policy.quantize({"a": jnp.ones((2, 2, 2))}, stacked_axes=bad)
        assert repr(bad) in str(info.value) or "'('" in str(info.value)
    with pytest.raises(ValueError, match=r"rank >= 3.*\(2, 2\).*stacked=1"):
        quantization.quantize(jnp.ones((2, 2)), "int8", None, 1)
    with pytest.raises(ValueError, match=r"`stacked` must be a non-negative int.*stacked=-1"):
        quantization.quantize(jnp.ones((2, 2)), "int8", None, -1)


def test_stacked_quantized_array_checks_its_scale_and_keeps_old_fields_working():
    q = quantization.quantize(_stack(), "int8", None, 1)
    with pytest.raises(ValueError, match=r"`scale` must have shape \(3, 16\)"):
        jp.QuantizedArray(q.values, q.scale[0], "int8", None, q.shape, np.dtype("float32"), 1)
    with pytest.raises(TypeError, match=r"`stacked` must be.*stacked='1' \(of type str\)"):
        jp.QuantizedArray(q.values, q.scale, "int8", None, q.shape, np.dtype("float32"), "1")
    # Six positional fields (the earlier layout) still build an unstacked kernel.
    flat = jp.QuantizedArray(q.values[0], q.scale[0], "int8", None, (64, 16), np.dtype("float32"))
    assert flat.stacked == 0
    again = pickle.loads(pickle.dumps(q))
    assert again.stacked == 1 and again.scale.shape == (3, 16)
    assert jax.tree.map(lambda a: a, q).stacked == 1
    assert "stacked=1" in repr(q) and "stacked" not in repr(flat)


# -- the int8 matmul ----------------------------------------------------------------------

_DN = (((1,), (0,)), ((), ()))


def test_int8_dot_general_is_close_to_the_float_matmul(maybe_jit):
    x, w = _kernel((32, 64), 1), _kernel((64, 16), 2)
    y = maybe_jit(lambda x, w: quantized_matmul.int8_dot_general(x, w, _DN))(x, w)
    ref = x @ w
    assert y.dtype == jnp.float32
    assert float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref)) < 0.02


def test_int8_dot_general_handles_batch_and_several_contracting_axes():
    a, b = _kernel((3, 5, 4, 6), 1), _kernel((3, 6, 4, 7), 2)
    dn = (((2, 3), (2, 1)), ((0,), (0,)))
    y = quantized_matmul.int8_dot_general(a, b, dn)
    ref = jax.lax.dot_general(a, b, dn)
    assert y.shape == ref.shape == (3, 5, 7)
    assert float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref)) < 0.02


def test_int8_dot_general_multiplies_the_int8_grid_exactly_in_the_compute_dtype():
    """The operands on the int8 grid, as integers in bfloat16 (exact), one GEMM with
    float32 accumulation: equal to the int32 product times the scales."""
    x, w = _kernel((8, 16), dtype=jnp.bfloat16), _kernel((16, 4), dtype=jnp.bfloat16)
    jaxpr = jax.make_jaxpr(lambda x, w: quantized_matmul.int8_dot_general(x, w, _DN))(x, w)
    (dot,) = list(equations(jaxpr.jaxpr, "dot_general"))
    assert [str(v.aval.dtype) for v in dot.invars] == ["bfloat16", "bfloat16"]
    assert dot.params["preferred_element_type"] == jnp.float32
    assert "int8_matmul" in str(dot.source_info.name_stack)
    assert jaxpr.out_avals[0].dtype == jnp.bfloat16
    xq, xs = quantized_matmul._quantize_operand(x, (1,))
    wq, ws = quantized_matmul._quantize_operand(w, (0,))
    acc = jax.lax.dot_general(xq, wq, _DN, preferred_element_type=jnp.int32)
    want = (acc.astype(jnp.float32) * xs * ws).astype(jnp.bfloat16)
    np.testing.assert_array_equal(
        np.asarray(quantized_matmul.int8_dot_general(x, w, _DN), np.float32),
        np.asarray(want, np.float32),
    )


def test_int8_dot_general_gradient_is_straight_through(maybe_jit):
    x, w = _kernel((8, 16), 1), _kernel((16, 4), 2)
    ct = _kernel((8, 4), 3)

    def loss(dot):
        return lambda x, w: jnp.sum(dot(x, w) * ct)

    gx, gw = maybe_jit(
        jax.grad(loss(lambda x, w: quantized_matmul.int8_dot_general(x, w, _DN)), (0, 1))
    )(x, w)
    rx, rw = jax.grad(loss(lambda x, w: x @ w), (0, 1))(x, w)
    np.testing.assert_allclose(np.asarray(gx), np.asarray(rx), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(gw), np.asarray(rw), rtol=1e-5, atol=1e-5)


def test_int8_dot_general_leaves_integer_matmuls_alone():
    a = jnp.ones((2, 3), jnp.int32)
    out = quantized_matmul.int8_dot_general(a, a.T, _DN)
    assert out.dtype == jnp.int32 and int(out[0, 0]) == 3


def int8_einsum(subscripts, *operands):
    """``jnp.einsum`` whose contractions run through ``int8_dot_general`` (JAX's own
    ``_dot_general`` route, the one the glue's einsum takes)."""
    return quantized_matmul.JNP_EINSUM(
        subscripts, *operands, _dot_general=quantized_matmul.int8_dot_general
    )


def test_int8_einsum_matches_einsum():
    x, w = _kernel((4, 8, 16), 1), _kernel((16, 2, 8), 2)
    y = int8_einsum("bti,ihd->bthd", x, w)
    ref = jnp.einsum("bti,ihd->bthd", x, w)
    assert float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref)) < 0.02
    jaxpr = jax.make_jaxpr(lambda x, w: int8_einsum("bti,ihd->bthd", x, w))(x, w)
    assert [d[1] for d in _dots(jaxpr.jaxpr)] == ["int32"]  # the int8 matmul's scope


def test_scales_follow_the_last_axis_and_int4_blocks_axis_0_at_any_rank():
    """The README's "Axes": int8 one scale per last-axis index; int4 blocks along axis 0,
    for an einsum kernel [2, K, D, H] the leading 2, not the contracted D."""
    w = _kernel((2, 3, 64, 16))
    q8 = quantization.quantize(w, "int8")
    assert q8.scale.shape == (16,)
    np.testing.assert_allclose(q8.scale, jnp.abs(w).max(axis=(0, 1, 2)) / 127, rtol=1e-6)
    q4 = quantization.quantize(w, "int4", block_size=1)
    assert q4.scale.shape == (2, 16)  # a block per index of axis 0
    # amax / 7.5: the full-range grid, int4's default since #49 (was / 7).
    np.testing.assert_allclose(q4.scale, jnp.abs(w).max(axis=(1, 2)) / 7.5, rtol=1e-6)
    # An Equinox-style [out, in] weight: one scale per input feature (its last axis).
    eqx_weight = _kernel((8, 32))
    assert quantization.quantize(eqx_weight, "int8").scale.shape == (32,)
