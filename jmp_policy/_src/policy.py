"""Dtype policies: frozen values that say which dtype parameters, computations and
outputs use, and cast whole pytrees accordingly."""

from __future__ import annotations

from typing import Any, ClassVar, TypeVar

import numpy as np
from jax.typing import DTypeLike

from jmp_policy._src import casting
from jmp_policy._src import dtypes as dt

T = TypeVar("T")


def _global_name() -> str:
    # Imported here: the global state holds policies, so it imports this module.
    from jmp_policy._src.global_state import dtype_policy

    policy = dtype_policy()
    return policy.source_name if isinstance(policy, QuantizedDTypePolicy) else policy.name


class DTypePolicy:
    """A float dtype policy: the dtypes of variables, of computation and of outputs.

    Accepts every name of Keras (``"float32"``, ``"mixed_bfloat16"``), jmp
    (``"p=f32,c=bf16,o=f32"``) and any numpy dtype name. Policies are immutable, compare
    and hash by value (so they can be ``jax.jit`` static arguments and dict keys),
    pickle and deep-copy. Two policies are equal when their kinds and their three dtypes
    are equal, whatever their names.

    jmp's constructor works too: ``DTypePolicy(param_dtype, compute_dtype, output_dtype)``
    (or the keywords ``param_dtype=``/``variable_dtype=``, ``compute_dtype=``,
    ``output_dtype=``), with jmp's defaults for what is left out.

    Args:
        name: the policy name; ``None`` takes the current global policy's name. With
            ``compute_dtype`` or ``output_dtype`` given, the variable dtype (jmp's form).
        compute_dtype: jmp's form: the compute dtype.
        output_dtype: jmp's form: the output dtype.
        param_dtype: jmp's form, by keyword: the variable dtype (alias ``variable_dtype``).
        variable_dtype: alias of ``param_dtype``.

    Raises:
        TypeError: ``name`` is not a string (or a dtype is not a numeric dtype).
        ValueError: ``name`` cannot be parsed (the message lists the accepted forms).

    Examples:
        >>> import jax.numpy as jnp
        >>> import jmp_policy as jp
        >>> policy = jp.DTypePolicy("mixed_bfloat16")
        >>> policy
        <DTypePolicy "mixed_bfloat16">
        >>> policy.compute_dtype, policy.variable_dtype, policy.output_dtype
        (dtype(bfloat16), dtype('float32'), dtype(bfloat16))
        >>> str(policy)
        'p=f32,c=bf16,o=bf16'
        >>> policy == jp.get_policy("p=f32,c=bf16,o=bf16")
        True
        >>> params = {"w": jnp.ones((2, 2)), "step": jnp.array(3)}
        >>> jp.DTypePolicy("bfloat16").cast_to_compute(params)["w"].dtype
        dtype(bfloat16)
        >>> jp.Policy(jnp.float32, jnp.bfloat16, jnp.float32)   # jmp's constructor
        <Policy "p=f32,c=bf16,o=f32">
    """

    __slots__ = ("_compute_dtype", "_name", "_output_dtype", "_variable_dtype")
    _kind: ClassVar[str] = "float"

    _name: str
    _variable_dtype: np.dtype
    _compute_dtype: np.dtype
    _output_dtype: np.dtype

    def __init__(
        self,
        name: str | None = None,
        compute_dtype: DTypeLike | None = None,
        output_dtype: DTypeLike | None = None,
        *,
        param_dtype: DTypeLike | None = None,
        variable_dtype: DTypeLike | None = None,
    ):
        if (compute_dtype, output_dtype, param_dtype, variable_dtype) != (None,) * 4:
            self._init_from_dtypes(name, compute_dtype, output_dtype, param_dtype, variable_dtype)
            return
        if name is None:
            name = _global_name()
        parsed = dt.parse_float_name(name)
        self._init(name.strip(), parsed.params, parsed.compute, parsed.output)

    def _init_from_dtypes(
        self, first: Any, compute: Any, output: Any, param: Any, variable: Any
    ) -> None:
        # jmp's constructor: Policy(param_dtype, compute_dtype, output_dtype), with jmp's
        # defaults for what is left out (params float32, compute follows params, output
        # follows compute).
        given = [
            (n, v)
            for n, v in (("name", first), ("param_dtype", param), ("variable_dtype", variable))
            if v is not None
        ]
        if len(given) > 1:
            raise TypeError(
                f"Give the variable dtype once: as the first argument (jmp's "
                f"`Policy(param_dtype, compute_dtype, output_dtype)`), `param_dtype=` or "
                f"`variable_dtype=`. Received: {', '.join(f'{n}={v!r}' for n, v in given)}"
            )
        params = _as_dtype(given[0][1], given[0][0]) if given else dt.canonicalize_dtype("float32")
        compute_ = params if compute is None else _as_dtype(compute, "compute_dtype")
        output_ = compute_ if output is None else _as_dtype(output, "output_dtype")
        self._init(dt.float_policy_name(params, compute_, output_), params, compute_, output_)

    def _init(self, name: str, variable: np.dtype, compute: np.dtype, output: np.dtype) -> None:
        if hasattr(self, "_name"):
            raise AttributeError(
                f"{type(self).__name__} is immutable; it cannot be re-initialized."
            )
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_variable_dtype", variable)
        object.__setattr__(self, "_compute_dtype", compute)
        object.__setattr__(self, "_output_dtype", output)

    # -- immutability and value semantics -------------------------------------------------

    def __setattr__(self, key: str, value: Any) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable; use with_*_dtype to derive one.")

    def __delattr__(self, key: str) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable.")

    def _key(self) -> tuple[Any, ...]:
        return (self._kind, self._variable_dtype, self._compute_dtype, self._output_dtype)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DTypePolicy):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self.get_config()))

    def __copy__(self) -> DTypePolicy:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> DTypePolicy:
        return self

    def __repr__(self) -> str:
        return f'<{type(self).__name__} "{self._name}">'

    def __str__(self) -> str:
        return (
            f"p={dt.short_name(self._variable_dtype)},"
            f"c={dt.short_name(self._compute_dtype)},"
            f"o={dt.short_name(self._output_dtype)}"
        )

    # -- properties -----------------------------------------------------------------------

    @property
    def name(self) -> str:
        """The policy's name, as given (or canonical, for derived policies)."""
        return self._name

    @property
    def compute_dtype(self) -> np.dtype:
        """The dtype computations run in."""
        return self._compute_dtype

    @property
    def variable_dtype(self) -> np.dtype:
        """The dtype variables (parameters) are stored in."""
        return self._variable_dtype

    @property
    def param_dtype(self) -> np.dtype:
        """jmp's and Flax's name for :attr:`variable_dtype`."""
        return self._variable_dtype

    @property
    def output_dtype(self) -> np.dtype:
        """The dtype outputs are returned in."""
        return self._output_dtype

    @property
    def quantization_mode(self) -> str | None:
        """``None`` for float policies; ``"int8"``, ``"int4"`` or ``"float8"`` otherwise."""
        return None

    # -- casting --------------------------------------------------------------------------

    def cast_to_compute(self, tree: T) -> T:
        """Casts every floating array leaf of ``tree`` to :attr:`compute_dtype`."""
        return casting.cast_tree(tree, self._compute_dtype)

    def cast_to_variable(self, tree: T) -> T:
        """Casts every floating array leaf of ``tree`` to :attr:`variable_dtype`."""
        return casting.cast_tree(tree, self._variable_dtype)

    cast_to_param = cast_to_variable

    def cast_to_output(self, tree: T) -> T:
        """Casts every floating array leaf of ``tree`` to :attr:`output_dtype`."""
        return casting.cast_tree(tree, self._output_dtype)

    # -- derivation -----------------------------------------------------------------------

    def _with(self, variable: Any, compute: Any, output: Any) -> DTypePolicy:
        v, c, o = (_as_dtype(d) for d in (variable, compute, output))
        return DTypePolicy(dt.float_policy_name(v, c, o))

    def with_compute_dtype(self, dtype: DTypeLike) -> DTypePolicy:
        """A policy like this one with another compute dtype."""
        return self._with(self._variable_dtype, dtype, self._output_dtype)

    def with_variable_dtype(self, dtype: DTypeLike) -> DTypePolicy:
        """A policy like this one with another variable dtype."""
        return self._with(dtype, self._compute_dtype, self._output_dtype)

    with_param_dtype = with_variable_dtype

    def with_output_dtype(self, dtype: DTypeLike) -> DTypePolicy:
        """A policy like this one with another output dtype."""
        return self._with(self._variable_dtype, self._compute_dtype, dtype)

    # -- config ---------------------------------------------------------------------------

    def get_config(self) -> dict[str, Any]:
        """A JSON-ready dict that :meth:`from_config` reads back."""
        return {"name": self._name}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> DTypePolicy:
        """Builds a policy from :meth:`get_config`'s dict (the dict is not modified).

        A tf.keras experimental config's ``loss_scale`` field is ignored, as tf.keras did.
        """
        if not isinstance(config, dict):
            raise TypeError(
                f"`config` must be a dict such as {{'name': 'mixed_bfloat16'}}. "
                f"Received: config={config!r}"
            )
        kwargs = {k: v for k, v in config.items() if k != "loss_scale"}
        try:
            return cls(**kwargs)
        except TypeError as e:
            if "argument" not in str(e):
                raise
            raise TypeError(
                f"`config` does not fit {cls.__name__}: {e}. Received: config={config!r}"
            ) from e


class FloatDTypePolicy(DTypePolicy):
    """Keras's second name for :class:`DTypePolicy` (the same kind: equal to it by value).

    Examples:
        >>> import jmp_policy as jp
        >>> jp.FloatDTypePolicy("mixed_float16") == jp.DTypePolicy("mixed_float16")
        True
    """

    __slots__ = ()


class Policy(DTypePolicy):
    """tf.keras's name for :class:`DTypePolicy` (the same kind: equal to it by value).

    Examples:
        >>> import jmp_policy as jp
        >>> jp.Policy("mixed_float16").compute_dtype
        dtype('float16')
    """

    __slots__ = ()


class QuantizedDTypePolicy(DTypePolicy):
    """A weight-quantized policy (``int8``, ``int4`` or ``int4/<block>``).

    Compute, variable and output dtypes come from the source policy. ``int4/<block>``
    quantizes in blocks of ``<block>`` rows; ``int4`` (like ``int4/-1``) per channel.

    Args:
        mode: ``"int8"``, ``"int4"`` or ``"int4/<block>"``.
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
        >>> jp.get("int4/128_from_float32").block_size
        128
    """

    __slots__ = ("_block_size", "_mode", "_quantization_mode", "_source_name")
    _kind: ClassVar[str] = "quantized"

    _mode: str
    _quantization_mode: str
    _block_size: int | None
    _source_name: str

    def __init__(self, mode: str, source_name: str | None = None):
        base, block = dt.parse_int_mode(mode)
        self._init_quantized(mode, base, block, source_name)

    def _init_quantized(
        self, mode: str, base: str, block: int | None, source_name: str | None
    ) -> None:
        if source_name is None:
            source_name = _global_name()
        dt.check_name_type(source_name, "source_name")
        if dt.split_quantized_name(source_name) is not None:
            raise ValueError(
                f"Cannot convert {source_name!r} to a float source policy: `source_name` "
                f"must be a float policy name, not a quantized one. "
                f"Received: source_name={source_name!r}"
            )
        parsed = dt.parse_float_name(source_name)
        if base == "int8" and parsed.compute == np.float16:
            raise ValueError(
                f"Quantization mode='{mode}' doesn't work well with compute_dtype='float16'. "
                "Use a bfloat16 or float32 source policy, such as 'mixed_bfloat16'. "
                f"Received: source_name={source_name!r}"
            )
        if not dt.is_floating(parsed.compute):
            raise ValueError(
                f"A quantized policy needs a floating compute dtype. "
                f"Received: source_name={source_name!r}"
            )
        source_name = source_name.strip()
        self._init(f"{mode}_from_{source_name}", parsed.params, parsed.compute, parsed.output)
        object.__setattr__(self, "_mode", mode)
        object.__setattr__(self, "_quantization_mode", base)
        object.__setattr__(self, "_block_size", block)
        object.__setattr__(self, "_source_name", source_name)

    def _key(self) -> tuple[Any, ...]:
        return (*super()._key(), self._quantization_mode, self._block_size)

    @property
    def quantization_mode(self) -> str:
        """``"int8"``, ``"int4"`` or ``"float8"`` (without a block size)."""
        return self._quantization_mode

    @property
    def mode(self) -> str:
        """The mode as given, block size included (``"int4/128"``)."""
        return self._mode

    @property
    def block_size(self) -> int | None:
        """int4's block size along the input axis (-1: per channel); ``None`` otherwise."""
        return self._block_size

    @property
    def source_name(self) -> str:
        """The name of the float policy the dtypes come from."""
        return self._source_name

    @property
    def source_policy(self) -> DTypePolicy:
        """The float policy the dtypes come from."""
        return DTypePolicy(self._source_name)

    def _rebuild_from(self, source: DTypePolicy) -> QuantizedDTypePolicy:
        return QuantizedDTypePolicy(self._mode, source.name)

    def _with(self, variable: Any, compute: Any, output: Any) -> QuantizedDTypePolicy:  # type: ignore[override]
        return self._rebuild_from(self.source_policy._with(variable, compute, output))

    def get_config(self) -> dict[str, Any]:
        return {"mode": self._mode, "source_name": self._source_name}


class QuantizedFloat8DTypePolicy(QuantizedDTypePolicy):
    """A float8 policy with delayed scaling (e4m3 forward, e5m2 for gradients).

    Args:
        mode: ``"float8"``.
        source_name: the float policy the dtypes come from; ``None`` takes the global one.
        amax_history_length: length of the amax history window, a positive ``int``.

    Raises:
        TypeError: ``amax_history_length`` is not an ``int`` (bools included).
        ValueError: another mode, a bad source name, or ``amax_history_length < 1``.

    Examples:
        >>> import jmp_policy as jp
        >>> policy = jp.QuantizedFloat8DTypePolicy("float8", "mixed_bfloat16", 16)
        >>> policy.amax_history_length
        16
        >>> jp.get("float8_from_mixed_bfloat16").amax_history_length
        1024
    """

    __slots__ = ("_amax_history_length",)
    _kind: ClassVar[str] = "float8"
    default_amax_history_length: ClassVar[int] = 1024

    _amax_history_length: int

    def __init__(
        self,
        mode: str = "float8",
        source_name: str | None = None,
        amax_history_length: int = 1024,
    ):
        if mode != "float8":
            raise ValueError(
                f"Invalid quantization mode. Expected 'float8' for QuantizedFloat8DTypePolicy "
                f"(use QuantizedDTypePolicy for 'int8' and 'int4'). Received: mode={mode!r}"
            )
        if isinstance(amax_history_length, bool) or not isinstance(amax_history_length, int):
            raise TypeError(
                "`amax_history_length` must be an integer. "
                f"Received: amax_history_length={amax_history_length!r} "
                f"(of type {type(amax_history_length).__name__})"
            )
        if amax_history_length < 1:
            raise ValueError(
                "`amax_history_length` must be at least 1. "
                f"Received: amax_history_length={amax_history_length!r}"
            )
        self._init_quantized(mode, "float8", None, source_name)
        object.__setattr__(self, "_amax_history_length", amax_history_length)

    def _key(self) -> tuple[Any, ...]:
        return (*super()._key(), self._amax_history_length)

    @property
    def amax_history_length(self) -> int:
        """The length of the amax history window used to compute scales."""
        return self._amax_history_length

    def _rebuild_from(self, source: DTypePolicy) -> QuantizedFloat8DTypePolicy:
        return QuantizedFloat8DTypePolicy(self._mode, source.name, self._amax_history_length)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "amax_history_length": self._amax_history_length}


def _as_dtype(dtype: Any, argument: str = "dtype") -> np.dtype:
    # `None` would silently become float64 (numpy's default); object/str dtypes are no policy.
    try:
        canonical = None if dtype is None else dt.canonicalize_dtype(dtype)
    except TypeError as e:
        canonical = None
        cause: Exception | None = e
    else:
        cause = None
    if canonical is None or not dt.is_numeric(canonical):
        raise TypeError(
            f"`{argument}` must be a numeric dtype, such as 'bfloat16' or jnp.float16. "
            f"Received: {argument}={dtype!r}"
        ) from cause
    return canonical


def _rebuild(cls: type[DTypePolicy], config: dict[str, Any]) -> DTypePolicy:
    return cls.from_config(config)


def policy_from_name(name: str) -> DTypePolicy:
    """Any accepted name to the right policy class (quantized names included)."""
    dt.check_name_type(name)
    split = dt.split_quantized_name(name)
    if split is None:
        return DTypePolicy(name)
    mode, source = split
    if mode == "float8":
        return QuantizedFloat8DTypePolicy(mode, source)
    return QuantizedDTypePolicy(mode, source)


def get_policy(name: str) -> DTypePolicy:
    """jmp's spelling: the policy of a name (any form :func:`get` accepts as a string).

    Args:
        name: a Keras name, a jmp string or a quantized name.

    Returns:
        The policy.

    Raises:
        TypeError: ``name`` is not a string.
        ValueError: ``name`` is not an accepted name.

    Examples:
        >>> import jmp_policy as jp
        >>> p = jp.get_policy("p=f32,c=bf16,o=f32")
        >>> p.param_dtype, p.compute_dtype, p.output_dtype
        (dtype('float32'), dtype(bfloat16), dtype('float32'))
        >>> jp.get_policy("c=f16")
        <DTypePolicy "c=f16">
        >>> str(jp.get_policy("half"))
        'p=bf16,c=bf16,o=bf16'
    """
    return policy_from_name(name)
