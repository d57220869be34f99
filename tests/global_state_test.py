"""The global policy: process default, `set_dtype_policy`, `policy_scope`, isolation."""

import asyncio
import threading

import jax.numpy as jnp
import numpy as np
import pytest

import jmp_policy as jp


def test_process_default_is_float32():
    policy = jp.dtype_policy()
    assert type(policy) is jp.DTypePolicy
    assert policy.name == "float32"
    assert policy == jp.DTypePolicy("float32")
    assert jp.global_policy() is policy


def test_aliases_are_the_same_functions_but_each_setter_takes_none_as_its_peer_does():
    assert jp.global_policy is jp.dtype_policy
    # tf.keras's set_global_policy(None) resets; Keras 3's set_dtype_policy(None) raises
    assert jp.set_global_policy is not jp.set_dtype_policy


@pytest.mark.parametrize(
    "name",
    [
        "mixed_float16",
        "mixed_bfloat16",
        "bfloat16",
        "float64",
        "p=f32,c=bf16,o=f32",
        "half",
        "int8_from_mixed_bfloat16",
        "int4/128_from_float32",
        "float8_from_mixed_bfloat16",
    ],
)
@pytest.mark.parametrize("setter", [jp.set_dtype_policy, jp.set_global_policy])
def test_set_policy_by_name(setter, name):
    setter(name)
    assert jp.dtype_policy() == jp.get_policy(name)
    assert jp.dtype_policy().name == name
    assert jp.global_policy().name == name


@pytest.mark.parametrize(
    "policy",
    [
        jp.DTypePolicy("mixed_float16"),
        jp.Policy("mixed_bfloat16"),
        jp.QuantizedDTypePolicy("int8", "mixed_bfloat16"),
        jp.QuantizedFloat8DTypePolicy("float8", "float32", 16),
    ],
    ids=repr,
)
def test_set_policy_object_keeps_it(policy):
    jp.set_dtype_policy(policy)
    assert jp.dtype_policy() is policy


def test_set_policy_repeatedly_and_set_global_policy_none_restores_float32():
    jp.set_dtype_policy("mixed_float16")
    assert jp.dtype_policy().name == "mixed_float16"
    jp.set_dtype_policy("float32")
    assert jp.dtype_policy().name == "float32"
    jp.set_dtype_policy("mixed_bfloat16")
    jp.set_global_policy(None)  # tf.keras's reset
    assert jp.dtype_policy() == jp.DTypePolicy("float32")
    assert jp.global_policy().name == "float32"


def test_set_dtype_policy_none_is_keras_3s_error_naming_the_way_back():
    jp.set_dtype_policy("mixed_bfloat16")
    with pytest.raises(ValueError, match=r"Invalid `policy` argument.*policy=None") as info:
        jp.set_dtype_policy(None)
    assert isinstance(info.value, TypeError)
    assert jp.dtype_policy().name == "mixed_bfloat16"  # unchanged


@pytest.mark.parametrize("name", ["int32", "int8", "uint8", "bool", "complex64", "p=f32,c=int32"])
def test_non_floating_compute_policy_cannot_be_global(name):
    with pytest.raises(ValueError, match="floating compute dtype") as info:
        jp.set_dtype_policy(name)
    assert name in str(info.value)
    with pytest.raises(ValueError, match="floating compute dtype"):
        jp.set_dtype_policy(jp.DTypePolicy(name))
    with pytest.raises(ValueError, match="floating compute dtype"), jp.policy_scope(name):
        pass  # pragma: no cover
    assert jp.dtype_policy().name == "float32"


def test_failed_set_keeps_previous_global():
    jp.set_dtype_policy("mixed_bfloat16")
    with pytest.raises(ValueError, match="floating compute dtype"):
        jp.set_dtype_policy("int32")
    with pytest.raises(ValueError, match="Cannot convert"):
        jp.set_dtype_policy("mixed_bfloat15")
    with pytest.raises(TypeError):
        jp.set_dtype_policy(12345)
    assert jp.dtype_policy().name == "mixed_bfloat16"


@pytest.mark.parametrize(
    "bad", [12345, 1.5, jnp.bfloat16, np.dtype("float32"), ["float32"], {"name": "float32"}]
)
def test_set_policy_bad_type_raises_type_error(bad):
    with pytest.raises(TypeError, match="Invalid `policy` argument"):
        jp.set_dtype_policy(bad)
    with pytest.raises(TypeError, match="Invalid `policy` argument"), jp.policy_scope(bad):
        pass  # pragma: no cover


def test_bad_name_raises_value_error():
    with pytest.raises(ValueError, match="Cannot convert value mixed_bfloat15 "):
        jp.set_dtype_policy("mixed_bfloat15")


def test_policy_scope_sets_and_restores():
    with jp.policy_scope("mixed_bfloat16") as policy:
        assert policy == jp.DTypePolicy("mixed_bfloat16")
        assert jp.dtype_policy() is policy
        assert jp.global_policy() is policy
    assert jp.dtype_policy().name == "float32"


def test_policy_scope_yields_given_policy_object():
    policy = jp.QuantizedDTypePolicy("int8", "mixed_bfloat16")
    with jp.policy_scope(policy) as inside:
        assert inside is policy
        assert jp.dtype_policy() is policy


def test_policy_scope_nests():
    with jp.policy_scope("mixed_float16"):
        assert jp.dtype_policy().name == "mixed_float16"
        with jp.policy_scope("bfloat16"):
            assert jp.dtype_policy().name == "bfloat16"
            with jp.policy_scope("p=f32,c=bf16,o=f32"):
                assert jp.dtype_policy().name == "p=f32,c=bf16,o=f32"
            assert jp.dtype_policy().name == "bfloat16"
        assert jp.dtype_policy().name == "mixed_float16"
    assert jp.dtype_policy().name == "float32"


def test_policy_scope_restores_on_exception():
    with (
        pytest.raises(RuntimeError, match="boom"),
        jp.policy_scope("mixed_float16"),
        jp.policy_scope("bfloat16"),
    ):
        raise RuntimeError("boom")
    assert jp.dtype_policy().name == "float32"


def test_policy_scope_wins_over_default_and_default_returns_after():
    jp.set_dtype_policy("mixed_bfloat16")
    with jp.policy_scope("float16"):
        assert jp.dtype_policy().name == "float16"
        # Changing the process default inside a scope does not override the scope...
        jp.set_dtype_policy("mixed_float16")
        assert jp.dtype_policy().name == "float16"
    # ...but holds once the scope is gone.
    assert jp.dtype_policy().name == "mixed_float16"


def test_policy_scope_works_as_decorator():
    @jp.policy_scope("mixed_bfloat16")
    def inside():
        return jp.dtype_policy().name

    assert inside() == "mixed_bfloat16"
    assert jp.dtype_policy().name == "float32"


def test_policy_scope_is_local_to_its_thread():
    seen = {}
    entered = threading.Event()
    release = threading.Event()

    def worker():
        with jp.policy_scope("mixed_float16"):
            seen["worker_inside"] = jp.dtype_policy().name
            entered.set()
            release.wait(timeout=120)
        seen["worker_after"] = jp.dtype_policy().name

    with jp.policy_scope("bfloat16"):
        thread = threading.Thread(target=worker)
        thread.start()
        assert entered.wait(timeout=120)
        # The worker's scope does not reach this thread, nor this one the worker's.
        assert jp.dtype_policy().name == "bfloat16"
        release.set()
        thread.join(timeout=120)
    assert seen == {"worker_inside": "mixed_float16", "worker_after": "float32"}
    assert jp.dtype_policy().name == "float32"


def test_set_dtype_policy_is_process_wide():
    result = {}

    def worker():
        result["name"] = jp.dtype_policy().name

    jp.set_dtype_policy("mixed_bfloat16")
    thread = threading.Thread(target=worker)
    thread.start()
    thread.join(timeout=120)
    assert result == {"name": "mixed_bfloat16"}


def test_policy_scope_is_local_to_its_asyncio_task():
    async def task(name, started, other_started):
        with jp.policy_scope(name):
            started.set()
            await other_started.wait()  # both scopes are open at once
            await asyncio.sleep(0)
            return jp.dtype_policy().name

    async def main():
        a, b = asyncio.Event(), asyncio.Event()
        results = await asyncio.gather(task("mixed_float16", a, b), task("mixed_bfloat16", b, a))
        return results, jp.dtype_policy().name

    results, after = asyncio.run(main())
    assert results == ["mixed_float16", "mixed_bfloat16"]
    assert after == "float32"
    assert jp.dtype_policy().name == "float32"


def test_new_policies_follow_scope():
    with jp.policy_scope("mixed_bfloat16"):
        assert jp.DTypePolicy().compute_dtype == jnp.bfloat16
        assert jp.QuantizedDTypePolicy("int8").name == "int8_from_mixed_bfloat16"
        assert jp.get(None).name == "mixed_bfloat16"


# -- the current call: what glue sets and `current_policy` / `current_path` read --------------


def current_path():
    """The module path of the call running now (what the glue sets), ``None`` outside one."""
    from jmp_policy._src import context

    call = context.CALL.get()
    return None if call is None else call.path


def test_current_path_is_none_outside_a_call():
    assert current_path() is None


def test_current_policy_scope_sets_policy_and_path_and_restores():
    from jmp_policy._src import context, global_state

    policy = jp.DTypePolicy("mixed_bfloat16")
    with global_state.current_policy_scope(policy, path="encoder/mlp"):
        assert jp.current_policy() is policy
        assert current_path() == "encoder/mlp"
        assert context.CALL.get() == context.RunningCall(policy, "encoder/mlp")
        with global_state.current_policy_scope(jp.DTypePolicy("float16")):
            assert current_path() is None
            assert jp.current_policy().name == "float16"
        assert current_path() == "encoder/mlp"
    assert current_path() is None
    assert jp.current_policy() == jp.dtype_policy()


def test_call_is_a_named_tuple_of_policy_and_path():
    from jmp_policy._src import context

    call = context.RunningCall(jp.DTypePolicy("float32"), "a/b")
    assert call.policy == jp.DTypePolicy("float32")
    assert call.path == "a/b"
    assert call._fields == ("policy", "path")


def test_jitted_function_keeps_the_policy_it_was_traced_under():
    # README "Good to know": the global policy is read at trace time.
    import jax

    def body(x):
        return x.astype(jp.dtype_policy().compute_dtype)

    make = jax.jit(body)
    x = jnp.ones(2)
    with jp.policy_scope("mixed_bfloat16"):
        assert make(x).dtype == jnp.bfloat16
    assert make(x).dtype == jnp.bfloat16  # cached trace: the scope has ended
    assert jax.jit(lambda x: body(x))(x).dtype == jnp.float32  # a new trace reads it again
