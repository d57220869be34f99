"""A config's fields against those a class's ``from_config`` reads (#30): an unknown
field is an error naming it and listing the accepted ones, never a constructor argument
passed on (or dropped) in silence."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Collection
from typing import Any

from jmp_policy._src import dtypes as dt
from jmp_policy._src.dtypes import TypeAndValueError, bounded_repr

# A float policy config's dtype fields -> the policy attribute each must agree with.
DTYPE_FIELDS = {
    "compute_dtype": "compute_dtype",
    "output_dtype": "output_dtype",
    "param_dtype": "variable_dtype",
    "variable_dtype": "variable_dtype",
}


@functools.lru_cache(maxsize=64)  # a map's config reads one per value: 100,000 signatures
def constructor_fields(cls: type) -> tuple[str, ...]:
    """The named parameters of ``cls``'s constructor (``self``, ``*args``, ``**kwargs`` aside)."""
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]  # type: ignore[misc]
    return tuple(p.name for p in params if p.kind in kinds)


def check_fields(
    config: Any, accepted: Collection[str], owner: str, example: str, ignored: Collection[str] = ()
) -> None:
    """Raises unless ``config`` is a dict whose fields are all ``accepted`` (or ``ignored``).

    A non-dict is a ``TypeError``; an unknown field a ``ValueError`` that is also a
    ``TypeError`` (what Keras's ``cls(**config)`` raises), so that either ``except`` catches it.
    """
    if not isinstance(config, dict):
        raise TypeError(
            f"`config` must be a dict such as {example}. Received: config={bounded_repr(config)}"
        )
    unknown = [k for k in config if k not in accepted and k not in ignored]
    if unknown:
        names = ", ".join(bounded_repr(k) for k in unknown[:5])
        more = f" (and {len(unknown) - 5} more)" if len(unknown) > 5 else ""
        plural = "s" if len(unknown) > 1 else ""
        raise TypeAndValueError(
            f"Unknown field{plural} {names}{more} in a {owner} `config`; accepted fields: "
            f"{', '.join(repr(a) for a in accepted)}. Received: config={bounded_repr(config)}"
        )


def constructor_kwargs(
    cls: type, config: Any, example: str, ignored: Collection[str] = ()
) -> dict[str, Any]:
    """``config``'s fields as ``cls``'s constructor arguments, once checked (a new dict)."""
    check_fields(config, constructor_fields(cls), cls.__name__, example, ignored)
    return {k: v for k, v in config.items() if k not in ignored}


def check_named_dtypes(policy: Any, fields: dict[str, Any], config: Any) -> None:
    """Raises unless each dtype field of a config agrees with ``policy``, the one its
    ``name`` names: a config's name is a policy name (what ``get_config`` and Keras
    write; Keras's ``DTypePolicy`` takes no dtype field), never jmp's variable dtype
    beside a ``compute_dtype`` (``{'name': 'float32', 'compute_dtype': 'float16'}`` is
    not ``'p=f32,c=f16'``)."""
    for field, attribute in DTYPE_FIELDS.items():
        if fields.get(field) is None:
            continue
        given, named = dt.as_dtype(fields[field], field), getattr(policy, attribute)
        if given != named:
            raise ValueError(
                f"A {type(policy).__name__} config's 'name' and {field!r} disagree: "
                f"{fields['name']!r} has {attribute} {getattr(named, 'name', None)}, the config says "
                f"{field}={fields[field]!r}. The name alone names the policy (Keras reads "
                "only it): give the name of the policy meant (a jmp string such as "
                f"'p=f32,c=f16,o=f16' names any three dtypes). Received: config={config!r}"
            )
