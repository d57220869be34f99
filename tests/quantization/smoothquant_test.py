"""SmoothQuant (``"smoothquant/8_from_<source>"``): the smoothing scale, the int8 kernel it
is folded into, the policy and its config, and int8 x int8 layers calibrated by
``jp.linen.calibrate``."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_policy as jp
from jmp_policy._src.quantization import awq
from jmp_policy._src.quantization.smoothquant import smoothing_scale, smoothquant_quantize


def _kernel(shape=(64, 32)):
    return jax.random.normal(jax.random.key(0), shape)


def test_the_smoothing_scale_is_the_papers():
    w = _kernel()
    x_max = jnp.linspace(0.5, 40.0, 64)
    s = smoothing_scale(x_max, w, 0.5)
    want = np.sqrt(np.asarray(x_max)) / np.sqrt(np.abs(np.asarray(w)).max(axis=1))
    np.testing.assert_allclose(s, want, rtol=1e-5)
    s75 = smoothing_scale(x_max, w, 0.75)
    want75 = np.asarray(x_max) ** 0.75 / np.abs(np.asarray(w)).max(axis=1) ** 0.25
    np.testing.assert_allclose(s75, want75, rtol=1e-5)
    # an unseen channel or a zero row: 1
    s0 = smoothing_scale(x_max.at[3].set(0.0), w.at[5].set(0.0), 0.5)
    assert float(s0[3]) == 1.0 and float(s0[5]) == 1.0


@pytest.mark.parametrize("use_jit", [False, True])
def test_the_kernel_is_int8_of_the_scaled_rows_and_dequantizes_to_w(use_jit):
    w = _kernel()
    x_max = jnp.linspace(0.5, 40.0, 64)
    fn = lambda k, a: smoothquant_quantize(k, a, alpha=0.5)  # noqa: E731
    q = (jax.jit(fn) if use_jit else fn)(w, x_max)
    assert isinstance(q, awq.InputScaledArray) and q.mode == "int8"
    assert q.values.dtype == jnp.int8 and q.scale.shape == (32,) and q.input_scale.shape == (64,)
    s = smoothing_scale(x_max, w, 0.5)
    scaled = w * s[:, None]
    np.testing.assert_allclose(q.scale, np.abs(np.asarray(scaled)).max(axis=0) / 127, rtol=1e-6)
    step = np.asarray(q.scale)[None, :] / np.asarray(s)[:, None]
    assert np.all(np.abs(np.asarray(q.dequantize()) - np.asarray(w)) <= step / 2 + 1e-6)
    assert q.nbytes == 64 * 32 + 32 * 4 + 64 * 4


def test_stacked_kernels_are_smoothed_per_layer():
    w = jnp.stack([_kernel(), 3 * _kernel()])
    x_max = jnp.stack([jnp.linspace(1, 9, 64), jnp.linspace(9, 1, 64)])
    q = smoothquant_quantize(w, x_max, stacked=1)
    for i in range(2):
        one = smoothquant_quantize(w[i], x_max[i])
        np.testing.assert_array_equal(q.input_scale[i], one.input_scale)
        np.testing.assert_array_equal(q.dequantize()[i], one.dequantize())


@pytest.mark.parametrize(
    ("alpha", "error"),
    [("0.5", TypeError), (True, TypeError), ([0.5], TypeError), (1.5, ValueError),
     (-0.1, ValueError), (float("nan"), ValueError)],
)  # fmt: skip
def test_bad_alpha_names_it(alpha, error):
    with pytest.raises(error, match="alpha"):
        smoothquant_quantize(_kernel(), jnp.ones(64), alpha=alpha)
    with pytest.raises(error, match="alpha"):
        jp.SmoothQuantDTypePolicy("smoothquant/8", "float32", alpha=alpha)


def test_none_alpha_is_the_default_and_the_kernel_refuses_it():
    assert jp.SmoothQuantDTypePolicy("smoothquant/8", "float32", alpha=None).alpha == 0.5
    with pytest.raises(TypeError, match="alpha=None"):
        smoothquant_quantize(_kernel(), jnp.ones(64), alpha=None)


def test_smoothing_strength_is_alpha_in_llm_compressors_spelling():
    a = jp.SmoothQuantDTypePolicy("smoothquant/8", "float32", smoothing_strength=0.8)
    assert a.alpha == 0.8
    assert a == jp.SmoothQuantDTypePolicy("smoothquant/8", "float32", alpha=0.8)
    assert a.get_config() == {"mode": "smoothquant/8", "source_name": "float32", "alpha": 0.8}
    with pytest.raises(
        ValueError, match=r"not both\. Received: alpha=0\.5, smoothing_strength=0\.8"
    ):
        jp.SmoothQuantDTypePolicy("smoothquant/8", "float32", alpha=0.5, smoothing_strength=0.8)
    for bad, error in ((True, TypeError), ("0.8", TypeError), (1.2, ValueError)):
        with pytest.raises(error, match=f"smoothing_strength={bad!r}"):
            jp.SmoothQuantDTypePolicy("smoothquant/8", "float32", smoothing_strength=bad)


def test_abs_max_of_another_shape_is_refused():
    with pytest.raises(ValueError, match="abs_max"):
        smoothquant_quantize(_kernel(), jnp.ones(63))


def test_names_configs_and_round_trips():
    p = jp.get("smoothquant/8_from_mixed_bfloat16")
    assert type(p) is jp.SmoothQuantDTypePolicy and p.alpha == 0.5
    assert p.quantization_mode == "smoothquant" and p.weight_bits == 8
    assert p.get_config() == {"mode": "smoothquant/8", "source_name": "mixed_bfloat16"}
    a = jp.SmoothQuantDTypePolicy("smoothquant/8", "mixed_bfloat16", alpha=0.8)
    assert a != p and a.get_config()["alpha"] == 0.8
    assert jp.SmoothQuantDTypePolicy.from_config(a.get_config()) == a
    assert jp.deserialize(jp.serialize(a)) == a
    assert a.with_compute_dtype("float32").alpha == 0.8
    assert jp.DTypePolicyMap("float32", {"up": "smoothquant/8_from_float32"})["up"].alpha == 0.5
    for bad in ("smoothquant/4_from_float32", "smoothquant/8/128_from_float32"):
        with pytest.raises(ValueError, match="smoothquant/8"):
            jp.get(bad)
    assert jp.get("smoothquant_from_mixed_bfloat16") == p
    with pytest.raises(ValueError, match="calibrate"):
        p.quantize({"kernel": _kernel()})


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(16, name="down")(nn.Dense(128, name="up")(x))


@pytest.fixture(scope="module")
def outlier_model():
    model = MLP()
    scale = jnp.ones(64).at[jnp.array([3, 17, 40])].set(60.0)  # outlier channels
    x = jax.random.normal(jax.random.key(1), (1024, 64)) * scale
    return model, model.init(jax.random.key(0), x), x


@pytest.mark.parametrize("use_jit", [False, True])
def test_calibrated_int8_x_int8_layers_lose_less_than_plain_int8(outlier_model, use_jit):
    model, variables, x = outlier_model
    reference = model.apply(variables, x[:256])
    errors = {}
    for name in ("int8_from_float32", "smoothquant/8_from_float32"):
        policy_map = jp.DTypePolicyMap("float32", {"up": name, "down": name})
        q = jp.linen.calibrate(model, policy_map, variables, [x[:512], x[512:]])
        serve = jp.linen.apply(model, policy_map)
        y = (jax.jit(serve) if use_jit else serve)(q, x[:256])
        errors[name] = float(jnp.mean((y - reference) ** 2) / jnp.mean(reference**2))
        table = str(jp.linen.explain(model, policy_map, q, x[:256]))
        assert "int8 x int8" in table
    assert errors["smoothquant/8_from_float32"] < 0.5 * errors["int8_from_float32"]
    assert "smoothquant int8 weights: int8 x int8" in table
    up = q["params"]["up"]["kernel"]
    assert isinstance(up, awq.InputScaledArray) and up.mode == "int8"


def _outlier_inputs():
    scale = jnp.ones(64).at[jnp.array([3, 17, 40])].set(60.0)
    return jax.random.normal(jax.random.key(1), (1024, 64)) * scale


def test_nnx_calibrate_smooths_and_serves_int8_x_int8():
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.up = nnx.Linear(64, 128, rngs=rngs)
            self.down = nnx.Linear(128, 16, rngs=rngs)

        def __call__(self, x):
            return self.down(self.up(x))

    x = _outlier_inputs()
    model = Net(nnx.Rngs(0))
    reference = model(x[:256])
    errors = {}
    for name in ("int8_from_float32", "smoothquant/8_from_float32"):
        policy_map = jp.DTypePolicyMap("float32", {"up": name, "down": name})
        q = jp.nnx.calibrate(model, policy_map, [x[:512], x[512:]])
        y = jp.nnx.apply(q, policy_map)(x[:256])
        errors[name] = float(jnp.mean((y - reference) ** 2) / jnp.mean(reference**2))
    assert isinstance(q.up.kernel.get_value(), awq.InputScaledArray)
    assert errors["smoothquant/8_from_float32"] < 0.5 * errors["int8_from_float32"]


def test_equinox_calibrate_smooths():
    import equinox as eqx

    class Net(eqx.Module):
        up: eqx.nn.Linear
        down: eqx.nn.Linear

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.up = eqx.nn.Linear(64, 128, key=k1)
            self.down = eqx.nn.Linear(128, 16, key=k2)

        def __call__(self, x):  # a batch of rows
            return jax.vmap(lambda row: self.down(self.up(row)))(x)

    x = _outlier_inputs()[:256]
    model = Net(jax.random.key(0))
    policy_map = jp.DTypePolicyMap("float32", {"up": "smoothquant/8_from_float32"})
    q = jp.equinox.calibrate(model, policy_map, [x[:128], x[128:]])
    kernel = q.up.weight
    assert isinstance(kernel, awq.InputScaledArray) and kernel.mode == "int8"
    reference = model(x[:8])
    y = jp.equinox.apply(q, policy_map)(x[:8])
    np.testing.assert_allclose(y, reference, rtol=0.1, atol=0.1 * float(jnp.abs(reference).max()))


def test_layer_stats_merge_takes_the_larger_max_and_sums_the_rest():
    from jmp_policy._src.quantization.calibration_stats import LayerStats

    a = LayerStats.zeros(3).update(jnp.asarray([[1.0, -5.0, 2.0]]))
    b = LayerStats.zeros(3).update(jnp.asarray([[-4.0, 1.0, 0.5], [0.0, 2.0, 1.0]]))
    both = a.merge(b)
    np.testing.assert_array_equal(both.abs_max, [4.0, 5.0, 2.0])
    assert float(both.count) == 3.0
    stacked = jax.tree.map(lambda x, y: jnp.stack([x, y]), a, b).total()
    np.testing.assert_array_equal(stacked.abs_max, both.abs_max)
    np.testing.assert_allclose(stacked.gram, both.gram)
