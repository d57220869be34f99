"""GPTQ and AWQ on the asymmetric int4 grid (``"gptq/4/<group>/asym"``, Keras's
``symmetric=False``), solved directly and through ``jp.linen.calibrate``."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_policy as jp
from jmp_policy._src.quantization import asymmetric_grid, awq, gptq
from jmp_policy._src.quantization.zero_point import quantize_asymmetric


def _problem(rows=256, n=48):
    w = jax.random.normal(jax.random.key(0), (rows, n)) + 0.3
    x = jax.random.normal(jax.random.key(1), (512, rows)) * jnp.linspace(0.1, 3.0, rows)
    return w, x, x.T @ x, jnp.mean(jnp.abs(x), axis=0)


def _error(q, w, x):
    return float(jnp.sum((x @ q.dequantize(jnp.float32) - x @ w) ** 2))


@pytest.mark.parametrize("clip", [False, True])
def test_gptq_and_awq_on_the_asymmetric_grid_beat_its_round_to_nearest_and_symmetric(clip):
    w, x, h, m = _problem()
    rtn = quantize_asymmetric(w, 128)
    g = gptq.gptq_quantize(w, h, group_size=128, clip_search=clip, symmetric=False)
    a = awq.awq_quantize(w, m, h, group_size=128, clip_search=clip, symmetric=False)
    assert type(g) is jp.QuantizedArray and g.zero_point.shape == (2, 48)
    assert (
        type(a) is awq.InputScaledArray
        and a.zero_point is not None
        and a.input_scale.shape == (256,)
    )
    assert _error(g, w, x) < _error(rtn, w, x) and _error(a, w, x) <= _error(rtn, w, x)
    g_sym = gptq.gptq_quantize(w, h, group_size=128, clip_search=clip)
    assert _error(g, w, x) < _error(g_sym, w, x)
    for q in (g, a):
        v = np.asarray(q.values).astype(int)
        assert v.min() >= -8 and v.max() <= 7


def test_gptq_symmetric_default_is_unchanged_by_the_new_argument():
    w, _, h, _ = _problem()
    assert gptq.gptq_quantize(w, h, group_size=64) == gptq.gptq_quantize(
        w, h, group_size=64, symmetric=True
    )


def test_gptq_asymmetric_per_channel_stacked_and_under_jit():
    w, _, h, _ = _problem(64, 8)
    stacked = gptq.gptq_quantize(
        jnp.stack([w, -w]), jnp.stack([h, h]), group_size=-1, stacked=1, symmetric=False
    )
    assert stacked.zero_point.shape == stacked.scale.shape == (2, 1, 8)
    one = gptq.gptq_quantize(-w, h, group_size=-1, symmetric=False)
    np.testing.assert_array_equal(stacked.dequantize()[1], one.dequantize())
    jitted = jax.jit(lambda k, hh: gptq.gptq_quantize(k, hh, group_size=32, symmetric=False))
    assert jitted(w, h) == gptq.gptq_quantize(w, h, group_size=32, symmetric=False)


@pytest.mark.parametrize("bad", ["no", 0, None])
def test_bad_symmetric_arguments(bad):
    w, _, h, m = _problem(16, 4)
    with pytest.raises(TypeError, match="symmetric"):
        gptq.gptq_quantize(w, h, group_size=8, symmetric=bad)
    with pytest.raises(TypeError, match="symmetric"):
        awq.awq_quantize(w, m, h, group_size=8, symmetric=bad)
    with pytest.raises(ValueError, match="int4"):
        gptq.gptq_quantize(w, h, weight_bits=8, group_size=-1, symmetric=False)


def test_asymmetric_clip_search_never_does_worse_than_the_full_range():
    w, _, _, _ = _problem(128, 16)
    w = w.at[3, :].set(9.0)  # an outlier row
    full = asymmetric_grid.column_grid(w, (16,))
    clipped = asymmetric_grid.column_grid(w, (16,), clip=True)

    def weight_error(grid):
        s, z = grid
        return jnp.sum(
            jnp.abs(w - asymmetric_grid.real(asymmetric_grid.round_values(w, s, z), s, z)) ** 2.4,
            axis=0,
        )

    assert bool(jnp.all(weight_error(clipped) <= weight_error(full) + 1e-4))
    assert bool(jnp.any(clipped[0] < full[0]))


def test_policies_names_and_keras_configs():
    for name, cls in (
        ("gptq/4/128/asym_from_mixed_bfloat16", jp.GPTQDTypePolicy),
        ("awq/4/-1/asym_from_float32", jp.AWQDTypePolicy),
    ):
        p = jp.get(name)
        assert type(p) is cls and p.symmetric is False and p.name == name
        config = p.get_config()
        assert config["symmetric"] is False and "/asym" not in config["mode"]
        assert cls.from_config(config) == p and jp.deserialize(jp.serialize(p)) == p
        assert cls(config["mode"], config["source_name"], symmetric=False) == p
        assert p != jp.get(name.replace("/asym", ""))
    assert jp.get("gptq/4/128_from_float32").get_config() == {
        "mode": "gptq/4/128",
        "source_name": "float32",
    }
    with pytest.raises(ValueError, match="int4"):
        jp.get("gptq/8/-1/asym_from_float32")
    with pytest.raises(ValueError, match="symmetric"):
        jp.GPTQDTypePolicy("gptq/4/128/asym", "float32", symmetric=True)
    for cls, mode in (
        (jp.GPTQDTypePolicy, "gptq/8/-1"),
        (jp.SmoothQuantDTypePolicy, "smoothquant/8"),
    ):
        with pytest.raises(
            ValueError, match=rf"`symmetric=False` does not apply to mode='{mode}': .*int4's only"
        ):
            cls(mode, "float32", symmetric=False)
    with pytest.raises(TypeError, match="symmetric"):
        jp.AWQDTypePolicy("awq/4/128", "float32", symmetric="False")


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(64, name="up")(x))
        x = nn.relu(nn.Dense(64, name="mid")(x))
        return nn.Dense(8, name="head")(x)


@pytest.mark.parametrize("use_jit", [False, True])
def test_linen_calibrate_serves_asymmetric_gptq_awq_and_rtn(use_jit):
    model = MLP()
    x = jax.random.normal(jax.random.key(2), (256, 32)) + 0.5
    variables = model.init(jax.random.key(0), x)
    policies = {
        "up": "awq/4/16/asym_from_float32",
        "mid": "gptq/4/16/asym_from_float32",
        "head": "int4/16/asym_from_float32",
    }
    policy_map = jp.DTypePolicyMap("float32", policies)
    q = jp.linen.calibrate(model, policy_map, variables, [x[:128], x[128:]])
    up, mid, head = (q["params"][n]["kernel"] for n in ("up", "mid", "head"))
    assert type(up) is awq.InputScaledArray and up.zero_point is not None
    assert type(mid) is jp.QuantizedArray and type(head) is jp.QuantizedArray
    assert mid.zero_point is not None and head.zero_point is not None
    serve = jp.linen.apply(model, policy_map)
    run = jax.jit(serve) if use_jit else serve
    y = run(q, x[:4])
    quantized = lambda k: isinstance(k, jp.QuantizedArray)  # noqa: E731
    dense = jax.tree.map(
        lambda k: k.dequantize(jnp.float32) if quantized(k) else k, q, is_leaf=quantized
    )
    np.testing.assert_allclose(y, model.apply(dense, x[:4]), rtol=1e-4, atol=1e-4)
    table = str(jp.linen.explain(model, policy_map, q, x[:4]))
    assert "zero point folded" in table and "with zero points" in table
