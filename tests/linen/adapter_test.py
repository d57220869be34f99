"""The Linen adapter of the framework protocol: the core's entry points on a Linen model."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_policy as jp
from jmp_policy._src.framework import entry_points
from jmp_policy._src.options import Options
from jmp_policy.linen._adapter import ADAPTER, Bound


class Model(nn.Module):
    @nn.compact
    def __call__(self, x, scale=1.0):
        x = nn.Dense(8, name="body")(x) * scale
        x = nn.LayerNorm(name="norm")(x)
        return nn.Dense(2, name="head")(x)


def _setup():
    model, x = Model(), jnp.ones((2, 4))
    return model, x, model.init(jax.random.key(0), x)


def _rows(table):
    """The table's rows by path, up to its total (the matmul lines come after)."""
    lines = table.splitlines()[1:]
    body = lines[: [line.split()[0] for line in lines].index("total")]
    return {line.split()[0]: line.split() for line in body}


def test_learn_meets_the_modules_in_call_order_with_class_and_own_dtype():
    model, x, variables = _setup()
    bound = Bound(model, variables, {})
    policies = jp.get("mixed_bfloat16")
    jax.eval_shape(lambda v: ADAPTER.learn(bound._replace(variables=v), policies, Options(), (x,), {}),
                   variables)  # fmt: skip
    layers = list(ADAPTER.layers(bound))
    assert [layer.path for layer in layers] == ["", "body", "norm", "head"]
    assert [layer.cls for layer in layers] == [Model, nn.Dense, nn.LayerNorm, nn.Dense]
    assert ADAPTER.class_name(bound) == "Model"
    assert ADAPTER.params(bound) is variables["params"]


@pytest.mark.parametrize("jit", [False, True])
def test_core_apply_runs_a_bound_model_per_submodule(jit):
    model, x, variables = _setup()
    policy_map = jp.DTypePolicyMap("mixed_bfloat16", {"head": "float32"})

    def run(v):
        bound = Bound(model, v, {}, None, {"scale": 2.0})
        return entry_points.apply(ADAPTER, bound, policy_map, Options(), ())(x)

    out = jax.jit(run)(variables) if jit else run(variables)
    want = jp.linen.apply(model, policy_map)(variables, x, scale=2.0)
    assert out.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want))


def test_core_explain_names_the_module_class_not_the_bound_pair():
    model, x, variables = _setup()
    policy_map = jp.DTypePolicyMap("float32", {"nowhere": "float16"})
    with pytest.warns(UserWarning, match="resolve no module or variable of Model: "):
        jp.linen.explain(model, policy_map, variables, x)


@pytest.mark.parametrize("jit", [False, True])
def test_explain_counts_a_quantized_kernel_in_its_layers_row(jit):
    model, x, variables = _setup()
    policy = "int8_from_float32"
    q = jp.linen.quantize(model, policy, variables, x)
    if jit:  # variables as a jitted function returns them
        q = jax.jit(lambda v: v)(q)
    rows = _rows(jp.linen.explain(model, policy, q, x))
    assert "body/kernel" not in rows and "head/kernel" not in rows
    assert rows["body"][-3] == "f32,i8→f32"
    # int8 values (4 x 8 bytes) and float32 scales (8 x 4) with the float32 bias (8 x 4)
    assert rows["body"][-2] == str(4 * 8 + 8 * 4 + 8 * 4)
