"""Root variables, the variable-key rule, typo warnings and `explain` (issue #8).

One rule everywhere: a ViT's root `pos_embedding` resolves through the root's policy (path
""), and a key names a variable only when it matches the variable's path and not its module
path, alike in `policy_tree`, `cast_to_compute`, `cast_apply`, `linen.apply` and `nnx.apply`.
A key that resolves nothing warns once, naming it and `unused_keys`. `explain` takes
`jax.eval_shape` variables and fits 100 columns.
"""

from __future__ import annotations

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from flax_examples import gemma_nnx
from flax_examples import lm1b_models as lm
from flax_examples.measure import (
    BF16,
    F32,
    VOCAB,
    B,
    Encoder,
    NNXEncoder,
    dot_dtypes,
    lm1b_config,
    tokens,
)

import jmp_policy as jp

# --------------------------------------------------------------------------- root variables

SEEN_DTYPES: dict[str, np.dtype] = {}


class ViTish(nn.Module):
    """A ViT's root: a learned `pos_embedding` on the root module, then an encoder."""

    @nn.compact
    def __call__(self, x):
        pos = self.param("pos_embedding", nn.initializers.normal(0.02), (1, *x.shape[1:]))
        SEEN_DTYPES["pos_embedding"] = np.dtype(pos.dtype)
        return Encoder(name="encoder")(x + pos)


class NNXViTish(nnx.Module):
    def __init__(self, *, rngs):
        self.pos_embedding = nnx.Param(jax.random.normal(rngs.params(), (1, 3, 6)) * 0.02)
        self.encoder = NNXEncoder(rngs=rngs)

    def __call__(self, x):
        pos = self.pos_embedding[...]
        SEEN_DTYPES["pos_embedding"] = np.dtype(pos.dtype)
        return self.encoder(x + pos)


def vit_params():
    x = jnp.ones((B, 3, 6))
    return ViTish().init(jax.random.key(0), x)["params"], x


def test_root_variable_follows_the_root_policy_in_every_tree_method_and_wrapper(maybe_jit):
    policy_map = jp.DTypePolicyMap("mixed_bfloat16", {"": "float32"})
    params, x = vit_params()

    tree = policy_map.policy_tree(params)
    assert tree["pos_embedding"].compute_dtype == F32
    assert tree["encoder"]["body"]["kernel"].compute_dtype == BF16
    cast = policy_map.cast_to_compute(params)
    assert cast["pos_embedding"].dtype == F32
    assert cast["encoder"]["body"]["kernel"].dtype == BF16

    seen = {}

    @jp.cast_apply(policy_map)
    def apply(params, x):
        seen.update(jax.tree.map(lambda a: np.dtype(a.dtype), params))
        return x + params["pos_embedding"]

    maybe_jit(apply)(params, x)
    assert seen["pos_embedding"] == F32
    assert seen["encoder"]["body"]["kernel"] == BF16

    SEEN_DTYPES.clear()
    maybe_jit(jp.linen.apply(ViTish(), policy_map))({"params": params}, x)
    assert SEEN_DTYPES["pos_embedding"] == F32

    SEEN_DTYPES.clear()
    jp.nnx.apply(NNXViTish(rngs=nnx.Rngs(0)), policy_map)(x)
    assert SEEN_DTYPES["pos_embedding"] == F32


@pytest.mark.parametrize("module_key", ["encoder/.*", r"encoder(/\w+)*"])
def test_variable_key_rule_is_the_same_in_every_tree_method_and_wrapper(module_key):
    # Both keys name modules (they match "encoder/head"), so neither overrides the exact key
    # of encoder/head for its kernel: the kernel stays float32, the body's goes bfloat16.
    policy_map = jp.DTypePolicyMap(
        "float32", {module_key: "mixed_bfloat16", "encoder/head": "float32"}
    )
    params, x = vit_params()
    head, body = ("encoder", "head", "kernel"), ("encoder", "body", "kernel")

    def at(tree, path):
        for key in path:
            tree = tree[key]
        return tree

    tree = policy_map.policy_tree(params)
    assert at(tree, head).compute_dtype == F32
    assert at(tree, body).compute_dtype == BF16
    cast = policy_map.cast_to_compute(params)
    assert at(cast, head).dtype == F32
    assert at(cast, body).dtype == BF16

    seen = {}

    @jp.cast_apply(policy_map)
    def apply(params):
        seen.update(jax.tree.map(lambda a: np.dtype(a.dtype), params))
        return 0.0

    apply(params)
    assert at(seen, head) == F32 and at(seen, body) == BF16

    fn = jp.linen.apply(ViTish(), policy_map)
    assert dot_dtypes(fn, {"params": params}, x) == [("bfloat16",) * 2, ("float32",) * 2]

    model = NNXViTish(rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    pure = lambda state, x: jp.nnx.apply(nnx.merge(graphdef, state), policy_map)(x)  # noqa: E731
    assert dot_dtypes(pure, state, x) == [("bfloat16",) * 2, ("float32",) * 2]


# --------------------------------------------------------------------------- typos


def typo_warnings(record):
    return [w for w in record if "haed" in str(w.message)]


@pytest.mark.parametrize("wrapper", ["linen.apply", "linen.init", "nnx.apply"])
def test_a_key_that_resolves_nothing_warns_once_naming_it(wrapper):
    policy_map = jp.DTypePolicyMap("mixed_bfloat16", {"haed": "float32"})
    x = jax.random.normal(jax.random.key(0), (B, 6))
    if wrapper == "linen.apply":
        model = Encoder()
        variables = model.init(jax.random.key(0), x)
        fn, args = jp.linen.apply(model, policy_map), (variables, x)
        assert policy_map.unused_keys(variables["params"]) == ["haed"]
    elif wrapper == "linen.init":
        fn, args = jp.linen.init(Encoder(), policy_map), (jax.random.key(0), x)
    else:
        fn, args = jp.nnx.apply(NNXEncoder(rngs=nnx.Rngs(0)), policy_map), (x,)

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fn(*args)
        fn(*args)

    found = typo_warnings(record)
    assert len(found) == 1, [str(w.message) for w in record]
    assert found[0].category is UserWarning
    assert "unused_keys" in str(found[0].message)


def test_no_typo_warning_when_every_key_resolves():
    policy_map = jp.DTypePolicyMap("mixed_bfloat16", {"head": "float32", ".*/kernel": "float32"})
    x = jax.random.normal(jax.random.key(0), (B, 6))
    model = Encoder()
    variables = model.init(jax.random.key(0), x)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        jp.linen.apply(model, policy_map)(variables, x)
    assert [str(w.message) for w in record if "unused_keys" in str(w.message)] == []
    assert policy_map.unused_keys(variables["params"]) == []


# --------------------------------------------------------------------------- explain


@pytest.mark.parametrize("config", ["policy-friendly", "stock"])
def test_linen_explain_takes_eval_shape_variables_and_fits_100_columns(config):
    cfg = lm1b_config(dtype=None) if config == "policy-friendly" else lm1b_config()
    model, x = lm.TransformerLM(cfg), tokens()
    abstract = jax.eval_shape(model.init, jax.random.key(0), x)
    assert isinstance(jax.tree.leaves(abstract)[0], jax.ShapeDtypeStruct)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the stock config warns: not what this test is about
        table = jp.linen.explain(model, "mixed_bfloat16", abstract, x)
        concrete = jp.linen.explain(
            model, "mixed_bfloat16", jax.jit(model.init)(jax.random.key(0), x), x
        )

    assert isinstance(table, str)
    assert table == concrete
    width = max(len(line) for line in table.splitlines())
    assert width <= 100, f"{width} columns:\n{table}"
    assert "logitdense" in table
    assert "encoderdecoderblock_1" in table


def test_nnx_explain_fits_100_columns():
    # NNX modules exist before they are called: explain needs the model, not its inputs
    model = gemma_nnx.Transformer(vocab_size=VOCAB, rngs=nnx.Rngs(0))
    table = jp.nnx.explain(model, "mixed_bfloat16", type_policies=jp.nnx.NORM_FLOAT32)
    assert isinstance(table, str)
    width = max(len(line) for line in table.splitlines())
    assert width <= 100, f"{width} columns:\n{table}"
    assert "_query_norm" in table and "qkv_einsum" in table and "RMSNorm" in table
