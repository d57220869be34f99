"""The adapters' shared docstring blocks (``jmp_policy._src.framework.shared_docs``)."""

import importlib
import inspect
import re

import pytest

import jmp_policy as jp
from jmp_policy._src.framework import shared_docs
from jmp_policy._src.framework.shared_docs import BLOCKS, WORDS, fill


def _in(package: str, doc: str):
    """A function as ``jmp_policy.<package>`` would define it, with docstring ``doc``."""

    def f():
        pass

    f.__doc__ = doc
    f.__module__ = f"jmp_policy.{package}._module"
    return f


@pytest.mark.parametrize("indent", ["", "    ", "        "])  # Python 3.13 dedents
def test_fill_puts_the_block_at_the_placeholder_indentation(indent):
    doc = f"Does f.\n\n{indent}Args:\n{indent}    {{batches}}\n{indent}"
    lines = fill(_in("linen", doc)).__doc__.splitlines()
    assert (
        lines[3]
        == f"{indent}    batches: an iterable of calls' arguments (a tuple per call, or one array)."
    )


@pytest.mark.parametrize("package", ["linen", "nnx", "equinox"])
def test_fill_writes_the_words_of_the_functions_framework(package):
    doc = fill(_in(package, "Runs.\n\n{apply_rules}\n")).__doc__
    assert f":func:`jmp_policy.{package}.quantize`" in doc
    assert WORDS[package]["transforms"].split()[0] in doc
    assert "{" not in doc
    assert max(len(line) for line in doc.splitlines()) <= 88


def test_fill_drops_a_line_the_framework_has_no_words_for():
    args = fill(_in("equinox", "D.\n\nArgs:\n    {diagnose_args}\n")).__doc__
    assert "method:" not in args and "\n\n    every" not in args
    assert (
        "method: as for :func:`jmp_policy.nnx.apply`."
        in fill(_in("nnx", "D.\n\nArgs:\n    {diagnose_args}\n")).__doc__
    )


def test_fill_reflows_an_entry_with_its_hanging_lines():
    doc = fill(_in("linen", "Q.\n\n{apply_tail}\n")).__doc__
    assert doc.splitlines()[2:4] == [
        "Returns:",
        "    A function with ``module.apply``'s signature.",
    ]
    raises = doc.split("Raises:\n")[1].splitlines()
    assert raises[0].startswith("    TypeError: ``module`` is not a ``flax.linen`` Module")
    assert raises[1].startswith("        ")  # its continuation hangs under the entry


def test_fill_refuses_an_unknown_block_an_inline_block_and_an_unknown_word():
    with pytest.raises(ValueError, match="'nope'"):
        fill(_in("linen", "X.\n\n    {nope}\n"))
    with pytest.raises(ValueError, match="stands alone on its line"):
        fill(_in("linen", "X. {apply_rules}\n"))
    with pytest.raises(ValueError, match="no word"):
        fill(_in("other", "X.\n\n{apply_rules}\n"))  # not an adapter package: no words


def test_every_block_fills_in_every_framework():
    for package in WORDS:
        for name in BLOCKS:
            doc = fill(_in(package, f"X.\n\n{{{name}}}\n")).__doc__
            assert not re.search(r"\{\w+\}", doc), (package, name, doc)


@pytest.mark.parametrize("package", ["linen", "nnx", "equinox"])
def test_public_docstrings_hold_no_placeholder(package):
    module = importlib.import_module(f"jmp_policy.{package}")
    for name in module.__all__:
        doc = inspect.getdoc(getattr(module, name)) or ""
        assert not re.search(r"^\s*\{\w+\}\s*$", doc, re.M), name
        assert not set(re.findall(r"\{(\w+)\}", doc)) & set(BLOCKS), name


def test_shared_text_reaches_the_three_adapters_help():
    for fn in (jp.linen.diagnose, jp.nnx.diagnose, jp.equinox.diagnose):
        assert "report.with_gradients(probe_gradient)" in fn.__doc__
        assert "``every > 1``" in fn.__doc__
    assert shared_docs.words_for(jp.nnx.apply)["fw"] == "nnx"
