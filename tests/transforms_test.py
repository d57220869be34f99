"""The one table of patches and reads of JAX and Flax, and the one check of an unknown JAX."""

import pathlib
import re
import threading

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.core.scope import Scope

import jmp_policy as jp
from jmp_policy._src import interception, traced_records, transforms

ROOT = pathlib.Path(__file__).resolve().parents[1] / "jmp_policy"


def _sources():
    return {p: p.read_text() for p in sorted(ROOT.rglob("*.py"))}


def test_every_declared_patch_is_made_once_and_only_declared_ones_are_made():
    made = [
        key
        for text in _sources().values()
        for key in re.findall(r"ThreadPatch\(\s*\"(\w+)\"", text)
    ]
    assert sorted(made) == sorted(transforms.PATCHES)


def test_no_module_but_transforms_sets_an_attribute_of_jax_or_flax():
    pattern = re.compile(r"\bsetattr\(\s*(jax|jnp|lax|nn|flax|Scope)\b")
    found = [
        f"{path.relative_to(ROOT)}: {line.strip()}"
        for path, text in _sources().items()
        if path.name != "transforms.py"
        for line in text.splitlines()
        if pattern.search(line)
    ]
    assert found == []


def test_a_patch_not_in_the_table_is_refused():
    with pytest.raises(ValueError, match=r"declared in `transforms.PATCHES`.*'cumsum'"):
        transforms.ThreadPatch("cumsum", {"cumsum": lambda f: f})
    with pytest.raises(ValueError, match=r"declared: \['scan', 'while_loop', 'fori_loop'\]"):
        transforms.ThreadPatch("loops", {"scan": lambda f: f})


def test_an_unknown_jax_trace_names_the_version_and_the_attribute(monkeypatch):
    from jax._src import core as jax_core

    class Moved:  # a JAX whose trace context has no `trace`
        pass

    monkeypatch.setattr(jax_core, "trace_ctx", Moved())
    with pytest.raises(transforms.UnknownJaxError) as info:
        transforms.current_trace()
    message = str(info.value)
    assert f"jax {jax.__version__} does not have" in message
    assert "`jax._src.core.trace_ctx.trace`" in message
    assert "current trace" in message  # what it is for
    assert isinstance(info.value, RuntimeError)
    assert isinstance(info.value.__cause__, AttributeError)


def test_an_unknown_jax_loop_is_an_error_at_first_use_and_patches_nothing(monkeypatch):
    scan = jax.lax.scan
    monkeypatch.delattr(jax.lax, "while_loop")
    with (
        pytest.raises(transforms.UnknownJaxError, match=r"`jax\.lax\.while_loop`") as info,
        interception.loop_carries(),
    ):
        pass
    assert f"jax {jax.__version__} does not have" in str(info.value)
    assert jax.lax.scan is scan  # nothing was replaced before the missing one was found
    assert not interception._LOOPS.inside()


def test_a_missing_transform_is_named_when_a_search_would_patch_it(monkeypatch):
    monkeypatch.delattr(jax, "remat")
    with (
        pytest.raises(transforms.UnknownJaxError, match=r"checkpointed calls.*`jax\.remat`"),
        traced_records.REMATS.active(),
    ):
        pass
    assert not traced_records.REMATS.inside()


def test_an_unknown_flax_names_flax_and_jax_versions(monkeypatch):
    model = nn.Dense(2)
    x = jnp.ones((1, 3))
    variables = model.init(jax.random.key(0), x)  # before the attribute goes
    monkeypatch.delattr(Scope, "get_variable")
    with pytest.raises(transforms.UnknownJaxError) as info:
        jp.linen.apply(model, "mixed_bfloat16")(variables, x)
    message = str(info.value)
    assert "`flax.core.scope.Scope.get_variable`" in message
    assert f"flax {flax.__version__} (with jax {jax.__version__}) does not have" in message


def test_a_patch_is_restored_when_the_last_thread_leaves():
    scan = jax.lax.scan
    entered, leave = threading.Event(), threading.Event()

    def other():
        with interception.loop_carries():
            entered.set()
            leave.wait(10)

    thread = threading.Thread(target=other)
    thread.start()
    entered.wait(10)
    try:
        assert jax.lax.scan is not scan  # patched while the other thread is inside
        assert not interception._LOOPS.inside()  # but not in this thread
        with interception.loop_carries():
            out, _ = jax.lax.scan(lambda c, x: (c + x, None), np.float32(0), jnp.ones(3))
        assert float(out) == 3.0
    finally:
        leave.set()
        thread.join()
    assert jax.lax.scan is scan
