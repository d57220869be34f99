"""Tests of cast_apply and current_policy on plain apply functions."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_policy as jp


def _params():
    return {
        "dense": {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)},
        "head": {"w": jnp.ones((2, 1))},
        "step": jnp.array(1),
    }


def _apply(params, x, *, scale):
    seen.append(
        {
            "dense_w": params["dense"]["w"].dtype,
            "head_w": params["head"]["w"].dtype,
            "step": params["step"].dtype,
            "x": x.dtype,
            "scale": scale.dtype,
            "policy": jp.current_policy(),
        }
    )
    h = x @ params["dense"]["w"] + params["dense"]["b"]
    return {"out": h @ params["head"]["w"] * scale, "count": jnp.array(2)}


seen: list = []


@pytest.fixture(autouse=True)
def _clear_seen():
    seen.clear()


def test_single_policy_casts_params_every_argument_and_outputs(maybe_jit):
    f = maybe_jit(jp.cast_apply("p=f32,c=bf16,o=f16")(_apply))
    out = f(_params(), jnp.ones((4, 3)), scale=np.array(2.0, np.float32))
    assert seen[-1]["dense_w"] == jnp.bfloat16
    assert seen[-1]["head_w"] == jnp.bfloat16
    assert seen[-1]["step"] == jnp.int32
    assert seen[-1]["x"] == jnp.bfloat16
    assert seen[-1]["scale"] == jnp.bfloat16  # keyword arguments too (tf.keras casts only one)
    assert seen[-1]["policy"] == jp.get_policy("p=f32,c=bf16,o=f16")
    assert out["out"].dtype == jnp.float16
    assert out["count"].dtype == jnp.int32
    np.testing.assert_allclose(np.asarray(out["out"], np.float32), np.full((4, 1), 12.0))


def test_map_casts_params_per_path_and_arguments_with_the_root_policy(maybe_jit):
    m = jp.DTypePolicyMap("mixed_bfloat16", {"head": "float32"})
    f = maybe_jit(jp.cast_apply(m)(_apply))
    out = f(_params(), jnp.ones((4, 3)), scale=jnp.ones(()))
    assert seen[-1]["dense_w"] == jnp.bfloat16
    assert seen[-1]["head_w"] == jnp.float32
    assert seen[-1]["x"] == jnp.bfloat16
    assert seen[-1]["policy"] == jp.DTypePolicy("mixed_bfloat16")
    # bf16 @ f32 promotes to f32; a Keras name leaves the output as computed (output rule).
    assert out["out"].dtype == jnp.float32


def test_output_rule_casts_only_when_output_differs_from_compute(maybe_jit):
    def f(params, x):
        return x.astype(jnp.float32) @ params["w"]

    params = {"w": jnp.ones((3, 2))}
    x = jnp.ones((1, 3))
    assert maybe_jit(jp.cast_apply("mixed_bfloat16")(f))(params, x).dtype == jnp.float32
    assert maybe_jit(jp.cast_apply("p=f32,c=f32,o=bf16")(f))(params, x).dtype == jnp.bfloat16


def test_loops_keep_their_carry_dtype(maybe_jit):
    # The bodies compute in the policy's dtype (as a submodule would); the carries are
    # float32 and come back float32 instead of failing JAX's carry type check.
    def f(params, x):
        dtype = jp.current_policy().compute_dtype

        def body(c, xi):
            return (c + xi @ params["w"]).astype(dtype), None

        c, _ = jax.lax.scan(body, jnp.zeros((2,), jnp.float32), x)
        c = jax.lax.fori_loop(0, 2, lambda i, c: (c * params["w"][0, 0]).astype(dtype), c)
        return jax.lax.while_loop(
            lambda c: c.sum() < 30, lambda c: (c + x[0] @ params["w"]).astype(dtype), c
        )

    params = {"w": jnp.ones((3, 2))}
    out = maybe_jit(jp.cast_apply("mixed_bfloat16")(f))(params, jnp.ones((4, 3)))
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(out, [15.0, 15.0])
    assert jax.lax.scan.__module__.startswith("jax")  # restored after the call


def test_non_floating_policies_are_rejected():
    with pytest.raises(ValueError, match=r'floating compute dtype.*"int8"'):
        jp.cast_apply("int8")


def test_dict_argument_becomes_a_map_with_the_global_default():
    f = jp.cast_apply({"head": "float16"})(_apply)
    with jp.policy_scope("mixed_bfloat16"):
        f(_params(), jnp.ones((4, 3)), scale=jnp.ones(()))
    assert seen[-1]["dense_w"] == jnp.bfloat16
    assert seen[-1]["head_w"] == jnp.float16


def test_none_uses_the_global_policy_at_call_time():
    f = jp.cast_apply(None)(_apply)
    f(_params(), jnp.ones((4, 3)), scale=jnp.ones(()))
    assert seen[-1]["x"] == jnp.float32
    with jp.policy_scope("bfloat16"):
        out = f(_params(), jnp.ones((4, 3)), scale=jnp.ones(()))
    assert seen[-1]["x"] == jnp.bfloat16
    assert out["out"].dtype == jnp.bfloat16


def test_gradients_come_back_in_the_stored_dtype(maybe_jit):
    f = jp.cast_apply("mixed_bfloat16")(_apply)

    def loss(params, x):
        return jnp.sum(f(params, x, scale=jnp.ones(()))["out"].astype(jnp.float32))

    params = {k: v for k, v in _params().items() if k != "step"}
    params["step"] = jnp.zeros(())
    grads = maybe_jit(jax.grad(loss))(params, jnp.ones((4, 3)))
    for g in jax.tree.leaves(grads):
        assert g.dtype == jnp.float32
        assert np.all(np.isfinite(g))
    np.testing.assert_allclose(grads["head"]["w"], np.full((2, 1), 12.0))


def test_current_policy_is_global_outside_and_root_inside():
    assert jp.current_policy() == jp.DTypePolicy("float32")
    with jp.policy_scope("mixed_float16"):
        assert jp.current_policy() == jp.DTypePolicy("mixed_float16")

    @jp.cast_apply("mixed_bfloat16")
    def noise(params, key):
        return jax.random.normal(key, (3,), jp.current_policy().compute_dtype)

    assert noise({}, jax.random.key(0)).dtype == jnp.bfloat16
    assert jp.current_policy() == jp.DTypePolicy("float32")


def test_wrapper_keeps_the_function_name_and_does_not_mutate_arguments():
    f = jp.cast_apply("bfloat16")(_apply)
    assert f.__name__ == "_apply"
    params = _params()
    before = jax.tree.map(lambda x: (x.dtype, np.asarray(x).copy()), params)
    f(params, jnp.ones((4, 3)), scale=jnp.ones(()))
    after = jax.tree.map(lambda x: (x.dtype, np.asarray(x)), params)
    is_pair = lambda t: isinstance(t, tuple)  # noqa: E731
    for (d0, v0), (d1, v1) in zip(
        jax.tree.leaves(before, is_leaf=is_pair),
        jax.tree.leaves(after, is_leaf=is_pair),
        strict=True,
    ):
        assert d0 == d1
        np.testing.assert_array_equal(v0, v1)


@pytest.mark.parametrize("bad", ["mixed_bf16", 3])
def test_bad_policy_names_the_argument(bad):
    with pytest.raises((ValueError, TypeError), match="Invalid `policy_or_map`"):
        jp.cast_apply(bad)


def test_same_hlo_as_hand_written_casts():
    policy = jp.DTypePolicy("mixed_bfloat16")

    def model(params, x):
        return jnp.tanh(x @ params["w"] + params["b"])

    def by_hand(params, x):
        params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
        return model(params, x.astype(jnp.bfloat16))

    params = {"w": jnp.ones((8, 8)), "b": jnp.ones(8)}
    x = jnp.ones((4, 8))
    ours = jax.jit(jp.cast_apply(policy)(model)).lower(params, x).as_text()
    theirs = jax.jit(by_hand).lower(params, x).as_text()
    assert ours.count("convert") == theirs.count("convert") == 3


def test_float8_policies_warn_that_a_plain_function_computes_in_the_source_dtype(maybe_jit):
    with pytest.warns(UserWarning, match=r"the float8 policies \['float8_from_mixed_bfloat16'\]"):
        apply = jp.cast_apply(jp.DTypePolicyMap("float32", {"w": "float8_from_mixed_bfloat16"}))(
            lambda p, x: x @ p["w"]
        )
    out = maybe_jit(apply)({"w": jnp.ones((3, 2))}, jnp.ones((1, 3)))
    assert out.dtype == jnp.float32  # the root (default) policy: float32 inputs and outputs
    with pytest.warns(UserWarning, match="jmp_policy.linen.apply"):
        jp.cast_apply("float8_from_mixed_bfloat16")


def _resnet():
    from flax_examples import imagenet_models

    # Flax's own ResNet example with `dtype=None` (the layers follow their inputs and
    # parameters); BatchNorm statistics travel in the "batch_stats" collection.
    model = imagenet_models.ResNet(
        stage_sizes=[1],
        block_cls=imagenet_models.ResNetBlock,
        num_classes=4,
        num_filters=4,
        dtype=None,
    )
    x = jnp.ones((2, 8, 8, 3))
    return model, model.init(jax.random.key(0), x, train=False), x


def test_cast_apply_resolves_a_linen_variables_dict_by_module_path(maybe_jit):
    """`cast_apply(map)(model.apply)` receives `{"params": ..., "batch_stats": ...}`:
    the map's keys name modules, so the collection level is skipped, and the head's
    parameters reach it in float32 (its matmul runs in float32), without a warning."""
    import warnings

    from flax_examples.measure import dot_dtypes

    model, variables, x = _resnet()
    assert set(variables) == {"params", "batch_stats"}
    policy_map = jp.DTypePolicyMap("mixed_bfloat16", {"Dense_0": "float32"})
    seen = {}

    def apply(variables, x):
        seen.update(jax.tree.map(lambda a: a.dtype, variables))
        return model.apply(variables, x, train=False)

    fn = jp.cast_apply(policy_map)(apply)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = maybe_jit(fn)(variables, x)
    assert out.dtype == jnp.float32  # the float32 head's logits, as computed
    assert seen["params"]["Dense_0"]["kernel"] == jnp.float32
    assert seen["params"]["conv_init"]["kernel"] == jnp.bfloat16
    assert seen["batch_stats"]["bn_init"]["mean"] == jnp.bfloat16  # as a single policy does
    assert dot_dtypes(fn, variables, x) == [("float32", "float32")]
    # A single policy still casts the whole tree, as before.
    plain = jp.cast_apply("mixed_bfloat16")(model.apply)
    assert plain(variables, x, train=False).dtype == jnp.bfloat16


def test_cast_apply_warns_once_naming_keys_that_match_nothing_and_linen_apply():
    model, variables, x = _resnet()
    policy_map = jp.DTypePolicyMap("mixed_bfloat16", {"Dense_0": "float32", "haed": "float32"})
    fn = jp.cast_apply(policy_map)(lambda v, x: model.apply(v, x, train=False))
    with pytest.warns(UserWarning) as record:
        fn(variables, x)
        fn(variables, x)
    messages = [str(w.message) for w in record]
    assert len(messages) == 1
    assert messages[0].startswith(
        "Keys of the DTypePolicyMap match no module or variable of the tree cast_apply "
        "received: ['haed']."
    )
    assert "`jmp_policy.linen.apply(model, policy_map)`" in messages[0]
    # Plain parameter trees too.
    with pytest.warns(UserWarning, match=r"\['nothing'\]"):
        jp.cast_apply({"nothing": "float32"})(lambda p, x: x @ p["w"])(
            {"w": jnp.ones((3, 2))}, jnp.ones((1, 3))
        )
