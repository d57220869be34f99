"""Quantized kernels of NNX layer stacks (layers made by ``nnx.vmap``, run by ``nnx.scan``,
through ``nnx.remat`` or by ``nnx.vmap``) reach each layer's matmul as its own slice of
the integer values and scales, with the matmul an unstacked layer runs."""

import warnings

import jax
import numpy as np
import pytest
from flax import nnx
from quantization.calibrate_reference import correlated_inputs
from quantization.loop_reads import assert_read_in_loop, integer_dots

import jmp_policy as jp
from jmp_policy._src.quantization import matmuls

DEPTH, WIDTH = 3, 32


class Stack(nnx.Module):
    """``DEPTH`` Linear layers made stacked, run by ``nnx.scan`` (optionally each through
    ``nnx.remat``) or, with ``scan=False``, by ``nnx.vmap`` on one input."""

    def __init__(self, rngs, scan=True, remat=False):
        @nnx.split_rngs(splits=DEPTH)
        @nnx.vmap
        def make(rngs):
            return nnx.Linear(WIDTH, WIDTH, rngs=rngs)

        self.layers = make(rngs)
        self.scan, self.remat = scan, remat

    def __call__(self, x):
        if not self.scan:
            return nnx.vmap(lambda layer, x: layer(x), in_axes=(0, None))(self.layers, x).mean(0)

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def body(x, layer):
            call = nnx.remat(lambda layer, x: layer(x)) if self.remat else type(layer).__call__
            return nnx.relu(call(layer, x))

        return body(x, self.layers)


class Unrolled(nnx.Module):
    """The stack's layers as separate layers, each with its own slice of the kernels."""

    def __init__(self, stack, scan=True):
        q = stack.layers.kernel.get_value()
        bias = stack.layers.bias.get_value()
        self.layers = nnx.List([nnx.Linear(WIDTH, WIDTH, rngs=nnx.Rngs(0)) for _ in range(DEPTH)])
        for i, layer in enumerate(self.layers):
            fields = (q.values[i], q.scale[i], q.mode, q.block_size, q.shape[1:], q.original_dtype)
            if hasattr(q, "input_scale"):  # AWQ's: the layer's input scale too
                layer.kernel.set_value(type(q)(*fields, 0, q.input_scale[i]))
            else:
                layer.kernel.set_value(jp.QuantizedArray(*fields))
            layer.bias.set_value(bias[i])
        self.scan = scan

    def __call__(self, x):
        if not self.scan:
            return sum(layer(x) for layer in self.layers) / DEPTH
        for layer in self.layers:
            x = nnx.relu(layer(x))
        return x


def _run(model, policy, jit):
    fn = lambda m, x: jp.nnx.apply(m, policy)(x)  # noqa: E731
    return nnx.jit(fn) if jit else fn


X = correlated_inputs(16)[:, :WIDTH]


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize(
    ("mode", "dtype", "form"),
    [
        ("int4", "int4", "weight-only, scale after"),
        ("int4/16", "int4", "int4 blocks"),
        ("int8", "int8", "weight-only, scale after"),
    ],
)
def test_each_scanned_layer_reads_its_slice_of_the_quantized_values(mode, dtype, form, jit):
    policy = f"{mode}_from_float32"
    q = jp.nnx.quantize(Stack(nnx.Rngs(0)), policy)
    kernel = q.layers.kernel.get_value()
    assert kernel.stacked == 1 and kernel.shape == (DEPTH, WIDTH, WIDTH)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing is dequantized ahead
        jaxpr = jax.make_jaxpr(lambda x: _run(q, policy, False)(q, x))(X).jaxpr
        assert_read_in_loop(jaxpr, kernel, dtype)
        out = _run(q, policy, jit)(q, X)
    ref = _run(None, policy, False)(Unrolled(q), X)
    np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-6 * float(np.abs(ref).max()))
    table = jp.nnx.explain(q, policy, X)
    assert f"layers  {mode} weights: {form}; per layer, in the stack's loop" in table
    # The model itself is left as it was: its kernel quantized, nothing added to it.
    after = q.layers.kernel.get_value()
    assert isinstance(after, jp.QuantizedArray) and after.stacked == 1
    np.testing.assert_array_equal(after.values, kernel.values)
    assert sorted(vars(q.layers)).count("kernel") == 1
    assert not [name for name in vars(q.layers) if "jmp_policy" in name]


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_a_calibrated_scanned_stack_under_remat_serves_on_its_quantized_values(method):
    policy = f"{method}/4/16_from_float32"
    model = Stack(nnx.Rngs(0), remat=True)
    q = jp.nnx.calibrate(model, policy, [X])
    kernel = q.layers.kernel.get_value()
    assert kernel.stacked == 1 and hasattr(kernel, "input_scale") == (method == "awq")
    jaxpr = jax.make_jaxpr(lambda x: _run(q, policy, False)(q, x))(X).jaxpr
    assert_read_in_loop(jaxpr, kernel, "int4")
    ref = _run(None, policy, False)(Unrolled(q), X)
    for jit in (False, True):
        out = _run(q, policy, jit)(q, X)
        np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-6 * float(np.abs(ref).max()))


def test_a_stack_run_by_vmap_reads_the_quantized_values_of_all_its_layers_at_once():
    policy = "int4_from_float32"
    q = jp.nnx.quantize(Stack(nnx.Rngs(0), scan=False), policy)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jaxpr = jax.make_jaxpr(lambda x: _run(q, policy, False)(q, x))(X).jaxpr
        out = _run(q, policy, True)(q, X)
    # No loop: the batched matmul reads the int4 values (no scaled float copy made).
    assert integer_dots(jaxpr) == [("int4", False)]
    ref = _run(None, policy, False)(Unrolled(q, scan=False), X)
    np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-6 * float(np.abs(ref).max()))
    assert "layers  int4 weights: weight-only, scale after; per layer" in (
        jp.nnx.explain(q, policy, X)
    )


def test_a_stack_quantized_as_one_kernel_is_dequantized_ahead_and_warns_once():
    matmuls._WARNED_AHEAD.clear()  # given once per process: as if this were the first
    model = Stack(nnx.Rngs(1))
    policy = "int8_from_float32"
    with pytest.warns(UserWarning, match="quantize: the kernel"):
        nnx.update(model, jp.get(policy).quantize(nnx.state(model, nnx.Param)))
    match = (
        r"The int8 kernel \(3, 32, 32\) of the stacked layer 'layers' is dequantized ahead "
        r"of its stack.*quantized as one kernel \(`stacked=0`\).*jp.nnx.quantize"
    )
    with pytest.warns(UserWarning, match=match):
        out = _run(model, policy, False)(model, X)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once
        np.testing.assert_allclose(_run(model, policy, True)(model, X), out, rtol=1e-6)
    assert "layers  int8 weights: dequantized ahead (a stack)" in jp.nnx.explain(model, policy, X)
