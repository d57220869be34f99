"""What a newcomer meets first (issue #44): a mapping given where the default policy goes, a
map key that matches nothing (named with the closest real paths wherever it is seen), and a
search table that shows each policy's whole name."""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import jmp_policy as jp
from jmp_policy._src.map_search import LayerRow, SearchResult


class _Linen(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(2, name="head")(nn.relu(nn.Dense(4, name="body")(x)))


class _NNX(nnx.Module):
    def __init__(self, rngs):
        self.body = nnx.Linear(3, 4, rngs=rngs)
        self.head = nnx.Linear(4, 2, rngs=rngs)

    def __call__(self, x):
        return self.head(nnx.relu(self.body(x)))


X = jnp.ones((1, 3))
CLOSEST = "'haed' (closest module paths: 'head')"


@pytest.mark.parametrize("paths", [{"head": "float32"}, {"dense/.*": "mixed_bfloat16"}])
def test_a_dict_of_paths_as_the_only_argument_says_it_is_the_policy_map(paths):
    with pytest.raises(TypeError, match=r"dict of paths to policies.*second argument") as info:
        jp.DTypePolicyMap(paths)
    message = str(info.value)
    assert "`policy_map`" in message and "DTypePolicyMap(None, {...})" in message
    assert message.endswith(f"Received: default_policy={paths!r}")
    assert "custom_objects" not in message
    # What was meant works, and a policy's config dict is still a default policy.
    assert jp.DTypePolicyMap(None, paths)[next(iter(paths))] is not None
    config = {"class_name": "DTypePolicy", "config": {"name": "float32"}}
    assert jp.DTypePolicyMap(config).default_policy == jp.DTypePolicy("float32")


def _caught(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn()
    return out, [str(w.message) for w in caught if "resolve no" in str(w.message)]


def test_linen_explain_names_a_key_that_matches_nothing_with_the_closest_paths():
    model = _Linen()
    variables = model.init(jax.random.key(0), X)
    policy_map = jp.DTypePolicyMap("mixed_bfloat16", {"haed": "float32"})
    table, said = _caught(lambda: jp.linen.explain(model, policy_map, variables, X))
    assert f"keys that resolve nothing: {CLOSEST}" in table.splitlines()
    assert len(said) == 1 and CLOSEST in said[0] and "_Linen" in said[0]
    # Once per map and model: a second explain, or apply, says it in the table only.
    table, said = _caught(lambda: jp.linen.explain(model, policy_map, variables, X))
    assert said == [] and CLOSEST in table
    _, said = _caught(lambda: jp.linen.apply(model, policy_map)(variables, X))
    assert said == []
    # A map whose keys all match shows no such line.
    good = jp.DTypePolicyMap("mixed_bfloat16", {"head": "float32"})
    table, said = _caught(lambda: jp.linen.explain(model, good, variables, X))
    assert "resolve nothing" not in table and said == []


@pytest.mark.parametrize("with_args", [False, True])
def test_nnx_explain_names_a_key_that_matches_nothing_with_the_closest_paths(with_args):
    model = _NNX(nnx.Rngs(0))
    policy_map = jp.DTypePolicyMap("mixed_bfloat16", {"haed": "float32"})
    args = (X,) if with_args else ()
    table, said = _caught(lambda: jp.nnx.explain(model, policy_map, *args))
    assert f"keys that resolve nothing: {CLOSEST}" in table.splitlines()
    assert len(said) == 1 and CLOSEST in said[0]


@pytest.mark.parametrize("jit", [False, True])
def test_cast_apply_names_the_closest_paths_of_a_key_that_matches_nothing(jit):
    params = {"body": {"kernel": jnp.ones((3, 4))}, "head": {"kernel": jnp.ones((4, 2))}}
    policy_map = jp.DTypePolicyMap("mixed_bfloat16", {"haed": "float32"})

    def apply(p, x):
        return x @ p["body"]["kernel"] @ p["head"]["kernel"]

    fn = jp.cast_apply(policy_map)(apply)
    fn = jax.jit(fn) if jit else fn
    with pytest.warns(UserWarning, match=r"match no module or variable") as caught:
        out = fn(params, X)
    assert out.dtype == jnp.bfloat16 and float(out[0, 0]) == 12.0
    assert any(CLOSEST in str(w.message) for w in caught)


def test_the_search_table_shows_each_policy_name_whole():
    int8, int4, bf16 = "int8_from_mixed_bfloat16", "int4/128_from_mixed_bfloat16", "mixed_bfloat16"
    rows = (
        LayerRow("up", 16384, {bf16: 0.0, int8: 1e-6, int4: 0.5}, {bf16: 1, int8: 1, int4: 1}, bf16, "why"),
        LayerRow("down", 16384, {bf16: 0.0, int4: 0.125}, {bf16: 1, int4: 1}, int4, "why"),
    )  # fmt: skip
    text = str(SearchResult(jp.DTypePolicyMap(bf16), rows, 3, 16.0, 0.0, "sum"))
    lines = text.splitlines()
    assert lines[0].split() == ["layer", bf16, int8, int4, "choice"]
    assert lines[1].split() == ["up", "0", "1e-06", "0.5", bf16]
    assert lines[3].split() == ["down", "0", "-", "0.125", int4]
    # The numbers stand under their names' last characters.
    for name, value in ((int8, "1e-06"), (int4, "0.5")):
        assert lines[1].index(value) + len(value) == lines[0].index(name) + len(name)


def test_an_unknown_jax_is_a_clear_error_at_first_use_not_a_silent_guard(monkeypatch):
    """``transforms.current_trace`` reads JAX's internals; where they moved it names the JAX
    version (it returned ``None`` before, which turned calibration's guard off quietly)."""
    from jax._src import core as jax_core

    from jmp_policy._src import transforms

    assert transforms.current_trace() is jax_core.trace_ctx.trace  # eval trace outside jit
    seen = []
    jax.jit(lambda x: seen.append(transforms.current_trace()) or x)(1.0)
    assert seen[0] is not jax_core.trace_ctx.trace  # inside jit: the jit's own trace

    class Moved:  # a JAX whose trace context has no `trace`
        pass

    monkeypatch.setattr(jax_core, "trace_ctx", Moved())
    with pytest.raises(RuntimeError, match=rf"jax {jax.__version__} does not have"):
        transforms.current_trace()
