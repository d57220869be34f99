"""The key index of a DTypePolicyMap: which stored key names a path.

Keys are exact paths or regular expressions. Two questions are answered here, and only
here:

* ``match(path)``: the key that names the path itself. An exact key wins; otherwise every
  regular-expression key is tried with ``re.fullmatch``, and two or more matches are a
  ``ValueError`` naming the path and the keys (Keras's rule). No ancestor walk.
* ``match_variable(path)``: the key that names a *variable* path itself. A key names a
  variable when it matches the variable's path (exactly or by ``fullmatch``) and does not
  match the variable's module path (the path without its last segment, ``""`` for a
  variable of the root module). So ``".*/embedding"`` and ``"embed/embedding"`` name
  variables, while ``"encoder/.*"`` and ``"encoder(/\\w+)*"`` name modules.

Non-matching paths are rejected cheaply: each regular expression's literal prefix (the text
every ``fullmatch`` must start with) buckets it, so a path is only tried against the keys
whose prefix it starts with, and per module the keys that may name one of its variables are
found once.
"""

from __future__ import annotations

import bisect
import re

_META = frozenset(".^$*+?{}[]\\|()")
_QUANTIFIERS = frozenset("*?{")


def literal_prefix(pattern: str) -> str:
    """The literal text every ``re.fullmatch`` of ``pattern`` must start with."""
    if "|" in pattern:
        return ""
    for i, char in enumerate(pattern):
        if char in _META:
            # A quantifier makes the character before it optional.
            return pattern[: i - 1] if char in _QUANTIFIERS and i else pattern[:i]
    return pattern


def is_literal(pattern: str) -> bool:
    """Whether ``pattern`` matches only itself (no regular-expression syntax)."""
    return not any(char in _META for char in pattern)


class KeyIndex:
    """The stored keys of a map, indexed for :meth:`match` and :meth:`match_variable`.

    The index holds keys only (no policies); its answers are cached per path until the
    next :meth:`add` or :meth:`remove`.
    """

    def __init__(self) -> None:
        self._order: dict[str, int] = {}  # every key, to its insertion rank
        self._next = 0
        self._regex: dict[str, re.Pattern[str]] = {}
        self._by_prefix: dict[str, list[str]] = {}
        self._prefix_lengths: list[int] = []
        self._sorted_prefixes: list[str] = []
        self._sorted_keys: list[str] = []
        self._match_cache: dict[str, str | None] = {}
        self._variable_cache: dict[str, str | None] = {}
        self._module_cache: dict[str, tuple[tuple[str, ...], bool]] = {}

    def add(self, key: str) -> None:
        """Adds ``key``; a bad regular expression is a ``ValueError`` naming the key."""
        if not is_literal(key):
            try:
                self._regex[key] = re.compile(key)
            except re.error as e:
                raise ValueError(
                    f"Key {key!r} of the DTypePolicyMap is not a valid regular expression: {e}"
                ) from e
        self._order[key] = self._next
        self._next += 1
        self._reindex()

    def remove(self, key: str) -> None:
        """Removes ``key`` (which must be there)."""
        del self._order[key]
        self._regex.pop(key, None)
        self._reindex()

    def _reindex(self) -> None:
        self._match_cache.clear()
        self._variable_cache.clear()
        self._module_cache.clear()
        self._by_prefix = {}
        for key in self._regex:
            self._by_prefix.setdefault(literal_prefix(key), []).append(key)
        self._prefix_lengths = sorted({len(p) for p in self._by_prefix})
        self._sorted_prefixes = sorted(self._by_prefix)
        self._sorted_keys = sorted(self._order)

    def _raise_ambiguous(self, path: str, matches: list[str]) -> None:
        matches = sorted(matches, key=self._order.__getitem__)
        raise ValueError(
            f"Path {path!r} matches multiple dtype policy keys: {matches}. Please make "
            "sure each path only matches at most one key of the DTypePolicyMap."
        )

    def match(self, path: str) -> str | None:
        """The key that names ``path`` itself (exact, else one ``fullmatch``), or None."""
        try:
            return self._match_cache[path]
        except KeyError:
            pass
        key = self.match_uncached(path)
        self._match_cache[path] = key
        return key

    def match_uncached(self, path: str) -> str | None:
        """:meth:`match` without its cache (for callers that cache their own answers)."""
        if path in self._order:
            return path
        matches = []
        for length in self._prefix_lengths:
            if length > len(path):
                break
            for candidate in self._by_prefix.get(path[:length], ()):
                if self._regex[candidate].fullmatch(path):
                    matches.append(candidate)
        if len(matches) > 1:
            self._raise_ambiguous(path, matches)
        return matches[0] if matches else None

    def variable_keys(self, module: str) -> tuple[tuple[str, ...], bool]:
        """Per module path (cached): the regular-expression keys that may name one of its
        variables (their prefix allows it and they do not match the module path), and
        whether some stored key starts with ``module + "/"`` (could be a variable's exact
        key; always true for the root module)."""
        try:
            return self._module_cache[module]
        except KeyError:
            pass
        stem = f"{module}/" if module else ""
        candidates: list[str] = []
        for length in self._prefix_lengths:  # prefixes of the stem
            if length > len(stem):
                break
            candidates.extend(self._by_prefix.get(stem[:length], ()))
        i = bisect.bisect_right(self._sorted_prefixes, stem)  # prefixes longer than the stem
        while i < len(self._sorted_prefixes) and self._sorted_prefixes[i].startswith(stem):
            candidates.extend(self._by_prefix[self._sorted_prefixes[i]])
            i += 1
        by_name = tuple(k for k in candidates if not self._regex[k].fullmatch(module))
        j = bisect.bisect_left(self._sorted_keys, stem)
        has_exact = j < len(self._sorted_keys) and self._sorted_keys[j].startswith(stem)
        info = (by_name, has_exact)
        self._module_cache[module] = info
        return info

    def match_variable(self, path: str) -> str | None:
        """The key that names the variable ``path`` itself, or None (see the module doc)."""
        try:
            return self._variable_cache[path]
        except KeyError:
            pass
        key = self.match_variable_of(path.rpartition("/")[0], path)
        self._variable_cache[path] = key
        return key

    def match_variable_of(self, module: str, path: str) -> str | None:
        """:meth:`match_variable` for ``path`` whose module path is ``module`` (uncached
        per path, for tree walks that know the module and visit each path once)."""
        by_name, has_exact = self.variable_keys(module)
        if has_exact and path in self._order:
            return path
        if not by_name:
            return None
        matches = [k for k in by_name if self._regex[k].fullmatch(path)]
        if len(matches) > 1:
            self._raise_ambiguous(path, matches)
        return matches[0] if matches else None
