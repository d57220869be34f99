"""Calibrated int4/int8 policies, Keras 3's ``GPTQDTypePolicy`` ("gptq/<bits>/<group>") and
``AWQDTypePolicy`` ("awq/<bits>/<group>"): quantized policies whose scheme
(:mod:`jmp_policy._src.quantization.calibrated_schemes`) chooses the weights on calibration inputs
(:func:`jmp_policy.linen.calibrate`, :func:`jmp_policy.nnx.calibrate`)."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from jmp_policy._src import schemes
from jmp_policy._src.policy import DTypePolicy, T
from jmp_policy._src.quantization.asymmetric_grid import ASYM, check_symmetric
from jmp_policy._src.quantization.calibrated_schemes import AWQScheme, CalibratedScheme, GPTQScheme
from jmp_policy._src.quantization.smoothquant import DEFAULT_ALPHA, check_alpha
from jmp_policy._src.quantization.smoothquant_scheme import SmoothQuantScheme
from jmp_policy._src.quantized_policy import QuantizedDTypePolicy


class _CalibratedDTypePolicy(QuantizedDTypePolicy):
    """What GPTQ and AWQ policies share: ``weight_bits``, ``group_size`` and their mode."""

    __slots__ = ()
    _scheme_class: ClassVar[type[CalibratedScheme]] = CalibratedScheme

    def __init__(self, mode: str, source_name: str | None = None, symmetric: bool | None = None):
        cls, example = type(self).__name__, f"'{self._scheme_class.mode}/4/128'"
        if not isinstance(mode, str):
            raise TypeError(
                f"`mode` of {cls} must be a string such as {example}. "
                f"Received: mode={mode!r} (of type {type(mode).__name__})"
            )
        scheme: Any = schemes.parse_mode(mode, type(self))
        if symmetric is not None and check_symmetric(symmetric) != scheme.symmetric:
            if scheme.symmetric is False:
                raise ValueError(
                    "`symmetric` contradicts `mode`, whose groups have zero points. "
                    f"Received: symmetric={symmetric!r}, mode={mode!r}"
                )
            try:
                scheme = dataclasses.replace(scheme, symmetric=False)
            except ValueError as e:  # 8-bit weights: the scheme says why, we say which argument
                raise ValueError(f"`symmetric=False` does not apply to mode={mode!r}: {e}") from e
        self._init_quantized(scheme.mode_text(), scheme, source_name)

    @property
    def symmetric(self) -> bool:
        """Keras's ``symmetric``: ``False`` where each group has a zero point."""
        return self._scheme.symmetric  # type: ignore[no-any-return]

    def get_config(self) -> dict[str, Any]:
        """Keras's fields (``mode``, ``source_name``), and ``"symmetric": False`` where the
        groups have zero points (configs of symmetric policies are as before)."""
        if self._scheme.symmetric:
            return super().get_config()
        mode = self._mode[: -len(ASYM)]
        return {"mode": mode, "source_name": self.source_name, "symmetric": False}

    @property
    def weight_bits(self) -> int:
        """The bits per weight: 4 (``jnp.int4``) or 8 (``jnp.int8``)."""
        return self._scheme.weight_bits

    @property
    def group_size(self) -> int:
        """Input rows per scale (-1: per output channel), as Keras's ``group_size``."""
        return self._scheme.group_size

    @property
    def storage_mode(self) -> str:
        """The :class:`~jmp_policy.QuantizedArray` mode its weights are stored in."""
        return self._scheme.storage_mode

    def quantize(self, tree: T, *, stacked_axes: Any = None) -> T:
        """Not available: calibrated weights need calibration inputs.

        Raises:
            ValueError: always, naming ``calibrate``.
        """
        return self._scheme.quantize(tree, 0)  # type: ignore[no-any-return]

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
    _scheme_class: ClassVar[type[CalibratedScheme]] = GPTQScheme


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
    _scheme_class: ClassVar[type[CalibratedScheme]] = AWQScheme


class SmoothQuantDTypePolicy(_CalibratedDTypePolicy):
    """SmoothQuant (Xiao et al., 2023) for int8 x int8 layers: ``"smoothquant/8_from_<source>"``.

    A per-input-channel smoothing scale ``s = max|x|^alpha / max|W|^(1 - alpha)``, from the
    calibration inputs' ``max |x|`` (``jmp_policy.linen.calibrate``, ``nnx.calibrate``,
    ``equinox.calibrate``), is folded into the kernel (stored int8 per output channel)
    and divides the layer's inputs in the matmul, as AWQ's scale does; the layer then runs
    int8 x int8 at enough rows, as an int8 policy's does. ``alpha`` is a per-model choice
    (the paper's practice; llm-compressor's recipes mostly use 0.8): score a few values on
    the calibration batches and keep the best (on Gemma 3 270M, 0.75 of 0.5-0.85 halves the
    gap that 0.5 leaves; docs/quantization.md).

    Args:
        mode: ``"smoothquant/8"``.
        source_name: the float policy the dtypes come from; ``None`` takes the global one.
        alpha: the migration strength, from 0 to 1 (``None``: 0.5, the paper's default).
            Names do not carry it (as float8's history length); configs do, where it is
            not 0.5.
        symmetric: ``True`` or ``None`` (SmoothQuant's int8 weights have no zero point).
        smoothing_strength: ``alpha`` in llm-compressor's spelling
            (``SmoothQuantModifier(smoothing_strength=0.8)``); give one of the two.

    Raises:
        TypeError: ``alpha`` or ``smoothing_strength`` no number (bools included).
        ValueError: another mode, ``alpha`` outside ``[0, 1]``, both ``alpha`` and
            ``smoothing_strength`` given, or a bad source name.

    Examples:
        >>> import jmp_policy as jp
        >>> policy = jp.get("smoothquant/8_from_mixed_bfloat16")
        >>> policy, policy.alpha
        (<SmoothQuantDTypePolicy "smoothquant/8_from_mixed_bfloat16">, 0.5)
        >>> jp.SmoothQuantDTypePolicy("smoothquant/8", "float32", alpha=0.75).get_config()
        {'mode': 'smoothquant/8', 'source_name': 'float32', 'alpha': 0.75}
    """

    __slots__ = ()
    _scheme_class: ClassVar[type[CalibratedScheme]] = SmoothQuantScheme

    def __init__(
        self,
        mode: str = "smoothquant/8",
        source_name: str | None = None,
        alpha: float | None = None,
        symmetric: bool | None = None,
        *,
        smoothing_strength: float | None = None,
    ):
        super().__init__(mode, source_name, symmetric)
        if smoothing_strength is not None:
            if alpha is not None:
                raise ValueError(
                    "Give `alpha` or its llm-compressor spelling `smoothing_strength`, not "
                    f"both. Received: alpha={alpha!r}, smoothing_strength={smoothing_strength!r}"
                )
            alpha = check_alpha(smoothing_strength, "smoothing_strength")
        alpha = DEFAULT_ALPHA if alpha is None else alpha
        scheme = dataclasses.replace(self._scheme, alpha=alpha)
        object.__setattr__(self, "_parsed", dataclasses.replace(self._parsed, scheme=scheme))

    @property
    def alpha(self) -> float:
        """SmoothQuant's migration strength."""
        return self._scheme.alpha  # type: ignore[no-any-return]

    def _rebuild_from(self, source: DTypePolicy) -> SmoothQuantDTypePolicy:
        return SmoothQuantDTypePolicy(self._mode, source.name, self.alpha)


schemes.register(GPTQScheme, GPTQDTypePolicy)
schemes.register(AWQScheme, AWQDTypePolicy)
schemes.register(SmoothQuantScheme, SmoothQuantDTypePolicy)
