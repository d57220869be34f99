"""Tests of the wrappers' resolution (`_src/resolution.py`): which policy a module call and a
variable run under, from the map's keys, `type_policies` and the module's own `dtype`.

The glue records what it knows of each module as a `ModuleInfo` (its class and own dtype);
these tests build them by hand, so no flax is needed.
"""

import numpy as np
import pytest

import jmp_policy as jp
from jmp_policy._src.options import Island, Options
from jmp_policy._src.resolution import ModuleInfo, Resolver

F32 = jp.DTypePolicy("float32")
BF16 = jp.DTypePolicy("bfloat16")
F16 = jp.DTypePolicy("float16")
MIXED = jp.DTypePolicy("mixed_bfloat16")


class Block:
    pass


class Norm:
    pass


class SubBlock(Block):
    pass


def _resolver(policy_or_map, infos=None, **options):
    return Resolver(policy_or_map, Options(**options), dict(infos or {}))


# -- keys, type_policies and the ancestor walk ----------------------------------------------


def test_key_beats_type_policy_at_the_same_level():
    m = jp.DTypePolicyMap(F32, {"enc": BF16})
    r = _resolver(m, {"enc": ModuleInfo(Block, None)}, type_policies={Block: F16})
    resolution = r.module("enc")
    assert resolution.policy == BF16
    assert (resolution.source, resolution.key) == ("key 'enc'", "enc")
    assert r.used_keys == {"enc"}


def test_type_policy_on_the_module_beats_a_key_on_its_ancestor():
    m = jp.DTypePolicyMap(F32, {"enc": BF16})
    r = _resolver(m, {"enc/block": ModuleInfo(Block, None)}, type_policies={Block: F16})
    resolution = r.module("enc/block/dense")
    assert resolution.policy == F16
    assert (resolution.source, resolution.key) == ("type Block", None)
    assert r.unused_keys() == ["enc"]


def test_nearer_ancestor_key_wins():
    m = jp.DTypePolicyMap(F32, {"enc": BF16, "enc/layers_0": F16})
    r = _resolver(m)
    assert r.module("enc/layers_0/mlp/dense").key == "enc/layers_0"
    assert r.module("enc/layers_1/mlp").key == "enc"
    assert r.module("enc/layers_1/mlp").policy == BF16


def test_key_on_the_module_beats_type_policy_on_its_ancestor():
    m = jp.DTypePolicyMap(F32, {"enc/block/norm": BF16})
    r = _resolver(m, {"enc/block": ModuleInfo(Block, None)}, type_policies={Block: F16})
    assert r.module("enc/block/norm").policy == BF16
    assert r.module("enc/block/dense").policy == F16


def test_type_policy_on_an_ancestor_applies_to_its_submodules():
    infos = {"enc": ModuleInfo(Block, None), "enc/norm": ModuleInfo(Norm, None)}
    r = _resolver(MIXED, infos, type_policies={Block: F16})
    assert r.module("enc/norm/scale").policy == F16
    assert r.module("enc/norm/scale").source == "type Block"
    assert r.module("dec").policy == MIXED
    assert r.module("dec").source == "default"


def test_type_policy_of_a_base_class_applies_to_subclasses():
    r = _resolver(F32, {"enc": ModuleInfo(SubBlock, None)}, type_policies={Block: BF16})
    assert r.module("enc").policy == BF16
    assert r.module("enc").source == "type SubBlock"


def test_reloaded_class_matches_by_module_and_qualified_name():
    def make_class():
        class Reloaded:
            pass

        return Reloaded

    old, new = make_class(), make_class()
    assert old is not new
    r = _resolver(F32, {"enc": ModuleInfo(new, None)}, type_policies={old: BF16})
    assert r.module("enc").policy == BF16
    assert r.module("enc").source == "type Reloaded"


def test_root_key_is_not_an_ancestor_of_other_paths():
    m = jp.DTypePolicyMap(F32, {"": BF16})
    r = _resolver(m)
    assert (r.module("").policy, r.module("").key) == (BF16, "")
    assert (r.module("enc").policy, r.module("enc").source) == (F32, "default")


def test_policy_instead_of_a_map_is_every_module_default():
    r = _resolver(BF16)
    assert (r.module("enc/dense").policy, r.module("enc/dense").source) == (BF16, "default")
    assert r.unused_keys() == []


def test_none_follows_the_global_policy_at_resolution():
    with jp.policy_scope("float16"):
        assert _resolver(None).module("enc").policy == F16


def test_module_records_its_class_for_its_submodules():
    r = _resolver(F32, type_policies={Block: BF16})
    assert r.module("enc", Block).policy == BF16
    assert r.infos["enc"] == ModuleInfo(Block, None)
    assert r.module("enc/dense").policy == BF16


def test_island_type_policy_marks_the_resolution():
    r = _resolver(MIXED, {"norm": ModuleInfo(Norm, None)}, type_policies={Norm: Island(F32)})
    resolution = r.module("norm")
    assert (resolution.policy, resolution.island) == (F32, True)
    assert r.module("norm/scale").island is True
    assert r.module("dense").island is False


# -- the module's own dtype -------------------------------------------------------------------


def test_own_dtype_wins_over_compute_and_output_dtypes_under_respect():
    bf16 = np.dtype(BF16.compute_dtype)
    r = _resolver(F32, {"enc": ModuleInfo(Block, bf16)}, module_dtype="respect")
    resolution = r.module("enc")
    assert resolution.policy.compute_dtype == bf16
    assert resolution.policy.output_dtype == bf16
    assert resolution.policy.variable_dtype == np.float32
    assert resolution.chosen_policy == F32
    assert resolution.set_dtype is None
    assert r.overridden() == ["enc"]
    assert r.variable_dtype("enc/kernel") == np.float32


def test_own_dtype_cancels_an_island():
    bf16 = np.dtype(BF16.compute_dtype)
    infos = {"norm": ModuleInfo(Norm, bf16)}
    r = _resolver(MIXED, infos, type_policies={Norm: Island(F32)})
    assert r.module("norm").island is False
    assert r.module("norm").policy.compute_dtype == bf16


def test_policy_overrides_own_dtype_under_override():
    f16 = np.dtype(F16.compute_dtype)
    r = _resolver(BF16, {"enc": ModuleInfo(Block, f16)}, module_dtype="override")
    resolution = r.module("enc")
    assert resolution.policy == BF16
    assert resolution.chosen_policy == BF16
    assert resolution.own_dtype == f16
    assert resolution.set_dtype == BF16.compute_dtype
    assert r.overridden() == []


def test_own_dtype_equal_to_the_compute_dtype_changes_nothing():
    r = _resolver(BF16, {"enc": ModuleInfo(Block, np.dtype(BF16.compute_dtype))})
    resolution = r.module("enc")
    assert (resolution.policy, resolution.set_dtype) == (BF16, None)
    assert r.overridden() == []


# -- variables -------------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["enc/dense/embedding", ".*/embedding"])
def test_variable_key_beats_its_module_policy(key):
    m = jp.DTypePolicyMap(MIXED, {"enc/.*": BF16, key: F32})
    r = _resolver(m)
    assert r.variable("enc/dense/embedding") == (F32, True)
    assert r.variable_dtype("enc/dense/embedding") == np.float32
    assert key in r.used_keys


def test_variable_without_its_own_key_takes_its_module_policy():
    m = jp.DTypePolicyMap(F32, {"enc/.*": MIXED, ".*/embedding": F32})
    r = _resolver(m)
    assert r.variable("enc/dense/kernel") == (MIXED, False)
    assert r.variable_dtype("enc/dense/kernel") == np.float32  # mixed: stored in float32
    assert r.used_keys == {"enc/.*"}


def test_variable_takes_its_module_own_dtype_but_not_as_stored_dtype():
    bf16 = np.dtype(BF16.compute_dtype)
    r = _resolver(F32, {"enc": ModuleInfo(Block, bf16)})
    policy, named = r.variable("enc/kernel")
    assert (policy.compute_dtype, named) == (bf16, False)
    assert r.variable_dtype("enc/kernel") == np.float32


def test_variable_of_the_root_module_takes_the_root_policy():
    m = jp.DTypePolicyMap(BF16, {"": F32})
    assert _resolver(m).variable("pos") == (F32, False)


def test_module_key_does_not_name_its_variables():
    # "enc/.*" matches "enc/dense/kernel" and its module path "enc/dense": a module key.
    m = jp.DTypePolicyMap(F32, {"enc/.*": BF16})
    assert _resolver(m).variable("enc/dense/kernel") == (BF16, False)
