"""What the Linen and NNX ``calibrate`` tests compare against: each layer solved alone on
the inputs it sees, by ``gptq_quantize``/``awq_quantize`` directly.

Shared by ``tests/linen/calibrate_test.py`` and ``tests/nnx/calibrate_test.py`` (imported
as ``quantization.calibrate_reference``, as ``flax_examples`` is); no flax here.
"""

import jax
import jax.numpy as jnp
import numpy as np

from jmp_policy._src.quantization import awq, calibration_stats, gptq
from quantization import loop_reads


def correlated_inputs(rows, seed=0):
    """Correlated features of unequal sizes; one mixing for every seed (held-out rows)."""
    fixed = np.random.default_rng(123)
    mix = fixed.normal(size=(32, 32)) / np.sqrt(32)
    scale = np.exp(fixed.normal(size=32))
    rng = np.random.default_rng(seed)
    return jnp.asarray((rng.normal(size=(rows, 32)) @ mix) * scale, jnp.float32)


def int4_converts_into_dots(jaxpr):
    """How many dot_generals read an operand converted from int4 (anywhere in ``jaxpr``)."""
    return sum(1 for dtype, _ in loop_reads.integer_dots(jaxpr) if dtype == "int4")


def stack_inputs(x, up, stack):
    """The inputs each layer of a relu stack sees after a relu ``up`` layer, run unrolled
    with the float parameters: ``up`` is ``(kernel, bias)``, ``stack`` ``(kernels,
    biases)`` with the layers on the leading axis."""
    h = jax.nn.relu(x @ up[0] + up[1])
    inputs = []
    for kernel, bias in zip(*stack, strict=True):
        inputs.append(h)
        h = jax.nn.relu(h @ kernel + bias)
    return inputs


def solve_alone(method, kernel, h, group_size, clip_search=True):
    """``kernel`` quantized by ``method`` (``"gptq"`` or ``"awq"``) on its inputs ``h``."""
    gram = calibration_stats.gram(h)
    if method == "gptq":
        return gptq.gptq_quantize(kernel, gram, group_size=group_size, clip_search=clip_search)
    mean_abs = jnp.abs(h).mean(0)
    return awq.awq_quantize(kernel, mean_abs, gram, group_size=group_size, clip_search=clip_search)


def assert_each_layer_solved_alone(method, stored, rtn, kernels, inputs, held_inputs):
    """Each layer ``i`` of the calibrated stack ``stored`` is what ``method`` gives that
    layer alone on ``inputs[i]`` (scales, AWQ's input scale, nearly every value), and on
    the held-out ``held_inputs[i]`` its output error is below the round-to-nearest stack
    ``rtn``'s; ``kernels`` are the float layers."""
    for i, (h, held) in enumerate(zip(inputs, held_inputs, strict=True)):
        want = solve_alone(method, kernels[i], h, stored.block_size)
        if method == "awq":
            np.testing.assert_allclose(
                np.asarray(stored.input_scale[i]), np.asarray(want.input_scale), rtol=1e-5
            )
        np.testing.assert_allclose(
            np.asarray(stored.scale[i]), np.asarray(want.scale), rtol=1e-5, atol=1e-7
        )
        same = np.asarray(stored.values[i], np.int8) == np.asarray(want.values, np.int8)
        assert same.mean() > 0.999
        w = kernels[i]
        err = lambda k, w=w, held=held: float(jnp.linalg.norm(held @ w - held @ k))  # noqa: E731
        assert err(stored.dequantize()[i]) < err(rtn.dequantize()[i])
