"""`jp.nnx.explain` with the model's arguments on models whose call writes state back
(issue #31): batch statistics, float8 delayed-scaling state, RNG counts. The matmuls are
listed, and the user's model is left as it was."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jmp_policy as jp


class Normed(nnx.Module):
    def __init__(self, r):
        self.l = nnx.Linear(4, 4, rngs=r)
        self.bn = nnx.BatchNorm(4, rngs=r)
        self.drop = nnx.Dropout(0.5, rngs=r)

    def __call__(self, x):
        return self.drop(self.bn(self.l(x)))


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.up, self.head = nnx.Linear(32, 64, rngs=rngs), nnx.Linear(64, 10, rngs=rngs)

    def __call__(self, x):
        return self.head(nnx.relu(self.up(x)))


def _numpy(x):
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(x)


def _snapshot(model):
    return jax.tree.map(_numpy, nnx.state(model))


def _assert_same(before, model):
    after = _snapshot(model)
    assert jax.tree.structure(before) == jax.tree.structure(after)
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
        np.testing.assert_array_equal(a, b)


def test_batch_norm_model_is_explained_with_arguments_and_left_unchanged():
    model = Normed(nnx.Rngs(0))
    before = _snapshot(model)
    table = jp.nnx.explain(model, "mixed_bfloat16", jnp.ones((2, 4)))
    lines = table.splitlines()
    assert lines[0].split() == ["path", "class", "policy", "source", "dtype", "bytes", "c.bytes"]
    assert lines[2].split()[:3] == ["bn", "BatchNorm", "mixed_bfloat16"]
    assert lines[4].split()[:3] == ["l", "Linear", "mixed_bfloat16"]
    assert "matmuls:" not in table  # no quantized or float8 layer
    _assert_same(before, model)
    # The model still runs and updates its statistics when called for real.
    jp.nnx.apply(model, "mixed_bfloat16")(jnp.ones((2, 4)))
    assert float(jnp.abs(model.bn.mean.get_value()).sum()) > 0


def test_batch_norm_model_with_int8_weights_lists_its_matmul():
    policy_map = jp.DTypePolicyMap("mixed_bfloat16", {"l": "int8_from_mixed_bfloat16"})
    model = jp.nnx.quantize(Normed(nnx.Rngs(0)), policy_map)
    before = _snapshot(model)
    args = jax.ShapeDtypeStruct((2, 4), jnp.float32)  # shapes are enough
    table = jp.nnx.explain(model, policy_map, args)
    assert table.endswith("matmuls:\n  l  int8 weights: weight-only, scale after")
    _assert_same(before, model)


@pytest.mark.filterwarnings("ignore:The float8 layer")
@pytest.mark.parametrize("scaling", ["delayed", "current"])
def test_float8_model_is_explained_with_arguments_and_its_state_unchanged(scaling):
    name = (
        "float8_from_mixed_bfloat16"
        if scaling == "delayed"
        else ("float8_current_from_mixed_bfloat16")
    )
    policy_map = jp.DTypePolicyMap("mixed_bfloat16", {"up": name})
    model = MLP(nnx.Rngs(0))
    if scaling == "delayed":
        model = jp.nnx.init_float8(model, policy_map)
    before = _snapshot(model)
    table = jp.nnx.explain(model, policy_map, jnp.ones((8, 32)))
    assert f"  up  float8 ({scaling}), e4m3 x e4m3 GEMM 8x32x64" in table
    assert "head" not in table.split("matmuls:")[1]  # bf16: runs as written
    _assert_same(before, model)
