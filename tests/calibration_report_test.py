"""A calibration report under an explain table (#46): rows of the wrong types, or of
kernels the model does not have, are refused naming them (Linen and NNX)."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import jmp_policy as jp
from jmp_policy._src.calibration_report import format_calibration
from jmp_policy._src.quantization.calibration import LayerReport

GOOD = LayerReport("up/kernel", "gptq", 0.08, 0.04, 1.25)
PARAMS = {"up": {"kernel": jnp.ones((2, 2))}, "stack": {"kernel": jnp.ones((3, 2, 2))}}


@pytest.mark.parametrize(
    ("row", "field"),
    [
        (LayerReport("up/kernel", "gptq", "8%", 0.04, 1.0), "rtn_error"),
        (LayerReport("up/kernel", "gptq", 0.08, None, 1.0), "error"),
        (LayerReport("up/kernel", "gptq", 0.08, 0.04, True), "seconds"),
        (LayerReport(3, "gptq", 0.08, 0.04, 1.0), "path"),
        (LayerReport("up/kernel", b"gptq", 0.08, 0.04, 1.0), "method"),
    ],
)
def test_a_row_with_a_field_of_another_type_is_a_type_error_naming_it(row, field):
    with pytest.raises(TypeError, match=rf"`calibration\[1\]\.{field}` must be .*Received: "):
        format_calibration([GOOD, row])


def test_a_row_of_a_kernel_the_model_lacks_is_refused_naming_it():
    rows = [GOOD, LayerReport("stack/kernel[2]", "awq", 0.1, 0.05, 0.5)]
    assert "stack/kernel[2]" in format_calibration(rows, PARAMS)  # a stack's layer: known
    with pytest.raises(ValueError, match=r"kernels the model does not have: \['dwn/kernel'\]"):
        format_calibration([*rows, LayerReport("dwn/kernel", "gptq", 0.1, 0.1, 0.1)], PARAMS)


def test_explain_refuses_a_report_of_another_model_linen_and_nnx():
    other = [LayerReport("elsewhere/kernel", "gptq", 0.1, 0.05, 0.5)]
    model, x = nn.Dense(2, name="up"), jnp.ones((1, 2))
    variables = model.init(jax.random.key(0), x)
    with pytest.raises(ValueError, match=r"does not have: \['elsewhere/kernel'\]"):
        jp.linen.explain(model, "float32", variables, x, calibration=other)
    with pytest.raises(ValueError, match=r"does not have: \['elsewhere/kernel'\]"):
        jp.nnx.explain(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), "float32", calibration=other)
    assert "kernel  gptq" in jp.nnx.explain(
        nnx.Linear(2, 2, rngs=nnx.Rngs(0)),
        "float32",
        calibration=[dataclasses.replace(GOOD, path="kernel")],
    )
