"""Trees deeper than the tree functions walk (#46): a 3,000-deep tree raised
RecursionError inside JAX's flattening, which leaves the interpreter unusable; every
public tree function refuses it first, naming its argument."""

import jax
import jax.numpy as jnp
import pytest

import jmp_policy as jp
from jmp_policy._src.tree_paths import MAX_TREE_DEPTH, check_depth


def _deep(levels, leaf=None):
    tree = jnp.ones((2, 2)) if leaf is None else leaf
    for i in range(levels):
        tree = {"a": tree} if i % 3 else [tree] if i % 3 == 1 else (tree,)
    return tree


DEEP = _deep(3000)
POLICY = jp.get("mixed_bfloat16")
MAP = jp.DTypePolicyMap("float32", {"a": "bfloat16"})


@pytest.mark.parametrize(
    ("call", "argument"),
    [
        (lambda t: POLICY.cast_to_compute(t), "tree"),
        (lambda t: POLICY.cast_to_param(t), "tree"),
        (lambda t: jp.cast_to_full(t), "tree"),
        (lambda t: MAP.cast_to_compute(t), "tree"),
        (lambda t: MAP.policy_tree(t), "tree"),
        (lambda t: MAP.unused_keys(t), "tree"),
        (lambda t: MAP.explain(t), "tree"),
        (lambda t: jp.get("int8_from_float32").quantize(t), "tree"),
        (lambda t: jp.all_finite(t), "tree"),
        (lambda t: jp.select_tree(jnp.array(True), t, t), "on_true"),
    ],
)
def test_a_3000_deep_tree_is_a_value_error_naming_the_argument(call, argument):
    with pytest.raises(ValueError, match=rf"`{argument}` is nested more than 200 levels deep"):
        call(DEEP)
    assert jax.tree.map(lambda x: x + 1, {"b": 1}) == {"b": 2}  # the interpreter still works


def test_the_deepest_accepted_tree_is_walked():
    tree = _deep(MAX_TREE_DEPTH, jnp.ones(2))
    check_depth(tree)
    assert jax.tree.leaves(POLICY.cast_to_compute(tree))[0].dtype == jnp.bfloat16
    with pytest.raises(ValueError, match=r"Received: a (dict|list|tuple) at depth 200"):
        check_depth([tree])
