"""The key index of a DTypePolicyMap: which stored key names a path, and which chooses its policy.

Keys are exact paths or regular expressions. One vocabulary, here and in the map: a key
*names* a path (``match``, ``match_variable``: the path itself, no ancestor walk), and a
path *resolves* to the key that chooses its policy (``resolve``, ``resolve_variable``: for
a module, the key naming it or its nearest ancestor; for a variable, the key naming it,
else its module's; ``None`` for the default policy). The naming questions are answered
here, and only here:

* ``match(path)``: the key that names the path itself. An exact key wins; otherwise every
  regular-expression key is tried with ``re.fullmatch``, and two or more matches are a
  ``ValueError`` naming the path and the keys (Keras's rule).
* ``match_variable(path)``: the key that names a *variable* path itself. A key names a
  variable when it matches the variable's path (exactly or by ``fullmatch``) and does not
  match the variable's module path (the path without its last segment, ``""`` for a
  variable of the root module). So ``".*/embedding"`` and ``"embed/embedding"`` name
  variables, while ``"encoder/.*"`` and ``"encoder(/\\w+)*"`` name modules.

The ancestor walk (:func:`path_and_ancestors`) is written once, here: the map's resolution
and the wrappers' (which also try ``type_policies`` at each level) both follow it.
Answers are keys, never policies, so they are cached per path until the keys change.

Regular-expression keys are :class:`~jmp_policy._src.path_patterns.PathPattern` s (matched
in bounded time). Non-matching paths are rejected cheaply: each regular expression's
literal prefix (the text every ``fullmatch`` must start with, from Python's parse of the
key, so ``'encoder/layers_3/(mlp|attn)_\\d+'`` has one) buckets it, so a path is only tried against the keys
whose prefix it starts with, and per module the keys that may name one of its variables are
found once.
"""

from __future__ import annotations

import bisect
import functools
import threading
from collections.abc import Callable, Collection, Iterator
from typing import Any, TypeVar

from jmp_policy._src import dtypes as _dt
from jmp_policy._src.path_patterns import PathPattern, compile_pattern, is_literal
from jmp_policy._src.tree_paths import parent_path

F = TypeVar("F", bound=Callable[..., Any])

#: How the map's messages name a key (see :func:`compile_pattern`).
KEY = "key {key} of the DTypePolicyMap"


def check_key_type(key: Any) -> None:
    """A ``TypeError`` naming ``key`` and what is accepted, for a key that is not a string."""
    if not isinstance(key, str):
        raise TypeError(
            f"Keys of a DTypePolicyMap are module paths (strings) such as "
            f"'encoder/layers_0', or regular expressions such as 'encoder/.*'. "
            f"Received: key={key!r} (of type {type(key).__name__})"
        )


def check_path(path: Any) -> None:
    """A ``TypeError`` naming ``path`` and what is accepted, for a path that is not a string."""
    if not isinstance(path, str):
        raise TypeError(
            f"A module path must be a string such as 'encoder/layers_0'. "
            f"Received: path={path!r} (of type {type(path).__name__})"
        )


def absent_key(key: str, keys: Collection[str]) -> KeyError:
    """The ``KeyError`` for a key that is not stored, with the closest stored key."""
    hint = _dt.did_you_mean(key, keys) if len(keys) <= 10_000 else ""
    return KeyError(
        f"{key!r} is not a key of the DTypePolicyMap (it has {len(keys)} keys; `map[path]` "
        f"resolves any path, while `del`, `pop` and `get` take stored keys only).{hint}"
    )


def path_and_ancestors(path: str) -> Iterator[str]:
    """``path``, then each ancestor up to the top-level one: ``"a/b"`` -> ``"a/b"``, ``"a"``.

    The root ``""`` is no ancestor (an unmatched path gets the default policy, not the
    root's key); it is walked only as a path of its own.
    """
    current: str | None = path
    while current is not None:
        yield current
        current = parent_path(current) or None


def _locked(method: F) -> F:
    """``method`` run holding its index's lock."""

    @functools.wraps(method)
    def locked(self: KeyIndex, *args: Any) -> Any:
        with self.lock:
            return method(self, *args)

    return locked  # type: ignore[return-value]


class KeyIndex:
    """The stored keys of a map, indexed for matching (:meth:`match`,
    :meth:`match_variable`) and resolution (:meth:`resolve`, :meth:`resolve_variable`).

    The index holds keys only (no policies); its answers are cached per path until the
    next :meth:`add` or :meth:`remove`. Its public methods hold :attr:`lock`; the
    ``*_unlocked`` and ``*_uncached`` ones are for callers that hold it.
    """

    def __init__(self) -> None:
        # One lock for the keys and every cache: threads sharing a map look paths up
        # while others add keys (a lookup fills caches an add clears, and the sorted views
        # are rebuilt from dicts an add changes). Re-entrant: the map's methods hold it
        # around the index's.
        self.lock = threading.RLock()
        self._order: dict[str, int] = {}  # every key, to its insertion rank
        self._next = 0
        # Regular-expression keys, to their checked pattern (compiled on its first match:
        # checking a key on insertion needs only its parse, and compiling is most of the
        # cost of building a large map).
        self._regex: dict[str, PathPattern] = {}
        self._by_prefix: dict[str, list[str]] = {}
        # Keys with no literal prefix but a literal suffix (".*/layers_3/mlp"), by it: a
        # path tries only those its own end matches.
        self._by_suffix: dict[str, list[str]] = {}
        self._suffix_lengths: list[int] = []
        self._prefix_lengths: list[int] = []
        self._sorted_prefixes: list[str] = []
        self._sorted_keys: list[str] = []
        self._stale = False  # the sorted views wait for the next lookup
        self._match_cache: dict[str, str | None] = {}
        self._variable_cache: dict[str, str | None] = {}
        self._candidate_cache: dict[str, tuple[tuple[str, ...], bool]] = {}
        self._resolve_cache: dict[str, str | None] = {}
        # Per module path: its resolved key, and whether a key may name one of its variables.
        self._module_keys: dict[str, tuple[str | None, bool]] = {}

    @_locked
    def add(self, key: str) -> None:
        """Adds ``key``; a bad regular expression is a ``ValueError`` naming the key (see
        :mod:`jmp_policy._src.path_patterns`).

        Constant time (amortised): the sorted views are rebuilt once, at the next lookup,
        so building a map of n keys is linear in n (it was quadratic).
        """
        if not is_literal(key):
            pattern = self._regex[key] = compile_pattern(key, KEY)
            self._bucket(pattern).setdefault(pattern.literal_text, []).append(key)
        self._order[key] = self._next
        self._next += 1
        self._changed()

    @_locked
    def remove(self, key: str) -> None:
        """Removes ``key`` (which must be there)."""
        del self._order[key]
        if key in self._regex:
            pattern = self._regex.pop(key)
            buckets = self._bucket(pattern)
            buckets[pattern.literal_text].remove(key)
            if not buckets[pattern.literal_text]:
                del buckets[pattern.literal_text]
        self._changed()

    def _bucket(self, pattern: PathPattern) -> dict[str, list[str]]:
        return self._by_suffix if pattern.literal_suffix else self._by_prefix

    def __getstate__(self) -> dict[str, Any]:  # a lock is not copied or pickled
        return {k: v for k, v in self.__dict__.items() if k != "lock"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.lock = threading.RLock()

    def _changed(self) -> None:
        for cache in (
            self._match_cache,
            self._variable_cache,
            self._candidate_cache,
            self._resolve_cache,
            self._module_keys,
        ):
            if cache:
                cache.clear()
        self._stale = True

    def _refresh(self) -> None:
        if not self._stale:
            return
        self._prefix_lengths = sorted({len(p) for p in self._by_prefix})
        self._suffix_lengths = sorted({len(s) for s in self._by_suffix})
        self._sorted_prefixes = sorted(self._by_prefix)
        self._sorted_keys = sorted(self._order)
        self._stale = False

    def _raise_ambiguous(self, path: str, matches: list[str]) -> None:
        matches = sorted(matches, key=self._order.__getitem__)
        raise ValueError(
            f"Path {path!r} matches multiple dtype policy keys: {matches}. Please make "
            "sure each path only matches at most one key of the DTypePolicyMap."
        )

    @_locked
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
        self._refresh()
        matches = []
        for length in self._prefix_lengths:
            if length > len(path):
                break
            for candidate in self._by_prefix.get(path[:length], ()):
                if self._regex[candidate].fullmatch(path):
                    matches.append(candidate)
        matches += self._by_end(path)
        if len(matches) > 1:
            self._raise_ambiguous(path, matches)
        return matches[0] if matches else None

    def _variable_candidates(self, module: str) -> tuple[tuple[str, ...], bool]:
        """Per module path (cached): the regular-expression keys that may name one of its
        variables (their prefix allows it and they do not match the module path), and
        whether some stored key starts with ``module + "/"`` (could be a variable's exact
        key; always true for the root module)."""
        try:
            return self._candidate_cache[module]
        except KeyError:
            pass
        self._refresh()
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
        self._candidate_cache[module] = info
        return info

    def _by_end(self, path: str) -> list[str]:
        """The keys indexed by a literal suffix that fullmatch ``path``."""
        self._refresh()
        found = []
        for length in self._suffix_lengths:
            if length > len(path):
                break
            for candidate in self._by_suffix.get(path[len(path) - length :], ()):
                if self._regex[candidate].fullmatch(path):
                    found.append(candidate)
        return found

    @_locked
    def match_variable(self, path: str) -> str | None:
        """The key that names the variable ``path`` itself, or None (see the module doc)."""
        try:
            return self._variable_cache[path]
        except KeyError:
            pass
        key = self.match_variable_uncached(path, path.rpartition("/")[0])
        self._variable_cache[path] = key
        return key

    def match_variable_uncached(self, path: str, module: str) -> str | None:
        """:meth:`match_variable` without its cache, for ``path`` whose module path is
        ``module`` (tree walks know the module and visit each path once)."""
        by_name, has_exact = self._variable_candidates(module)
        if has_exact and path in self._order:
            return path
        ends = [k for k in self._by_end(path) if not self._regex[k].fullmatch(module)]
        if not by_name and not ends:
            return None
        matches = [k for k in by_name if self._regex[k].fullmatch(path)] + ends
        if len(matches) > 1:
            self._raise_ambiguous(path, matches)
        return matches[0] if matches else None

    @_locked
    def resolve(self, path: str) -> str | None:
        """The key that chooses ``path``'s policy (see :meth:`resolve_unlocked`)."""
        return self.resolve_unlocked(path)

    def resolve_unlocked(self, path: str) -> str | None:
        """The key that chooses ``path``'s policy: the one naming the path or its nearest
        ancestor (:func:`path_and_ancestors`); None: the default policy."""
        if type(path) is not str:  # before the cache: `map[[]]` is no bare "unhashable"
            check_path(path)
        try:
            return self._resolve_cache[path]
        except KeyError:
            pass
        walked: list[str] = []
        key = None
        for current in path_and_ancestors(path):
            if current in self._resolve_cache:
                key = self._resolve_cache[current]
                break
            walked.append(current)
            key = self.match_uncached(current)
            if key is not None:
                break
        for current in walked:
            self._resolve_cache[current] = key
        return key

    @_locked
    def resolve_variable(self, module: str, name: str) -> str | None:
        """:meth:`resolve_variable_unlocked`, holding the lock."""
        return self.resolve_variable_unlocked(module, name)

    def resolve_variable_unlocked(self, module: str, name: str) -> str | None:
        """The key that chooses the policy of the variable ``name`` of ``module``: one
        naming the variable itself, else the module's (the root's for module ``""``)."""
        try:
            module_key, may_name = self._module_keys[module]
        except KeyError:
            by_name, has_exact = self._variable_candidates(module)
            may_name = bool(by_name or has_exact or self._by_suffix)
            module_key = self.resolve_unlocked(module)
            self._module_keys[module] = module_key, may_name
        if may_name:
            key = self.match_variable_uncached(f"{module}/{name}" if module else name, module)
            if key is not None:
                return key
        return module_key
