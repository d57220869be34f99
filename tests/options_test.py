"""The apply wrappers' options and warnings, alike in Linen and NNX: module_dtype,
autocast_exclude, the typo warning, the own-dtype warning, non-float policies."""

import functools
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from flax_examples.measure import dot_dtypes

import jmp_policy as jp

BF16, F32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)


class Stock(nn.Module):
    """Every layer pinned to float32, as stock Flax example configs do."""

    @nn.compact
    def __call__(self, x):
        for i in range(3):
            x = nn.Dense(8, dtype=jnp.float32, name=f"dense_{i}")(x)
        return nn.Dense(2, dtype=jnp.float32, name="head")(x)


X = jnp.ones((2, 4))


def test_linen_stock_model_warns_and_override_puts_every_matmul_in_bf16():
    model = Stock()
    variables = model.init(jax.random.key(0), X)
    fn = jp.linen.apply(model, "mixed_bfloat16")
    with pytest.warns(
        UserWarning, match=r'4 of 4 modules of Stock that carry.*module_dtype="override"'
    ):
        out = fn(variables, X)
    assert out.dtype == F32
    assert dot_dtypes(fn, variables, X) == [("float32", "float32")] * 4
    over = jp.linen.apply(model, "mixed_bfloat16", module_dtype="override")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = over(variables, X)
    assert out.dtype == BF16
    assert dot_dtypes(over, variables, X) == [("bfloat16", "bfloat16")] * 4
    # The module instances keep their own dtype after the call.
    grads = jax.grad(lambda p: over({"params": p}, X).astype(F32).sum())(variables["params"])
    assert {g.dtype for g in jax.tree.leaves(grads)} == {F32}


class StockNnx(nnx.Module):
    def __init__(self, rngs):
        self.layers = nnx.List(
            [nnx.Linear(4 if i == 0 else 8, 8, dtype=jnp.float32, rngs=rngs) for i in range(3)]
        )
        self.head = nnx.Linear(8, 2, dtype=jnp.float32, rngs=rngs)

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_nnx_stock_model_warns_and_override_puts_every_matmul_in_bf16():
    model = StockNnx(nnx.Rngs(0))
    with pytest.warns(UserWarning, match='module_dtype="override"'):
        assert jp.nnx.apply(model, "mixed_bfloat16")(X).dtype == F32
    over = jp.nnx.apply(model, "mixed_bfloat16", module_dtype="override")
    assert over(X).dtype == BF16
    assert dot_dtypes(over, X) == [("bfloat16", "bfloat16")] * 4
    assert model.head.dtype == F32  # the stored model is untouched


class TimeEmbed(nn.Module):
    @nn.compact
    def __call__(self, t):
        self.sow("intermediates", "t", t)
        return nn.Dense(4)(t[:, None])


class Diffusion(nn.Module):
    @nn.compact
    def __call__(self, x, t):
        return nn.Dense(4)(x) + TimeEmbed(name="time")(t)


@pytest.mark.parametrize("exclude", [[TimeEmbed], ["time"]], ids=["class", "path"])
def test_linen_autocast_exclude_keeps_timesteps(exclude, maybe_jit):
    model = Diffusion()
    t = jnp.array([257.0, 999.0, 1001.0])
    x = jnp.ones((3, 4))
    variables = model.init(jax.random.key(0), x, t)
    wrapped = jp.linen.apply(model, "bfloat16", autocast_exclude=exclude)
    fn = maybe_jit(functools.partial(wrapped, mutable="intermediates"))
    _, state = fn(variables, x, t)
    np.testing.assert_array_equal(state["intermediates"]["time"]["t"][0], [257.0, 999.0, 1001.0])
    plain = maybe_jit(functools.partial(jp.linen.apply(model, "bfloat16"), mutable="intermediates"))
    _, state = plain(variables, x, t)
    np.testing.assert_array_equal(
        np.asarray(state["intermediates"]["time"]["t"][0], np.float32), [256.0, 1000.0, 1000.0]
    )


def test_nnx_autocast_exclude():
    seen = {}

    class Time(nnx.Module):
        def __call__(self, t):
            seen["t"] = t
            return t

    class Model(nnx.Module):
        def __init__(self):
            self.time = Time()

        def __call__(self, t):
            return self.time(t)

    t = jnp.array([257.0, 999.0, 1001.0])
    jp.nnx.apply(Model(), "bfloat16", autocast_exclude=[Time])(t)
    assert seen["t"].dtype == F32
    jp.nnx.apply(Model(), "bfloat16")(t)
    assert seen["t"].dtype == BF16


def test_typo_keys_warn_once_in_linen_and_nnx():
    model = Stock()
    variables = model.init(jax.random.key(0), X)
    policy_map = jp.DTypePolicyMap("mixed_bfloat16", {"haed": "float32", "head": "float32"})
    fn = jp.linen.apply(model, policy_map, module_dtype="override")
    with pytest.warns(UserWarning, match=r"\['haed'\].*unused_keys"):
        fn(variables, X)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fn(variables, X)  # once
    nnx_map = jp.DTypePolicyMap("mixed_bfloat16", {"haed": "float32"})
    with pytest.warns(UserWarning, match=r"\['haed'\]"):
        jp.nnx.apply(StockNnx(nnx.Rngs(0)), nnx_map, module_dtype="override")(X)


def test_variable_keys_are_not_reported_as_typos():
    model = Stock()
    variables = model.init(jax.random.key(0), X)
    policy_map = jp.DTypePolicyMap("bfloat16", {"head/kernel": "float32"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jp.linen.apply(model, policy_map, module_dtype="override")(variables, X)


@pytest.mark.parametrize("policy", ["int8", "int32", "bool", {"head": "int8"}])
def test_non_floating_policies_are_rejected(policy):
    with pytest.raises(ValueError, match="floating compute dtype"):
        jp.linen.apply(Stock(), policy)
    with pytest.raises(ValueError, match="floating compute dtype"):
        jp.linen.init(Stock(), policy)
    with pytest.raises(ValueError, match="floating compute dtype"):
        jp.nnx.apply(StockNnx(nnx.Rngs(0)), policy)


def test_bad_options_name_the_argument():
    with pytest.raises(ValueError, match=r"`module_dtype`.*'ignore'"):
        jp.linen.apply(Stock(), "float32", module_dtype="ignore")
    with pytest.raises(TypeError, match=r"`autocast_exclude`.*3"):
        jp.nnx.apply(StockNnx(nnx.Rngs(0)), "float32", autocast_exclude=[3])
    with pytest.raises(
        ValueError, match=r"Entry .\(. of `autocast_exclude` is not a valid regular expression"
    ):
        jp.linen.apply(Stock(), "float32", autocast_exclude=["("])
    with pytest.raises(TypeError, match=r"nn.Module subclasses"):
        jp.linen.apply(Stock(), "float32", autocast_exclude=[int])


class Residual(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x + nn.LayerNorm(name="norm")(x)


def test_norm_float32_returns_the_callers_dtype(maybe_jit):
    model = Residual()
    x = jnp.ones((2, 4))
    variables = model.init(jax.random.key(0), x)
    fn = jp.linen.apply(model, "mixed_bfloat16", type_policies=jp.linen.NORM_FLOAT32)
    assert maybe_jit(fn)(variables, x).dtype == BF16  # the residual stream stays 16-bit
    plain = jp.linen.apply(model, "mixed_bfloat16", type_policies={nn.LayerNorm: "float32"})
    assert maybe_jit(plain)(variables, x).dtype == F32  # a plain float32 policy leaks float32


def test_nnx_norm_float32_returns_the_callers_dtype():
    class Res(nnx.Module):
        def __init__(self):
            self.norm = nnx.LayerNorm(4, rngs=nnx.Rngs(0))

        def __call__(self, x):
            return x + self.norm(x)

    x = jnp.ones((2, 4))
    assert jp.nnx.apply(Res(), "mixed_bfloat16", type_policies=jp.nnx.NORM_FLOAT32)(x).dtype == BF16
    assert (
        jp.nnx.apply(Res(), "mixed_bfloat16", type_policies={nnx.LayerNorm: "float32"})(x).dtype
        == F32
    )


def test_unknown_option_is_a_type_error_listing_the_options():
    with pytest.raises(TypeError, match=r"\['autocast'\].*type_policies, module_dtype"):
        jp.linen.apply(Stock(), "float32", autocast=False)
    with pytest.raises(TypeError, match=r"\['dtype'\]"):
        jp.nnx.apply(StockNnx(nnx.Rngs(0)), "float32", dtype="float32")


_RELOADED_SOURCE = """
import flax.linen as nn
from flax import nnx


class Norm(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(x.shape[-1], name="proj")(x)


class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        return Norm(name="norm")(nn.Dense(4, name="body")(x))


class NnxNorm(nnx.Module):
    def __init__(self, rngs):
        self.proj = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, x):
        return self.proj(x)


class NnxNet(nnx.Module):
    def __init__(self, rngs):
        self.body = nnx.Linear(4, 4, rngs=rngs)
        self.norm = NnxNorm(rngs)

    def __call__(self, x):
        return self.norm(self.body(x))
"""


@pytest.fixture
def reloadable(tmp_path, monkeypatch):
    """A module of model classes on disk, imported once (its classes before a reload)."""
    import importlib
    import sys

    (tmp_path / "reloaded_models.py").write_text(_RELOADED_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("reloaded_models")
    yield module
    sys.modules.pop("reloaded_models", None)


def test_type_policies_follow_a_class_after_importlib_reload(reloadable):
    """Haiku's `test_policy_for_reloaded_class`: notebook autoreload makes new class
    objects; a policy given for the old class still applies (matched by module and
    qualified name), for Linen and NNX, and so does `autocast_exclude`."""
    import importlib

    old_norm, old_nnx_norm = reloadable.Norm, reloadable.NnxNorm
    types, nnx_types = {old_norm: "float32"}, {old_nnx_norm: "float32"}
    new = importlib.reload(reloadable)
    assert new.Norm is not old_norm

    model = new.Net()
    variables = model.init(jax.random.key(0), X)
    fn = jp.linen.apply(model, "mixed_bfloat16", type_policies=types)
    assert fn(variables, X).dtype == F32
    assert dot_dtypes(fn, variables, X) == [("bfloat16", "bfloat16"), ("float32", "float32")]

    nnx_model = new.NnxNet(nnx.Rngs(0))
    run = jp.nnx.apply(nnx_model, "mixed_bfloat16", type_policies=nnx_types)
    assert run(X).dtype == F32
    assert dot_dtypes(run, X) == [("bfloat16", "bfloat16"), ("float32", "float32")]

    # A subclass of the reloaded class inherits the policy, too.
    class Sub(new.Norm):
        pass

    class Parent(nn.Module):
        @nn.compact
        def __call__(self, x):
            return Sub(name="sub")(x)

    sub_vars = Parent().init(jax.random.key(0), X)
    sub_fn = jp.linen.apply(Parent(), "mixed_bfloat16", type_policies=types)
    assert sub_fn(sub_vars, X).dtype == F32

    from jmp_policy._src.options import make_options

    assert make_options(autocast_exclude=[old_norm]).excluded("norm", new.Norm)
    assert make_options(autocast_exclude=[old_norm]).excluded("sub", Sub)
    assert not make_options(autocast_exclude=[old_norm]).excluded("norm", new.Net)
