"""tests/conftest.py hands the heavy tests out first, longest first, one test at a time."""

import importlib.util
import pathlib
import types

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "tests_conftest", pathlib.Path(__file__).with_name("conftest.py")
)
conftest = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(conftest)


class _Item:
    def __init__(self, name, seconds=None):
        self.name = name
        self._marker = None if seconds is None else pytest.mark.heavy(seconds).mark

    def get_closest_marker(self, name):
        return self._marker if name == "heavy" else None


def test_heavy_tests_go_first_longest_first_and_the_rest_keep_their_order():
    items = [_Item("a"), _Item("b", 5), _Item("c"), _Item("d", 80), _Item("e", 5), _Item("f")]
    conftest.pytest_collection_modifyitems(None, items)
    assert [item.name for item in items] == ["d", "b", "e", "a", "c", "f"]


def test_without_heavy_tests_the_order_is_kept():
    items = [_Item("a"), _Item("b")]
    conftest.pytest_collection_modifyitems(None, items)
    assert [item.name for item in items] == ["a", "b"]


@pytest.mark.parametrize("given, expected", [(None, 1), (4, 4)])
def test_xdist_hands_out_one_test_at_a_time_unless_told_otherwise(given, expected):
    config = types.SimpleNamespace(option=types.SimpleNamespace(maxschedchunk=given))
    conftest.pytest_configure(config)
    assert config.option.maxschedchunk == expected
