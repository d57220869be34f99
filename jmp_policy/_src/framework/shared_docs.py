"""The docstring text the three adapters' entry points share, written once.

Each adapter's public function keeps its own summary, framework-specific arguments and
runnable example, and names a shared block with a ``{placeholder}`` line; :func:`fill`
puts the block there at import time, indented as the placeholder is, with the block's
``{word}`` fields in the words of the function's framework (:data:`WORDS`, chosen by the
function's package), so ``help()`` and the API reference show the whole text.
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Callable
from typing import Any, TypeVar

from jmp_policy._src.framework.doc_blocks import BLOCKS, WORDS

F = TypeVar("F", bound=Callable[..., Any])

__all__ = ["BLOCKS", "WORDS", "fill", "words_for"]

_PLACEHOLDER = re.compile(r"^([ \t]*)\{(\w+)\}[ \t]*$", re.MULTILINE)
_FIELD = re.compile(r"\{(\w+)\}")
_ITEM = re.compile(r"^\s*(\*\*)?\w+(, \w+)*: ")  # an Args/Raises entry: its next lines hang
_HEADER = re.compile(r"^\s*[A-Z]\w*:\s*$")  # a section's header (``Returns:``)
_WIDTH = 84  # a block's lines, without the placeholder's indentation


def _reflowed(text: str) -> str:
    """``text``'s paragraphs (an entry and its hanging lines, or plain lines up to a blank
    line, a header or an entry) wrapped again, once the fields' words changed lengths."""
    out: list[str] = []
    paragraph: list[str] = []

    def flush() -> None:
        if paragraph:
            first = paragraph[0]
            indent = first[: len(first) - len(first.lstrip())]
            hang = indent + ("    " if _ITEM.match(first) else "")
            words = " ".join(line.strip() for line in paragraph)
            out.extend(
                textwrap.wrap(
                    words,
                    _WIDTH,
                    initial_indent=indent,
                    subsequent_indent=hang,
                    break_long_words=False,
                    break_on_hyphens=False,
                )
            )
            paragraph.clear()

    for line in text.splitlines():
        if not line.strip() or _HEADER.match(line):
            flush()
            out.append(line.rstrip())
        else:
            if _ITEM.match(line):
                flush()
            paragraph.append(line)
    flush()
    return "\n".join(out)


def words_for(fn: Any) -> dict[str, str]:
    """The words of ``fn``'s framework: ``WORDS[<name>]`` for a ``jmp_policy.<name>``
    module, else none."""
    parts = (getattr(fn, "__module__", None) or "").split(".")
    words = WORDS.get(parts[1], {}) if len(parts) > 1 and parts[0] == "jmp_policy" else {}
    stack = words.get("stack", "")
    return {**words, "stack_capitalized": stack[:1].upper() + stack[1:]} if words else {}


def fill(fn: F) -> F:
    """Puts each shared block named by a ``{name}`` line of ``fn``'s docstring there.

    A block's ``{word}`` fields take the words of ``fn``'s framework (:data:`WORDS`,
    chosen by the package ``fn`` is defined in: ``jmp_policy.linen``, ``.nnx`` or
    ``.equinox``). Works on functions and classes.

    Args:
        fn: a function or class whose docstring has lines holding only ``{name}`` (a key
            of :data:`BLOCKS`), indented where the block goes.

    Returns:
        ``fn``, its ``__doc__`` filled.

    Raises:
        ValueError: a placeholder names no block, a block's name stands inside a line
            of text, or a block's field has no word in ``fn``'s framework.

    Examples:
        >>> @fill
        ... def f(policy_or_map):
        ...     '''Does f.
        ...
        ...     Args:
        ...         {policy_or_map}
        ...     '''
        >>> print(f.__doc__.strip().splitlines()[-1].strip())
        policy_or_map: a policy (or name), a :class:`~jmp_policy.DTypePolicyMap` or a dict.
    """
    words = words_for(fn)

    def word(match: re.Match[str]) -> str:
        if match.group(1) not in words:
            raise ValueError(
                f"{fn.__qualname__}'s docstring uses a shared block with the field "
                f"{match.group(0)!r}, which has no word in its framework (module "
                f"{fn.__module__!r}); the words are {sorted(words)}."
            )
        return words[match.group(1)]

    def block(match: re.Match[str]) -> str:
        indent, name = match.groups()
        if name not in BLOCKS:
            raise ValueError(
                f"{fn.__qualname__}'s docstring names the shared block {name!r}, which "
                f"does not exist; the blocks are {sorted(BLOCKS)}."
            )
        # A line that a field's words leave empty (a framework without that argument) goes.
        lines = [_FIELD.sub(word, line) for line in BLOCKS[name].splitlines()]
        text = "\n".join(
            new
            for old, new in zip(BLOCKS[name].splitlines(), lines, strict=True)
            if new.strip() or not old.strip()
        )
        lines = _reflowed(text).splitlines()
        return "\n".join(indent + line if line else "" for line in lines)

    fn.__doc__ = _PLACEHOLDER.sub(block, fn.__doc__ or "")
    inline = sorted({name for name in _FIELD.findall(fn.__doc__) if name in BLOCKS})
    if inline:
        raise ValueError(
            f"{fn.__qualname__}'s docstring names the shared blocks {inline} inside a line "
            "of text; a placeholder stands alone on its line."
        )
    return fn
