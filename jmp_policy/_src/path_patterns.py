"""User path patterns: every regular expression a user gives to name module paths, compiled
one way and matched in bounded time.

``DTypePolicyMap`` keys, ``stacked_axes=`` keys, ``autocast_exclude=`` entries and
``diagnose(paths=)`` entries are Python regular expressions matched with ``re.fullmatch``
semantics (the whole path, Keras's rule). Python's ``re`` backtracks (``([a-z]+)+!`` takes
minutes on a 30-character path) and holds the GIL, so it cannot be bounded; configs are
read from files. So a pattern is parsed by Python's own parser (``re._parser``, what
``re.compile`` uses: the syntax and its errors are Python's) and then matched by a
well-kept engine:

* RE2 (``google-re2``), linear in the path's length by construction, for every pattern it
  can run: the parsed pattern is written out again in RE2's syntax
  (:mod:`jmp_policy._src.pattern_syntax`), so the meaning stays
  Python's (``\\d``, ``\\w`` and ``\\s`` as Python's Unicode classes, ``$`` and ``\\Z`` as
  Python reads them, ``{,3}`` as ``{0,3}``). Python's and RE2's Unicode tables differ only
  on code points Python's version of Unicode leaves unassigned.
* the ``regex`` package, with a :data:`MATCH_TIMEOUT_S` timeout, for the rest: lookarounds
  and backreferences (the README's ``encoder/(?!.*norm).*``, as in Keras), atomic groups,
  possessive repeats, case-insensitive patterns, word boundaries and counts above RE2's
  1000. A match that runs past the timeout is a ``ValueError`` naming the pattern and the
  path.

:func:`compile_pattern` checks a pattern (a ``ValueError`` naming it, never ``re.error``,
``OverflowError`` or ``RecursionError``) and returns a :class:`PathPattern`, which
compiles for its engine on its first match (a large map's keys are checked on insertion,
and only those a lookup tries are compiled). :meth:`PathPattern.literal_prefix` is the text
every match starts with, which the map indexes its keys by.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import re2
import regex

from jmp_policy._src.pattern_syntax import (
    Invalid,
    Unsupported,
    Writer,
    flags_of,
    leading_literals,
    parse,
)

#: How long one match by the ``regex`` fallback may run before it is stopped (seconds).
#: Patterns RE2 runs are linear-time and never time out.
MATCH_TIMEOUT_S = 0.02

_META_SEARCH = re.compile(r"[.^$*+?{}\[\]\\|()]").search
_META = frozenset(".^$*+?{}[]\\|()")
_QUANTIFIERS = frozenset("*?{")
# Keys whose skeleton is not enough to check them: escapes whose validity depends on what
# follows (`\x`, `\N{...}`), and groups other than `(?:`, `(?=` and `(?!` (names, flags,
# conditions, lookbehinds, whose width counts).
_SKELETON_UNSAFE = re.compile(r"\\[xuUN]|\(\?(?![:=!])").search
# An escape (a backreference or octal escape with all its digits), a brace, a class (copied
# as they are: `[z-a]` and `\12` decide validity), a structural group opening, or a run of
# literals (replaced by "a": its text cannot change whether the key is valid).
_SKELETON_TOKEN = re.compile(
    r"(\\[0-9]+|\\.|\{[^}]*\}|\(\?[:=!]|\[\^?\]?(?:\\.|[^\]\\])*\])|[^.^$*+?{}\[\]\\|()]+", re.S
)
_ESCAPE = re.compile(r"\\.", re.S)
_INNERMOST_GROUP = re.compile(r"\([^()]*\)")


def is_literal(pattern: str) -> bool:
    """Whether ``pattern`` matches only itself (no regular-expression syntax).

    >>> is_literal("encoder/layers_0"), is_literal("encoder/.*")
    (True, False)
    """
    return _META_SEARCH(pattern) is None


def _skeleton_run(match: re.Match[str]) -> str:
    return match.group(1) or "a"


@functools.lru_cache(maxsize=4096)
def _check_skeleton(skeleton: str) -> None:
    parse(skeleton)


#: The deepest nesting of groups a pattern may have: compiling and writing a pattern out
#: recurse once per level, so a deeper one would fail at its first match, not when given.
MAX_NESTING = 50


def _nesting(key: str) -> int:
    """How deep ``key``'s groups nest (escapes and classes skipped; a verbose comment's
    parentheses counted, which only overestimates)."""
    depth = deepest = i = 0
    in_class = False
    while i < len(key):
        c = key[i]
        if c == "\\":
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
            i += 1 + (key[i + 1 : i + 2] == "^")
            i += key[i : i + 1] == "]"  # a class's first "]" is a literal
            continue
        elif c == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif c == ")":
            depth -= 1
        i += 1
    return deepest


def _check(key: str) -> tuple[Any, str]:
    """Checks ``key`` (raises ``Invalid``); returns its parse (None where a cached check of
    its skeleton vouched for it) and its literal prefix.

    A key's skeleton (``'encoder/layers_12/(mlp|attn)_\\d+'`` -> ``'a(a|a)a\\d+'``) is valid
    exactly when the key is, so the many keys of a large map that differ only in their
    names are parsed once.
    """
    if key.count("(") > MAX_NESTING and (depth := _nesting(key)) > MAX_NESTING:
        raise Invalid(
            f"it is nested too deeply: its groups nest {depth} deep, more than the {MAX_NESTING} "
            "levels a path pattern may have (it could not be compiled when matched)"
        )
    if not _SKELETON_UNSAFE(key):
        try:
            _check_skeleton(_SKELETON_TOKEN.sub(_skeleton_run, key))
        except Invalid:
            pass  # parsed below, for the key's own message
        else:
            if "[" in key and "|" in key:  # a class may hide a group's parenthesis
                return None, ""
            return None, _plain_prefix(key)
    parsed = parse(key)
    return parsed, leading_literals(parsed)


_FLAGS_OR_NAMES = re.compile(r"\(\?[^:=!]").search


def plain_suffix(key: str) -> str:
    """Text every match of ``key`` ends with (``".*/layers_3/mlp"`` -> ``"/layers_3/mlp"``),
    read off its end; ``""`` when unsure (an alternation, flags, a hex or named escape),
    which only costs speed: the map indexes its keys with no literal prefix by it.

    >>> plain_suffix(".*/layers_3/mlp"), plain_suffix("(a)\\\\1/x"), plain_suffix("a|b")
    ('/layers_3/mlp', '/x', '')
    """
    if "|" in key or _FLAGS_OR_NAMES(key):
        return ""
    i = len(key)
    while i and key[i - 1] not in _META:
        i -= 1
    run, slashes = key[i:], 0
    while i - slashes and key[i - slashes - 1] == "\\":
        slashes += 1
    if slashes % 2:  # the run's first character is escaped: not a literal
        if run[:1] in ("x", "u", "U", "N"):
            return ""
        run = run[1:].lstrip("0123456789") if run[:1].isdigit() else run[1:]
    return run


def _plain_prefix(key: str) -> str:
    """The literal prefix of a key with no class, group name or flag (so no verbose mode)."""
    if "|" in key:  # at the top level, the key has no common prefix
        bare = _ESCAPE.sub("", key)
        while True:
            shorter = _INNERMOST_GROUP.sub("", bare)
            if shorter == bare:
                break
            bare = shorter
        if "|" in bare:
            return ""
    meta = _META_SEARCH(key)
    if meta is None:
        return key
    i = meta.start()
    # A quantifier makes the character before it optional.
    return key[: i - 1] if key[i] in _QUANTIFIERS and i else key[:i]


class PathPattern:
    """A checked user path pattern, matched as ``re.fullmatch`` would, in bounded time.

    Made by :func:`compile_pattern`; compiles for its engine on its first match.

    >>> p = compile_pattern("encoder/layers_\\\\d+/(mlp|attn)", "entry {key} of `paths`")
    >>> p.fullmatch("encoder/layers_12/mlp"), p.fullmatch("encoder/layers_12/mlp/x")
    (True, False)
    >>> p.literal_prefix, p.engine
    ('encoder/layers_', 're2')
    >>> compile_pattern("encoder/(?!.*norm).*", "entry {key} of `paths`").engine
    'regex'
    """

    __slots__ = (
        "_engine", "_matcher", "_parsed", "key", "literal_prefix", "literal_suffix", "what"
    )  # fmt: skip

    def __init__(self, key: str, what: str, parsed: Any, prefix: str) -> None:
        self.key = key
        self.what = what  # "key {key} of the DTypePolicyMap": how messages name it
        self._parsed = parsed
        self.literal_prefix = prefix
        # What every match ends with, for a key with no literal prefix ("" when none).
        self.literal_suffix = "" if prefix else plain_suffix(key)
        self._matcher: Any = None
        self._engine = ""

    @property
    def literal_text(self) -> str:
        """What the map indexes the key by: its literal suffix if it has only that, else
        its literal prefix (maybe ``""``)."""
        return self.literal_suffix or self.literal_prefix

    @property
    def engine(self) -> str:
        """``"re2"`` or ``"regex"`` (with a timeout): which engine matches the pattern."""
        if self._matcher is None:
            self._compile()
        return self._engine

    def __repr__(self) -> str:
        return f"PathPattern({self.key!r})"

    def _compile(self) -> Any:
        parsed = self._parsed if self._parsed is not None else parse(self.key)
        self._parsed = None  # the parse is no longer needed
        flags = flags_of(parsed)
        try:
            try:
                written = Writer("re2").seq(parsed, flags, True)
                options = re2.Options()
                options.never_capture = True
                options.log_errors = False
                compiled = re2.compile(written, options)
                self._engine = "re2"
                self._matcher = compiled
                return compiled
            except (Unsupported, re2.error):
                written = Writer("regex").seq(parsed, flags, True)
                self._matcher = regex.compile(written, regex.VERSION0)
                self._engine = "regex"
                return self._matcher
        except RecursionError:
            raise _invalid(self.key, self.what, "it is nested too deeply", None) from None
        except regex.error as e:  # pragma: no cover - Python's parser accepted it
            raise _invalid(self.key, self.what, str(e), None) from None

    def fullmatch(self, path: str) -> bool:
        """Whether the whole of ``path`` matches; a ``ValueError`` naming the pattern and
        the path when the ``regex`` fallback runs past :data:`MATCH_TIMEOUT_S`."""
        matcher = self._matcher if self._matcher is not None else self._compile()
        if self._engine == "re2":
            try:
                return matcher.fullmatch(path) is not None
            except UnicodeEncodeError:  # a lone surrogate: not UTF-8, so not for RE2
                self._parsed = parse(self.key)
                matcher = regex.compile(
                    Writer("regex").seq(self._parsed, flags_of(self._parsed), True), regex.VERSION0
                )
                return self._slow_match(matcher, path)
        return self._slow_match(matcher, path)

    def _slow_match(self, matcher: Any, path: str) -> bool:
        try:
            return matcher.fullmatch(path, timeout=MATCH_TIMEOUT_S) is not None
        except TimeoutError:
            raise ValueError(
                f"Matching the path {path!r} against {self.what.format(key=repr(self.key))} was stopped "
                f"after {MATCH_TIMEOUT_S * 1000:g} ms. The pattern uses syntax that RE2 "
                "cannot run in linear time (lookarounds, backreferences, atomic groups, "
                "possessive repeats, case-insensitive matching, word boundaries or counts "
                "above 1000), so it is matched by backtracking, which could take very long "
                "on this path. Rewrite it without them, as in 'encoder(/\\w+)*' or "
                "'(encoder|decoder)/.*', or list the paths exactly. "
                f"Received: key={self.key!r}, path={path!r}"
            ) from None


def _invalid(key: str, what: str, why: str, received: str | None) -> ValueError:
    named = what.format(key=repr(key))
    return ValueError(
        f"{named[0].upper()}{named[1:]} is not a valid regular expression: {why}. A module "
        f"path ('encoder/layers_0') or a regular expression matched with re.fullmatch "
        f"('encoder/.*') is accepted. Received: {received or f'key={key!r}'}"
    )


def compile_pattern(key: str, what: str, received: str | None = None) -> PathPattern:
    """``key`` checked, as a :class:`PathPattern`: a ``ValueError`` when Python's ``re``
    would not compile it, naming it as ``what`` (a template such as ``"key {key} of the
    DTypePolicyMap"``) and ending ``Received: {received}`` (default ``key=...``)."""
    try:
        parsed, prefix = _check(key)
    except Invalid as e:
        raise _invalid(key, what, str(e), received) from None
    return PathPattern(key, what, parsed, prefix)
