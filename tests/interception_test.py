"""The one per-submodule hook and the loop-carry rule, on plain functions (no flax)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_policy as jp
from jmp_policy._src import context, global_state, interception
from jmp_policy._src.options import Island, Options, make_options
from jmp_policy._src.resolution import Resolver

BF16, F32, F16 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32), jnp.dtype(jnp.float16)


def _call(policy, path="m", options=None, cls=None):
    options = Options() if options is None else options
    resolution = Resolver(jp.get(policy) if isinstance(policy, str) else policy, options).module(
        path, cls
    )
    return interception.Call(path, None, resolution)


def current_path():
    """The module path of the call running now (what the glue sets), ``None`` outside one."""
    call = context.CALL.get()
    return None if call is None else call.path


def _probe(seen):
    def fn(x, *, y):
        seen.update(x=x.dtype, y=y.dtype, policy=jp.current_policy(), path=current_path())
        return x.astype(jnp.float32) * y.astype(jnp.float32)

    return fn


@pytest.mark.parametrize("use_jit", [False, True])
def test_inputs_cast_context_set_and_output_rule(use_jit):
    seen = {}

    def run(x, y):
        return interception.run(_call("mixed_bfloat16", "enc/mlp"), _probe(seen), (x,), {"y": y})

    out = (jax.jit(run) if use_jit else run)(jnp.ones(3), jnp.ones(3, F16))
    assert seen == {
        "x": BF16,
        "y": BF16,
        "policy": jp.DTypePolicy("mixed_bfloat16"),
        "path": "enc/mlp",
    }
    assert out.dtype == F32  # compute == output: left as computed
    out = interception.run(
        _call("p=f32,c=bf16,o=f16"), _probe(seen), (jnp.ones(3),), {"y": jnp.ones(3)}
    )
    assert out.dtype == F16  # output differs from compute: cast
    assert current_path() is None


def test_autocast_exclude_passes_inputs_as_given():
    seen = {}
    options = make_options(autocast_exclude=["time.*"])
    t = jnp.array([257.0, 999.0, 1001.0])
    interception.run(_call("bfloat16", "time_embed", options), _probe(seen), (t,), {"y": t})
    assert seen["x"] == F32 and seen["y"] == F32
    interception.run(_call("bfloat16", "other", options), _probe(seen), (t,), {"y": t})
    assert seen["x"] == BF16


def test_island_returns_the_callers_compute_dtype():
    options = Options(type_policies={int: Island(jp.DTypePolicy("float32"))})
    call = _call("mixed_bfloat16", "norm", options, cls=int)
    seen = {}
    with global_state.current_policy_scope(jp.DTypePolicy("mixed_bfloat16"), "block"):
        out = interception.run(call, _probe(seen), (jnp.ones(2, BF16),), {"y": jnp.ones(2)})
    assert seen["x"] == F32 and out.dtype == BF16
    with global_state.current_policy_scope(jp.DTypePolicy("float16"), "block"):
        out = interception.run(call, _probe(seen), (jnp.ones(2, BF16),), {"y": jnp.ones(2)})
    assert out.dtype == F16


def test_extensions_wrap_the_call_outermost_first():
    order = []

    def ext(name):
        def wrap(call, next_fn, args, kwargs):
            order.append((name, call.path, args[0].dtype))
            return next_fn(*args, **kwargs) + 1

        return wrap

    out = interception.run(
        _call("bfloat16", "a"),
        lambda x: x * 2,
        (jnp.ones(2),),
        {},
        extensions=(ext("outer"), ext("inner")),
    )
    assert order == [("outer", "a", BF16), ("inner", "a", BF16)]
    np.testing.assert_array_equal(np.asarray(out, np.float32), [4.0, 4.0])


def test_opaque_nodes_are_not_traversed():
    class Box:  # not a pytree: a leaf, and opaque
        pass

    box = Box()
    out = interception.run(
        _call("bfloat16"), lambda b, x: (b, x), (box, jnp.ones(2)), {}, opaque=lambda v: v is box
    )
    assert out[0] is box and out[1].dtype == BF16


@pytest.mark.parametrize("use_jit", [False, True])
def test_loop_carries_keep_their_entry_dtype(use_jit):
    def f(x):
        def body(c, xi):
            return (c + xi).astype(BF16), xi.astype(BF16)

        c, ys = jax.lax.scan(body, jnp.zeros(2, F32), x)
        c = jax.lax.fori_loop(0, 3, lambda i, c: (c + 1).astype(BF16), c)
        c = jax.lax.while_loop(lambda c: c[0] < 10, lambda c: (c * 2).astype(BF16), c)
        return c, ys

    x = jnp.ones((4, 2))
    with pytest.raises(TypeError):  # JAX rejects a carry that changes dtype
        f(x)
    with interception.loop_carries():
        c, ys = (jax.jit(f) if use_jit else f)(x)
    assert c.dtype == F32 and ys.dtype == BF16
    np.testing.assert_array_equal(c, [14.0, 14.0])


def test_loop_wrappers_are_installed_only_inside_the_block():
    original = jax.lax.scan
    with interception.loop_carries():
        assert jax.lax.scan is not original
        with interception.loop_carries():
            pass
        assert jax.lax.scan is not original
    assert jax.lax.scan is original
