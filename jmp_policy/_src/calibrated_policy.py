"""Calibrated int4/int8 policies, Keras 3's ``GPTQDTypePolicy`` ("gptq/<bits>/<group>") and
``AWQDTypePolicy`` ("awq/<bits>/<group>"): their weights are chosen on calibration inputs
(:func:`jmp_policy.linen.calibrate`, :func:`jmp_policy.nnx.calibrate`) and stored as int4
(groups of ``group_size`` input rows, -1 per channel) or int8 (per channel)."""

from __future__ import annotations

from typing import Any, ClassVar

from jmp_policy._src.policy import DTypePolicy, T
from jmp_policy._src.quantized_policy import QuantizedDTypePolicy

# The bit widths stored here (jnp.int4, jnp.int8); Keras's GPTQ also allows 2 and 3.
SUPPORTED_BITS = (4, 8)


def parse_calibrated_mode(mode: Any, method: str) -> tuple[int, int]:
    """``"<method>/<bits>/<group>"`` -> ``(bits, group)``, checked as Keras checks it, then
    against what this library stores."""
    cls = f"{method.upper()}DTypePolicy"
    expected = f"'{method}/<weight_bits>/<group_size>'"
    if not isinstance(mode, str):
        raise TypeError(
            f"`mode` of {cls} must be a string such as '{method}/4/128'. "
            f"Received: mode={mode!r} (of type {type(mode).__name__})"
        )
    parts = mode.split("/")
    if len(parts) != 3 or parts[0] != method:
        raise ValueError(
            f"Invalid mode for {cls}. Expected format {expected}. Received: mode={mode!r}"
        )
    try:
        bits, group = int(parts[1]), int(parts[2])
    except ValueError:
        raise ValueError(
            f"Invalid mode for {cls}: <weight_bits> and <group_size> must be integers, as in "
            f"'{method}/4/128'. Received: mode={mode!r}"
        ) from None
    if group < -1 or group == 0:
        raise ValueError(
            f"Invalid group_size in mode: -1 (per channel) or a positive integer. "
            f"Received: mode={mode!r}"
        )
    supported = (4,) if method == "awq" else SUPPORTED_BITS
    if bits not in supported:
        words = " or ".join(map(str, supported))
        raise ValueError(
            f"{method.upper()} weights of {bits} bits are not supported: weight_bits must "
            f"be {words} (stored as jnp.int4{' or jnp.int8' if 8 in supported else ''}). "
            f"Received: mode={mode!r}"
        )
    if bits == 8 and group != -1:
        raise ValueError(
            f"8-bit {method.upper()} weights are stored as int8 per output channel here: "
            f"use '{method}/8/-1' (or 4 bits for groups). Received: mode={mode!r}"
        )
    return bits, group


class _CalibratedDTypePolicy(QuantizedDTypePolicy):
    """What GPTQ and AWQ policies share: ``weight_bits``, ``group_size`` and their mode."""

    __slots__ = ("_group_size", "_weight_bits")
    _method: ClassVar[str] = ""

    _weight_bits: int
    _group_size: int

    def __init__(self, mode: str, source_name: str | None = None):
        bits, group = parse_calibrated_mode(mode, self._method)
        block = group if bits == 4 else None
        self._init_quantized(f"{self._method}/{bits}/{group}", self._method, block, source_name)
        object.__setattr__(self, "_weight_bits", bits)
        object.__setattr__(self, "_group_size", group)

    def _key(self) -> tuple[Any, ...]:
        return (*super()._key(), self._weight_bits, self._group_size)

    @property
    def weight_bits(self) -> int:
        """The bits per weight: 4 (``jnp.int4``) or 8 (``jnp.int8``)."""
        return self._weight_bits

    @property
    def group_size(self) -> int:
        """Input rows per scale (-1: per output channel), as Keras's ``group_size``."""
        return self._group_size

    @property
    def storage_mode(self) -> str:
        """The :class:`~jmp_policy.QuantizedArray` mode its weights are stored in."""
        return "int4" if self._weight_bits == 4 else "int8"

    def quantize(self, tree: T, *, stacked_axes: Any = None) -> T:
        """Not available: calibrated weights need calibration inputs.

        Raises:
            ValueError: always, naming ``calibrate``.
        """
        raise ValueError(
            f"Policy {self.name!r} chooses its weights on calibration inputs: quantize with "
            "`jmp_policy.linen.calibrate(...)` or `jmp_policy.nnx.calibrate(...)`, or use "
            f"'int4/{self._group_size}' for round-to-nearest."
        )

    def _rebuild_from(self, source: DTypePolicy) -> _CalibratedDTypePolicy:
        return type(self)(self._mode, source.name)


class GPTQDTypePolicy(_CalibratedDTypePolicy):
    """Keras 3's GPTQ policy: ``"gptq/<weight_bits>/<group_size>_from_<source>"``.

    Weights chosen by GPTQ (Frantar et al., 2022) on calibration inputs by
    ``jmp_policy.linen.calibrate`` / ``jmp_policy.nnx.calibrate``, stored as int4 in groups
    of ``group_size`` input rows (-1 per channel), or int8 per channel (``gptq/8/-1``). Keras
    also allows 2 and 3 bits, which have no storage here (a ``ValueError``).

    Args:
        mode: ``"gptq/<weight_bits>/<group_size>"``, such as ``"gptq/4/128"``.
        source_name: the float policy the dtypes come from; ``None`` takes the global one.

    Raises:
        ValueError: another mode, 2 or 3 bits, 8 bits with groups, or a bad source name.

    Examples:
        >>> import jmp_policy as jp
        >>> policy = jp.get("gptq/4/128_from_mixed_bfloat16")
        >>> policy
        <GPTQDTypePolicy "gptq/4/128_from_mixed_bfloat16">
        >>> policy.quantization_mode, policy.weight_bits, policy.group_size
        ('gptq', 4, 128)
        >>> policy.get_config()
        {'mode': 'gptq/4/128', 'source_name': 'mixed_bfloat16'}
    """

    __slots__ = ()
    _method: ClassVar[str] = "gptq"


class AWQDTypePolicy(_CalibratedDTypePolicy):
    """Keras 3's AWQ policy: ``"awq/4/<group_size>_from_<source>"``.

    Weights chosen by AWQ (Lin et al., 2023) on calibration inputs by
    ``jmp_policy.linen.calibrate`` / ``jmp_policy.nnx.calibrate``: a per-input-channel
    scale, searched, divides the layer's inputs in the matmul, and the kernel times it is
    stored as int4 in groups of ``group_size`` input rows (-1 per channel). As in Keras,
    only 4 bits.

    Args:
        mode: ``"awq/4/<group_size>"``, such as ``"awq/4/128"``.
        source_name: the float policy the dtypes come from; ``None`` takes the global one.

    Raises:
        ValueError: another mode, bits other than 4, or a bad source name.

    Examples:
        >>> import jmp_policy as jp
        >>> policy = jp.AWQDTypePolicy("awq/4/-1", "float32")
        >>> policy.name, policy.group_size
        ('awq/4/-1_from_float32', -1)
        >>> jp.get("awq/4/-1_from_float32") == policy
        True
    """

    __slots__ = ()
    _method: ClassVar[str] = "awq"
