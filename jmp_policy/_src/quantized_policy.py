"""Quantized dtype policies: float policies that also carry a quantization scheme (int8,
int4 with its block size, float8 with its scaling, or a registered format of
:mod:`jmp_policy._src.schemes`); their dtypes come from a source policy."""

from __future__ import annotations

from typing import Any, ClassVar

from jmp_policy._src import name_grammar as names
from jmp_policy._src import quantization, schemes
from jmp_policy._src.policy import DTypePolicy, T, check_fresh, global_name
from jmp_policy._src.quantization import float8
from jmp_policy._src.quantization.float8_scheme import DEFAULT_AMAX_HISTORY_LENGTH, Float8Scheme
from jmp_policy._src.quantization.int_schemes import Int4Scheme, Int8Scheme, check_symmetric
from jmp_policy._src.quantization.quantized_array_checks import int4_block
from jmp_policy._src.tree_paths import check_depth

_DEFAULT_INT4_BLOCK = 128


class QuantizedDTypePolicy(DTypePolicy):
    """A weight-quantized policy (``int8``, ``int4`` or ``int4/<block>``).

    Compute, variable and output dtypes come from the source policy. ``int4/<block>``
    quantizes in blocks of ``<block>`` rows, ``int4`` (or ``int4/-1``, Keras's legacy
    ``int4/None``) per channel, on int4's 16 codes ``-8..7`` (``int4/<block>/narrow``: the
    15 codes ``-7..7``); ``int8/asym`` and ``int4/<block>/asym`` store a zero point
    per group. ``str`` writes the mode before jmp's short form of the
    dtypes, which :func:`get` reads back.

    Args:
        mode: ``"int8"``, ``"int4"`` or ``"int4/<block>"`` (``"/asym"`` after either: with
            zero points).
        source_name: the float policy the dtypes come from; ``None`` takes the global one.

    Raises:
        ValueError: an unknown mode, a quantized or invalid source name, or ``int8`` with
            a float16 compute dtype (it "doesn't work well", as Keras says).

    Examples:
        >>> import jmp_policy as jp
        >>> policy = jp.QuantizedDTypePolicy("int8", "mixed_bfloat16")
        >>> policy
        <QuantizedDTypePolicy "int8_from_mixed_bfloat16">
        >>> policy.quantization_mode, policy.compute_dtype
        ('int8', dtype(bfloat16))
        >>> str(policy)
        'int8_from_p=f32,c=bf16,o=bf16'
        >>> int4 = jp.QuantizedDTypePolicy("int4/128", "float32")
        >>> int4.mode, int4.block_size
        ('int4', 128)
    """

    __slots__ = ()
    _kind: ClassVar[str] = "quantized"

    def __init__(self, mode: str, source_name: str | None = None):
        # The formats registered to this class (or to the nearest registered base of a
        # subclass: a format's own policy class inherits this constructor).
        scheme = schemes.parse_mode(mode, type(self))
        self._init_quantized(scheme.mode_text(mode), scheme, source_name)

    @classmethod
    def class_for_mode(cls, scheme: schemes.Scheme, text: str) -> type[QuantizedDTypePolicy]:
        """The class a name of ``scheme`` whose mode is written ``text`` builds: this one,
        except Keras's ``Int4DTypePolicy`` for int4 names with a block (``"int4/128"``)."""
        if cls is QuantizedDTypePolicy and isinstance(scheme, Int4Scheme) and "/" in text:
            return Int4DTypePolicy
        return cls

    def _init_quantized(self, mode: str, scheme: schemes.Scheme, source_name: str | None) -> None:
        """Initialises from the mode as names write it, its scheme and the source name
        (``None``: the global policy's), parsed once."""
        check_fresh(self)
        if source_name is None:
            source_name = global_name()
        object.__setattr__(self, "_parsed", names.parse_source(mode, scheme, source_name))

    @property
    def _scheme(self) -> Any:
        return self._parsed.scheme

    @property
    def _source_name(self) -> str:  # Keras's attribute, which its users read
        return str(self._parsed.source)

    @property
    def _mode(self) -> str:
        """The mode as names write it (``"int4/128"``); ``mode`` gives the quantization
        mode alone."""
        return str(self._parsed.mode)

    def _key(self) -> tuple[Any, ...]:
        return (*super()._key(), self._scheme)

    def __str__(self) -> str:
        """``"<mode>_from_<jmp short form>"``; :func:`get` reads it back (float8's
        ``amax_history_length`` aside, which no name carries)."""
        return f"{self._mode}_from_{super().__str__()}"

    @property
    def quantization_mode(self) -> str:
        """``"int8"``, ``"int4"`` or ``"float8"`` (without a block size: see
        :attr:`block_size`); ``mode`` is Keras's name for it."""
        return self._scheme.mode

    mode = quantization_mode

    @property
    def scheme(self) -> schemes.Scheme:
        """The quantization format (a frozen value): its names, storage, matmul and state."""
        return self._scheme

    @property
    def block_size(self) -> int | None:
        """int4's block size along the input axis (-1: per channel); ``None`` otherwise."""
        return self._scheme.block_size

    @property
    def source_name(self) -> str:
        """The name of the float policy the dtypes come from."""
        return str(self._parsed.source)

    @property
    def source_policy(self) -> DTypePolicy:
        """The float policy the dtypes come from."""
        parsed = self._parsed
        return DTypePolicy._from_parsed(
            names.ParsedName(str(parsed.source), parsed.params, parsed.compute, parsed.output)
        )

    def quantize(self, tree: T, *, stacked_axes: Any = None) -> T:
        """Every floating leaf of rank >= 2 of ``tree`` as a :class:`~jmp_policy.QuantizedArray`.

        Symmetric abs-max: int8 with one scale per index of the last axis; int4 in blocks of
        :attr:`block_size` rows along axis 0 (``-1``: per channel), stored as ``jnp.int4``.
        Other leaves, and leaves already quantized, are returned as they are. Works under ``jit``.

        Args:
            tree: a pytree of parameters.
            stacked_axes: how many leading axes of a kernel stack layers (``nn.scan``,
                ``nnx.scan``: ``[depth, in, out]``), each layer then quantized on its own:
                ``None`` (none), an int for every leaf, or a mapping from path regular
                expression (``"layers/.*"``, the first key that fully matches a leaf's
                ``"/"``-joined path wins, no match is 0) to an int. A leaf whose layers are
                of rank < 2 (a stacked bias) stays float.

        Raises:
            ValueError: a float8 policy (it stores no quantized weights), or a
                ``stacked_axes`` count that is not a non-negative int.
            TypeError: ``stacked_axes`` is not None, an int or a mapping of strings.

        Examples:
            >>> import jax.numpy as jnp
            >>> import jmp_policy as jp
            >>> params = {"kernel": jnp.ones((256, 8)), "bias": jnp.zeros(8)}
            >>> q = jp.get("int4/128_from_float32").quantize(params)
            >>> q["kernel"]
            QuantizedArray(int4/128, shape=(256, 8), original_dtype=float32)
            >>> q["kernel"].values.dtype, q["kernel"].scale.shape
            (dtype(int4), (2, 8))
            >>> stack = {"layers": {"kernel": jnp.ones((4, 256, 8)), "bias": jnp.ones((4, 8))}}
            >>> q = jp.get("int4/128_from_float32").quantize(stack, stacked_axes={"layers/.*": 1})
            >>> q["layers"]["kernel"].scale.shape, q["layers"]["bias"].dtype   # per layer
            ((4, 2, 8), dtype('float32'))
        """
        if not self._scheme.stores_weights:
            raise ValueError(
                f"Policy {self.name!r} does not store quantized weights: float8 scales "
                "inputs and kernels at compute time. Only int8 and int4 policies quantize."
            )
        check_depth(tree)
        return quantization.quantize_tree(tree, self._scheme.quantize, stacked_axes)  # type: ignore[no-any-return]

    def _rebuild_from(self, source: DTypePolicy) -> QuantizedDTypePolicy:
        # The format's registered class (a registered format's own class stays itself).
        cls: type[QuantizedDTypePolicy] = schemes.class_of(type(self._scheme))
        return cls._from_parsed(names.parse_source(self._mode, self._scheme, source.name))

    def _with(self, variable: Any, compute: Any, output: Any) -> QuantizedDTypePolicy:  # type: ignore[override]
        return self._rebuild_from(self.source_policy._with(variable, compute, output))

    def get_config(self) -> dict[str, Any]:
        mode = self._scheme.config_mode(self._mode)
        return {"mode": mode, "source_name": self.source_name, **self._scheme.config_fields()}


class Int4DTypePolicy(QuantizedDTypePolicy):
    """Keras's int4 class: ``mode == "int4"`` and a separate ``block_size``.

    Equal to ``QuantizedDTypePolicy("int4/<block>", source_name)``; :func:`get` returns
    this class for ``"int4/<block>_from_<source>"`` names, as Keras does.

    Args:
        mode: ``"int4"`` (or Keras 3's ``"int4/<block>"``, whose block is used).
        source_name: the float policy the dtypes come from; ``None`` takes the global one.
        block_size: rows per block along the input axis; ``-1`` (or ``None``) per channel.
        symmetric: Keras's key: ``False``, a zero point per group on all 16 codes (names
            ``"int4/<block>/asym"``); ``None``: as ``mode`` says (configs write it if False).

    Raises:
        TypeError: ``block_size`` is not an ``int`` (bools included) or ``None``;
            ``symmetric`` no bool.
        ValueError: another mode, a ``block_size`` of 0 or below -1, a ``block_size`` that
            contradicts the block in ``mode``, or a bad source name.

    Examples:
        >>> import jmp_policy as jp
        >>> policy = jp.Int4DTypePolicy("int4", "mixed_bfloat16", block_size=64)
        >>> policy
        <Int4DTypePolicy "int4/64_from_mixed_bfloat16">
        >>> policy.mode, policy.block_size
        ('int4', 64)
        >>> policy == jp.QuantizedDTypePolicy("int4/64", "mixed_bfloat16")
        True
        >>> type(jp.get("int4/128_from_float32")).__name__
        'Int4DTypePolicy'
    """

    __slots__ = ()

    def __init__(
        self,
        mode: str = "int4",
        source_name: str | None = None,
        block_size: int | None = _DEFAULT_INT4_BLOCK,
        symmetric: bool | None = None,
    ):
        given = schemes.parse_mode(mode, QuantizedDTypePolicy)
        if not isinstance(given, Int4Scheme):
            raise ValueError(
                "Invalid mode for Int4DTypePolicy. Expected 'int4' or 'int4/<block_size>' "
                f"(use QuantizedDTypePolicy for other modes). Received: mode={mode!r}"
            )
        if block_size is not None and (
            isinstance(block_size, bool) or not isinstance(block_size, int)
        ):
            raise TypeError(
                "`block_size` must be an integer (-1 or None: per channel). "
                f"Received: block_size={block_size!r} (of type {type(block_size).__name__})"
            )
        block = int4_block(block_size)
        if "/" in mode:
            # Keras 3's block in `mode` wins over the default, never over another explicit one.
            if block_size != _DEFAULT_INT4_BLOCK and block != given.block_size:
                raise ValueError(
                    f"`block_size` contradicts the block in `mode`. "
                    f"Received: block_size={block_size!r}, mode={mode!r}"
                )
            block = given.block_size
        if symmetric is None:
            symmetric = given.symmetric
        elif check_symmetric(symmetric) != given.symmetric and not given.symmetric:
            raise ValueError(
                "`symmetric` contradicts `mode`, whose groups have zero points. "
                f"Received: symmetric={symmetric!r}, mode={mode!r}"
            )
        full = given.full_range  # narrow with symmetric=False: Int4Scheme says both cannot be
        scheme = Int4Scheme(block_size=block, symmetric=bool(symmetric), full_range=full)
        self._init_quantized(scheme.mode_text(), scheme, source_name)

    def _rebuild_from(self, source: DTypePolicy) -> Int4DTypePolicy:
        scheme = self._scheme
        mode = "int4" if scheme.full_range else scheme.mode_text()
        return Int4DTypePolicy(mode, source.name, scheme.block_size, scheme.symmetric)

    @property
    def symmetric(self) -> bool:
        """Keras's ``symmetric``: ``False`` where each group has a zero point."""
        return self._scheme.symmetric  # type: ignore[no-any-return]

    def get_config(self) -> dict[str, Any]:
        """Keras's ``mode`` and ``source_name``; ``"symmetric": False`` with zero points."""
        if self._scheme.symmetric:
            return super().get_config()
        mode = f"int4/{self._scheme.block_size}"
        return {"mode": mode, "source_name": self.source_name, "symmetric": False}


class QuantizedFloat8DTypePolicy(QuantizedDTypePolicy):
    """A float8 policy (e4m3 forward, e5m2 for gradients), with delayed or current scaling.

    Delayed scaling (the default, as in Keras and Flax) scales a tensor by ``fp8_max`` over
    the largest amax of the last ``amax_history_length`` steps, kept as state (made by
    ``jmp_policy.linen.init`` / ``jmp_policy.nnx.init_float8``); current scaling
    (``"float8_current_from_…"``) by its own amax in the step, with no state (see README).

    Args:
        mode: ``"float8"`` (or ``"float8_current"``, the same as ``scaling="current"``).
        source_name: the float policy the dtypes come from; ``None`` takes the global one.
        amax_history_length: the amax history's length, a positive ``int`` (delayed scaling;
            a NumPy integer is kept as an ``int``).
        scaling: ``"delayed"``, ``"current"`` or ``None`` (as ``mode`` says).

    Raises:
        TypeError: ``amax_history_length`` is not an integer (bools and floats included).
        ValueError: another mode or scaling, a bad source name, or a length not in 1..65536.

    Examples:
        >>> import jmp_policy as jp
        >>> policy = jp.QuantizedFloat8DTypePolicy("float8", "mixed_bfloat16", 16)
        >>> policy.amax_history_length, policy.scaling
        (16, 'delayed')
        >>> current = jp.get("float8_current_from_mixed_bfloat16")
        >>> current.scaling, current.quantization_mode
        ('current', 'float8')
        >>> current == jp.QuantizedFloat8DTypePolicy("float8", "mixed_bfloat16", scaling="current")
        True
    """

    __slots__ = ()
    _kind: ClassVar[str] = "float8"
    default_amax_history_length: ClassVar[int] = DEFAULT_AMAX_HISTORY_LENGTH

    def __init__(
        self,
        mode: str = "float8",
        source_name: str | None = None,
        amax_history_length: int = DEFAULT_AMAX_HISTORY_LENGTH,
        scaling: str | None = None,
    ):
        if mode not in ("float8", "float8_current"):
            raise ValueError(
                "Invalid quantization mode. Expected 'float8' (or 'float8_current') for "
                "QuantizedFloat8DTypePolicy (use QuantizedDTypePolicy for 'int8' and "
                f"'int4'). Received: mode={mode!r}"
            )
        scaling = float8.scaling_of(mode, scaling)  # a contradiction is an error
        scheme = Float8Scheme(scaling=scaling, amax_history_length=amax_history_length)
        self._init_quantized(scheme.mode_text(), scheme, source_name)

    @property
    def amax_history_length(self) -> int:
        """The length of the amax history window used to compute scales (delayed scaling)."""
        return self._scheme.amax_history_length

    @property
    def scaling(self) -> str:
        """``"delayed"`` (scales from an amax history kept as state) or ``"current"``."""
        return self._scheme.scaling

    def _rebuild_from(self, source: DTypePolicy) -> QuantizedFloat8DTypePolicy:
        length, scaling = self._scheme.amax_history_length, self._scheme.scaling
        return QuantizedFloat8DTypePolicy("float8", source.name, length, scaling)


schemes.set_default_policy_class(QuantizedDTypePolicy)
schemes.register(Int8Scheme, QuantizedDTypePolicy)
schemes.register(Int4Scheme, QuantizedDTypePolicy, also=(Int4DTypePolicy,))
schemes.register(Float8Scheme, QuantizedFloat8DTypePolicy)
