"""DTypePolicyMap's matching: which stored key names a path itself (no ancestor walk).

Functions of the map that it binds as its methods (``match``, ``match_variable``), their
docstrings kept; the key index (``_index``) does the work under its lock. Resolution (the
ancestor walk, the default) stays with the map: ``map[path]``, ``resolve``.
"""

from __future__ import annotations

from typing import Protocol

import jmp_policy._src.policy_map._index as _index


class PolicyMap(Protocol):
    """What matching uses of a ``DTypePolicyMap``: its key index. (``_mapping`` imports this
    module, so the map is described here, not imported.)"""

    _index: _index.KeyIndex


def match(policy_map: PolicyMap, path: str) -> str | None:
    """The stored key that names ``path`` itself, or ``None`` (no ancestor walk).

    An exact key wins; otherwise every key is tried with ``re.fullmatch``.

    Raises:
        ValueError: two or more keys match (naming the path and the keys).
        TypeError: ``path`` is not a string.

    Examples:
        >>> import jmp_policy as jp
        >>> m = jp.DTypePolicyMap("float32", {"encoder/.*": "bfloat16", "head": "float32"})
        >>> m.match("encoder/mlp"), m.match("head"), m.match("head/dense")
        ('encoder/.*', 'head', None)
    """
    _index.check_path(path)
    return policy_map._index.match(path)


def match_variable(policy_map: PolicyMap, path: str) -> str | None:
    """The stored key that names the variable ``path`` itself, or ``None``.

    A key names a variable when it matches the variable's path (exactly or by
    ``re.fullmatch``) and does not match the variable's module path (``path`` without
    its last segment; ``""`` for a variable of the root module). An exact key wins.

    Raises:
        ValueError: two or more keys name the variable (naming the path and the keys).
        TypeError: ``path`` is not a string.

    Examples:
        >>> import jmp_policy as jp
        >>> m = jp.DTypePolicyMap(None, {".*/embedding": "float32", "encoder/.*": "bfloat16"})
        >>> m.match_variable("embed/embedding")
        '.*/embedding'
        >>> print(m.match_variable("encoder/head/kernel"))  # "encoder/.*" names modules
        None
    """
    _index.check_path(path)
    return policy_map._index.match_variable(path)
