"""Searching a policy map: the knapsack, the budgets, the candidates, Linen and NNX."""

import itertools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jmp_policy as jp
from jmp_policy._src import map_choice, map_search
from jmp_policy._src.map_search import _passes as search_passes


def _brute(layers, bound, minimize):
    con, obj = (0, 1) if minimize == "score" else (1, 0)
    best = None
    for picks in itertools.product(*(range(len(o)) for o in layers)):
        c = sum(layers[i][j][con] for i, j in enumerate(picks))
        v = sum(layers[i][j][obj] for i, j in enumerate(picks))
        if c <= bound + 1e-9 and (best is None or v < best - 1e-12):
            best = v
    return best


@pytest.mark.parametrize("seed", range(30))
@pytest.mark.parametrize("minimize", ["score", "cost"])
def test_choose_matches_brute_force_on_small_instances(seed, minimize):
    rng = np.random.default_rng(seed)
    layers = [
        [(float(rng.integers(1, 20)), float(rng.random())) for _ in range(rng.integers(1, 4))]
        for _ in range(rng.integers(1, 6))
    ]
    con = 0 if minimize == "score" else 1
    least = map_choice.cheapest(layers, con)
    bound = least + rng.random() * (sum(max(o[con] for o in opts) for opts in layers) - least)
    picks, method = map_choice.choose(layers, bound, minimize=minimize)
    assert method == "exact"
    total_con = sum(layers[i][j][con] for i, j in enumerate(picks))
    total_obj = sum(layers[i][j][1 - con] for i, j in enumerate(picks))
    assert total_con <= bound + 1e-9
    assert total_obj == pytest.approx(_brute(layers, bound, minimize))
    # The Lagrangian method (forced) meets the bound too, and is never far off.
    picks, method = map_choice.choose(layers, bound, minimize=minimize, max_frontier=0)
    assert method == "lagrangian"
    assert sum(layers[i][j][con] for i, j in enumerate(picks)) <= bound + 1e-9


def test_choose_is_deterministic_on_ties():
    layers = [[(1.0, 0.5), (1.0, 0.5)], [(2.0, 0.0), (1.0, 1.0)]]
    assert map_choice.choose(layers, 3.0) == map_choice.choose(layers, 3.0) == ([0, 0], "exact")


def test_compact_covers_runs_and_nothing_else():
    choices = {f"blocks_{i}/mlp/up": "int4" for i in range(4)}
    choices |= {"blocks_0/attn/query": "int8", "blocks_1/attn/query": "bf16"}
    choices |= {"blocks_2/attn/query": "int8", "blocks_3/attn/query": "int8", "head": "bf16"}
    entries = map_search.compact(choices, "bf16")
    assert entries == {r"blocks_\d+/mlp/up": "int4", "blocks_(?:0|2|3)/attn/query": "int8"}


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        for i in range(3):
            x = nn.relu(nn.Dense(256, name=f"layers_{i}")(x))
        return nn.Dense(4, name="head")(x)


def _loss(out, batch):
    return (out.astype(jnp.float32) ** 2).mean()


@pytest.fixture(scope="module")
def linen_setup():
    model = MLP()
    x = jax.random.normal(jax.random.key(0), (16, 128))
    variables = model.init(jax.random.key(1), x)
    return model, variables, [x, x * 0.5]


@pytest.fixture(scope="module")
def linen_search(linen_setup):
    """One search of ``linen_setup`` at 16 bits: the tests below read other budgets off it
    with ``at`` (the same choice as a search at that budget, which
    ``test_at_chooses_again_from_the_same_scores`` checks)."""
    model, variables, batches = linen_setup
    return jp.linen.search_map(model, variables, batches, _loss, budget={"effective_bits": 16})


@pytest.mark.parametrize("bits", [16, 8, 6, 5, 4.5])
def test_linen_search_meets_the_budget_and_round_trips(linen_setup, linen_search, bits):
    model, variables, batches = linen_setup
    result = linen_search.at({"effective_bits": bits})
    params = sum(row.params for row in result.table)
    assert result.weight_bytes * 8 <= bits * params
    assert result.effective_bits == pytest.approx(8 * result.weight_bytes / params)
    assert result.weight_bytes == sum(row.bytes[row.choice] for row in result.table)
    for row in result.table:  # the map gives each layer its choice
        assert result.policy_map[row.path].name == row.choice
        assert row.scores["mixed_bfloat16"] == 0.0
    config = jp.serialize(result.policy_map)
    assert jp.deserialize(config) == result.policy_map
    # The map runs as is: init (float8 state), quantize and apply take it.
    state = jp.linen.init(model, result.policy_map)(jax.random.key(1), batches[0])
    variables = {**state, "params": variables["params"]}
    if map_search.stores_weights(result.policy_map):
        variables = jp.linen.quantize(model, result.policy_map, variables, batches[0])
    out = jp.linen.apply(model, result.policy_map)(variables, batches[0])
    assert out.shape == (16, 4)
    assert "total:" in str(result)


def test_linen_scores_order_the_formats(linen_search):
    result = linen_search
    for row in result.table:
        s = row.scores
        assert 0 < s["int8_from_mixed_bfloat16"] < s["int4/128_from_mixed_bfloat16"], row
    assert [row.path for row in result.table] == ["head", "layers_0", "layers_1", "layers_2"]


def test_linen_search_jit_and_eager_agree(linen_setup):
    model, variables, batches = linen_setup
    budget = {"effective_bits": 5}
    a = jp.linen.search_map(model, variables, batches, _loss, budget=budget)
    b = jp.linen.search_map(model, variables, batches, _loss, budget=budget, jit=False)
    assert [r.choice for r in a.table] == [r.choice for r in b.table]
    for ra, rb in zip(a.table, b.table, strict=True):
        # int4's errors dwarf bfloat16's rounding, which differs with XLA's fusions
        name = "int4/128_from_mixed_bfloat16"
        assert ra.scores[name] == pytest.approx(rb.scores[name], rel=0.1)


def test_loss_budget_minimizes_bytes(linen_search):
    loose = linen_search.at({"loss_increase": 1.0})
    assert loose.loss_increase <= 1.0
    assert loose.weight_bytes == sum(min(r.bytes.values()) for r in loose.table)
    tight = linen_search.at({"loss_increase": 1e-12})
    assert tight.loss_increase <= 1e-12 and tight.weight_bytes > loose.weight_bytes


def test_infeasible_budget_names_the_cheapest(linen_setup):
    model, variables, batches = linen_setup
    with pytest.raises(ValueError, match=r"cheapest possible is [\d,]+ weight bytes \(4\.\d+ eff"):
        jp.linen.search_map(model, variables, batches, _loss, budget={"effective_bits": 2})
    with pytest.raises(ValueError, match="cheapest possible is"):
        jp.linen.search_map(model, variables, batches, _loss, budget={"weight_bytes": 10})


@pytest.mark.parametrize(
    "candidates, match",
    [
        (["int3_from_mixed_bfloat16"], "'int3_from_mixed_bfloat16', which is not a policy name"),
        (["float32"], "'float32', a float policy"),
        ("int8_from_mixed_bfloat16", "non-empty list of policy names"),
        ([7], "Received: 7"),
    ],
)
def test_candidates_validated(linen_setup, candidates, match):
    model, variables, batches = linen_setup
    with pytest.raises((ValueError, TypeError), match=match):
        jp.linen.search_map(
            model, variables, batches, _loss, candidates=candidates, budget={"effective_bits": 8}
        )


@pytest.mark.parametrize(
    "budget, match",
    [
        ({"bits": 4}, "must name one of"),
        (
            {"effective_bits": -1},
            "must be a finite positive number. Received: budget={.effective_bits.: -1}",
        ),
        (4.5, "must be a dict of one of"),
    ],
)
def test_budget_validated(linen_setup, budget, match):
    model, variables, batches = linen_setup
    with pytest.raises((ValueError, TypeError), match=match):
        jp.linen.search_map(model, variables, batches, _loss, budget=budget)


class NnxMLP(nnx.Module):
    def __init__(self, rngs):
        self.layers = nnx.List(
            [nnx.Linear(128 if i == 0 else 256, 256, rngs=rngs) for i in range(3)]
        )
        self.head = nnx.Linear(256, 4, rngs=rngs)

    def __call__(self, x):
        for layer in self.layers:
            x = nnx.relu(layer(x))
        return self.head(x)


def test_nnx_search_meets_the_budget_and_runs():
    model = NnxMLP(nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(0), (16, 128))
    before = jax.tree.map(np.asarray, nnx.state(model))
    result = jp.nnx.search_map(model, [x], _loss, budget={"effective_bits": 5})
    params = sum(row.params for row in result.table)
    assert result.weight_bytes * 8 <= 5 * params
    assert sorted(r.path for r in result.table) == ["head", "layers/0", "layers/1", "layers/2"]
    jax.tree.map(np.testing.assert_array_equal, before, jax.tree.map(np.asarray, nnx.state(model)))
    runner = jp.nnx.quantize(model, result.policy_map)
    assert jp.nnx.apply(runner, result.policy_map)(x).shape == (16, 4)


# -- layer stacks (nn.scan, nnx.scan, vmap): one path of the map, scored and chosen per stack

INT4 = "int4/128_from_mixed_bfloat16"
FP8 = "float8_from_mixed_bfloat16"


class ScanBlock(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return nn.relu(nn.Dense(128, name="mlp")(x)), None


class ScanStack(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(128, name="embed")(x)
        layers = nn.scan(
            ScanBlock, variable_axes={"params": 0}, split_rngs={"params": True}, length=3
        )
        x, _ = layers(name="layers")(x, None)
        return nn.Dense(4, name="head")(x)


class Unrolled(nn.Module):  # the same layers, one path each
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(128, name="embed")(x)
        for i in range(3):
            x = nn.relu(nn.Dense(128, name=f"mlp_{i}")(x))
        return nn.Dense(4, name="head")(x)


@pytest.fixture(scope="module")
def scan_setup():
    model = ScanStack()
    x = jax.random.normal(jax.random.key(0), (16, 32))
    variables = model.init(jax.random.key(1), x)
    return model, variables, [x, x * 2]


def _rows(result):
    return {row.path: row for row in result.table}


@pytest.mark.parametrize("jit", [True, False])
def test_linen_scan_stack_scores_as_the_sum_of_its_layers(scan_setup, jit):
    model, variables, batches = scan_setup
    params = variables["params"]
    unrolled = {"embed": params["embed"], "head": params["head"]}
    for i in range(3):
        unrolled[f"mlp_{i}"] = jax.tree.map(lambda a, i=i: a[i], params["layers"]["mlp"])
    budget = {"effective_bits": 16}
    stack = _rows(jp.linen.search_map(model, variables, batches, _loss, budget=budget, jit=jit))
    flat = _rows(
        jp.linen.search_map(
            Unrolled(), {"params": unrolled}, batches, _loss, budget=budget, jit=jit
        )
    )
    assert sorted(stack) == ["embed", "head", "layers/mlp"]
    row = stack["layers/mlp"]
    assert row.params == 3 * 128 * 128
    assert row.unit == "per stack (scanned: 3 layers)"
    assert row.why.startswith("per stack (scanned: 3 layers), one entry of the map for all its ")
    for name in row.bytes:  # each layer quantized on its own: the stack's bytes are theirs
        assert row.bytes[name] == sum(flat[f"mlp_{i}"].bytes[name] for i in range(3)), name
    # Float8 runs the same matmul in and out of the loop: the scores add up exactly; a
    # stacked int4 kernel is dequantized ahead of the loop (a bfloat16 matmul), the unrolled
    # layers run the int4 matmul, which rounds a little differently.
    assert row.scores[FP8] == pytest.approx(sum(flat[f"mlp_{i}"].scores[FP8] for i in range(3)))
    int4 = sum(flat[f"mlp_{i}"].scores[INT4] for i in range(3))
    assert row.scores[INT4] == pytest.approx(int4, rel=0.05)
    assert 0 < row.scores[FP8] < row.scores[INT4]
    for path in ("embed", "head"):  # the layers outside the loop are scored as before
        assert stack[path].scores[INT4] == pytest.approx(flat[path].scores[INT4], rel=1e-3)


@pytest.mark.parametrize("jit", [True, False])
def test_linen_scan_stack_is_chosen_and_quantized_per_stack(scan_setup, jit):
    model, variables, batches = scan_setup
    x = batches[0]
    # 5 bits: the stack (3/4 of the parameters) must go to int4
    result = jp.linen.search_map(
        model, variables, batches, _loss, budget={"effective_bits": 5}, jit=jit
    )
    params = sum(row.params for row in result.table)
    assert result.weight_bytes * 8 <= 5 * params
    assert _rows(result)["layers/mlp"].choice == INT4
    assert result.policy_map["layers/mlp"].name == INT4
    quantized = jp.linen.quantize(model, result.policy_map, variables, x)
    kernel = quantized["params"]["layers"]["mlp"]["kernel"]
    assert isinstance(kernel, jp.QuantizedArray)
    assert (kernel.shape, kernel.stacked) == ((3, 128, 128), 1)
    explained = jp.linen.explain(model, result.policy_map, variables, x)
    line = next(s for s in explained.splitlines() if s.startswith("layers/mlp "))
    assert INT4 in line and "key 'layers/mlp'" in line
    run = jp.linen.apply(model, result.policy_map)
    out = run(quantized, x)
    np.testing.assert_allclose(jax.jit(run)(quantized, x), out, rtol=1e-2, atol=1e-2)
    ref = model.apply(variables, x)
    bf16 = jp.linen.apply(model, "mixed_bfloat16")(variables, x)
    err = float(jnp.abs(out.astype(jnp.float32) - ref).max())  # int4 took effect
    assert (
        float(jnp.abs(bf16.astype(jnp.float32) - ref).max()) < err < 0.5 * float(jnp.abs(ref).max())
    )


def test_linen_scan_sharing_one_kernel_says_so():
    class Shared(nn.Module):
        @nn.compact
        def __call__(self, x):
            layers = nn.scan(
                ScanBlock, variable_broadcast="params", split_rngs={"params": False}, length=3
            )
            x, _ = layers(name="layers")(x, None)
            return nn.Dense(4, name="head")(x)

    model, x = Shared(), jax.random.normal(jax.random.key(0), (16, 128))
    variables = model.init(jax.random.key(1), x)
    result = jp.linen.search_map(model, variables, [x], _loss, budget={"effective_bits": 16})
    row = _rows(result)["layers/mlp"]
    assert row.unit == "one kernel shared by 3 scan iterations"
    assert row.why.startswith("one kernel shared by 3 scan iterations; ")
    assert row.params == 128 * 128 and row.scores[INT4] > 0


class NnxBlock(nnx.Module):
    def __init__(self, rngs):
        self.mlp = nnx.Linear(128, 128, rngs=rngs)

    def __call__(self, x):
        return nnx.relu(self.mlp(x))


class NnxStack(nnx.Module):
    def __init__(self, rngs, remat=False):
        self.remat = remat
        self.embed = nnx.Linear(32, 128, rngs=rngs)

        @nnx.split_rngs(splits=3)
        @nnx.vmap
        def make(rngs):
            return NnxBlock(rngs)

        self.blocks = make(rngs)  # kernels [3, 128, 128]
        self.head = nnx.Linear(128, 4, rngs=rngs)

    def __call__(self, x):
        def run(x, block):
            return block(x)

        run = nnx.remat(run) if self.remat else run
        body = nnx.scan(run, in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        return self.head(body(self.embed(x), self.blocks))


def test_nnx_scan_stack_is_scored_chosen_and_quantized_per_stack():
    model = NnxStack(nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(0), (16, 32))
    before = jax.tree.map(np.asarray, nnx.state(model))
    result = jp.nnx.search_map(model, [x, x * 2], _loss, budget={"effective_bits": 5})
    jax.tree.map(np.testing.assert_array_equal, before, jax.tree.map(np.asarray, nnx.state(model)))
    rows = _rows(result)
    assert sorted(rows) == ["blocks/mlp", "embed", "head"]
    row = rows["blocks/mlp"]
    assert row.unit == "per stack (scanned: 3 layers)"
    assert row.why.startswith("per stack (scanned: 3 layers), one entry of the map for all its ")
    assert row.params == 3 * 128 * 128
    assert 0 < row.scores[FP8] < row.scores[INT4]
    assert result.weight_bytes * 8 <= 5 * sum(r.params for r in result.table)
    assert row.choice == INT4 and result.policy_map["blocks/mlp"].name == INT4
    runner = jp.nnx.quantize(model, result.policy_map)
    kernel = runner.blocks.mlp.kernel.get_value()
    assert isinstance(kernel, jp.QuantizedArray)
    assert (kernel.shape, kernel.stacked) == ((3, 128, 128), 1)
    line = next(
        s
        for s in jp.nnx.explain(model, result.policy_map).splitlines()
        if s.startswith("blocks/mlp ")
    )
    assert INT4 in line and "key 'blocks/mlp'" in line
    run = jp.nnx.apply(runner, result.policy_map)
    out = run(x)
    jitted = nnx.jit(lambda m, x: jp.nnx.apply(m, result.policy_map)(x))(runner, x)
    np.testing.assert_allclose(jitted, out, rtol=1e-2, atol=1e-2)
    ref = model(x)
    bf16 = jp.nnx.apply(model, "mixed_bfloat16")(x)
    err = float(jnp.abs(out.astype(jnp.float32) - ref).max())  # int4 took effect
    assert (
        float(jnp.abs(bf16.astype(jnp.float32) - ref).max()) < err < 0.5 * float(jnp.abs(ref).max())
    )


class VmapBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.relu(nn.Dense(128, name="mlp")(x))


class VmapStack(nn.Module):  # two layers run in parallel, each on its own input
    @nn.compact
    def __call__(self, x):
        vmapped = nn.vmap(
            VmapBlock, variable_axes={"params": 0}, split_rngs={"params": True}, in_axes=0
        )
        x = vmapped(name="vm")(jnp.stack([x, -x])).mean(0)
        return nn.Dense(4, name="head")(x)


class VmapUnrolled(nn.Module):  # the same layers, one path each
    @nn.compact
    def __call__(self, x):
        ys = [nn.relu(nn.Dense(128, name=f"mlp_{i}")(s * x)) for i, s in enumerate((1, -1))]
        return nn.Dense(4, name="head")((ys[0] + ys[1]) / 2)


@pytest.mark.parametrize("jit", [True, False])
def test_linen_vmap_stack_scores_as_the_sum_of_its_layers(jit):
    model, x = VmapStack(), jax.random.normal(jax.random.key(0), (8, 128))
    variables = model.init(jax.random.key(1), x)
    params = variables["params"]
    unrolled = {"head": params["head"]}
    for i in range(2):
        unrolled[f"mlp_{i}"] = jax.tree.map(lambda a, i=i: a[i], params["vm"]["mlp"])
    kw = {"budget": {"effective_bits": 16}, "candidates": [INT4]}
    stack = _rows(jp.linen.search_map(model, variables, [x], _loss, jit=jit, **kw))
    flat = _rows(jp.linen.search_map(VmapUnrolled(), {"params": unrolled}, [x], _loss, **kw))
    row = stack["vm/mlp"]
    assert row.scored and row.unit == "per stack (vmapped: 2 layers)"
    assert row.params == 2 * 128 * 128
    # each lane scored on its own input and gradient: the layers' scores add up (within
    # the rounding of a stacked int4 kernel, dequantized ahead of the vmap, as in a scan)
    want = sum(flat[f"mlp_{i}"].scores[INT4] for i in range(2))
    assert row.scores[INT4] == pytest.approx(want, rel=0.05)
    assert row.scores[INT4] > 0
    assert stack["head"].scores[INT4] == pytest.approx(flat["head"].scores[INT4], rel=1e-3)


class NnxVmapStack(NnxStack):  # the stack run by nnx.vmap, every layer on the same input
    def __call__(self, x):
        run = nnx.vmap(lambda block, x: block(x), in_axes=(0, None))
        return self.head(run(self.blocks, self.embed(x)).mean(0))


def test_nnx_vmap_stack_is_scored_per_stack_and_quantized():
    model, x = NnxVmapStack(nnx.Rngs(0)), jax.random.normal(jax.random.key(0), (16, 32))
    result = jp.nnx.search_map(model, [x], _loss, budget={"effective_bits": 5}, candidates=[INT4])
    row = _rows(result)["blocks/mlp"]
    assert row.scored and row.unit == "per stack (vmapped: 3 layers)"
    assert row.scores[INT4] > 0
    assert row.choice == INT4
    kernel = jp.nnx.quantize(model, result.policy_map).blocks.mlp.kernel.get_value()
    assert (kernel.shape, kernel.stacked) == ((3, 128, 128), 1)


_MADE_AT_IMPORT = nnx.vmap(lambda block, x: block(x), in_axes=(0, None))


class NnxVmapMadeBefore(NnxStack):  # run by an nnx.vmap function made before the search
    def __call__(self, x):
        return self.head(_MADE_AT_IMPORT(self.blocks, self.embed(x)).mean(0))


def test_a_stack_run_by_an_nnx_vmap_made_before_the_search_is_not_scored_and_says_so():
    model, x = NnxVmapMadeBefore(nnx.Rngs(0)), jax.random.normal(jax.random.key(0), (16, 32))
    result = jp.nnx.search_map(model, [x], _loss, budget={"effective_bits": 16}, candidates=[INT4])
    row = _rows(result)["blocks/mlp"]
    assert not row.scored and row.choice == "mixed_bfloat16"
    assert row.why == (
        "not scored (called inside a transform the search cannot see into: one other than "
        "a scan, remat or vmap, or an nnx.remat/nnx.vmap function made before the search "
        "ran): base kept"
    )
    assert _rows(result)["head"].scores[INT4] > 0


class RematBlock(nn.Module):
    @nn.compact
    def __call__(self, x, _=None):
        return nn.relu(nn.Dense(128, name="mlp")(x)), None


def _remat_model(remat, scan):
    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            block = nn.remat(RematBlock) if remat else RematBlock
            if scan:
                block = nn.scan(
                    block, variable_axes={"params": 0}, split_rngs={"params": True}, length=3
                )
            x, _ = block(name="layers")(x, None)
            return nn.Dense(4, name="head")(x)

    return Model()


@pytest.mark.parametrize("jit", [True, False])
@pytest.mark.parametrize("scan", [False, True])
def test_linen_remat_layers_score_as_without_remat(scan, jit):
    x = jax.random.normal(jax.random.key(0), (8, 128))
    variables = _remat_model(False, scan).init(jax.random.key(1), x)
    budget = {"effective_bits": 16}
    plain, remat = (
        _rows(
            jp.linen.search_map(
                _remat_model(r, scan), variables, [x, 2 * x], _loss, budget=budget, jit=jit
            )
        )["layers/mlp"]
        for r in (False, True)
    )
    assert remat.scored and remat.unit == plain.unit
    assert remat.unit == ("per stack (scanned: 3 layers)" if scan else "layer")
    assert remat.scores == pytest.approx(plain.scores, rel=1e-5)
    assert remat.scores[INT4] > 0


class NnxPair(nnx.Module):  # one nnx.remat function, made in the call, called twice
    def __init__(self, rngs, remat):
        self.a, self.b = NnxBlock(rngs), NnxBlock(rngs)
        self.head = nnx.Linear(128, 4, rngs=rngs)
        self.remat = remat

    def __call__(self, x):
        def run(block, x):
            return block(x)

        run = nnx.remat(run) if self.remat else run
        return self.head(run(self.b, run(self.a, x)))


def test_nnx_remat_made_in_the_call_scores_each_call_as_without_remat():
    x = jax.random.normal(jax.random.key(0), (8, 128))
    plain, remat = (
        _rows(jp.nnx.search_map(NnxPair(nnx.Rngs(0), r), [x], _loss, budget={"effective_bits": 16}))
        for r in (False, True)
    )
    assert sorted(remat) == ["a/mlp", "b/mlp", "head"]
    for path in remat:  # JAX caches a remat function's trace: each call is still its own
        assert remat[path].scored
        assert remat[path].scores == pytest.approx(plain[path].scores, rel=1e-5), path
    assert remat["a/mlp"].scores[INT4] != pytest.approx(remat["b/mlp"].scores[INT4], rel=1e-3)


def test_nnx_scan_over_remat_scores_as_without_remat():
    x = jax.random.normal(jax.random.key(0), (16, 32))
    plain, remat = (
        _rows(
            jp.nnx.search_map(NnxStack(nnx.Rngs(0), r), [x], _loss, budget={"effective_bits": 16})
        )
        for r in (False, True)
    )
    assert remat["blocks/mlp"].unit == "per stack (scanned: 3 layers)"
    for path in remat:
        assert remat[path].scores == pytest.approx(plain[path].scores, rel=1e-5), path


@pytest.mark.parametrize(
    "budget", [{"effective_bits": 5}, {"weight_bytes": 300_000}, {"loss_increase": 1e-3}]
)
def test_at_chooses_again_from_the_same_scores(linen_setup, linen_search, budget):
    model, variables, batches = linen_setup
    first = linen_search
    again = first.at(budget)
    direct = jp.linen.search_map(model, variables, batches, _loss, budget=budget)
    assert [r.choice for r in again.table] == [r.choice for r in direct.table]
    assert again.policy_map == direct.policy_map
    assert (again.weight_bytes, again.method) == (direct.weight_bytes, direct.method)
    assert again.loss_increase == pytest.approx(direct.loss_increase)
    assert [r.why for r in again.table] == [r.why for r in direct.table]
    assert first.at({"effective_bits": 16}) == first


def test_at_validates_its_budget(linen_search):
    first = linen_search
    with pytest.raises(ValueError, match=r"cheapest possible is [\d,]+ weight bytes \(4\.\d+ eff"):
        first.at({"effective_bits": 2})
    with pytest.raises(TypeError, match="must be a dict of one of"):
        first.at(4.5)


def test_at_keeps_a_stack_per_stack(scan_setup):
    model, variables, batches = scan_setup
    first = jp.linen.search_map(model, variables, batches, _loss, budget={"effective_bits": 16})
    row = _rows(first.at({"effective_bits": 5}))["layers/mlp"]
    assert (row.unit, row.choice) == ("per stack (scanned: 3 layers)", INT4)


@pytest.fixture
def backend_compiles():
    """The XLA compilations that run while the test does (JAX's monitoring events)."""
    seen = []

    def listen(name, duration, **kwargs):
        if "backend_compile" in name:
            seen.append(name)

    jax.monitoring.register_event_duration_secs_listener(listen)
    yield seen
    jax.monitoring.unregister_event_duration_listener(listen)


def test_searching_the_same_model_again_compiles_nothing(backend_compiles):
    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(4, name="head")(nn.relu(nn.Dense(64, name="up")(x)))

    model, x = MLP(), jax.random.normal(jax.random.key(0), (16, 32))
    variables = model.init(jax.random.key(1), x)
    other = jax.tree.map(lambda a: a * 2, variables)  # new weights, same shapes
    first = jp.linen.search_map(model, variables, [x], _loss, budget={"effective_bits": 8})
    compiled = len(backend_compiles)
    assert compiled > 0  # the passes of the first search
    again = jp.linen.search_map(model, other, [x], _loss, budget={"effective_bits": 8})
    assert len(backend_compiles) == compiled  # every pass reused (it recompiled all of them)
    assert [r.path for r in again.table] == [r.path for r in first.table]
    assert again.table[0].scores != first.table[0].scores  # computed on the new weights
    jp.linen.search_map(model, variables, [x[:8]], _loss, budget={"effective_bits": 8})
    assert len(backend_compiles) > compiled  # another batch shape: compiled for it
    key = [k for k, (reuse, _) in search_passes._COMPILED.items() if reuse[0] is model]
    assert key and len(search_passes._COMPILED) <= map_search.MAX_COMPILED
