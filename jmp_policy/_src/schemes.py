"""Quantization formats as values: the :class:`Scheme` every format is, and the registry.

A quantized policy carries one scheme, a frozen keyword-only value that owns what differs
between formats: the mode its names and configs write (``"int4/128"``) and its config
fields, how a kernel is quantized and stored, the matmul a layer under it runs (the one
place that chooses among its forms, which ``explain`` records in its words,
:meth:`Scheme.describe`), and the state it needs (none for stateless formats). The policy classes, names, configs, ``quantize``,
:func:`jmp_policy._src.quantization.matmuls.pick` and both glues ask the scheme; none tests a mode's
text.

**Adding a format** is one module holding a subclass of :class:`Scheme`, its policy class if
it needs one, and one call, ``register(MyScheme, MyPolicy)``: its names
(``"<token>_from_<source>"``) then read back, its policies serialize and its layers run what
:meth:`Scheme.matmul` returns. The registry is one dict keyed by the scheme class; it holds
the policy class, so names, ``get``, configs and ``deserialize`` read it and nothing else.
The built-in formats are registered where their policy classes are defined
(:mod:`jmp_policy._src.quantized_policy`, :mod:`jmp_policy._src.calibrated_policy`).

This module imports nothing of jmp_policy: the name grammar
(:mod:`jmp_policy._src.name_grammar`) reads the registry's tokens and asks to be told of a
change (:func:`on_change`), so that ``register`` clears its cache of parsed names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar


@dataclasses.dataclass(frozen=True, kw_only=True)
class Scheme:
    """One quantization format (a frozen, keyword-only value; compares by value).

    Class attributes say what every value of the format shares; methods with defaults give
    a stateless format that stores weights and changes no matmul. A format is a subclass
    (a frozen, keyword-only dataclass) and one :func:`~jmp_policy.register` call; see
    ``docs/quantization.md``, "Define your own format".

    Examples:
        >>> import dataclasses
        >>> import jax.numpy as jnp
        >>> import jmp_policy as jp
        >>> @dataclasses.dataclass(frozen=True, kw_only=True)
        ... class Int8Copy(jp.Scheme):
        ...     mode = "int8copy"
        ...     def quantize(self, x, stacked):  # int8 storage, a scale per channel
        ...         return jp.get("int8_from_float32").scheme.quantize(x, stacked)
        >>> _ = jp.register(Int8Copy)
        >>> policy = jp.get("int8copy_from_float32")
        >>> policy.quantization_mode, policy.scheme
        ('int8copy', Int8Copy())
        >>> policy.quantize({"kernel": jnp.ones((4, 2))})["kernel"]
        QuantizedArray(int8, shape=(4, 2), original_dtype=float32)
        >>> jp.unregister(Int8Copy)
    """

    #: What ``policy.quantization_mode`` reports, and the registry's default token.
    mode: ClassVar[str] = ""
    #: The tokens a name's mode starts with (``"int4"`` in ``"int4/128_from_float32"``).
    tokens: ClassVar[tuple[str, ...]] = ()
    #: The modes as error messages list them (``"'int4/<block>'"``).
    grammar: ClassVar[tuple[str, ...]] = ()
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


# The registry: every format by its scheme class, with the policy class its names build
# (``None``: the default quantized class) and the classes that also build it (Keras's
# int4 class). Names reach a format through its tokens, read off this one dict.
_FORMATS: dict[type[Scheme], tuple[type | None, tuple[type, ...]]] = {}
# What a change of the registry must reset (the name grammar's parse cache).
_ON_CHANGE: list[Callable[[], None]] = []
# The class of a format registered without one (``QuantizedDTypePolicy``, set where it is
# defined: this module imports no policy).
_DEFAULT_CLASS: list[type] = []


def set_default_policy_class(cls: type) -> None:
    """The class a format registered without a policy class builds."""
    _DEFAULT_CLASS[:] = [cls]


def on_change(callback: Callable[[], None]) -> None:
    """Calls ``callback`` after every :func:`register` and :func:`unregister`."""
    _ON_CHANGE.append(callback)


def _changed() -> None:
    for callback in _ON_CHANGE:
        callback()


def _tokens_of(scheme: type[Scheme]) -> tuple[str, ...]:
    return scheme.tokens or (scheme.mode,)


def register(
    scheme: type[Scheme], policy_class: type | None = None, *, also: tuple[type, ...] = ()
) -> type[Scheme]:
    """Registers a quantization format: its scheme class and the policy class its names build.

    Names whose mode starts with one of ``scheme.tokens`` (or ``scheme.mode``) then build
    ``policy_class`` (``"<mode>_from_<source>"``, in ``get``, maps and configs),
    :func:`~jmp_policy.deserialize` reads that class's configs without ``custom_objects``,
    and the cache of parsed names is cleared. Registering the same pair again does nothing.

    Args:
        scheme: a subclass of :class:`Scheme` (a frozen keyword-only dataclass).
        policy_class: the policy class its names build, a subclass of
            :class:`~jmp_policy.QuantizedDTypePolicy` whose constructor reads the format's
            modes; ``None``: ``QuantizedDTypePolicy`` itself.
        also: further policy classes that build the format (the library's use: Keras's
            ``Int4DTypePolicy`` beside ``QuantizedDTypePolicy``).

    Returns:
        ``scheme``.

    Raises:
        TypeError: ``scheme`` is not a subclass of :class:`Scheme`, or ``policy_class`` no
            class.
        ValueError: it names no token, or a token another format holds.

    Examples:
        >>> import dataclasses
        >>> import jmp_policy as jp
        >>> @dataclasses.dataclass(frozen=True, kw_only=True)
        ... class Int8Twin(jp.Scheme):
        ...     mode = "int8twin"
        >>> _ = jp.register(Int8Twin)
        >>> jp.get("int8twin_from_mixed_bfloat16").quantization_mode
        'int8twin'
        >>> jp.unregister(Int8Twin)
    """
    if not (isinstance(scheme, type) and issubclass(scheme, Scheme)):
        raise TypeError(f"`scheme` must be a subclass of Scheme. Received: scheme={scheme!r}")
    base = _DEFAULT_CLASS[0] if _DEFAULT_CLASS else object
    for cls in (policy_class, *also):
        if cls is not None and not (isinstance(cls, type) and issubclass(cls, base)):
            raise TypeError(
                "`policy_class` must be a policy class (a subclass of QuantizedDTypePolicy) "
                f"or None. Received: policy_class={cls!r}"
            )
    tokens = _tokens_of(scheme)
    if not all(tokens):
        raise ValueError(f"`scheme` must name its tokens. Received: scheme={scheme!r}")
    for token in tokens:
        held = lookup(token)
        if held is not None and held is not scheme:
            raise ValueError(
                f"The token {token!r} is already the format {held.__name__}. "
                f"Received: scheme={scheme!r}"
            )
    _FORMATS[scheme] = (policy_class, tuple(also))
    _changed()
    return scheme


def unregister(scheme: type[Scheme]) -> None:
    """Removes a format :func:`register` added (its names no longer read; a test's cleanup).

    Examples:
        >>> import dataclasses
        >>> import jmp_policy as jp
        >>> @dataclasses.dataclass(frozen=True, kw_only=True)
        ... class Gone(jp.Scheme):
        ...     mode = "gone"
        >>> _ = jp.register(Gone)
        >>> jp.unregister(Gone)
        >>> jp.get("gone_from_float32")
        Traceback (most recent call last):
        ...
        ValueError: Cannot convert value gone_from_float32 to a mixed precision Policy. ...
    """
    if _FORMATS.pop(scheme, None) is not None:
        _changed()


def tokens() -> tuple[str, ...]:
    """Every registered token, in registration order."""
    return tuple(token for scheme in _FORMATS for token in _tokens_of(scheme))


def registered() -> tuple[type[Scheme], ...]:
    """Every registered format, once each, in registration order."""
    return tuple(_FORMATS)


def lookup(text: str) -> type[Scheme] | None:
    """The format a mode's text (``"int4/128"``) belongs to, by its token; else ``None``."""
    token = text.partition("/")[0]
    return next((s for s in _FORMATS if token in _tokens_of(s)), None)


def class_of(scheme: type[Scheme]) -> type:
    """The policy class the names of a registered format build (its constructor reads the
    format's modes).

    Raises:
        ValueError: ``scheme`` is not registered.
    """
    if scheme not in _FORMATS:
        raise ValueError(
            f"The format {scheme.__name__} is not registered: call "
            f"`jmp_policy.register({scheme.__name__}, YourPolicyClass)` first."
        )
    cls = _FORMATS[scheme][0]
    return cls if cls is not None else _DEFAULT_CLASS[0]


def class_for(scheme: Scheme, text: str) -> type:
    """The class a name of ``scheme`` whose mode is written ``text`` builds: the registered
    class, or the one its ``class_for_mode`` picks (Keras's int4 names with a block build
    its ``Int4DTypePolicy``)."""
    cls = class_of(type(scheme))
    pick = getattr(cls, "class_for_mode", None)
    return cls if pick is None else pick(scheme, text)  # type: ignore[no-any-return]


def policy_classes() -> tuple[type, ...]:
    """Every class that builds a registered format (each once, in registration order)."""
    found = [class_of(s) for s in _FORMATS]
    found += [cls for _, also in _FORMATS.values() for cls in also]
    return tuple(dict.fromkeys(found))


def owner(cls: type) -> type:
    """The registered policy class whose constructor ``cls`` inherits (itself, or the nearest
    registered base: a user's plain subclass of ``QuantizedDTypePolicy`` reads its modes)."""
    primary = {class_of(s) for s in _FORMATS}
    return next((c for c in cls.__mro__ if c in primary), cls)


def parse_mode(mode: Any, policy_class: type | None = None) -> Scheme:
    """The scheme of ``mode`` as the constructor of ``policy_class`` (``None``: the default
    quantized class) takes it: a format whose registered class is ``policy_class``'s
    (:func:`owner`).

    Raises:
        TypeError: ``mode`` is not a string.
        ValueError: no format of ``policy_class`` reads ``mode``.
    """
    if not isinstance(mode, str):
        raise TypeError(
            f"`mode` must be a string such as 'int8', 'int4' or 'int4/128'. "
            f"Received: mode={mode!r} (of type {type(mode).__name__})"
        )
    wanted = owner(policy_class or _DEFAULT_CLASS[0])
    cls = lookup(mode)
    scheme = None if cls is None or class_of(cls) is not wanted else cls.parse(mode)
    if scheme is None:
        by_class: dict[str, list[str]] = {}
        for s in registered():
            by_class.setdefault(class_of(s).__name__, []).extend(s.grammar or (repr(s.mode),))
        accepted = ", ".join(by_class.pop(wanted.__name__, []))
        others = "; ".join(f"use {c} for {', '.join(g)}" for c, g in by_class.items())
        raise ValueError(
            f"Invalid quantization mode. Expected one of {accepted} ({others}). "
            f"Received: mode={mode!r}"
        )
    return scheme
