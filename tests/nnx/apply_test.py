"""Tests of `jmp_policy.nnx`: per-submodule policies for Flax NNX models."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jmp_policy as jp
from jmp_policy import nnx as jpnnx

F32 = np.dtype("float32")
BF16 = np.dtype(jnp.bfloat16)

# Filled by the probes while a model runs (while tracing, under jit): tag -> facts.
SEEN: dict[str, dict] = {}


def _record(tag, **facts):
    SEEN[tag] = {**facts, "policy": jp.current_policy()}


class Dense(nnx.Module):
    """A dense layer that records the dtypes it sees."""

    def __init__(self, din, dout, tag, rngs):
        self.tag = tag
        self.kernel = nnx.Param(jax.random.normal(rngs.params(), (din, dout)) / din**0.5)
        self.bias = nnx.Param(jnp.zeros((dout,)))

    def __call__(self, x):
        _record(self.tag, x=x.dtype, kernel=self.kernel[...].dtype, bias=self.bias[...].dtype)
        return x @ self.kernel[...] + self.bias[...]


class RecNorm(nnx.LayerNorm):
    """A LayerNorm that records the dtypes it sees (a subclass: `type_policies` apply)."""

    def __init__(self, features, tag, rngs):
        super().__init__(features, rngs=rngs)
        self.tag = tag

    def __call__(self, x, mask=None):
        _record(self.tag, x=x.dtype, scale=self.scale[...].dtype)
        return super().__call__(x, mask=mask)


class RecEmbed(nnx.Embed):
    def __call__(self, inputs):
        _record("embed", x=inputs.dtype, embedding=self.embedding[...].dtype)
        return super().__call__(inputs)


class Noise(nnx.Module):
    """Adds noise made in `jp.current_policy()`'s compute dtype."""

    def __init__(self, tag):
        self.tag = tag

    def __call__(self, x):
        noise = jax.random.normal(jax.random.key(0), x.shape, jp.current_policy().compute_dtype)
        _record(self.tag, x=x.dtype, noise=noise.dtype)
        return x + 0.01 * noise


class Block(nnx.Module):
    def __init__(self, tag, rngs):
        self.tag = tag
        self.mlp = Dense(4, 4, f"{tag}/mlp", rngs)
        self.norm = RecNorm(4, f"{tag}/norm", rngs)

    def __call__(self, x):
        h = self.mlp(x)
        _record(self.tag, x=x.dtype, mlp_out=h.dtype)
        return self.norm(h)


class Encoder(nnx.Module):
    def __init__(self, rngs):
        self.layers = nnx.List([Block(f"encoder/layers/{i}", rngs) for i in range(2)])
        self.proj = nnx.Sequential(
            Dense(4, 4, "encoder/proj/layers/0", rngs),
            nnx.relu,
            Dense(4, 4, "encoder/proj/layers/2", rngs),
        )
        self.noise = Noise("encoder/noise")

    def __call__(self, x):
        _record("encoder", x=x.dtype)
        for layer in self.layers:
            x = layer(x)
        return self.noise(self.proj(x))


class Model(nnx.Module):
    def __init__(self, rngs):
        self.embed = RecEmbed(10, 4, rngs=rngs)
        self.encoder = Encoder(rngs)
        self.head = Dense(4, 3, "head", rngs)

    def __call__(self, ids, scale=1.0):
        x = self.embed(ids)
        _record("", x=x.dtype)
        return self.head(self.encoder(x * scale))

    def encode(self, ids):
        return self.encoder(self.embed(ids))


MAP = {"encoder": "mixed_bfloat16", ".*norm": "float32", "head": "float32"}
IDS = jnp.array([[1, 2, 3], [4, 5, 6]])
MIXED = jp.DTypePolicy("mixed_bfloat16")
FLOAT32 = jp.DTypePolicy("float32")


def _model():
    return Model(nnx.Rngs(0))


def _run_jit(model, policy_or_map, *args, **kwargs):
    """Runs `apply` under `nnx.jit` (one compilation is cheaper than eager op by op)."""
    return nnx.jit(lambda m, *a: jpnnx.apply(m, policy_or_map, **kwargs)(*a))(model, *args)


def _params(model):
    return {k: np.asarray(v[...]) for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


@pytest.fixture(autouse=True)
def _clear_seen():
    SEEN.clear()


@pytest.fixture(params=[False, True], ids=["eager", "nnx_jit"])
def nnx_jit(request):
    return nnx.jit if request.param else (lambda f, **kwargs: f)


# -- per-submodule dtypes --------------------------------------------------------------


def test_submodules_see_their_own_policy_dtypes(nnx_jit):
    model = _model()
    policy_map = jp.DTypePolicyMap("float32", MAP)
    out = nnx_jit(lambda m, ids: jpnnx.apply(m, policy_map)(ids))(model, IDS)

    assert out.dtype == F32 and out.shape == (2, 3, 3)
    assert SEEN[""]["policy"] == FLOAT32 and SEEN[""]["x"] == F32
    assert SEEN["embed"] == {"x": np.dtype("int32"), "embedding": F32, "policy": FLOAT32}
    assert SEEN["encoder"] == {"x": BF16, "policy": MIXED}
    for i in range(2):
        block = f"encoder/layers/{i}"
        assert SEEN[block] == {"x": BF16, "mlp_out": BF16, "policy": MIXED}
        assert SEEN[f"{block}/mlp"] == {"x": BF16, "kernel": BF16, "bias": BF16, "policy": MIXED}
        # ".*norm" names the norm itself, so it wins over inheritance from "encoder".
        assert SEEN[f"{block}/norm"] == {"x": F32, "scale": F32, "policy": FLOAT32}
    for tag in ("encoder/proj/layers/0", "encoder/proj/layers/2"):
        assert SEEN[tag] == {"x": BF16, "kernel": BF16, "bias": BF16, "policy": MIXED}
    assert SEEN["encoder/noise"] == {"x": BF16, "noise": BF16, "policy": MIXED}
    assert SEEN["head"] == {"x": F32, "kernel": F32, "bias": F32, "policy": FLOAT32}


def test_outputs_are_cast_to_each_modules_output_dtype():
    model = _model()
    policy_map = {"encoder/layers/0/mlp": "p=f32,c=bf16,o=f32", "encoder/layers/1": "bfloat16"}
    out = _run_jit(model, jp.DTypePolicyMap("mixed_bfloat16", policy_map), IDS)
    assert out.dtype == BF16  # root: mixed_bfloat16 outputs bfloat16
    assert SEEN["encoder/layers/0/mlp"]["x"] == BF16
    assert SEEN["encoder/layers/0"]["mlp_out"] == F32  # o=f32
    assert SEEN["encoder/layers/1"]["mlp_out"] == BF16
    out = _run_jit(model, "p=f32,c=bf16,o=f32", IDS)
    assert out.dtype == F32
    assert SEEN["head"]["x"] == BF16


def test_current_policy_outside_apply_is_the_global_policy():
    model = _model()
    jpnnx.apply(model, MAP)(IDS)
    assert jp.current_policy() == FLOAT32
    with jp.policy_scope("mixed_bfloat16"):
        # A dict map has the global policy (here mixed_bfloat16) as its default.
        jpnnx.apply(model, {"head": "float32"})(IDS)
        assert SEEN["embed"]["policy"] == MIXED and SEEN["head"]["policy"] == FLOAT32
        model(IDS)  # Without apply, a module sees the global policy and float32 params.
        assert SEEN["head"] == {"x": F32, "kernel": F32, "bias": F32, "policy": MIXED}


def test_current_policy_makes_noise_in_compute_dtype():
    model = _model()
    _run_jit(model, "mixed_bfloat16", IDS)
    assert SEEN["encoder/noise"]["noise"] == BF16
    _run_jit(model, {"encoder/noise": "float16"}, IDS)
    assert SEEN["encoder/noise"] == {
        "x": np.dtype("float16"),
        "noise": np.dtype("float16"),
        "policy": jp.DTypePolicy("float16"),
    }
    model(IDS)
    assert SEEN["encoder/noise"]["noise"] == F32


@pytest.mark.parametrize(
    "policy_or_map",
    [
        "mixed_bfloat16",
        jp.DTypePolicy("mixed_bfloat16"),
        "p=f32,c=bf16,o=bf16",
        jp.DTypePolicyMap("mixed_bfloat16"),
        {
            "": "mixed_bfloat16",
            "embed": "mixed_bfloat16",
            "encoder": "mixed_bfloat16",
            "head": "mixed_bfloat16",
        },
        {"class_name": "DTypePolicy", "config": {"name": "mixed_bfloat16"}},
    ],
    ids=["name", "policy", "jmp_name", "map", "dict", "config"],
)
def test_policy_or_map_forms(policy_or_map):
    out = jpnnx.apply(_model(), policy_or_map)(IDS)
    assert out.dtype == BF16
    assert {SEEN[t]["policy"] for t in SEEN} == {MIXED}
    assert SEEN["head"] == {"x": BF16, "kernel": BF16, "bias": BF16, "policy": MIXED}


def test_none_uses_the_global_policy():
    jp.set_dtype_policy("mixed_bfloat16")
    out = jpnnx.apply(_model(), None)(IDS)
    assert out.dtype == BF16 and SEEN["head"]["kernel"] == BF16


def test_stored_params_are_unchanged():
    model = _model()
    before = _params(model)
    jpnnx.apply(model, "bfloat16")(IDS)
    after = _params(model)
    assert before.keys() == after.keys()
    for path, value in before.items():
        assert after[path].dtype == F32, path
        np.testing.assert_array_equal(after[path], value)


def test_keyword_and_non_floating_arguments():
    model = _model()
    out = jpnnx.apply(model, "mixed_bfloat16")(IDS, scale=jnp.float32(2.0))
    assert out.dtype == BF16
    assert SEEN["embed"]["x"] == np.dtype("int32")  # integers are never cast
    np.testing.assert_allclose(
        np.asarray(jpnnx.apply(model, "float32")(IDS, scale=jnp.float32(1.0))),
        np.asarray(model(IDS)),
        rtol=1e-6,
    )


# -- gradients and transforms ----------------------------------------------------------


def _loss(model, ids, policy_or_map=MAP):
    out = jpnnx.apply(model, policy_or_map)(ids)
    return jnp.mean(out.astype(jnp.float32) ** 2)


def test_grad_is_float32_and_finite(nnx_jit):
    model = _model()
    grads = nnx_jit(nnx.grad(_loss))(model, IDS)
    leaves = jax.tree.leaves(grads)
    assert len(leaves) == len(_params(model))
    for g in leaves:
        assert g.dtype == F32
        assert bool(jnp.all(jnp.isfinite(g)))
    assert float(jnp.abs(grads["encoder"]["layers"][0]["mlp"]["kernel"][...]).sum()) > 0


def test_value_and_grad_matches_float32_run_approximately():
    model = _model()
    loss32, grads32 = nnx.jit(nnx.value_and_grad(lambda m: _loss(m, IDS, "float32")))(model)
    loss16, grads16 = nnx.jit(nnx.value_and_grad(lambda m: _loss(m, IDS, "mixed_bfloat16")))(model)
    assert loss16.dtype == F32
    np.testing.assert_allclose(float(loss16), float(loss32), rtol=5e-2)
    g32 = grads32["head"]["kernel"][...]
    g16 = grads16["head"]["kernel"][...]
    assert g16.dtype == F32
    np.testing.assert_allclose(np.asarray(g16), np.asarray(g32), rtol=0.1, atol=2e-2)


def test_jax_jit_of_a_split_merge_function():
    model = _model()
    graphdef, state = nnx.split(model)

    @jax.jit
    def step(state, ids):
        def loss(state):
            return _loss(nnx.merge(graphdef, state), ids)

        return jax.value_and_grad(loss)(state)

    loss, grads = step(state, IDS)
    assert loss.dtype == F32 and bool(jnp.isfinite(loss))
    assert {g.dtype for g in jax.tree.leaves(grads)} == {F32}
    assert SEEN["encoder/layers/0/mlp"]["kernel"] == BF16


def test_nnx_vmap_over_inputs():
    model = _model()
    ids = jnp.stack([IDS, IDS + 1])
    out = nnx.vmap(lambda m, x: jpnnx.apply(m, MAP)(x), in_axes=(None, 0))(model, ids)
    assert out.shape == (2, 2, 3, 3) and out.dtype == F32
    assert SEEN["encoder/layers/1/mlp"]["kernel"] == BF16


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.a = Dense(4, 4, "a", rngs)
        self.b = Dense(4, 4, "b", rngs)

    def __call__(self, x):
        return self.b(jnp.tanh(self.a(x)))


def test_nnx_vmap_and_scan_over_a_stacked_model():
    @nnx.split_rngs(splits=3)
    @nnx.vmap(in_axes=0, out_axes=0)
    def make(rngs):
        return MLP(rngs)

    stack = make(nnx.Rngs(0))
    x = jnp.ones((2, 4))
    policy_map = jp.DTypePolicyMap("float32", {"a": "p=f32,c=bf16,o=f32"})
    out = nnx.vmap(lambda m, x: jpnnx.apply(m, policy_map)(x), in_axes=(0, None))(stack, x)
    assert out.shape == (3, 2, 4) and out.dtype == F32
    assert SEEN["a"]["kernel"] == BF16 and SEEN["b"]["kernel"] == F32

    def body(x, layer):
        return jpnnx.apply(layer, policy_map)(x), None

    def loss(m):
        y, _ = nnx.scan(body, in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))(x, m)
        return y.sum()

    value, grads = nnx.jit(nnx.value_and_grad(loss))(stack)
    assert value.dtype == F32 and bool(jnp.isfinite(value))
    assert grads["a"]["kernel"][...].shape == (3, 4, 4)
    assert {g.dtype for g in jax.tree.leaves(grads)} == {F32}


class ScannedStack(nnx.Module):
    """A model that runs its layers with `nnx.scan` and `nnx.remat` inside `__call__`."""

    def __init__(self, rngs):
        @nnx.split_rngs(splits=3)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return Dense(4, 4, "stack/layers", rngs)

        self.layers = make(rngs)
        self.head = Dense(4, 2, "stack/head", rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        @nnx.remat
        def body(x, layer):
            return jnp.tanh(layer(x))

        return self.head(body(x, self.layers))


def test_transforms_inside_the_model_keep_the_policy():
    model = ScannedStack(nnx.Rngs(0))
    x = jnp.ones((2, 4))
    # The scanned layers' output dtype matches the float32 carry.
    policy_map = jp.DTypePolicyMap("float32", {"layers": "p=f32,c=bf16,o=f32"})
    out = jpnnx.apply(model, policy_map)(x)
    assert out.dtype == F32
    assert SEEN["stack/layers"] == {
        "x": BF16,
        "kernel": BF16,
        "bias": BF16,
        "policy": jp.get_policy("p=f32,c=bf16,o=f32"),
    }
    assert SEEN["stack/head"]["kernel"] == F32
    grads = nnx.jit(nnx.grad(lambda m: jpnnx.apply(m, policy_map)(x).sum()))(model)
    assert grads["layers"]["kernel"][...].shape == (3, 4, 4)
    assert grads["layers"]["kernel"][...].dtype == F32


# -- state: BatchNorm, Dropout, sow ----------------------------------------------------


class BNModel(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(3, 4, rngs=rngs)
        self.bn = nnx.BatchNorm(4, momentum=0.5, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.dropout(self.bn(self.linear(x)))


@pytest.mark.parametrize("type_policies", [None, jpnnx.NORM_FLOAT32], ids=["bf16", "f32_norm"])
def test_batchnorm_statistics_reach_the_model_in_float32(nnx_jit, type_policies):
    model = BNModel(nnx.Rngs(0))
    model.dropout.deterministic = True
    x = jax.random.normal(jax.random.key(1), (8, 3)) + 3.0

    @nnx_jit
    def run(m, x):
        return jpnnx.apply(m, "mixed_bfloat16", type_policies=type_policies)(x)

    out = run(model, x)
    assert out.dtype == BF16
    mean, var = model.bn.mean[...], model.bn.var[...]
    assert mean.dtype == F32 and var.dtype == F32
    expected = 0.5 * np.asarray(model.linear(x)).mean(axis=0)
    np.testing.assert_allclose(np.asarray(mean), expected, rtol=2e-2, atol=2e-2)
    assert model.linear.kernel[...].dtype == F32
    # Evaluation mode reads the stored statistics and leaves them alone.
    model.eval()
    run(model, x)
    np.testing.assert_array_equal(np.asarray(model.bn.mean[...]), np.asarray(mean))


def test_batchnorm_statistics_update_under_grad():
    model = BNModel(nnx.Rngs(0))
    model.dropout.deterministic = True
    x = jax.random.normal(jax.random.key(1), (8, 3))

    def loss(m):
        return jpnnx.apply(m, "mixed_bfloat16")(x).astype(F32).sum()

    grads = nnx.jit(nnx.grad(loss))(model)
    assert float(jnp.abs(model.bn.mean[...]).sum()) > 0
    assert model.bn.mean[...].dtype == F32
    assert "mean" not in grads["bn"]


def test_dropout_advances_the_models_rng_count():
    model = BNModel(nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (8, 3))
    count = model.dropout.rngs.count[...]
    run = nnx.jit(lambda m, x: jpnnx.apply(m, "mixed_bfloat16")(x))
    a, b = run(model, x), run(model, x)
    assert a.dtype == BF16
    assert int(model.dropout.rngs.count[...]) == int(count) + 2
    assert bool(jnp.any(a == 0)) and bool(jnp.any(a != 0))
    assert not bool(jnp.all((a == 0) == (b == 0)))  # a new mask each call


def test_dropout_with_rngs_argument():
    rngs = nnx.Rngs(dropout=7)

    class WithRngs(nnx.Module):
        def __init__(self):
            self.inner = nnx.Dropout(0.5)

        def __call__(self, x, rngs):
            return self.inner(x, rngs=rngs)

    wrapper = WithRngs()
    out = jpnnx.apply(wrapper, "bfloat16")(jnp.ones((16,)), rngs=rngs)
    assert out.dtype == BF16 and bool(jnp.any(out == 0))
    assert int(rngs.dropout.count[...]) == 1  # the caller's Rngs object was used


class Sower(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(2, 2, rngs=rngs)

    def __call__(self, x):
        y = self.linear(x)
        self.y = nnx.Intermediate(y)  # a variable created during the call
        return y


def test_sown_intermediates_reach_the_model():
    model = Sower(nnx.Rngs(0))
    _run_jit(model, "mixed_bfloat16", jnp.ones((1, 2)))
    assert isinstance(model.y, nnx.Intermediate) and model.y[...].dtype == BF16


# -- type policies and variable keys ---------------------------------------------------


def test_type_policies_keep_norms_in_float32():
    model = _model()
    jpnnx.apply(model, "mixed_bfloat16", type_policies=jpnnx.NORM_FLOAT32)(IDS)
    for i in range(2):
        assert SEEN[f"encoder/layers/{i}/norm"] == {"x": F32, "scale": F32, "policy": FLOAT32}
        assert SEEN[f"encoder/layers/{i}/mlp"]["kernel"] == BF16


def test_key_naming_the_module_wins_over_its_type():
    model = _model()
    policy_map = jp.DTypePolicyMap("mixed_bfloat16", {"encoder/layers/0/norm": "bfloat16"})
    jpnnx.apply(model, policy_map, type_policies=jpnnx.NORM_FLOAT32)(IDS)
    assert SEEN["encoder/layers/0/norm"]["policy"] == jp.DTypePolicy("bfloat16")
    assert SEEN["encoder/layers/0/norm"]["scale"] == BF16
    assert SEEN["encoder/layers/1/norm"]["scale"] == F32


def test_type_wins_over_inheritance_from_an_ancestor():
    model = _model()
    types_ = {Dense: "float16"}
    policy_map = jp.DTypePolicyMap(
        "float32", {"encoder": "bfloat16", "encoder/proj/layers/2": "bfloat16"}
    )
    _run_jit(model, policy_map, IDS, type_policies=types_)
    assert SEEN["encoder/layers/0/mlp"]["kernel"] == np.dtype("float16")  # type beats "encoder"
    assert SEEN["encoder/proj/layers/2"]["kernel"] == BF16  # key beats type
    assert SEEN["head"]["kernel"] == np.dtype("float16")
    assert SEEN["encoder/layers/0/norm"]["scale"] == BF16  # inherits "encoder"


def test_variable_key_keeps_one_variable_in_float32():
    model = _model()
    # The variable keeps float32 while its module (and the rest) computes in bfloat16.
    policy_map = jp.DTypePolicyMap("mixed_bfloat16", {"embed/embedding": "float32"})
    jpnnx.apply(model, policy_map)(IDS)
    assert SEEN["embed"] == {"x": np.dtype("int32"), "embedding": F32, "policy": MIXED}
    assert SEEN["head"]["kernel"] == BF16
    grads = nnx.grad(lambda m: _loss(m, IDS, policy_map))(model)
    assert grads["embed"]["embedding"][...].dtype == F32


class RecLinear(nnx.Linear):
    def __call__(self, x):
        _record("head", x=x.dtype, kernel=self.kernel[...])
        return super().__call__(x)


def test_a_module_with_its_own_dtype_is_respected():
    # `nnx.Linear(..., dtype=jnp.float32)`, the usual float32 logits head, computes in
    # float32 whatever the policy says: its weights are not rounded through bfloat16.
    head = RecLinear(4, 2, dtype=jnp.float32, rngs=nnx.Rngs(1))
    model = nnx.Sequential(Dense(3, 4, "body", nnx.Rngs(0)), head)
    x = jnp.ones((2, 3))
    out = jpnnx.apply(model, {"": "float32", ".*": "mixed_bfloat16"})(x)
    assert SEEN["body"]["kernel"] == BF16
    assert SEEN["head"]["x"] == F32 and SEEN["head"]["kernel"].dtype == F32
    np.testing.assert_array_equal(SEEN["head"]["kernel"], head.kernel[...])
    assert SEEN["head"]["policy"].compute_dtype == F32
    assert out.dtype == F32  # the head's output is left in its own dtype
    # A key naming one of its variables still wins.
    jpnnx.apply(model, {".*": "mixed_bfloat16", "layers/1/kernel": "bfloat16"})(x)
    assert SEEN["head"]["kernel"].dtype == BF16


def test_other_method_and_callable_method():
    model = _model()
    out = jpnnx.apply(model, MAP, method="encode")(IDS)
    assert out.dtype == BF16  # the encoder's output, left as computed (output rule)
    assert SEEN["encoder/layers/0/mlp"]["kernel"] == BF16
    SEEN.clear()
    out = jpnnx.apply(model, "mixed_bfloat16", method=lambda m, ids: m.head(m.embed(ids)))(IDS)
    assert out.dtype == BF16
    assert SEEN["head"]["policy"] == MIXED and "encoder" not in SEEN


class JitDense(Dense):
    """A layer whose `__call__` is an `nnx.jit` object, not a plain function."""

    @nnx.jit
    def __call__(self, x):
        return super().__call__(x)

    @nnx.jit
    def project(self, x):
        return super().__call__(x)


def test_methods_decorated_with_nnx_transforms_are_wrapped():
    layer = JitDense(3, 2, "layer", nnx.Rngs(0))
    model = nnx.Sequential(Dense(3, 3, "first", nnx.Rngs(1)), layer)
    x = jnp.ones((2, 3))
    out = jpnnx.apply(model, {"layers/1": "bfloat16"})(x)
    assert out.dtype == BF16  # the bfloat16 layer's output, left as computed
    assert SEEN["layer"]["x"] == BF16 and SEEN["layer"]["kernel"] == BF16
    assert SEEN["layer"]["policy"] == jp.DTypePolicy("bfloat16")
    SEEN.clear()  # A new shape: `nnx.jit` traces again, and the probe records again.
    assert jpnnx.apply(layer, "bfloat16")(x[:1]).dtype == BF16
    assert SEEN["layer"]["x"] == BF16 and SEEN["layer"]["policy"] == jp.DTypePolicy("bfloat16")
    SEEN.clear()
    assert jpnnx.apply(layer, "mixed_bfloat16", method="project")(x).dtype == BF16
    assert SEEN["layer"]["x"] == BF16 and SEEN["layer"]["kernel"] == BF16


# -- training --------------------------------------------------------------------------


def test_training_step_lowers_the_loss_with_float32_params():
    model = _model()
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    target = jax.random.normal(jax.random.key(3), (2, 3, 3))

    def loss_fn(m):
        out = jpnnx.apply(m, "mixed_bfloat16", type_policies=jpnnx.NORM_FLOAT32)(IDS)
        return jnp.mean((out.astype(jnp.float32) - target) ** 2)

    @nnx.jit
    def train_step(model, optimizer):
        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    losses = [float(train_step(model, optimizer)) for _ in range(30)]
    assert losses[-1] < 0.5 * losses[0]
    assert {v.dtype for v in _params(model).values()} == {F32}


# -- errors ----------------------------------------------------------------------------


def test_bad_arguments_raise_naming_the_argument():
    model = _model()
    with pytest.raises(TypeError, match="`model`"):
        jpnnx.apply(lambda x: x, "float32")
    with pytest.raises(ValueError, match=r"`policy_or_map`.*'f17'"):
        jpnnx.apply(model, "f17")
    with pytest.raises(ValueError, match=r"`method`.*'decode'"):
        jpnnx.apply(model, "float32", method="decode")
    with pytest.raises(TypeError, match="`method`"):
        jpnnx.apply(model, "float32", method=3)
    with pytest.raises(TypeError, match="`type_policies`"):
        jpnnx.apply(model, "float32", type_policies=[nnx.LayerNorm])
    with pytest.raises(TypeError, match="`type_policies`"):
        jpnnx.apply(model, "float32", type_policies={"LayerNorm": "float32"})
    with pytest.raises(TypeError, match=r"`type_policies`.*nnx.Module"):
        jpnnx.apply(model, "float32", type_policies={int: "float32"})
    with pytest.raises(ValueError, match=r"`type_policies`.*'f17'"):
        jpnnx.apply(model, "float32", type_policies={nnx.LayerNorm: "f17"})


def test_ambiguous_map_raises_naming_the_path():
    model = _model()
    run = jpnnx.apply(model, {"encoder/.*": "bfloat16", ".*norm": "float32"})
    with pytest.raises(ValueError, match="encoder/layers/0/norm"):
        run(IDS)


def test_norm_float32_is_read_only():
    assert {cls: v.policy for cls, v in jpnnx.NORM_FLOAT32.items()} == {
        nnx.LayerNorm: jp.DTypePolicy("float32"),
        nnx.RMSNorm: jp.DTypePolicy("float32"),
        nnx.BatchNorm: jp.DTypePolicy("float32"),
        nnx.GroupNorm: jp.DTypePolicy("float32"),
        nnx.InstanceNorm: jp.DTypePolicy("float32"),
    }
    with pytest.raises(TypeError):
        jpnnx.NORM_FLOAT32[nnx.Linear] = "float32"


def test_plain_array_attributes_stay_state_and_the_toy_example_trains():
    """Flax's `07_array_leaves` toy example keeps its weights as plain arrays: they are
    not `nnx.Param`s for Flax (`nnx.grad`/`nnx.Optimizer` take them only by the user's
    filter), so the policy leaves them in their stored dtype, says so once, and the
    model runs and trains; the plain `count` it increments is written back."""
    from flax_examples import nnx_array_leaves as toy

    model = toy.MLP(din=1, dhidden=32, dout=1, rngs=nnx.Rngs(0))
    run = jp.nnx.apply(model, "mixed_bfloat16")
    x = jnp.asarray(toy.X[:8], jnp.float32)
    with pytest.warns(UserWarning) as record:
        out = run(x)
        run(x)
    messages = [str(w.message) for w in record]
    assert len(messages) == 1
    assert messages[0].startswith(
        "MLP keeps floating arrays as plain attributes (linear1/b, linear1/w, linear2/b, "
        "linear2/w)."
    )
    assert "Wrap them in `nnx.Param`" in messages[0]
    # The policy casts the inputs; `x @ w` with a float32 plain `w` promotes to float32.
    assert out.dtype == jnp.float32 and out.shape == (8, 1)
    assert int(model.count) == 2
    assert model.linear1.w.dtype == jnp.float32  # stored arrays untouched

    # The example's own train step, with the model run under the policy.
    optimizer = nnx.Optimizer(model, optax.sgd(1e-1), wrt=toy.is_param)
    batch = (x, jnp.asarray(toy.Y[:8], jnp.float32))

    @nnx.jit
    def train_step(model, optimizer, batch):
        x, y = batch

        def loss_fn(model):
            y_pred = jp.nnx.apply(model, "mixed_bfloat16")(x)
            return jnp.mean((y - y_pred.astype(jnp.float32)) ** 2)

        grads = nnx.grad(loss_fn, argnums=nnx.DiffState(0, toy.is_param))(model)
        optimizer.update(model, grads)
        return loss_fn(model)

    before = jnp.mean((batch[1] - model(x)) ** 2)
    with pytest.warns(UserWarning, match="plain attributes"):
        for _ in range(5):
            loss = train_step(model, optimizer, batch)
    assert float(loss) < float(before)
    assert model.linear1.w.dtype == jnp.float32 and int(model.count) > 2
    toy.train_step(model, optimizer, batch)  # the example's step still runs unwrapped


def test_plain_int_and_matching_float_arrays_do_not_warn():
    class Counter(nnx.Module):
        def __init__(self, rngs):
            self.count = jnp.array(0)
            self.scale = jnp.ones((3,), jnp.bfloat16)
            self.linear = nnx.Linear(3, 2, rngs=rngs)

        def __call__(self, x):
            self.count += 1
            return self.linear(x * self.scale)

    model = Counter(nnx.Rngs(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = jp.nnx.apply(model, "mixed_bfloat16")(jnp.ones((1, 3)))
    assert out.dtype == jnp.bfloat16 and int(model.count) == 1
    assert model.scale.dtype == jnp.bfloat16
