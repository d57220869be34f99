"""A parsed Python regular expression written out again in RE2's syntax or the ``regex``
package's, with Python's meaning: what lets :mod:`jmp_policy._src.path_patterns` match user
path patterns with a bounded engine while they keep Python's syntax, errors and meaning.

The parse is Python's own (``re._parser``, what ``re.compile`` uses). The writer emits only
canonical syntax both engines read alike: every non-alphanumeric literal as a code point
escape, Python's Unicode ``\\w``, ``\\d`` and ``\\s`` as explicit classes (RE2's are
ASCII; ``regex``'s ``\\w`` also takes combining marks), ``$`` and ``\\Z`` as Python reads
them, capture groups numbered as Python numbers them (for backreferences). What RE2 cannot
run (lookarounds, backreferences, atomic groups, possessive repeats, case-insensitive
matching, Unicode word boundaries, counts above 1000, ``$`` before more of the pattern)
raises :class:`Unsupported`, and the pattern goes to ``regex``.
"""

from __future__ import annotations

import re
from typing import Any

try:  # the parser `re.compile` uses (Python 3.11+); `sre_parse` before
    import re._constants as _c
    import re._parser as _parser
except ImportError:  # pragma: no cover
    import sre_constants as _c  # type: ignore[no-redef]
    import sre_parse as _parser  # type: ignore[no-redef]


_RE2_MAX_COUNT = 1000  # RE2 refuses larger repetition counts
_POSSESSIVE = getattr(_c, "POSSESSIVE_REPEAT", None)
_ATOMIC = getattr(_c, "ATOMIC_GROUP", None)
_I, _M, _S, _A = re.IGNORECASE, re.MULTILINE, re.DOTALL, re.ASCII
# Python's Unicode classes for str patterns (as class contents): `\w` is str.isalnum() or
# "_", `\d` str.isdecimal() (category Nd), `\s` str.isspace().
_WORD = r"\p{L}\p{N}_"
# Python's `\s` for str patterns (str.isspace()), as code point ranges.
_SPACE = (
    (0x9, 0xD),
    (0x1C, 0x20),
    (0x85, 0x85),
    (0xA0, 0xA0),
    (0x1680, 0x1680),
    (0x2000, 0x200A),
    (0x2028, 0x2029),
    (0x202F, 0x202F),
    (0x205F, 0x205F),
    (0x3000, 0x3000),
)
_ASCII_SPACE = ((0x9, 0xD), (0x20, 0x20))
_CATEGORY = {
    _c.CATEGORY_WORD: ("word", False),
    _c.CATEGORY_NOT_WORD: ("word", True),
    _c.CATEGORY_DIGIT: ("digit", False),
    _c.CATEGORY_NOT_DIGIT: ("digit", True),
    _c.CATEGORY_SPACE: ("space", False),
    _c.CATEGORY_NOT_SPACE: ("space", True),
}


class Unsupported(Exception):
    """The pattern uses what the target engine cannot run (RE2: lookarounds, ...)."""


class Writer:
    """Writes a parsed Python pattern in RE2's syntax (``target="re2"``) or in the
    ``regex`` package's (``target="regex"``), with Python's meaning."""

    def __init__(self, target: str) -> None:
        self.re2 = target == "re2"

    def char(self, code: int) -> str:
        ch = chr(code)
        if ch.isascii() and (ch.isalnum() or ch in "_/"):
            return ch
        if 0xD800 <= code <= 0xDFFF and self.re2:
            raise Unsupported("a surrogate code point")
        return f"\\x{{{code:x}}}" if self.re2 else f"\\U{code:08x}"

    def seq(self, items: Any, flags: int, tail: bool) -> str:
        items = list(items)
        last = len(items) - 1
        return "".join(
            self.item(op, av, flags, tail and i == last) for i, (op, av) in enumerate(items)
        )

    def ignorecase(self, text: str, flags: int) -> str:
        if flags & _I:
            if self.re2:
                raise Unsupported("case-insensitive matching")
            return f"(?i:{text})"
        return text

    def classes(self, flags: int) -> dict[str, str]:
        """The contents of Python's ``\\w``, ``\\d`` and ``\\s`` classes under ``flags``."""
        ascii_only = bool(flags & _A)
        space = "".join(
            f"{self.char(lo)}-{self.char(hi)}" if lo != hi else self.char(lo)
            for lo, hi in (_ASCII_SPACE if ascii_only else _SPACE)
        )
        if ascii_only:
            return {"word": "0-9A-Za-z_", "digit": "0-9", "space": space}
        return {"word": _WORD, "digit": r"\p{Nd}", "space": space}

    def item(self, op: Any, av: Any, flags: int, tail: bool) -> str:
        if op is _c.LITERAL:
            return self.ignorecase(self.char(av), flags)
        if op is _c.NOT_LITERAL:
            return self.ignorecase(f"[^{self.char(av)}]", flags)
        if op is _c.ANY:
            return "(?s:.)" if flags & _S else "[^\\n]"
        if op is _c.IN:
            return self.ignorecase(self.char_set(av, flags), flags)
        if op is _c.BRANCH:
            return "(?:" + "|".join(self.seq(alt, flags, tail) for alt in av[1]) + ")"
        if op is _c.SUBPATTERN:
            group, add, remove, body = av
            inner = self.seq(body, (flags | add) & ~remove, tail)
            return f"({inner})" if group is not None and not self.re2 else f"(?:{inner})"
        if op in (_c.MAX_REPEAT, _c.MIN_REPEAT) or (op is _POSSESSIVE and op is not None):
            return self.repeat(op, av, flags)
        if op is _c.AT:
            return self.at(av, flags, tail)
        if self.re2:
            raise Unsupported(str(op).lower())
        if op in (_c.ASSERT, _c.ASSERT_NOT):
            direction, body = av
            sign = ("=" if op is _c.ASSERT else "!") if direction == 1 else None
            if sign is None:
                sign = "<=" if op is _c.ASSERT else "<!"
            return f"(?{sign}{self.seq(body, flags, False)})"
        if op is _c.GROUPREF:
            return self.ignorecase(f"(?:\\g<{av}>)", flags)
        if op is _c.GROUPREF_EXISTS:
            group, yes, no = av
            other = "" if no is None else "|" + self.seq(no, flags, tail)
            return f"(?({group}){self.seq(yes, flags, tail)}{other})"
        if op is _ATOMIC and op is not None:
            return f"(?>{self.seq(av, flags, tail)})"
        raise Unsupported(str(op).lower())  # pragma: no cover - every op of Python's parser

    def repeat(self, op: Any, av: Any, flags: int) -> str:
        low, high, body = av
        unbounded = high is _c.MAXREPEAT or high == _c.MAXREPEAT
        if op is _POSSESSIVE and self.re2:
            raise Unsupported("a possessive repeat")
        if self.re2 and (low > _RE2_MAX_COUNT or (not unbounded and high > _RE2_MAX_COUNT)):
            raise Unsupported("a repetition count above 1000")
        count = f"{{{low},}}" if unbounded else f"{{{low},{high}}}"
        count = {"{0,}": "*", "{1,}": "+", "{0,1}": "?"}.get(count, count)
        if op is _POSSESSIVE:
            count += "+"
        return f"(?:{self.seq(body, flags, False)}){count}"

    def at(self, where: Any, flags: int, tail: bool) -> str:
        if where is _c.AT_BEGINNING:
            return "(?m:^)" if flags & _M else "\\A"
        if where is _c.AT_BEGINNING_STRING:
            return "\\A"
        if where is _c.AT_END_STRING:
            return "\\z" if self.re2 else "\\Z"
        if where is _c.AT_END:
            if flags & _M:
                return "(?m:$)"
            if not self.re2:
                return "(?-m:$)"
            if tail:  # nothing follows: under fullmatch, Python's `$` is the end
                return "\\z"
            raise Unsupported("`$` before more of the pattern")
        if where in (_c.AT_BOUNDARY, _c.AT_NON_BOUNDARY):
            if self.re2:
                if flags & _A:
                    return "\\b" if where is _c.AT_BOUNDARY else "\\B"
                raise Unsupported("a Unicode word boundary")
            word = f"[{self.classes(flags)['word']}]"
            if where is _c.AT_BOUNDARY:
                return f"(?:(?<={word})(?!{word})|(?<!{word})(?={word}))"
            return f"(?:(?<={word})(?={word})|(?<!{word})(?!{word}))"
        raise Unsupported(str(where).lower())  # pragma: no cover

    def char_set(self, items: Any, flags: int) -> str:
        negate = False
        parts: list[str] = []
        negated_classes: list[str] = []
        for op, av in items:
            if op is _c.NEGATE:
                negate = True
            elif op is _c.LITERAL:
                parts.append(self.char(av))
            elif op is _c.RANGE:
                parts.append(f"{self.char(av[0])}-{self.char(av[1])}")
            elif op is _c.CATEGORY and av in _CATEGORY:
                name, negated = _CATEGORY[av]
                content = self.classes(flags)[name]
                if negated:
                    negated_classes.append(content)
                else:
                    parts.append(content)
            else:
                raise Unsupported(f"{op} in a character set".lower())
        if not negated_classes:
            return ("[^" if negate else "[") + "".join(parts) + "]"
        if len(negated_classes) == 1 and not parts:  # `\W` or `[^\S]`
            return ("[" if negate else "[^") + negated_classes[0] + "]"
        # A union with complemented classes: (one of the parts) or (not in a class).
        alternatives = [f"[{''.join(parts)}]"] if parts else []
        alternatives += [f"[^{content}]" for content in negated_classes]
        union = "(?:" + "|".join(alternatives) + ")"
        if not negate:
            return union
        if self.re2:
            raise Unsupported("a negated set with a negated class")
        return f"(?:(?!{union})(?s:.))"


class Invalid(ValueError):
    """Python's ``re`` would not compile the pattern (the message says why)."""


def parse(key: str) -> Any:
    """Python's parse of ``key``; raises :class:`Invalid` (saying why, without the key)
    where ``re.compile`` would raise."""
    try:
        parsed = _parser.parse(key)
        if "(?<" in key:  # a lookbehind's width is checked by the compiler, not the parser
            re.compile(key)
        return parsed
    except re.error as e:
        raise Invalid(str(e)) from None
    except OverflowError as e:
        raise Invalid(f"a repetition count is too large ({e})") from None
    except RecursionError:
        raise Invalid("it is nested too deeply") from None
    except MemoryError as e:  # pragma: no cover
        raise Invalid(f"MemoryError: {e}") from None


def flags_of(parsed: Any) -> int:
    state = getattr(parsed, "state", None) or getattr(parsed, "pattern", None)
    return int(getattr(state, "flags", 0))


def leading_literals(parsed: Any) -> str:
    """The literal text every match of ``parsed`` starts with (``""`` when it ignores case)."""
    if flags_of(parsed) & _I:
        return ""
    prefix = []
    for op, av in parsed:
        if op is not _c.LITERAL:
            break
        prefix.append(chr(av))
    return "".join(prefix)
