"""`quantize` on a plain tree warns once per call when a kernel of rank >= 3 might be a
layer stack and `stacked_axes=` was not given (#30); the Flax wrappers, which know the
stacked axes, and an explicit `stacked_axes=` do not warn."""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jmp_policy as jp

STACK = jnp.ones((4, 64, 32))
POLICY = jp.get("int8_from_float32")
MAP = jp.DTypePolicyMap("float32", {"blocks/.*": "int4/32_from_float32"})


def _quantize_warnings(fn, *args, **kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn(*args, **kwargs)
    return out, [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


@pytest.mark.parametrize("quantize", [POLICY.quantize, MAP.quantize], ids=["policy", "map"])
def test_a_rank_3_kernel_on_a_plain_tree_warns_once_naming_it_and_the_ways_out(quantize):
    tree = {"blocks": {"kernel": STACK, "bias": jnp.ones((4, 32))}}
    out, messages = _quantize_warnings(quantize, tree)
    assert out["blocks"]["kernel"].stacked == 0  # quantized as one kernel, as before
    assert messages == [
        "quantize: the kernel 'blocks/kernel' of shape (4, 64, 32) was quantized as one kernel "
        "(one scale per last-axis channel over all its other axes). If its first axis stacks "
        "layers (an `nn.scan`, `nnx.scan` or vmapped model's tree), the layers share their "
        "scales: pass `stacked_axes=` (such as {'blocks/kernel': 1}), or quantize the model "
        "with `jmp_policy.linen.quantize` / `jmp_policy.nnx.quantize`, which find the "
        "stacked axes. `stacked_axes=0` says there are none (a `DenseGeneral` or convolution "
        "kernel) and silences this warning."
    ]


@pytest.mark.parametrize("quantize", [POLICY.quantize, MAP.quantize], ids=["policy", "map"])
def test_several_rank_3_kernels_give_one_warning_per_call(quantize):
    tree = {"blocks": {"a": {"kernel": STACK}, "b": {"kernel": jnp.ones((2, 3, 8, 8))}}}
    for _ in range(2):  # once per call, not once per process
        _, messages = _quantize_warnings(quantize, tree)
        assert len(messages) == 1
        assert messages[0].startswith(
            "quantize: the kernel 'blocks/a/kernel' of shape (4, 64, 32) (and 1 more kernel(s) "
            "of rank >= 3) was quantized as one kernel"
        )


def test_it_warns_at_trace_time_under_jit():
    fn = jax.jit(lambda tree: POLICY.quantize(tree)["k"].dequantize())
    out, messages = _quantize_warnings(fn, {"k": STACK})
    np.testing.assert_allclose(np.asarray(out), 1.0, rtol=1e-2)
    assert len(messages) == 1 and "'k' of shape (4, 64, 32)" in messages[0]


@pytest.mark.parametrize("stacked_axes", [0, 1, {"blocks/.*": 1}, {"other": 1}, {}])
@pytest.mark.parametrize("quantize", [POLICY.quantize, MAP.quantize], ids=["policy", "map"])
def test_given_stacked_axes_silence_it(quantize, stacked_axes):
    _, messages = _quantize_warnings(
        quantize, {"blocks": {"kernel": STACK}}, stacked_axes=stacked_axes
    )
    assert messages == []


def test_rank_2_kernels_and_kernels_left_float_do_not_warn():
    _, messages = _quantize_warnings(POLICY.quantize, {"dense": {"kernel": jnp.ones((8, 4))}})
    assert messages == []
    tree = {"blocks": {"kernel": jnp.ones((8, 4))}, "attn": {"kernel": STACK}}  # attn: float32
    out, messages = _quantize_warnings(MAP.quantize, tree)
    assert out["attn"]["kernel"] is STACK and messages == []


class ScanBlock(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return nn.Dense(32)(x), None


class LinenModel(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.DenseGeneral((4, 8), name="attn")(x).reshape(x.shape[0], 32)  # kernel [16, 4, 8]
        stack = nn.scan(
            ScanBlock, variable_axes={"params": 0}, split_rngs={"params": True}, length=3
        )
        return stack(name="layers")(x, None)[0]


def test_no_warning_through_linen_quantize():
    model, x = LinenModel(), jnp.ones((2, 16))
    variables = model.init(jax.random.key(0), x)
    q, messages = _quantize_warnings(jp.linen.quantize, model, POLICY, variables, x)
    assert messages == []
    assert q["params"]["attn"]["kernel"].stacked == 0
    assert q["params"]["layers"]["Dense_0"]["kernel"].stacked == 1


class NnxModel(nnx.Module):
    def __init__(self, rngs):
        self.attn = nnx.LinearGeneral(16, (4, 8), rngs=rngs)  # kernel [16, 4, 8]

    def __call__(self, x):
        return self.attn(x)


def test_no_warning_through_nnx_quantize():
    q, messages = _quantize_warnings(jp.nnx.quantize, NnxModel(nnx.Rngs(0)), POLICY)
    assert messages == []
    assert q.attn.kernel.get_value().stacked == 0
