"""The search's candidates: which policies a layer may take, what its kernel costs under each.

The base policy (no quantization) is always an option; a candidate is a quantized policy.
A stateful format (float8 with delayed scaling) is scored by its stateless form.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jmp_policy._src.policy_map import DTypePolicyMap
from jmp_policy._src.policy_names import get_policy

DEFAULT_CANDIDATES = (
    "mixed_bfloat16",
    "float8_from_mixed_bfloat16",
    "int8_from_mixed_bfloat16",
    "int4/128_from_mixed_bfloat16",
)


def check_candidates(candidates: Any, base: Any) -> tuple[str, dict[str, Any]]:
    """The base name and ``{name: policy}`` of the candidates (the base always among them).

    Raises:
        TypeError: ``candidates`` is not a sequence of strings, or ``base`` not a string.
        ValueError: a name is not a policy name, or a candidate stores no format a kernel
            can take (a float policy other than the base).
    """
    if not isinstance(base, str):
        raise TypeError(f"`base` must be a policy name (a string). Received: base={base!r}")
    if isinstance(candidates, str) or not isinstance(candidates, Sequence) or not candidates:
        raise TypeError(
            "`candidates` must be a non-empty list of policy names such as "
            f"{list(DEFAULT_CANDIDATES)!r}. Received: candidates={candidates!r}"
        )
    out: dict[str, Any] = {}
    for name in [base, *candidates]:
        if not isinstance(name, str):
            raise TypeError(
                f"`candidates` must hold policy names (strings). Received: {name!r} "
                f"(of type {type(name).__name__}) in candidates={candidates!r}"
            )
        try:
            policy = get_policy(name)
        except (TypeError, ValueError) as e:
            arg = "base" if name == base and name not in candidates else "candidates"
            raise ValueError(
                f"`{arg}` holds {name!r}, which is not a policy name: {e} Accepted: a float "
                "policy (the base, no quantization) or a quantized policy such as "
                f"{list(DEFAULT_CANDIDATES[1:])!r}."
            ) from e
        # A candidate is an option a layer may take: the base (a float policy, always
        # one, so naming it changes nothing) or a quantized policy.
        if name != base and _scheme(policy) is None and policy == out.get(base):
            continue
        if name != base and _scheme(policy) is None:
            raise ValueError(
                f"`candidates` holds {name!r}, a float policy: the only unquantized option "
                f"is `base` ({base!r}). Give quantized policy names (or set `base`). "
                f"Received: candidates={candidates!r}"
            )
        if name == base and _scheme(policy) is not None:
            raise ValueError(
                f"`base` must be a float policy (no quantization). Received: base={base!r}"
            )
        out.setdefault(name, policy)
    if len(out) == 1:
        raise ValueError(
            f"`candidates` holds no quantized policy: {base!r} is `base`, which every layer "
            "may keep, so there is nothing to choose. Give quantized policy names such as "
            f"{list(DEFAULT_CANDIDATES[1:])!r}. Received: candidates={candidates!r}"
        )
    return base, out


def _scheme(policy: Any) -> Any:
    return getattr(policy, "scheme", None)


def stores_weights(policy_map: DTypePolicyMap) -> bool:
    """Whether the map holds a policy whose format stores quantized kernels."""
    return any(getattr(_scheme(p), "stores_weights", False) for p in policy_map.values())


def scored_as(name: str, policy: Any) -> Any:
    """The policy a candidate is scored under: a stateful format (float8 with delayed
    scaling) by its stateless form (current scaling), its state being unknown here."""
    scheme = _scheme(policy)
    if scheme is None or not scheme.stateful:
        return policy
    stateless = scheme.stateless()
    if stateless is None:
        raise ValueError(
            f"`candidates` holds {name!r}, whose layers keep state: it cannot be scored."
        )
    return get_policy(f"{stateless.mode_text()}_from_{policy.source_name}")


def kernel_bytes(policy: Any, kernel: Any, stacked: int = 0, at: int = 0) -> int | None:
    """Bytes of ``kernel`` as served under ``policy``; ``None``: the format cannot take it.

    A float policy counts its compute dtype; a format that stores weights its quantized
    array (scales included; ``stacked`` leading axes of layers, each quantized on its
    own, starting at axis ``at``); a format that quantizes at compute time (float8) one
    byte per parameter.
    """
    scheme = _scheme(policy)
    size = int(np.prod(kernel.shape))
    if scheme is None:
        return size * np.dtype(policy.compute_dtype).itemsize
    if not scheme.stores_weights:
        return size
    try:
        shapes = jax.eval_shape(
            lambda k: scheme.quantize(
                jnp.moveaxis(k, range(at, at + stacked), range(stacked)), stacked
            ),
            kernel,
        )
    except (TypeError, ValueError):
        return None
    return int(shapes.nbytes)
