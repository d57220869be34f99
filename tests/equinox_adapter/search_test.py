"""``jp.equinox.search_map``: a policy per layer of an Equinox transformer under a budget,
the returned map run by ``jp.equinox.apply`` (eager and jit)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest

import jmp_policy as jp
from equinox_adapter.models import Transformer, tokens

CANDIDATES = ("int8_from_mixed_bfloat16", "int4/8_from_mixed_bfloat16")
LAYERS = [
    "blocks/attn/query_proj",
    "blocks/attn/key_proj",
    "blocks/attn/value_proj",
    "blocks/attn/output_proj",
    "blocks/mlp/layers/0",
    "blocks/mlp/layers/1",
    "head",
]


def _loss(out, batch):
    labels = jnp.roll(batch, 1)
    return optax.softmax_cross_entropy_with_integer_labels(out.astype(jnp.float32), labels).mean()


@pytest.fixture(scope="module")
def model():
    return Transformer(jax.random.key(0))


@pytest.mark.heavy(20)
@pytest.mark.parametrize("bits", [8, 6])
def test_the_chosen_map_meets_its_budget_and_runs(model, bits):
    batches = [tokens(i) for i in range(1, 4)]
    budget = {"effective_bits": bits}
    result = jp.equinox.search_map(model, batches, _loss, budget=budget, candidates=CANDIDATES)
    assert result.effective_bits <= bits
    rows = [line.split()[0] for line in str(result).splitlines()[1:-1] if line[:1] != " "]
    assert rows == LAYERS
    quantized = {result.policy_map[p].name for p in LAYERS} - {"mixed_bfloat16"}
    assert quantized and quantized <= set(CANDIDATES)
    policy_map = result.policy_map
    q = jp.equinox.quantize(model, policy_map)
    for jit in (False, True):
        run = lambda m, t: jp.equinox.apply(m, policy_map)(t)  # noqa: E731
        out = (eqx.filter_jit(run) if jit else run)(q, tokens(9))
        assert out.shape == (8, 32) and bool(jnp.isfinite(out).all())


def test_an_unknown_budget_is_refused_naming_it(model):
    with pytest.raises(ValueError, match="budget"):
        jp.equinox.search_map(model, [tokens()], _loss, budget={"bits": 4})
