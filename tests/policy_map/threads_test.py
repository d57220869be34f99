"""A DTypePolicyMap shared by threads (#46): lookups, tree walks, configs and iterations
run while other threads add and remove keys, with no error and no stale answer."""

import copy
import pickle
import random
import sys
import threading

import jax.numpy as jnp
import pytest

import jmp_policy as jp


@pytest.fixture
def fast_switching():
    """Threads switch every microsecond, so races show in a few thousand operations."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


def test_sixteen_threads_reading_and_writing_one_map_raise_nothing(fast_switching):
    m = jp.DTypePolicyMap("float32", {f"enc/layers_{i}/.*": "bfloat16" for i in range(50)})
    tree = {"enc": {f"layers_{i}": {"mlp": {"kernel": jnp.ones((2, 2))}} for i in range(20)}}
    errors: list[BaseException] = []

    def worker(seed):
        rnd = random.Random(seed)
        try:
            for n in range(300):  # 16 x 300 = 4,800 operations, as the fuzz ran
                op = rnd.randrange(7)
                key = f"dec{seed}/l{n}/.*" if n % 2 else f"dec{seed}_{n}"
                if op == 0:
                    m[key] = "float16"
                elif op == 1:
                    m.pop(rnd.choice([k for k in m if k[:3] == "dec"] or ["x"]), None)
                elif op == 2:
                    assert m[f"enc/layers_{rnd.randrange(50)}/mlp"].name == "bfloat16"
                elif op == 3:
                    assert "enc/layers_0/.*" in m.get_config()["policy_map"]
                elif op == 4:
                    assert len(list(m.items())) >= 50 and repr(m)
                elif op == 5:
                    policies = m.policy_tree(tree)
                    assert policies["enc"]["layers_3"]["mlp"]["kernel"].name == "bfloat16"
                else:
                    assert m != jp.DTypePolicyMap("float32")
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_an_add_after_a_lookup_is_seen_by_the_next_lookup_of_another_thread():
    m = jp.DTypePolicyMap("float32", {"a/.*": "bfloat16"})
    assert m["b/x"].name == "float32"  # cached
    added = threading.Thread(target=m.__setitem__, args=("b/.*", "float16"))
    added.start()
    added.join()
    assert m["b/x"].name == "float16"


def test_a_map_with_its_lock_copies_and_pickles():
    m = jp.DTypePolicyMap("float32", {"a/.*": "bfloat16"})
    assert m["a/x"].name == "bfloat16"
    for other in (copy.deepcopy(m), pickle.loads(pickle.dumps(m))):
        assert other == m and other._index.lock is not m._index.lock
        other["b"] = "float16"  # its own lock works
        assert other["b/c"].name == "float16" and "b" not in m
