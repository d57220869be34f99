"""Float dtype policies: frozen values that say which dtype parameters, computations and
outputs use, and cast whole pytrees accordingly (the quantized ones build on them in
``quantized_policy``)."""

from __future__ import annotations

from typing import Any, ClassVar, TypeVar

import numpy as np
from jax.typing import DTypeLike

from jmp_policy._src import casting, config_fields, context, schemes
from jmp_policy._src import dtypes as dt
from jmp_policy._src import name_grammar as names

T = TypeVar("T")
P = TypeVar("P", bound="DTypePolicy")


def global_name() -> str:
    """The global policy's name (a quantized global's source's): what ``None`` means. Read
    from ``context``, so that this module never imports the global state (which imports it)."""
    policy = context.global_policy_or_none()
    if policy is None:
        return "float32"
    return str(getattr(policy, "source_name", policy.name))


class DTypePolicy:
    """A float dtype policy: the dtypes of variables, of computation and of outputs.

    Accepts every name of Keras (``"float32"``, ``"mixed_bfloat16"``), jmp
    (``"p=f32,c=bf16,o=f32"``), any numpy dtype name, tf.keras's ``"_infer"`` (its three
    dtypes are ``None``: its casts return their input) and jmp's constructor
    ``DTypePolicy(param_dtype, compute_dtype, output_dtype)``. Policies are immutable and
    compare and hash by their kind and three dtypes, whatever their names (so they can be
    ``jax.jit`` static arguments and dict keys).

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

    __slots__ = ("_parsed",)
    _kind: ClassVar[str] = "float"
    # The quantization scheme (:mod:`jmp_policy._src.schemes`); None: a float policy.
    scheme: ClassVar[Any] = None

    # What the policy is: its parsed name (dtypes None only for tf.keras's "_infer").
    _parsed: names.ParsedName

    def __init__(
        self,
        name: str | None = None,
        compute_dtype: DTypeLike | None = None,
        output_dtype: DTypeLike | None = None,
        *,
        param_dtype: DTypeLike | None = None,
        variable_dtype: DTypeLike | None = None,
    ):
        check_fresh(self)
        dtypes = (compute_dtype, output_dtype, param_dtype, variable_dtype)
        if name is None and dtypes == (None,) * 4:
            name = global_name()
        # The name (or jmp's dtypes) parsed once; the policy is the parsed value.
        object.__setattr__(self, "_parsed", names.parse_arguments(name, *dtypes))

    @classmethod
    def _from_parsed(cls: type[P], parsed: names.ParsedName) -> P:
        """A policy of this class built from a parsed name (never parsed again)."""
        policy = object.__new__(cls)
        object.__setattr__(policy, "_parsed", parsed)
        return policy

    # -- immutability and value semantics -------------------------------------------------

    def __setattr__(self, key: str, value: Any) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable; use with_*_dtype to derive one.")

    def __delattr__(self, key: str) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable.")

    def _key(self) -> tuple[Any, ...]:
        parsed = self._parsed
        return (self._kind, parsed.params, parsed.compute, parsed.output)

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
        # Keras prints a FloatDTypePolicy under its first name.
        cls = "DTypePolicy" if type(self) is FloatDTypePolicy else type(self).__name__
        return f'<{cls} "{self._parsed.name}">'

    def __str__(self) -> str:
        """jmp's short form (``"p=f32,c=bf16,o=bf16"``); ``get_policy(str(p)) == p``."""
        if self.compute_dtype is None:
            return names.INFER
        return (
            f"p={dt.short_name(self.variable_dtype)},"
            f"c={dt.short_name(self.compute_dtype)},"
            f"o={dt.short_name(self.output_dtype)}"
        )

    # -- properties -----------------------------------------------------------------------

    @property
    def name(self) -> str:
        """The policy's name, as given (or canonical, for derived policies)."""
        return self._parsed.name

    @property
    def compute_dtype(self) -> np.dtype:
        """The dtype computations run in (``None`` for tf.keras's ``"_infer"``)."""
        return self._parsed.compute  # type: ignore[return-value]

    @property
    def variable_dtype(self) -> np.dtype:
        """The dtype variables (parameters) are stored in (``None`` for ``"_infer"``);
        ``param_dtype`` is jmp's and Flax's name for it."""
        return self._parsed.params  # type: ignore[return-value]

    param_dtype = variable_dtype

    @property
    def output_dtype(self) -> np.dtype:
        """The dtype outputs are returned in (``None`` for ``"_infer"``)."""
        return self._parsed.output  # type: ignore[return-value]

    @property
    def quantization_mode(self) -> str | None:
        """``None`` for float policies; ``"int8"``, ``"int4"`` or ``"float8"`` otherwise."""
        return None

    # -- casting --------------------------------------------------------------------------

    def cast_to_compute(self, tree: T) -> T:
        """Casts every floating array leaf of ``tree`` to :attr:`compute_dtype`.

        A :class:`~jmp_policy.QuantizedArray` is dequantized to the compute dtype.
        """
        compute = self._parsed.compute
        if compute is None:  # "_infer"
            return tree
        return casting.compute_tree(tree, compute)

    def cast_to_variable(self, tree: T) -> T:
        """Casts every floating array leaf of ``tree`` to :attr:`variable_dtype`."""
        params = self._parsed.params
        if params is None:  # "_infer"
            return tree
        return casting.cast_tree(tree, params)

    cast_to_param = cast_to_variable

    def cast_to_output(self, tree: T) -> T:
        """Casts every floating array leaf of ``tree`` to :attr:`output_dtype`."""
        output = self._parsed.output
        if output is None:  # "_infer"
            return tree
        return casting.cast_tree(tree, output)

    def quantize(self, tree: T, *, stacked_axes: Any = None) -> T:
        """Quantizes ``tree``'s kernels; only int8 and int4 policies do (see
        :meth:`QuantizedDTypePolicy.quantize <jmp_policy.QuantizedDTypePolicy.quantize>`).

        Raises:
            ValueError: always, for a float policy: it names no quantization.

        Examples:
            >>> import jax.numpy as jnp
            >>> import jmp_policy as jp
            >>> jp.DTypePolicy("mixed_bfloat16").quantize({"kernel": jnp.ones((4, 4))})
            Traceback (most recent call last):
            ...
            ValueError: Policy 'mixed_bfloat16' does not quantize: ...
        """
        raise ValueError(
            f"Policy {self.name!r} does not quantize: only int8 and int4 policies store "
            f"quantized weights. Use QuantizedDTypePolicy('int8', {self.name!r}) or "
            f"'int4/128_from_{self.name}'."
        )

    # -- derivation -----------------------------------------------------------------------

    def _with(self, variable: Any, compute: Any, output: Any) -> DTypePolicy:
        if self._parsed.compute is None:
            raise ValueError(
                f"The '{names.INFER}' policy has no dtypes to derive another policy from; "
                "name the three dtypes instead, as in DTypePolicy('p=f32,c=bf16,o=f32'). "
                f"Received: policy={self!r}"
            )
        v, c, o = (dt.as_dtype(d) for d in (variable, compute, output))
        return DTypePolicy._from_parsed(names.from_dtypes(v, c, o))

    def with_compute_dtype(self, dtype: DTypeLike) -> DTypePolicy:
        """A policy like this one with another compute dtype."""
        return self._with(self.variable_dtype, dtype, self.output_dtype)

    def with_variable_dtype(self, dtype: DTypeLike) -> DTypePolicy:
        """A policy like this one with another variable dtype."""
        return self._with(dtype, self.compute_dtype, self.output_dtype)

    with_param_dtype = with_variable_dtype

    def with_output_dtype(self, dtype: DTypeLike) -> DTypePolicy:
        """A policy like this one with another output dtype."""
        return self._with(self.variable_dtype, self.compute_dtype, dtype)

    # -- config ---------------------------------------------------------------------------

    def get_config(self) -> dict[str, Any]:
        """A JSON-ready dict that :meth:`from_config` reads back."""
        return {"name": self._parsed.name}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> DTypePolicy:
        """Builds a policy from :meth:`get_config`'s dict (the dict is not modified).

        A tf.keras experimental config's ``loss_scale`` field is ignored, as tf.keras did;
        any other field that is not a constructor argument is a ``ValueError`` naming it.
        """
        example = "{'name': 'mixed_bfloat16'}"
        kwargs = config_fields.constructor_kwargs(cls, config, example, ignored=("loss_scale",))
        if kwargs.get("name") is not None and set(kwargs) & set(config_fields.DTYPE_FIELDS):
            policy = cls(kwargs["name"])  # the name names the policy: fields must agree
            config_fields.check_named_dtypes(policy, kwargs, config)
            return policy
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

    Its ``repr`` is Keras's, under the first name.

    Examples:
        >>> import jmp_policy as jp
        >>> jp.FloatDTypePolicy("mixed_float16") == jp.DTypePolicy("mixed_float16")
        True
        >>> jp.FloatDTypePolicy("mixed_float16")
        <DTypePolicy "mixed_float16">
    """

    __slots__ = ()


class Policy(DTypePolicy):
    """tf.keras's name for :class:`DTypePolicy` (the same kind: equal to it by value).

    tf.keras's ``"_infer"`` policy is read too (its dtypes are ``None``).

    Examples:
        >>> import jmp_policy as jp
        >>> jp.Policy("mixed_float16").compute_dtype
        dtype('float16')
        >>> jp.Policy("_infer").compute_dtype is None
        True
    """

    __slots__ = ()


def from_name(value: Any, argument: str = "name", *, or_dtype: bool = False) -> DTypePolicy | None:
    """A name (or, with ``or_dtype``, a dtype) to the class it names (a float name
    :class:`DTypePolicy`, a quantized one its format's registered class), built
    from the name parsed once: no constructor is handed the name to parse again. ``None``:
    with ``or_dtype``, ``value`` is neither. ``argument`` names the caller's argument."""
    if isinstance(value, str) or not or_dtype:
        parsed = names.parse(value, argument)
    else:
        # A dtype names the policy of that dtype (`jnp.bfloat16`: "bfloat16"), if the
        # grammar has its name (not float128, say).
        dtype = dt.dtype_or_none(value)
        if dtype is None or dtype.name not in dt.DTYPE_NAMES:
            return None
        parsed = names.ParsedName(str(dtype.name), dtype, dtype, dtype)
    cls: type[DTypePolicy] = DTypePolicy
    if parsed.scheme is not None and parsed.mode is not None:
        cls = schemes.class_for(parsed.scheme, parsed.mode)
    policy = object.__new__(cls)
    object.__setattr__(policy, "_parsed", parsed)  # as `_from_parsed`, without a call back
    return policy


def check_fresh(policy: DTypePolicy) -> None:
    """Refuses to initialise a policy twice (``policy.__init__(...)`` on a built one)."""
    if hasattr(policy, "_parsed"):
        raise AttributeError(f"{type(policy).__name__} is immutable; it cannot be re-initialized.")


def _rebuild(cls: type[DTypePolicy], config: dict[str, Any]) -> DTypePolicy:
    return cls.from_config(config)
