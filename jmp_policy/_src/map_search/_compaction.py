"""The searched map's entries: exact paths, compacted to a regular expression per run.

Paths that differ only by their number (``blocks_0/mlp/up``, ``blocks_1/mlp/up``) and share
a choice become one key when it covers them and no other path.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

_NUMBER = re.compile(r"\d+")


def compact(choices: Mapping[str, str], base: str) -> dict[str, str]:
    """Map entries for ``choices`` (``{path: name}``), base layers left to the default.

    Paths that differ only by their numbers (``blocks_0/mlp/up``, ``blocks_1/mlp/up``)
    and share a choice become one regular expression when it covers them and no other
    path; the others stay exact (escaped).
    """
    groups: dict[str, list[str]] = {}
    for path in choices:
        template = _NUMBER.sub("\0", path)
        groups.setdefault(template, []).append(path)
    entries: dict[str, str] = {}
    for template, paths in groups.items():
        named = [p for p in paths if choices[p] != base]
        by_choice: dict[str, list[str]] = {}
        for p in named:
            by_choice.setdefault(choices[p], []).append(p)
        for name, members in by_choice.items():
            if len(members) < 2 or template.count("\0") != 1:
                entries.update({re.escape(p): name for p in members})
                continue
            parts = [re.escape(part) for part in template.split("\0")]
            numbers = [_NUMBER.findall(p)[0] for p in members]
            every = len(members) == len(paths)
            middle = r"\d+" if every else "(?:" + "|".join(numbers) + ")"
            key = middle.join(parts)
            covered = [p for p in choices if re.fullmatch(key, p)]
            if sorted(covered) == sorted(members):
                entries[key] = name
            else:
                entries.update({re.escape(p): name for p in members})
    return entries
