"""Modules' own dtypes and `module_dtype` on stock configs; non-float policies (#8, #21).

lm1b, ImageNet's ResNet and Gemma set `dtype=float32` on every layer. The module's own dtype
wins (Keras's rule), so a policy changes nothing: the wrappers warn once, naming how many
modules override it and `module_dtype="override"`, which puts every matmul in the policy's
dtype (counted in the jaxpr). Apply wrappers reject non-float compute dtypes (`"int8"`).
"""

from __future__ import annotations

import re
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
    RTOL_BF16,
    VOCAB,
    B,
    Encoder,
    NNXEncoder,
    count,
    dot_dtypes,
    equations,
    lm1b_config,
    rel_err,
    tokens,
)

import jmp_policy as jp

# --------------------------------------------------------------------------- stock configs


def override_warnings(record):
    return [w for w in record if "module_dtype" in str(w.message)]


def test_stock_lm1b_config_warns_once_that_modules_own_dtype_override_the_policy():
    model, x = lm.TransformerLM(lm1b_config()), tokens()
    variables = model.init(jax.random.key(0), x)
    fn = jp.linen.apply(model, "mixed_bfloat16")

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fn(variables, x)
        fn(variables, x)

    found = override_warnings(record)
    assert len(found) == 1, [str(w.message) for w in record]
    assert found[0].category is UserWarning
    message = str(found[0].message)
    # Counted: the modules that carry the matmuls (4 MLP Dense, 2 attention and their 8
    # projections, the logits Dense), not the 5 LayerNorms, Dropouts or containers.
    assert message.startswith(
        "15 of 15 modules of TransformerLM that carry its matmuls and convolutions"
    ), message
    assert 'module_dtype="override"' in message
    # respected: every matmul of the model stays float32
    assert count(dot_dtypes(fn, variables, x)) == {"float32": 17}


def test_module_dtype_override_puts_every_lm1b_matmul_in_bfloat16(maybe_jit):
    model, x = lm.TransformerLM(lm1b_config()), tokens()
    variables = model.init(jax.random.key(0), x)
    reference = model.apply(variables, x)

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fn = jp.linen.apply(model, "mixed_bfloat16", module_dtype="override")
        out = maybe_jit(fn)(variables, x)
    assert override_warnings(record) == []

    assert count(dot_dtypes(fn, variables, x)) == {"bfloat16": 17}
    assert out.dtype == F32  # lm1b's own `logits.astype(config.dtype)` at the end
    assert rel_err(out, reference) < RTOL_BF16


def test_float32_output_spellings_on_lm1b():
    recommended = jp.DTypePolicyMap("mixed_bfloat16", {"": "p=f32,c=bf16,o=f32"})
    everywhere = "p=f32,c=bf16,o=f32"
    x = tokens()
    # lm1b with `dtype=None` (the policy chooses): the recommended spelling, float32 outputs
    # from the root only, keeps all 17 matmuls in bfloat16; float32 outputs from every module
    # hand q, k, v to Flax's attention function (not a module) in float32, so q·kᵀ and p·v of
    # both layers run in float32
    model = lm.TransformerLM(lm1b_config(dtype=None))
    variables = model.init(jax.random.key(0), x)
    fn = jp.linen.apply(model, recommended)
    assert count(dot_dtypes(fn, variables, x)) == {"bfloat16": 17}
    assert fn(variables, x).dtype == F32
    fn = jp.linen.apply(model, everywhere)
    assert count(dot_dtypes(fn, variables, x)) == {"bfloat16": 13, "float32": 4}
    # the stock config under override: the attention's own dtype is overridden too, so its
    # function casts q, k, v back to bfloat16 whichever spelling
    model = lm.TransformerLM(lm1b_config())
    variables = model.init(jax.random.key(0), x)
    for spelling in (recommended, everywhere):
        fn = jp.linen.apply(model, spelling, module_dtype="override")
        assert count(dot_dtypes(fn, variables, x)) == {"bfloat16": 17}


def test_the_own_dtype_check_does_not_run_the_model_twice():
    # The first call of a new wrapper (the one that warns) traces what later calls trace:
    # one copy of the model, not a checking pass left in the computation (eagerly, it runs).
    model, x = lm.TransformerLM(lm1b_config()), tokens()
    variables = model.init(jax.random.key(0), x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fn = jp.linen.apply(model, "mixed_bfloat16")
        assert count(dot_dtypes(fn, variables, x)) == {"float32": 17}


def test_stock_resnet_and_gemma_configs_warn_too():
    from flax_examples import imagenet_models

    resnet = imagenet_models.ResNet(
        stage_sizes=[1], block_cls=imagenet_models.ResNetBlock, num_classes=4, num_filters=4
    )
    x = jnp.ones((2, 8, 8, 3))
    variables = resnet.init(jax.random.key(0), x, train=False)
    with pytest.warns(UserWarning, match='module_dtype="override"'):
        jp.linen.apply(resnet, "mixed_bfloat16")(variables, x, train=False)

    gemma = gemma_nnx.Transformer(vocab_size=VOCAB, rngs=nnx.Rngs(0), dtype=jnp.float32)
    # a whole-sequence forward (no cache): tokens, positions, cache, causal mask
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((4, 4), bool)), (B, 4, 4))
    args = (tokens((B, 4)), jnp.broadcast_to(jnp.arange(4), (B, 4)), None, causal)
    with pytest.warns(UserWarning, match='module_dtype="override"'):
        jp.nnx.apply(gemma, "mixed_bfloat16")(*args)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        logits, _ = jp.nnx.apply(gemma, "mixed_bfloat16", module_dtype="override")(*args)
    assert override_warnings(record) == []
    assert logits.dtype == BF16


# --------------------------------------------------------------------------- non-float policies


@pytest.mark.parametrize("wrapper", ["linen.apply", "linen.init", "nnx.apply"])
def test_non_float_policy_is_rejected(wrapper):
    make = {
        "linen.apply": lambda p: jp.linen.apply(Encoder(), p),
        "linen.init": lambda p: jp.linen.init(Encoder(), p),
        "nnx.apply": lambda p: jp.nnx.apply(NNXEncoder(rngs=nnx.Rngs(0)), p),
    }[wrapper]
    with pytest.raises(ValueError, match=r"int8") as info:
        make("int8")
    assert re.search(r"float", str(info.value)), str(info.value)


# --------------------------------------------------------------------------- big_vision's ViT


@pytest.mark.parametrize("scan", [False, True], ids=["loop", "scan"])
def test_big_vision_vit_warns_how_many_compute_modules_the_policy_misses(scan):
    """big_vision's ViT passes `dtype=dtype_mm` ("float32") to its Conv, attention and
    Dense layers, while LayerNorm, Dropout and the containers have no dtype: counted over
    all modules less than half override the policy, yet 8 of the 9 modules that carry the
    matmuls do (all but the head). The warning counts those, once, and names the way out,
    which puts every matmul in bfloat16."""
    from flax_examples import big_vision_vit as vit

    model = vit.Model(10, variant="mu/8", scan=scan)
    x = jnp.ones((2, 16, 16, 3))
    variables = model.init(jax.random.key(0), x)
    fn = jp.linen.apply(model, "mixed_bfloat16")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fn(variables, x)
        fn(variables, x)
    found = override_warnings(record)
    assert [str(w.message) for w in found] == [
        "8 of 9 modules of _Model that carry its matmuls and convolutions (they hold "
        "kernels or run attention) set their own `dtype` (float32), which wins over the "
        "policy's compute dtype (bfloat16): the policy does not reach them. Pass "
        '`module_dtype="override"` to let the policy win everywhere, or leave the modules\' '
        "`dtype` unset. Under \"override\" a Linen module's `setup` sees the policy's dtype "
        "too, so what it derives from it (Hugging Face's `attention_softmax_in_fp32`) is as "
        "in a model built in that dtype; an NNX module keeps what its `__init__` derived "
        "from the dtype it was built with."
    ]
    # q, k, v, q·kᵀ, p·v, out and the MLP's two Dense stay float32; the head (called twice).
    assert count(dot_dtypes(fn, variables, x)) == {"float32": 8, "bfloat16": 2}

    over = jp.linen.apply(model, "mixed_bfloat16", module_dtype="override")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        logits, _ = over(variables, x)
    assert override_warnings(record) == []
    assert logits.dtype == BF16
    assert count(dot_dtypes(over, variables, x)) == {"bfloat16": 10}
    profile = jp.dtype_profile(over, variables, x)
    assert set(profile.matmul_flops) == {"bfloat16"}  # the patch Conv too


def test_a_float32_head_alone_does_not_warn():
    """One module of its own dtype among several (a float32 head) is a choice, not a
    policy turned off: no warning."""
    import flax.linen as nn

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            for i in range(3):
                x = nn.Dense(8, name=f"dense_{i}")(x)
            return nn.Dense(2, dtype=jnp.float32, name="head")(x)

    x = jnp.ones((2, 4))
    variables = Net().init(jax.random.key(0), x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert jp.linen.apply(Net(), "mixed_bfloat16")(variables, x).dtype == F32


# --------------------------------------------------------------------------- one trace (#21)


def _dots(closed):
    """Counts the dot_generals of a jaxpr by operand dtypes, sub-jaxprs included."""
    from flax_examples.measure import dot_equations

    return count(
        tuple(str(v.aval.dtype) for v in eqn.invars) for eqn in dot_equations(closed.jaxpr)
    )


def test_a_module_with_its_own_dtype_is_traced_once_in_the_callers_jaxpr():
    """A 3-layer body and a head with its own float32 dtype, on a fresh wrapper (which
    learns of the head while it traces): the jaxpr has the body's 3 bfloat16 matmuls and
    the head's float32 one, once, not a cut-short first run beside them; the same with a
    map and NORM_FLOAT32, and Python side effects of the body run once per trace."""
    import flax.linen as nn

    calls = []

    class Body(nn.Module):
        @nn.compact
        def __call__(self, x):
            calls.append(self.path)
            return nn.Dense(8, name="dense")(nn.LayerNorm(name="norm")(x))

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            for i in range(3):
                x = Body(name=f"layers_{i}")(x)
            return nn.Dense(2, dtype=jnp.float32, name="head")(x)

    x = jnp.ones((2, 8))
    variables = Net().init(jax.random.key(0), x)
    for policy, options in [
        ("mixed_bfloat16", {}),
        (
            jp.DTypePolicyMap("mixed_bfloat16", {"layers_0": "mixed_bfloat16"}),
            {"type_policies": jp.linen.NORM_FLOAT32},
        ),
    ]:
        calls.clear()
        fn = jp.linen.apply(Net(), policy, **options)
        jaxpr = jax.make_jaxpr(fn)(variables, x)
        assert _dots(jaxpr) == {"bfloat16": 3, "float32": 1}
        assert len(calls) == 3
        grads = jax.make_jaxpr(jax.grad(lambda p, fn=fn: fn({"params": p}, x).sum()))(
            variables["params"]
        )
        # forward 3 + 1, backward: kernel and input gradients of all 4 (the jaxpr keeps
        # the first layer's input gradient; XLA drops it)
        assert _dots(grads) == {"bfloat16": 9, "float32": 3}
        # the float32 head's kernel reaches it unrounded, eagerly and under jit
        out = fn(variables, x)
        assert out.dtype == F32


def _param_converts(closed, n_params):
    """``{param index: [target dtypes]}``: the converts applied straight to each of the
    first ``n_params`` inputs of a jaxpr (the parameters)."""
    params = closed.jaxpr.invars[:n_params]
    out = {}
    for eqn in closed.jaxpr.eqns:
        if eqn.primitive.name == "convert_element_type" and eqn.invars[0] in params:
            index = params.index(eqn.invars[0])
            out.setdefault(index, []).append(str(eqn.params["new_dtype"]))
    return out


def test_parameters_are_cast_once_as_read_and_float32_norms_never():
    """On a fresh wrapper's first trace (which learns of NORM_FLOAT32's norms while it
    traces), each bfloat16 parameter is converted once, where it is read, and the float32
    norms' parameters are not converted at all: no dead bfloat16 copy for a module met
    later, no copy rounded through bfloat16."""
    import flax.linen as nn

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            for i in range(3):
                x = nn.Dense(8, name=f"dense_{i}")(nn.LayerNorm(name=f"norm_{i}")(x))
            return x

    x = jnp.ones((2, 8))
    params = Net().init(jax.random.key(0), x)["params"]
    names = [jax.tree_util.keystr(kp) for kp, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    for jit in (False, True):
        fn = jp.linen.apply(Net(), "mixed_bfloat16", type_policies=jp.linen.NORM_FLOAT32)

        def call(p, x, fn=fn):
            return fn({"params": p}, x)

        run = jax.jit(call) if jit else call
        closed = jax.make_jaxpr(lambda p, x, run=run: run(p, x))(params, x)
        if jit:  # the converts are inside the jit's own jaxpr
            closed = closed.eqns[0].params["jaxpr"]
        converts = _param_converts(closed, len(names))
        by_name = {names[i]: dtypes for i, dtypes in converts.items()}
        assert by_name == {n: ["bfloat16"] for n in names if "dense" in n}
        assert fn({"params": params}, x).dtype == jnp.bfloat16


def test_a_scanned_stack_met_first_is_traced_once():
    """An ``nn.scan`` stack of norm + dense layers under NORM_FLOAT32, on a fresh wrapper:
    the scan body's Python runs as often as under Flax alone (no learn-and-rerun for the
    stack), its matmul is bfloat16, and the result is Flax's to bfloat16 precision."""
    import flax.linen as nn

    calls = []

    class Layer(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            calls.append(self.path)
            return nn.Dense(8, name="dense")(nn.LayerNorm(name="norm")(x)), None

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            stack = nn.scan(
                Layer, variable_axes={"params": 0}, split_rngs={"params": True}, length=4
            )
            return stack(name="layers")(x, None)[0]

    x = jnp.ones((2, 8))
    variables = Net().init(jax.random.key(0), x)
    calls.clear()
    jax.make_jaxpr(Net().apply)(variables, x)
    flax_calls = len(calls)
    assert flax_calls >= 1
    fn = jp.linen.apply(Net(), "mixed_bfloat16", type_policies=jp.linen.NORM_FLOAT32)
    calls.clear()
    closed = jax.make_jaxpr(fn)(variables, x)
    assert len(calls) == flax_calls
    assert _dots(closed) == {"bfloat16": 1}
    want = Net().apply(variables, x)
    out = fn(variables, x)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want), atol=0.1)


def test_a_parameter_read_first_inside_a_jax_transform_does_not_leak_its_cast():
    """A module that reads its parameter inside `jax.checkpoint` first and outside it
    afterwards: the cast made inside the transform is not reused outside (that would be a
    leaked tracer), with and without `jit`, and the result is the hand-cast one."""
    import flax.linen as nn

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            if self.is_initializing():
                self.param("w", nn.initializers.normal(), (4, 4))
            inner = jax.checkpoint(lambda x: x @ self.get_variable("params", "w"))(x)
            return inner + x @ self.get_variable("params", "w")

    x = jax.random.normal(jax.random.key(1), (2, 4))
    variables = Net().init(jax.random.key(0), x)
    half = jax.tree.map(lambda a: a.astype(jnp.bfloat16), variables)
    want = Net().apply(half, x.astype(jnp.bfloat16))
    fn = jp.linen.apply(Net(), "mixed_bfloat16")
    for run in (fn, jax.jit(fn)):
        out = run(variables, x)
        assert out.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want, np.float32))


# ------------------------------------------- what `setup` derives from the module's dtype


class _SetupAttention(nn.Module):
    """Hugging Face's Flax attention, reduced: `setup` derives the softmax dtype from the
    module's own dtype (`attention_softmax_in_fp32 = self.dtype is not jnp.float32`)."""

    dtype: jnp.dtype = jnp.float32

    def setup(self):
        self.attention_softmax_in_fp32 = self.dtype is not jnp.float32
        self.query = nn.Dense(16, dtype=self.dtype)
        self.key = nn.Dense(16, dtype=self.dtype)

    def __call__(self, x):
        scores = jnp.einsum("bqd,bkd->bqk", self.query(x), self.key(x))
        if self.attention_softmax_in_fp32:
            scores = scores.astype(jnp.float32)
        probs = jax.nn.softmax(scores, axis=-1)
        if self.attention_softmax_in_fp32:
            probs = probs.astype(self.dtype)
        return probs


class _SetupModel(nn.Module):
    dtype: jnp.dtype = jnp.float32

    def setup(self):  # children made in setup, as Hugging Face's models do
        self.attention = _SetupAttention(dtype=self.dtype)

    def __call__(self, x):
        return self.attention(x)


def _exp_dtypes(fn, *args):
    return [str(e.invars[0].aval.dtype) for e in equations(jax.make_jaxpr(fn)(*args).jaxpr, "exp")]


def test_override_reaches_setup_so_a_float32_softmax_safeguard_is_kept(maybe_jit):
    """A float32-built Hugging Face style model under "override" runs as the library's
    own bf16 model: its matmuls in bf16 and its softmax in float32, because `setup` sees
    the policy's dtype (before #31 it saw float32 and dropped the safeguard)."""
    x = jax.random.normal(jax.random.key(1), (2, 4, 8))
    model = _SetupModel()
    variables = model.init(jax.random.key(0), x)
    fn = jp.linen.apply(model, "mixed_bfloat16", module_dtype="override")
    theirs = lambda v, x: _SetupModel(dtype=jnp.bfloat16).apply(v, x)  # noqa: E731
    assert _exp_dtypes(theirs, variables, x) == ["float32"]
    assert _exp_dtypes(fn, variables, x) == ["float32"]
    assert dot_dtypes(fn, variables, x) == [("bfloat16", "bfloat16")] * 3
    out = maybe_jit(fn)(variables, x)
    assert out.dtype == jnp.bfloat16
    ref = theirs(jax.tree.map(lambda a: a.astype(jnp.bfloat16), variables), x)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=1e-2)
    # Under "respect" the model's own float32 wins, with the warning.
    with pytest.warns(UserWarning, match=r"`setup` sees the policy's dtype too"):
        respected = jp.linen.apply(model, "mixed_bfloat16")
        assert _exp_dtypes(respected, variables, x) == ["float32"]
