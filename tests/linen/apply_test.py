"""Tests of `jmp_policy.linen`: per-submodule policies for Flax Linen models."""

from __future__ import annotations

import re
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_policy as jp
from jmp_policy import linen as jpl

F16, BF16, F32 = np.dtype("float16"), np.dtype(jnp.bfloat16), np.dtype("float32")

# What each submodule saw, by path, written at trace time (the last trace wins: the
# shape-only pre-pass runs before the real call).
SEEN: dict[str, dict[str, Any]] = {}


def record(module: nn.Module, **arrays: Any) -> None:
    entry: dict[str, Any] = {name: np.dtype(a.dtype) for name, a in arrays.items()}
    entry["policy"] = jp.current_policy()
    SEEN["/".join(module.path)] = entry


@pytest.fixture(autouse=True)
def _clear_seen():
    SEEN.clear()
    yield
    SEEN.clear()


class RecDense(nn.Module):
    features: int

    @nn.compact
    def __call__(self, x):
        kernel = self.param("kernel", nn.initializers.lecun_normal(), (x.shape[-1], self.features))
        bias = self.param("bias", nn.initializers.normal(0.1), (self.features,))
        y = x @ kernel + bias
        record(self, x=x, kernel=kernel, bias=bias, y=y)
        return y


class RecLayerNorm(nn.LayerNorm):
    def __call__(self, x, *, mask=None):
        y = super().__call__(x, mask=mask)
        scale = self.variables["params"]["scale"]
        record(self, x=x, scale=scale, y=y)
        return y


class Block(nn.Module):
    carry: bool = False

    @nn.compact
    def __call__(self, x, _=None):
        h = nn.gelu(RecDense(8, name="mlp")(x))
        y = x + RecDense(8, name="out")(h)
        record(self, x=x, y=y)
        return (y, None) if self.carry else y


class Encoder(nn.Module):
    scan: bool = False

    @nn.compact
    def __call__(self, x):
        record(self, x=x)
        if self.scan:
            stack = nn.scan(
                nn.remat(Block),
                variable_axes={"params": 0},
                split_rngs={"params": True},
                length=2,
            )
            x, _ = stack(carry=True, name="layers")(x, None)
        else:
            for i in range(2):
                x = Block(name=f"layers_{i}")(x)
        return x


class Model(nn.Module):
    scan: bool = False

    @nn.compact
    def __call__(self, x):
        record(self, x=x)
        x = RecDense(8, name="embed")(x)
        x = Encoder(self.scan, name="encoder")(x)
        x = RecLayerNorm(name="final_norm")(x)
        return RecDense(3, name="head")(x)


POLICY_MAP = {"encoder/.*": "mixed_bfloat16", ".*norm.*": "float32", "head": "float32"}


def make_map() -> jp.DTypePolicyMap:
    return jp.DTypePolicyMap("mixed_float16", POLICY_MAP)


X = jax.random.normal(jax.random.key(1), (4, 5), jnp.float32)


def layer_paths(scan: bool) -> list[str]:
    return ["encoder/layers"] if scan else ["encoder/layers_0", "encoder/layers_1"]


def assert_seen_per_path(scan: bool) -> None:
    """The dtypes the submodules of `Model` see under `make_map()`."""
    assert SEEN[""]["x"] == F16 and SEEN[""]["policy"] == jp.DTypePolicy("mixed_float16")
    for name in ("x", "kernel", "bias", "y"):
        assert SEEN["embed"][name] == F16, name
    assert SEEN["encoder"]["x"] == F16
    assert SEEN["encoder"]["policy"].name == "mixed_float16"
    for layer in layer_paths(scan):
        assert SEEN[layer]["x"] == BF16 and SEEN[layer]["y"] == BF16
        assert SEEN[layer]["policy"] == jp.DTypePolicy("mixed_bfloat16")
        for sub in ("mlp", "out"):
            entry = SEEN[f"{layer}/{sub}"]
            assert {entry[n] for n in ("x", "kernel", "bias", "y")} == {BF16}, (layer, sub)
            assert entry["policy"].compute_dtype == BF16
    for name in ("x", "scale", "y"):
        assert SEEN["final_norm"][name] == F32, name
    assert SEEN["final_norm"]["policy"] == jp.DTypePolicy("float32")
    for name in ("x", "kernel", "bias", "y"):
        assert SEEN["head"][name] == F32, name


_VARIABLES: dict[bool, Any] = {}


def init_variables(scan: bool) -> Any:
    if scan not in _VARIABLES:
        _VARIABLES[scan] = jax.jit(Model(scan).init)(jax.random.key(0), X)
    return _VARIABLES[scan]


# -- per-submodule dtypes, gradients, jit, scan + remat -----------------------------------


# Eager Flax compiles op by op (slow on CPU): the big model runs eagerly once, else jitted.
@pytest.mark.parametrize(
    "scan, use_jit",
    [(False, False), (False, True), (True, True)],
    ids=["loop-eager", "loop-jit", "scan_remat-jit"],
)
def test_each_submodule_sees_its_own_dtypes(scan, use_jit):
    model = Model(scan)
    variables = init_variables(scan)
    fn = jpl.apply(model, make_map())
    y = (jax.jit(fn) if use_jit else fn)(variables, X)
    assert y.dtype == F32  # the float32 head's output, as computed (the output rule)
    assert_seen_per_path(scan)
    reference = jax.jit(model.apply)(variables, X)
    np.testing.assert_allclose(np.asarray(y, np.float32), reference, rtol=0.1, atol=0.1)
    # Stored parameters are untouched.
    assert {p.dtype for p in jax.tree.leaves(variables)} == {F32}


@pytest.mark.parametrize("scan", [False, True], ids=["loop", "scan_remat"])
def test_gradients_are_float32_finite_and_close_to_float32_gradients(scan):
    model = Model(scan)
    params = init_variables(scan)["params"]
    fn = jpl.apply(model, make_map())

    def loss(p):
        return jnp.mean(jnp.square(fn({"params": p}, X).astype(jnp.float32)))

    def reference_loss(p):
        return jnp.mean(jnp.square(model.apply({"params": p}, X)))

    value, grads = jax.jit(jax.value_and_grad(loss))(params)
    assert_seen_per_path(scan)
    _, reference = jax.jit(jax.value_and_grad(reference_loss))(params)
    assert value.dtype == F32 and np.isfinite(value)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(reference), strict=True):
        assert g.dtype == F32 and g.shape == r.shape
        assert np.all(np.isfinite(g))
        np.testing.assert_allclose(g, r, rtol=0.15, atol=0.05 * float(np.abs(r).max()) + 1e-3)


def test_scan_float32_carry_keeps_its_dtype_under_a_bfloat16_policy(maybe_jit):
    class Cell(nn.Module):
        @nn.compact
        def __call__(self, c, x):
            h = nn.tanh(nn.Dense(4)(c) + x)
            record(self, c=c, x=x, h=h)
            return h, h

    class Rnn(nn.Module):
        @nn.compact
        def __call__(self, xs):
            cell = nn.scan(
                Cell,
                variable_broadcast="params",
                split_rngs={"params": False},
                in_axes=1,
                out_axes=1,
            )
            carry, ys = cell(name="cell")(jnp.zeros((2, 4), jnp.float32), xs)
            record(self, carry=carry, ys=ys)
            return carry, ys

    xs = jnp.ones((2, 3, 4))
    variables = jax.jit(Rnn().init)(jax.random.key(0), xs)
    carry, ys = maybe_jit(jpl.apply(Rnn(), "p=f32,c=bf16,o=f32"))(variables, xs)
    assert carry.dtype == F32 and ys.dtype == F32
    assert SEEN["cell"]["c"] == BF16 and SEEN["cell"]["x"] == BF16
    assert SEEN["cell"]["h"] == F32  # the inner Dense's output dtype is float32
    # The body computes and outputs bfloat16; its carry goes back to float32.
    carry, ys = maybe_jit(jpl.apply(Rnn(), {"cell": "mixed_bfloat16"}))(variables, xs)
    assert SEEN["cell"]["h"] == BF16
    assert SEEN[""]["carry"] == F32 and SEEN[""]["ys"] == BF16
    # The root is float32 and leaves its outputs as computed: ys as the bfloat16 body made
    # them (output rule), the carry as it entered the loop (loop rule).
    assert carry.dtype == F32 and ys.dtype == BF16
    reference = jax.jit(Rnn().apply)(variables, xs)
    np.testing.assert_allclose(ys, reference[1], atol=0.05)
    np.testing.assert_allclose(carry, reference[0], atol=0.05)
    # The root module itself may be an nn.scan: the body at the path "" keeps its carry too.
    root_scan = nn.scan(
        Cell, variable_broadcast="params", split_rngs={"params": False}, in_axes=1, out_axes=1
    )()
    c0 = jnp.zeros((2, 4), jnp.float32)
    root_variables = {"params": variables["params"]["cell"]}
    carry, ys = maybe_jit(jpl.apply(root_scan, "p=f32,c=bf16,o=f32"))(root_variables, c0, xs)
    assert carry.dtype == F32 and ys.dtype == F32
    assert SEEN[""]["c"] == BF16


def test_vmap_ensemble_runs_in_its_compute_dtype():
    class Ensemble(nn.Module):
        @nn.compact
        def __call__(self, x):
            heads = nn.vmap(
                RecDense,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                in_axes=None,
                out_axes=0,
                axis_size=3,
            )
            y = heads(2, name="heads")(x)
            # A remat'd module returning a pair: both come back as computed (bfloat16).
            a, b = nn.remat(Pair)(name="pair")(y, y)
            record(self, a=a, b=b)
            return a + b

    class Pair(nn.Module):
        @nn.compact
        def __call__(self, a, b):
            record(self, a=a, b=b)
            return a * 2, b * 3

    model = Ensemble()
    variables = jax.jit(model.init)(jax.random.key(0), X)
    assert variables["params"]["heads"]["kernel"].shape == (3, 5, 2)
    fn = jpl.apply(
        model,
        jp.DTypePolicyMap("mixed_bfloat16", {"": "float32", "heads": "p=f32,c=bf16,o=f32"}),
    )
    y = jax.jit(fn)(variables, X)
    assert y.shape == (3, 4, 2) and y.dtype == BF16  # the pair's bfloat16, as computed
    assert SEEN["heads"]["x"] == BF16 and SEEN["heads"]["kernel"] == BF16
    assert SEEN["heads"]["y"] == BF16
    assert SEEN["pair"]["a"] == BF16 and SEEN["pair"]["b"] == BF16
    assert SEEN[""]["a"] == BF16 and SEEN[""]["b"] == BF16  # no carry kept in float32
    grads = jax.jit(jax.grad(lambda p: fn({"params": p}, X).sum()))(variables["params"])
    assert grads["heads"]["kernel"].dtype == F32 and grads["heads"]["kernel"].shape == (3, 5, 2)


# -- collections and rngs -----------------------------------------------------------------


class BnModel(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Dense(6)(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.5, name="bn")(x)
        return nn.Dense(2)(x)


@pytest.mark.parametrize("type_policies", [None, jpl.NORM_FLOAT32], ids=["bf16_bn", "f32_bn"])
def test_batchnorm_statistics_stay_float32_in_training(type_policies):
    model = BnModel()
    variables = jax.jit(model.init, static_argnames="train")(jax.random.key(0), X, train=False)
    fn = jpl.apply(model, "mixed_bfloat16", type_policies=type_policies)

    @jax.jit
    def step(variables):
        def loss(params):
            y, state = fn({**variables, "params": params}, X, train=True, mutable=["batch_stats"])
            return jnp.sum(y.astype(jnp.float32) ** 2), state

        (value, state), grads = jax.value_and_grad(loss, has_aux=True)(variables["params"])
        return value, state, grads

    value, state, grads = step(variables)
    assert value.dtype == F32 and np.isfinite(value)
    stats = state["batch_stats"]["bn"]
    assert stats["mean"].dtype == F32 and stats["var"].dtype == F32
    old = variables["batch_stats"]["bn"]
    assert not np.allclose(stats["mean"], old["mean"])  # they were updated
    expected_mean = 0.5 * jnp.mean(
        nn.Dense(6).apply({"params": variables["params"]["Dense_0"]}, X), axis=0
    )
    np.testing.assert_allclose(stats["mean"], expected_mean, atol=0.02)
    assert all(g.dtype == F32 and np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))
    # Evaluation mode reads the statistics without mutating anything.
    y = jax.jit(fn, static_argnames="train")(
        {**variables, "batch_stats": state["batch_stats"]}, X, train=False
    )
    assert y.dtype == BF16


def test_mutable_true_returns_params_as_stored():
    model = BnModel()
    variables = jax.jit(model.init, static_argnames="train")(jax.random.key(0), X, train=False)
    fn = jpl.apply(model, "mixed_bfloat16")
    for run in (fn, jax.jit(fn, static_argnames=("train", "mutable"))):
        _, state = run(variables, X, train=True, mutable=True)
        assert set(state) == {"params", "batch_stats"}
        for new, old in zip(
            jax.tree.leaves(state["params"]), jax.tree.leaves(variables["params"]), strict=True
        ):
            assert new.dtype == F32
            np.testing.assert_array_equal(new, old)  # not rounded through bfloat16


class Decoder(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.MultiHeadDotProductAttention(num_heads=2, decode=True, name="attn")(x)


def test_decoding_with_a_cache_made_by_init():
    # `init` makes the cache in the compute dtype; decoding writes bfloat16 keys into it.
    # (The shape-only pre-pass must see the model as the real call does: cast.)
    model, x = Decoder(), jax.random.normal(jax.random.key(2), (1, 3, 4))
    variables = jax.jit(jpl.init(model, "mixed_bfloat16"))(jax.random.key(0), x)
    assert variables["cache"]["attn"]["cached_key"].dtype == BF16
    step = jax.jit(jpl.apply(model, "mixed_bfloat16"), static_argnames="mutable")
    out, state = step(variables, x[:, :1], mutable=("cache",))
    assert out.dtype == BF16 and out.shape == (1, 1, 4)
    cache = state["cache"]["attn"]
    assert cache["cached_key"].dtype == BF16 and int(cache["cache_index"]) == 1
    assert np.any(np.asarray(cache["cached_key"][:, 0], np.float32) != 0)
    assert np.all(np.asarray(cache["cached_key"][:, 1:], np.float32) == 0)


def test_dropout_with_rngs_and_noise_from_current_policy():
    class Noisy(nn.Module):
        @nn.compact
        def __call__(self, x):
            noise = jax.random.normal(
                self.make_rng("noise"), x.shape, jp.current_policy().compute_dtype
            )
            record(self, x=x, noise=noise)
            return x + noise

    class Model2(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Dense(16)(x)
            x = nn.Dropout(0.5, deterministic=False)(x)
            return Noisy(name="noisy")(x)

    model = Model2()
    variables = jax.jit(model.init)(
        {"params": jax.random.key(0), "dropout": jax.random.key(1), "noise": jax.random.key(2)}, X
    )
    fn = jax.jit(jpl.apply(model, {"noisy": "float16"}))
    rngs = {"dropout": jax.random.key(3), "noise": jax.random.key(4)}
    with jp.policy_scope("mixed_bfloat16"):
        y = fn(variables, X, rngs=rngs)
        assert SEEN["noisy"]["noise"] == F16 and SEEN["noisy"]["x"] == F16
        assert SEEN["noisy"]["policy"] == jp.DTypePolicy("float16")
        assert y.dtype == F16  # the float16 module's output, left as computed (output rule)
        y_again = fn(variables, X, rngs=rngs)
        y_other = fn(variables, X, rngs={**rngs, "dropout": jax.random.key(5)})
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(y_again, np.float32))
    assert not np.allclose(np.asarray(y, np.float32), np.asarray(y_other, np.float32))
    assert np.isfinite(np.asarray(y, np.float32)).all()
    y2 = jax.jit(jpl.apply(model, {"noisy": "float16"}))(variables, X, rngs=rngs)
    assert y2.dtype == F16  # as computed by the float16 module, under a float32 root


def test_outputs_are_cast_to_the_output_dtype_and_intermediates_capture_them():
    model = Model()
    variables = init_variables(False)
    policy_map = jp.DTypePolicyMap(
        "float32", {"embed": "p=f32,c=bf16,o=f32", "encoder": "p=f32,c=f16,o=bf16"}
    )
    y, state = jpl.apply(model, policy_map)(variables, X, capture_intermediates=True)
    inter = state["intermediates"]
    assert SEEN["embed"]["y"] == BF16  # computed in bfloat16 ...
    assert inter["embed"]["__call__"][0].dtype == F32  # ... returned in float32
    assert SEEN["encoder/layers_0/mlp"]["y"] == F16
    assert inter["encoder"]["layers_0"]["__call__"][0].dtype == BF16
    assert inter["encoder"]["__call__"][0].dtype == BF16
    assert y.dtype == F32


# -- type policies and modules' own dtypes ------------------------------------------------


class Normed(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = RecDense(4, name="dense")(x)
        x = RecLayerNorm(name="norm1")(x)
        x = RecDense(4, name="dense2")(x)
        return RecLayerNorm(name="norm2")(x)


def test_type_policies_keep_norms_float32_and_a_path_key_wins():
    model = Normed()
    variables = jax.jit(model.init)(jax.random.key(0), X)
    # A float32 scale that bfloat16 cannot hold: it must reach the island unrounded.
    fine = jnp.full((4,), 1 + 2.0**-12, jnp.float32)
    variables = {"params": {**variables["params"], "norm1": {"scale": fine, "bias": jnp.zeros(4)}}}
    policy_map = jp.DTypePolicyMap("mixed_bfloat16", {"norm2": "bfloat16"})
    fn = jpl.apply(model, policy_map, type_policies=jpl.NORM_FLOAT32)
    jax.jit(fn)(variables, X)
    assert SEEN["dense"]["kernel"] == BF16 and SEEN["dense2"]["x"] == BF16
    assert SEEN["norm1"]["x"] == F32 and SEEN["norm1"]["scale"] == F32
    assert SEEN["norm1"]["policy"] == jp.DTypePolicy("float32")
    assert SEEN["norm2"]["x"] == BF16 and SEEN["norm2"]["scale"] == BF16  # key wins
    # Eagerly the island's scale is the stored float32 value, bit for bit.
    seen_scale = []

    class Probe(RecLayerNorm):
        def __call__(self, x, *, mask=None):
            seen_scale.append(self.variables["params"]["scale"])
            return super().__call__(x, mask=mask)

    jpl.apply(Probe(), "bfloat16", type_policies=jpl.NORM_FLOAT32)(
        {"params": {"scale": fine, "bias": jnp.zeros(4)}}, jnp.ones((2, 4))
    )
    np.testing.assert_array_equal(seen_scale[-1], fine)
    assert seen_scale[-1].dtype == F32
    # A type policy wins over inheritance from an ancestor.
    explained = jpl.explain(model, policy_map, variables, X, type_policies=jpl.NORM_FLOAT32)
    assert re.search(r"norm1\s+RecLayerNorm\s+float32\s+type RecLayerNorm", explained)
    assert re.search(r"norm2\s+RecLayerNorm\s+bfloat16\s+key 'norm2'", explained)


class OwnDtype(nn.Module):
    dtype: Any = None

    @nn.compact
    def __call__(self, x):
        kernel = self.param("kernel", nn.initializers.lecun_normal(), (x.shape[-1], 3))
        y = jnp.dot(x, kernel.astype(self.dtype or kernel.dtype))
        record(self, x=x, kernel=kernel, y=y)
        return y


@pytest.mark.filterwarnings("ignore:.*set their own `dtype`:UserWarning")  # its subject
def test_a_module_with_its_own_dtype_is_respected():
    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = OwnDtype(name="free")(x)
            return OwnDtype(dtype=jnp.float32, name="pinned")(h), nn.Dense(
                2, dtype=jnp.float32, name="logits"
            )(h)

    model = Net()
    variables = jax.jit(model.init)(jax.random.key(0), X)
    fn = jpl.apply(model, jp.DTypePolicyMap("mixed_bfloat16", {"": "float32"}))
    pinned, logits = jax.jit(fn)(variables, X)
    assert SEEN["free"]["x"] == BF16 and SEEN["free"]["kernel"] == BF16
    assert SEEN["pinned"]["x"] == F32 and SEEN["pinned"]["kernel"] == F32
    assert SEEN["pinned"]["policy"].compute_dtype == F32
    assert pinned.dtype == F32 and logits.dtype == F32
    explained = jpl.explain(model, "mixed_bfloat16", variables, X)
    assert re.search(r"pinned\s+OwnDtype\s+mixed_bfloat16\s+default\s+f32\s+f32\s+36", explained)
    assert re.search(r"logits\s+Dense\s+mixed_bfloat16\s+default\s+f32", explained)
    assert re.search(r"free\s+OwnDtype\s+mixed_bfloat16\s+default\s+f32→bf16", explained)


# -- init ---------------------------------------------------------------------------------


def test_init_returns_params_in_their_variable_dtype_per_path():
    model = Model()
    policy_map = jp.DTypePolicyMap(
        "mixed_bfloat16", {"encoder/layers_1": "bfloat16", "head/kernel": "float16"}
    )
    variables = jax.jit(jpl.init(model, policy_map))(jax.random.key(0), X)
    dtypes = jax.tree.map(lambda a: a.dtype, variables["params"])
    assert dtypes["embed"]["kernel"] == F32
    assert dtypes["encoder"]["layers_0"]["mlp"]["kernel"] == F32
    assert {d for d in jax.tree.leaves(dtypes["encoder"]["layers_1"])} == {BF16}
    assert dtypes["head"]["kernel"] == F16 and dtypes["head"]["bias"] == F32
    # Submodules ran under their policies during init too.
    assert SEEN["encoder/layers_1/mlp"]["policy"] == jp.DTypePolicy("bfloat16")
    assert SEEN["encoder/layers_1/mlp"]["x"] == BF16
    reference = init_variables(False)["params"]  # the same key
    np.testing.assert_allclose(variables["params"]["embed"]["kernel"], reference["embed"]["kernel"])


def test_init_with_type_policies_and_param_dtype():
    model = nn.Sequential([nn.Dense(4, param_dtype=jnp.bfloat16), nn.LayerNorm()])
    variables = jpl.init(model, "bfloat16", type_policies=jpl.NORM_FLOAT32)(jax.random.key(0), X)
    assert variables["params"]["layers_0"]["kernel"].dtype == BF16
    assert variables["params"]["layers_1"]["scale"].dtype == F32
    variables = jpl.init(model, "mixed_bfloat16")(jax.random.key(0), X)
    assert variables["params"]["layers_0"]["kernel"].dtype == F32


# -- policy_or_map forms and errors -------------------------------------------------------


@pytest.mark.parametrize(
    "policy_or_map, expected",
    [
        ("mixed_bfloat16", BF16),
        ("p=f32,c=f16,o=f32", F32),
        (jp.DTypePolicy("float16"), F16),
        ({"embed": "bfloat16"}, F32),
        (None, F32),
    ],
    ids=["name", "jmp_string", "policy", "dict", "none"],
)
def test_policy_or_map_forms(policy_or_map, expected):
    variables = init_variables(False)
    y = jpl.apply(Model(), policy_or_map)(variables, X)
    assert y.dtype == expected
    if isinstance(policy_or_map, dict):
        assert SEEN["embed"]["kernel"] == BF16 and SEEN["head"]["kernel"] == F32
    with jp.policy_scope("mixed_float16"):
        y = jpl.apply(Model(), None)(variables, X)
    assert y.dtype == F16 and SEEN["head"]["policy"] == jp.DTypePolicy("mixed_float16")


def test_method_argument_runs_the_root_under_its_policy():
    class TwoMethods(nn.Module):
        def setup(self):
            self.body = RecDense(4)

        def __call__(self, x):
            return self.body(x)

        def encode(self, x):
            record(self, x=x)
            return self.body(x) * 2

    model = TwoMethods()
    variables = jax.jit(model.init)(jax.random.key(0), X)
    y = jpl.apply(model, "mixed_bfloat16", method="encode")(variables, X)
    assert y.dtype == BF16 and SEEN[""]["x"] == BF16 and SEEN["body"]["kernel"] == BF16
    y = jpl.apply(model, "float16")(variables, X, method=lambda m, x: m.body(x))
    assert y.dtype == F16


def test_bad_arguments_raise_naming_the_argument():
    model = Model()
    variables = init_variables(False)
    with pytest.raises(TypeError, match="`module`"):
        jpl.apply(lambda x: x, "float32")
    with pytest.raises(ValueError, match=r"policy_or_map.*f17"):
        jpl.apply(model, "c=f17")
    with pytest.raises(TypeError, match="`method`"):
        jpl.apply(model, "float32", method=3)
    with pytest.raises(ValueError, match=r"`method`.*'nope'"):
        jpl.apply(model, "float32", method="nope")
    with pytest.raises(TypeError, match="`type_policies`"):
        jpl.apply(model, "float32", type_policies=[nn.LayerNorm])
    with pytest.raises(TypeError, match="`type_policies`"):
        jpl.init(model, "float32", type_policies={int: "float32"})
    with pytest.raises(ValueError, match="LayerNorm"):
        jpl.apply(model, "float32", type_policies={nn.LayerNorm: "f17"})
    with pytest.raises(TypeError, match="`variables`"):
        jpl.apply(model, "float32")([1, 2], X)
    with pytest.raises(TypeError, match="`module`"):
        jpl.explain("model", "float32", variables, X)


# -- zero overhead ------------------------------------------------------------------------


class Mlp(nn.Module):
    dtype: Any = None

    @nn.compact
    def __call__(self, x):
        for i in range(2):
            x = nn.gelu(nn.Dense(64, dtype=self.dtype, name=f"dense_{i}")(x))
        return nn.Dense(8, dtype=self.dtype, name="out")(x)


def compiled_stats(fn, *args) -> tuple[int, int]:
    compiled = jax.jit(fn).lower(*args).compile()
    converts = len(re.findall(r"\bconvert\(", compiled.as_text()))
    return converts, compiled.memory_analysis().temp_size_in_bytes


def test_linen_apply_compiles_no_worse_than_hand_casting():
    model = Mlp()
    x = jax.random.normal(jax.random.key(0), (64, 32))
    params = model.init(jax.random.key(1), x)["params"]
    fn = jpl.apply(model, "mixed_bfloat16")

    def ours(p, x):
        return jnp.mean(jnp.square(fn({"params": p}, x).astype(jnp.float32)))

    def by_hand(p, x):
        p = jax.tree.map(lambda a: a.astype(jnp.bfloat16), p)
        y = model.apply({"params": p}, x.astype(jnp.bfloat16))
        return jnp.mean(jnp.square(y.astype(jnp.float32)))

    ours_converts, ours_temp = compiled_stats(jax.value_and_grad(ours), params, x)
    hand_converts, hand_temp = compiled_stats(jax.value_and_grad(by_hand), params, x)
    assert ours_converts <= hand_converts
    assert ours_temp <= hand_temp
    assert hand_converts > 0
