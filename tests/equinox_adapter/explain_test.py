"""``jp.equinox.explain``: the policy of every submodule path and the matmul each layer runs."""

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import jmp_policy as jp
from equinox_adapter.models import Transformer, tokens


@pytest.fixture(scope="module")
def model():
    return Transformer(jax.random.key(0))


def _rows(table):
    table = table.split("matmuls:")[0]
    return {line.split()[0]: line.split() for line in table.splitlines() if line.strip()}


def test_lists_every_module_path_with_its_policy_and_source(model):
    policy_map = jp.DTypePolicyMap("mixed_bfloat16", {"head": "float32"})
    rows = _rows(jp.equinox.explain(model, policy_map))
    assert rows["head"][1:5] == ["Linear", "float32", "key", "'head'"]
    assert rows["blocks/attn/query_proj"][1:4] == ["Linear", "mixed_bfloat16", "default"]
    assert rows["blocks/attn/query_proj"][4] == "f32→bf16"
    assert rows["blocks/mlp/layers/1"][1] == "Linear"
    assert rows["embed"][1] == "Embedding"
    assert rows["<root>"][1] == "Transformer"


def test_type_policies_name_their_class(model):
    table = jp.equinox.explain(model, "mixed_bfloat16", type_policies=jp.equinox.NORM_FLOAT32)
    assert _rows(table)["blocks/norm1"][1:5] == ["LayerNorm", "float32", "type", "LayerNorm"]


@pytest.mark.parametrize(
    ("name", "form"),
    [
        ("int8_from_mixed_bfloat16", "int8 x int8 (both quantized in the step)"),
        ("float8_current_from_mixed_bfloat16", "float8 (current), e4m3 x e4m3 GEMM"),
    ],
)
def test_with_inputs_lists_each_routed_layers_matmul(model, name, form):
    policy_map = jp.DTypePolicyMap(name, {"head": "float32"})
    table = jp.equinox.explain(model, policy_map, tokens())
    matmuls = table.split("matmuls:")[1]
    for path in ("blocks/attn/query_proj", "blocks/attn/output_proj", "blocks/mlp/layers/0"):
        line = next(line for line in matmuls.splitlines() if line.split()[:1] == [path])
        assert form in line
    assert "\n  head " not in matmuls  # the float32 head runs as written


def test_quantized_weights_are_listed_as_stored_and_read_per_layer(model):
    policy_map = jp.DTypePolicyMap("int8_from_float32", {"head": "float32"})
    q = jp.equinox.quantize(model, policy_map)
    table = jp.equinox.explain(q, policy_map, jax.ShapeDtypeStruct((8,), "int32"))
    assert _rows(table)["blocks/mlp/layers/0"][-3] == "f32,i8→f32"
    assert "blocks/mlp/layers/0      int8 weights: weight-only, scale after" in table


def test_a_typo_in_a_key_is_named_with_the_closest_path(model):
    with pytest.warns(UserWarning, match="haed"):
        table = jp.equinox.explain(model, {"haed": "float32"})
    assert "keys that resolve nothing: 'haed' (closest module paths: 'head')" in table


class _Flagged(eqx.Module):
    """A model with a Python flag among its arguments (as Equinox's BERT example's
    ``enable_dropout``): explain holds it as given, never as a traced value."""

    linear: eqx.nn.Linear

    def __call__(self, x, train):
        y = self.linear(x)
        return y * 2 if train else y  # a bool branch: a traced flag would raise


def test_with_inputs_holds_python_arguments_static():
    model = _Flagged(eqx.nn.Linear(4, 4, key=jax.random.key(0)))
    for train in (True, False):
        table = jp.equinox.explain(model, "int8_from_float32", jnp.ones((4,)), train)
        assert "linear  int8 x int8 (both quantized in the step)" in table
