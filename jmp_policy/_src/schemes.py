"""Quantization formats as values: the :class:`Scheme` every format is, and the registry.

A quantized policy carries one scheme, a frozen keyword-only value that owns what differs
between formats: the mode its names and configs write (``"int4/128"``) and its config
fields, how a kernel is quantized and stored, the matmul a layer under it runs (the one
place that chooses among its forms, which ``explain`` records in its words,
:meth:`Scheme.describe`), and the state it needs (none for stateless formats). The policy classes, names, configs, ``quantize``,
:func:`jmp_policy._src.quantization.matmuls.pick` and both glues ask the scheme; none tests a mode's
text.

**Adding a format** is one module holding a subclass of :class:`Scheme` plus one line,
``register(MyScheme)``: its names (``"<token>_from_<source>"``) then read back, its policies
serialize and its layers run what :meth:`Scheme.matmul` returns. The built-in formats are
:mod:`jmp_policy._src.quantization.int_schemes` (int8, int4) and :mod:`jmp_policy._src.quantization.float8_scheme`.

This module imports nothing of jmp_policy: the name grammar
(:mod:`jmp_policy._src.name_grammar`) reads the registry's tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar


@dataclasses.dataclass(frozen=True, kw_only=True)
class Scheme:
    """One quantization format (a frozen, keyword-only value; compares by value).

    Class attributes say what every value of the format shares; methods with defaults give
    a stateless format that stores weights and changes no matmul.
    """

    #: What ``policy.quantization_mode`` reports, and the registry's default token.
    mode: ClassVar[str] = ""
    #: The tokens a name's mode starts with (``"int4"`` in ``"int4/128_from_float32"``).
    tokens: ClassVar[tuple[str, ...]] = ()
    #: The modes as error messages list them (``"'int4/<block>'"``).
    grammar: ClassVar[tuple[str, ...]] = ()
    #: The policy class its names build (a class of :mod:`jmp_policy._src.quantized_policy`).
    policy_class: ClassVar[str] = "QuantizedDTypePolicy"
    #: Whether ``quantize`` stores its kernels as ``QuantizedArray``s.
    stores_weights: ClassVar[bool] = True
    #: Whether a layer under it reads a stored ``QuantizedArray`` kernel whole (not
    #: dequantized first by ``cast_to_compute``).
    reads_stored_kernels: ClassVar[bool] = True
    #: Whether its compute exists only in the layers whose matmul the glue routes (a plain
    #: function wrapped by ``cast_apply`` runs in the source policy's dtypes: it warns).
    needs_routed_layers: ClassVar[bool] = False
    #: The kind of per-layer state its layers may hold (the glue's attribute and variable
    #: names start with it), or ``None``: its layers hold none.
    state_kind: ClassVar[str | None] = None

    @classmethod
    def parse(cls, text: str) -> Scheme | None:
        """The scheme of a mode as a name or config writes it, ``None`` when the text is
        not this format's; ``ValueError`` for this format's mode with a bad setting."""
        return cls() if text == cls.mode else None

    def mode_text(self, given: str | None = None) -> str:
        """The mode as names write it; ``given`` is the spelling the user wrote."""
        return self.mode

    def describe(self, kernel: Any) -> str:
        """What ``explain`` calls the weights of a layer under this format that reads the
        stored ``kernel`` (``"<this> weights: weight-only, scale after"``): by default the
        format's mode as names write it (``"int6"``), whatever dtype stores its values."""
        return self.mode_text()

    def config_mode(self, text: str) -> str:
        """The mode a config writes for a policy named with ``text``."""
        return text

    def config_fields(self) -> dict[str, Any]:
        """Config fields beyond ``mode`` and ``source_name``."""
        return {}

    def policy_class_for(self, text: str) -> str:
        """The class (this library's and Keras's) of a policy whose mode is ``text``."""
        return self.policy_class

    def check_source(self, compute: Any, text: str, source_name: str) -> None:
        """Raises ``ValueError`` for a source compute dtype the format does not take."""

    @property
    def block_size(self) -> int | None:
        """Rows per block of a blocked format (-1: per channel); ``None`` otherwise."""
        return None

    def quantize(self, x: Any, stacked: int) -> Any:
        """One floating kernel (``stacked`` leading layer axes) stored in this format."""
        raise ValueError(f"The {self.mode!r} format stores no quantized weights.")

    def matmul(self, kind: str, *, path: str, state: Any, kernel: Any) -> Callable[..., Any] | None:
        """The matmul a layer under this format runs (a drop-in ``jax.lax.dot_general``,
        or ``jnp.einsum`` when ``kind == "einsum"``), recording its form for ``explain``;
        ``None``: the layer runs as written. ``kernel``: the layer's ``QuantizedArray``
        kernel when it reaches the layer whole; ``state``: the layer's state."""
        return None

    def init_state(self) -> Any:
        """A fresh state for one layer (one call in Linen), or ``None``: it keeps none."""
        return None

    @property
    def stateful(self) -> bool:
        """Whether its layers keep state (``init_state`` gives one)."""
        return False

    def stateless(self) -> Scheme | None:
        """The stateless format closest to this one (itself when stateless), or ``None``:
        what a map search scores a stateful format with."""
        return None if self.stateful else self


_REGISTRY: dict[str, type[Scheme]] = {}


def register(scheme: type[Scheme]) -> type[Scheme]:
    """Registers a format: names whose mode starts with one of ``scheme.tokens`` build it.

    Raises:
        TypeError: ``scheme`` is not a subclass of :class:`Scheme`.
        ValueError: it names no token, or a token another format holds.
    """
    if not (isinstance(scheme, type) and issubclass(scheme, Scheme)):
        raise TypeError(f"`scheme` must be a subclass of Scheme. Received: scheme={scheme!r}")
    tokens = scheme.tokens or (scheme.mode,)
    if not all(tokens):
        raise ValueError(f"`scheme` must name its tokens. Received: scheme={scheme!r}")
    for token in tokens:
        held = _REGISTRY.get(token)
        if held is not None and held is not scheme:
            raise ValueError(
                f"The token {token!r} is already the format {held.__name__}. "
                f"Received: scheme={scheme!r}"
            )
    for token in tokens:
        _REGISTRY[token] = scheme
    return scheme


def unregister(scheme: type[Scheme]) -> None:
    """Removes a format registered with :func:`register` (for tests)."""
    for token in [t for t, s in _REGISTRY.items() if s is scheme]:
        del _REGISTRY[token]


def tokens() -> tuple[str, ...]:
    """Every registered token, in registration order."""
    return tuple(_REGISTRY)


def registered() -> tuple[type[Scheme], ...]:
    """Every registered format, once each, in registration order."""
    return tuple(dict.fromkeys(_REGISTRY.values()))


def lookup(text: str) -> type[Scheme] | None:
    """The format a mode's text (``"int4/128"``) belongs to, by its token; else ``None``."""
    return _REGISTRY.get(text.partition("/")[0])


def parse_mode(mode: Any, policy_class: str = "QuantizedDTypePolicy") -> Scheme:
    """The scheme of ``mode`` as ``policy_class`` takes it.

    Raises:
        TypeError: ``mode`` is not a string.
        ValueError: no format of ``policy_class`` reads ``mode``.
    """
    if not isinstance(mode, str):
        raise TypeError(
            f"`mode` must be a string such as 'int8', 'int4' or 'int4/128'. "
            f"Received: mode={mode!r} (of type {type(mode).__name__})"
        )
    cls = lookup(mode)
    scheme = None if cls is None or cls.policy_class != policy_class else cls.parse(mode)
    if scheme is None:
        by_class: dict[str, list[str]] = {}
        for s in registered():
            by_class.setdefault(s.policy_class, []).extend(s.grammar)
        accepted = ", ".join(by_class.pop(policy_class, []))
        others = "; ".join(f"use {c} for {', '.join(g)}" for c, g in by_class.items())
        raise ValueError(
            f"Invalid quantization mode. Expected one of {accepted} ({others}). "
            f"Received: mode={mode!r}"
        )
    return scheme
