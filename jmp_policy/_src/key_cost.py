"""A bound on what a regular-expression key of a DTypePolicyMap may cost to match.

Python's ``re`` backtracks: a key such as ``([a-z_0-9/]+)+!`` takes minutes on a 33-character
path, and configs are read from files. So every key is checked once, when it is inserted,
and a key that could backtrack without bound is rejected with a ``ValueError`` that names
it and says why (matching with a timeout is not possible: ``re`` holds the GIL and cannot be
interrupted).

The rule, on the parsed pattern (``re._parser``, the parser ``re.compile`` itself uses): a
repetition whose next step is ambiguous (the repeated item can start with a character that
could also come after it, as in ``\\w+\\w``) is allowed only outside every other repetition,
and at most :data:`MAX_AMBIGUOUS` times: that costs at most a polynomial of that degree in
the path's length. Inside a repetition (``(\\w+)+``, ``(a|a)*``, ``(\\w+_\\d+)*``) it would
be exponential, and is rejected, as are repeated groups that can match the empty string,
alternatives that can start alike inside a repetition, and backreferences. Unambiguous
nesting is fine: ``encoder(/\\w+)*``, ``(layers_\\d+/)*head``, ``.*/(query|key)``.
Character sets are compared on a sample alphabet (printable ASCII, a few non-ASCII
characters and the key's own literals).
"""

from __future__ import annotations

import functools
import re
from typing import Any

try:  # the parser `re.compile` uses (Python 3.11+); `sre_parse` before
    import re._constants as _c
    import re._parser as _parser
except ImportError:  # pragma: no cover
    import sre_constants as _c  # type: ignore[no-redef]
    import sre_parse as _parser  # type: ignore[no-redef]

#: Ambiguous repetitions allowed in sequence (outside any repetition): the degree of the
#: worst-case polynomial cost in the path's length.
MAX_AMBIGUOUS = 4

_QUANTIFIER_CHARS = "*+?{"
_BASE_ALPHABET = (
    "".join(chr(i) for i in range(32, 127)) + "\t\n\u00e9\u00df\u03a9\u4e2d\u0663\u00a0"
)
_REPEATS = {_c.MAX_REPEAT, _c.MIN_REPEAT, getattr(_c, "POSSESSIVE_REPEAT", _c.MAX_REPEAT)}
_CATEGORIES: dict[Any, Any] = {
    _c.CATEGORY_DIGIT: str.isdecimal,
    _c.CATEGORY_NOT_DIGIT: lambda ch: not ch.isdecimal(),
    _c.CATEGORY_SPACE: str.isspace,
    _c.CATEGORY_NOT_SPACE: lambda ch: not ch.isspace(),
    _c.CATEGORY_WORD: lambda ch: ch.isalnum() or ch == "_",
    _c.CATEGORY_NOT_WORD: lambda ch: not (ch.isalnum() or ch == "_"),
    _c.CATEGORY_LINEBREAK: lambda ch: ch == "\n",
    _c.CATEGORY_NOT_LINEBREAK: lambda ch: ch != "\n",
}


class UnsafeKey(ValueError):
    """A key whose matching cost has no bound (the message says why)."""


def _literals(seq: Any, found: set[str]) -> None:
    for op, av in seq:
        if op in (_c.LITERAL, _c.NOT_LITERAL):
            found.add(chr(av))
        elif op is _c.IN:
            for item_op, item_av in av:
                if item_op is _c.LITERAL:
                    found.add(chr(item_av))
        elif op is _c.BRANCH:
            for alternative in av[1]:
                _literals(alternative, found)
        elif op is _c.SUBPATTERN:
            _literals(av[3], found)
        elif op in _REPEATS:
            _literals(av[2], found)
        elif op in (_c.ASSERT, _c.ASSERT_NOT):
            _literals(av[1], found)
        elif op is getattr(_c, "ATOMIC_GROUP", None):
            _literals(av, found)


class _Checker:
    """Walks a parsed pattern once, with each item's follow set (bitmasks over an alphabet)."""

    def __init__(self, key: str, parsed: Any) -> None:
        self.key = key
        found: set[str] = set()
        _literals(parsed, found)
        self.alphabet = _BASE_ALPHABET + "".join(sorted(found - set(_BASE_ALPHABET)))
        self.all = (1 << len(self.alphabet)) - 1
        self.ambiguous = 0
        self._sets: dict[tuple[Any, ...], int] = {}

    # -- character sets -------------------------------------------------------------------

    def _mask(self, test: Any, ignore: bool) -> int:
        mask = 0
        for i, ch in enumerate(self.alphabet):
            if test(ch) or (ignore and (test(ch.lower()) or test(ch.upper()))):
                mask |= 1 << i
        return mask

    def char_set(self, op: Any, av: Any, ignore: bool) -> int:
        cache_key = (op, repr(av), ignore)
        if cache_key not in self._sets:
            self._sets[cache_key] = self._mask(self._test(op, av), ignore)
        return self._sets[cache_key]

    @staticmethod
    def _test(op: Any, av: Any) -> Any:
        if op is _c.LITERAL:
            return lambda ch: ch == chr(av)
        if op is _c.NOT_LITERAL:
            return lambda ch: ch != chr(av)
        if op is _c.ANY:
            return lambda ch: True
        negate = bool(av) and av[0][0] is _c.NEGATE
        tests: list[Any] = []
        for item_op, item_av in av:
            if item_op is _c.LITERAL:
                tests.append(lambda ch, v=item_av: ch == chr(v))
            elif item_op is _c.RANGE:
                tests.append(lambda ch, r=item_av: r[0] <= ord(ch) <= r[1])
            elif item_op is _c.CATEGORY:
                tests.append(_CATEGORIES.get(item_av, lambda ch: True))
            elif item_op is not _c.NEGATE:
                tests.append(lambda ch: True)  # unknown: assume it matches anything
        return lambda ch: negate != any(t(ch) for t in tests)

    # -- first sets -----------------------------------------------------------------------

    def first(self, seq: Any, ignore: bool) -> tuple[int, bool]:
        """The characters ``seq`` may start with, and whether it may match ``""``."""
        first = 0
        for op, av in seq:
            item_first, nullable = self.item_first(op, av, ignore)
            first |= item_first
            if not nullable:
                return first, False
        return first, True

    def item_first(self, op: Any, av: Any, ignore: bool) -> tuple[int, bool]:
        if op in (_c.LITERAL, _c.NOT_LITERAL, _c.ANY, _c.IN):
            return self.char_set(op, av, ignore), False
        if op in _REPEATS:
            first, nullable = self.first(av[2], ignore)
            return first, nullable or av[0] == 0
        if op is _c.SUBPATTERN:
            return self.first(av[3], ignore or bool(av[1] & re.IGNORECASE))
        if op is _c.BRANCH:
            first, nullable = 0, False
            for alternative in av[1]:
                alt_first, alt_nullable = self.first(alternative, ignore)
                first, nullable = first | alt_first, nullable or alt_nullable
            return first, nullable
        if op is getattr(_c, "ATOMIC_GROUP", None):
            return self.first(av, ignore)
        if op in (_c.AT, _c.ASSERT, _c.ASSERT_NOT):
            return 0, True  # zero-width
        self.unsafe("backreferences and conditional groups are not supported in keys")
        raise AssertionError  # unreachable

    # -- the walk -------------------------------------------------------------------------

    def unsafe(self, why: str) -> None:
        raise UnsafeKey(
            f"Key {self.key!r} of the DTypePolicyMap could take a very long time to match a "
            f"path ({why}), so it is rejected: keys are matched with Python's backtracking "
            f"`re`. Rewrite it so that each repeated part is followed by a character it "
            f"cannot match, as in 'encoder(/\\w+)*' or '(layers_\\d+/)*head', or list the "
            f"paths as exact keys."
        )

    def walk(self, seq: Any, follow: int, iterated: bool, ignore: bool) -> None:
        """Checks ``seq``, followed by a character of ``follow``, inside a repetition or not."""
        items = list(seq)
        suffix = [follow] * (len(items) + 1)  # suffix[i]: what may come after items[i-1]
        for i in range(len(items) - 1, -1, -1):
            op, av = items[i]
            item_first, nullable = self.item_first(op, av, ignore)
            suffix[i] = item_first | (suffix[i + 1] if nullable else 0)
        for i, (op, av) in enumerate(items):
            self.walk_item(op, av, suffix[i + 1], iterated, ignore)

    def walk_item(self, op: Any, av: Any, follow: int, iterated: bool, ignore: bool) -> None:
        if op in _REPEATS:
            low, high, body = av
            first, nullable = self.first(body, ignore)
            iterates = high > 1
            if iterates and nullable:
                self.unsafe("a repeated group can match the empty string")
            if low != high and first & follow:  # may stop or go on: a choice to backtrack
                if iterated:
                    self.unsafe("a repetition inside a repetition can split a path many ways")
                self.ambiguous += 1
                if self.ambiguous > MAX_AMBIGUOUS:
                    self.unsafe(
                        f"more than {MAX_AMBIGUOUS} repetitions in a row can match the same "
                        "characters"
                    )
            inner_follow = (first | follow) if iterates else follow
            self.walk(body, inner_follow, iterated or iterates, ignore)
        elif op is _c.SUBPATTERN:
            self.walk(av[3], follow, iterated, ignore or bool(av[1] & re.IGNORECASE))
        elif op is _c.BRANCH:
            seen = 0
            for alternative in av[1]:
                alt_first, alt_nullable = self.first(alternative, ignore)
                if alt_nullable:  # an empty alternative leaves the choice to what follows
                    alt_first |= follow
                if iterated and seen & alt_first:
                    self.unsafe("alternatives inside a repetition can start alike")
                seen |= alt_first
                self.walk(alternative, follow, iterated, ignore)
        elif op is getattr(_c, "ATOMIC_GROUP", None):
            self.walk(av, follow, iterated, ignore)
        elif op in (_c.ASSERT, _c.ASSERT_NOT):
            self.walk(av[1], 0, iterated, ignore)
        elif op in (_c.GROUPREF, _c.GROUPREF_EXISTS):
            self.unsafe("backreferences and conditional groups are not supported in keys")


# A run of characters that are literals wherever they stand (in a key without classes,
# escapes, groups or counted repetitions).
_PLAIN_RUN = re.compile(r"[^.^$*+?|()\[\]{}\\]+")


def check_key(key: str) -> None:
    """Raises ``ValueError`` naming ``key`` when it is not a valid regular expression, or when
    matching it could cost more than a bounded polynomial of the path's length.

    Parses ``key`` (as ``re.compile`` would) but does not compile it: see
    :func:`compile_key`.
    """
    if not any(c in key for c in "([\\{") and sum(map(key.count, _QUANTIFIER_CHARS)) <= (
        MAX_AMBIGUOUS
    ):
        # A simple key ('layers_12/.*'): valid exactly when its skeleton ('a/.*', literal runs
        # as one letter) is, and never costly; so the many keys of a large map that differ
        # only in their names are parsed once.
        try:
            _check_key(_PLAIN_RUN.sub("a", key))
        except ValueError:
            pass  # checked again below, for a message that names the key itself
        else:
            return
    _check_key(key)


@functools.lru_cache(maxsize=4096)
def _check_key(key: str) -> None:
    try:
        parsed = _parser.parse(key)
        if "(" in key or sum(key.count(q) for q in _QUANTIFIER_CHARS) > MAX_AMBIGUOUS:
            # (Without a group nothing nests, and a few repetitions are always fine.)
            checker = _Checker(key, parsed)
            checker.walk(parsed, 0, False, bool(parsed.state.flags & re.IGNORECASE))
    except UnsafeKey:
        raise
    except re.error as e:
        raise _invalid(key, str(e)) from e
    except (OverflowError, RecursionError, MemoryError) as e:
        raise _invalid(key, _why(e)) from e


def _why(e: BaseException) -> str:
    if isinstance(e, RecursionError):
        return "it is nested too deeply"
    if isinstance(e, OverflowError):
        return f"a repetition count is too large ({e})"
    return f"{type(e).__name__}: {e}"


def _invalid(key: str, why: str) -> ValueError:
    return ValueError(
        f"Key {key!r} of the DTypePolicyMap is not a valid regular expression: {why}. A key "
        f"is a module path ('encoder/layers_0') or a regular expression matched with "
        f"re.fullmatch ('encoder/.*'). Received: key={key!r}"
    )


def compile_key(key: str) -> re.Pattern[str]:
    """``key``, checked by :func:`check_key`, compiled (errors are ``ValueError`` naming it)."""
    check_key(key)
    try:
        return re.compile(key)
    except re.error as e:
        raise _invalid(key, str(e)) from e
    except (OverflowError, RecursionError, MemoryError) as e:
        raise _invalid(key, _why(e)) from e
