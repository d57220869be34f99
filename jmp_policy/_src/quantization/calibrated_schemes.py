"""The calibrated formats, Keras 3's ``"gptq/<bits>/<group>"`` and ``"awq/<bits>/<group>"``.

Their weights are chosen on calibration inputs (:func:`jmp_policy.linen.calibrate`,
:func:`jmp_policy.nnx.calibrate` call :meth:`CalibratedScheme.solve` with each layer's
statistics) and stored as round-to-nearest stores them: int4 in groups of ``group_size``
input rows (-1: per channel) or int8 per channel; ``quantize`` without statistics is a
``ValueError`` naming ``calibrate``. A layer reads its stored kernel whole through the
weight-only matmul; an AWQ kernel (:class:`~jmp_policy._src.quantization.awq.InputScaledArray`) first
divides the layer's inputs by its per-input-row scale (:meth:`AWQScheme.matmul`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jmp_policy._src import schemes
from jmp_policy._src.dtypes import MAX_INT4_BLOCK, bounded_repr
from jmp_policy._src.int_arguments import int_from_text
from jmp_policy._src.quantization import awq, gptq, matmuls, zero_point
from jmp_policy._src.quantization import quantized_array as quantization
from jmp_policy._src.quantization.asymmetric_grid import ASYM, check_symmetric
from jmp_policy._src.quantization.quantized_matmul import normalize_dims
from jmp_policy._src.schemes import Scheme

# The widest <weight_bits> a mode's text is read with (the format then says which it stores).
_MAX_BITS = 64


@dataclasses.dataclass(frozen=True, kw_only=True)
class CalibratedScheme(Scheme):
    """What GPTQ and AWQ share: ``weight_bits`` (4 or 8) and ``group_size`` (-1: per
    channel; 8 bits per channel only), their mode ``"<method>/<bits>/<group>"``."""

    #: The bit widths this format stores (Keras's GPTQ also allows 2 and 3).
    bits: ClassVar[tuple[int, ...]] = (4, 8)

    weight_bits: int = 4
    group_size: int = 128
    #: Keras's ``GPTQConfig(symmetric=...)``: ``False`` (4 bits) stores a zero point per
    #: group (``"<method>/4/<group>/asym"`` in names).
    symmetric: bool = True

    def __post_init__(self) -> None:
        if not check_symmetric(self.symmetric) and self.weight_bits != 4:
            raise ValueError(
                f"A zero point per group is int4's only: {self.mode.upper()} weights of "
                f"{self.weight_bits} bits are symmetric. Received: mode='{self.mode_text()}'"
            )
        if self.weight_bits not in self.bits:
            # Keras's phrase for AWQ ("only supports 4-bit"), with what is stored here.
            supported = " or ".join(f"{b}-bit" for b in self.bits)
            raise ValueError(
                f"{self.mode.upper()} only supports {supported} weights here (stored as "
                f"jnp.int4{' or jnp.int8' if 8 in self.bits else ''}): weights of "
                f"{self.weight_bits} bits are not supported. "
                f"Received: mode='{self.mode_text()}'"
            )
        gptq.check_bits_and_group(self.weight_bits, self.group_size, self.mode.upper())

    @classmethod
    def parse(cls, text: str) -> CalibratedScheme | None:
        parts = text.split("/")
        if parts[0] != cls.mode:
            return None
        cls_name = schemes.class_of(cls).__name__
        symmetric = not (len(parts) == 4 and f"/{parts[3]}" == ASYM)
        if not symmetric:
            parts = parts[:3]
        if len(parts) != 3:
            raise ValueError(
                f"Invalid mode for {cls_name}. Expected format "
                f"'{cls.mode}/<weight_bits>/<group_size>', as in '{cls.mode}/4/128' (a zero "
                f"point per group: '{cls.mode}/4/128/asym'). "
                f"Received: mode={bounded_repr(text)}"
            )
        # Each number read by the one bounded parser: full-width digits, "12_8", 20 digits refused.
        bits = int_from_text(parts[1], 0, _MAX_BITS)
        group = int_from_text(parts[2], -1, MAX_INT4_BLOCK)
        if bits is None or group is None or group == 0:
            raise ValueError(
                f"Invalid mode for {cls_name}: <weight_bits> and <group_size> must be "
                f"integers in ASCII digits (no '_', '+' or leading zeros), <weight_bits> {' or '.join(map(str, cls.bits))} "
                f"and <group_size> -1 (per channel) or from 1 to {MAX_INT4_BLOCK}, as in "
                f"'{cls.mode}/4/128'. Received: mode={bounded_repr(text)}"
            )
        if bits == 8 and group != -1 and 8 in cls.bits:
            raise ValueError(
                f"8-bit {cls.mode.upper()} weights are stored as int8 per output channel "
                f"here: use '{cls.mode}/8/-1' (or 4 bits for groups). "
                f"Received: mode={bounded_repr(text)}"
            )
        return cls(weight_bits=bits, group_size=group, symmetric=symmetric)

    def mode_text(self, given: str | None = None) -> str:
        asym = "" if self.symmetric else ASYM
        return f"{self.mode}/{self.weight_bits}/{self.group_size}{asym}"

    @property
    def block_size(self) -> int | None:
        """int4's rows per scale (-1: per channel); ``None`` for int8 (per channel)."""
        return self.group_size if self.weight_bits == 4 else None

    @property
    def storage_mode(self) -> str:
        """The :class:`~jmp_policy.QuantizedArray` mode the weights are stored in."""
        return "int4" if self.weight_bits == 4 else "int8"

    def quantize(self, x: Any, stacked: int) -> Any:
        rtn = "int8" if self.weight_bits == 8 else f"int4/{self.group_size}"
        raise ValueError(
            f"The '{self.mode_text()}' format chooses its weights on calibration inputs: "
            "quantize with `jmp_policy.linen.calibrate(...)` or `jmp_policy.nnx.calibrate"
            f"(...)`, or use '{rtn}' for round-to-nearest."
        )

    def describe(self, kernel: Any) -> str:
        # By its storage ("int4/128"), as round-to-nearest's weights are worded.
        return matmuls.storage_label(kernel)

    def round_to_nearest(self, x: Any, stacked: int = 0) -> quantization.QuantizedArray:
        """``x`` rounded to nearest in this format's storage (layers calibrate cannot see)."""
        if not self.symmetric:
            return zero_point.quantize_asymmetric(x, self.block_size, stacked)
        return quantization.quantize(x, self.storage_mode, self.block_size, stacked)

    def solve(
        self,
        x: Any,
        gram: Any,
        mean_abs: Any,
        options: Mapping[str, Any],
        in_axes: int = 1,
        abs_max: Any = None,
    ) -> Any:
        """One kernel chosen from its layer's statistics (``XᵀX``, ``mean |x|``, ``max
        |x|``) over its ``in_axes`` leading input axes (flattened)."""
        raise NotImplementedError

    def matmul(self, kind: str, *, path: str, state: Any, kernel: Any) -> Callable[..., Any] | None:
        if quantization.is_quantized(kernel):
            return matmuls.stored_kernel(kind, path, kernel, scheme=self, int8_compute=False)
        return None


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPTQScheme(CalibratedScheme):
    """GPTQ (Frantar et al., 2022): ``"gptq/4/<group>"`` or ``"gptq/8/-1"``.

    Examples:
        >>> from jmp_policy._src.quantization.calibrated_schemes import GPTQScheme
        >>> scheme = GPTQScheme.parse("gptq/4/128")
        >>> scheme, scheme.mode_text(), scheme.block_size
        (GPTQScheme(weight_bits=4, group_size=128, symmetric=True), 'gptq/4/128', 128)
    """

    mode: ClassVar[str] = "gptq"
    grammar: ClassVar[tuple[str, ...]] = (
        "'gptq/<weight_bits>/<group_size>'",
        "'gptq/4/<group_size>/asym'",
    )

    def solve(
        self,
        x: Any,
        gram: Any,
        mean_abs: Any,
        options: Mapping[str, Any],
        in_axes: int = 1,
        abs_max: Any = None,
    ) -> Any:
        return gptq.gptq_quantize(
            x, gram, weight_bits=self.weight_bits, group_size=self.group_size,
            hessian_damping=options["hessian_damping"], in_axes=in_axes,
            clip_search=options.get("clip_search", False), symmetric=self.symmetric,
        )  # fmt: skip


@dataclasses.dataclass(frozen=True, kw_only=True)
class AWQScheme(CalibratedScheme):
    """AWQ (Lin et al., 2023): ``"awq/4/<group>"`` (4 bits only, as Keras).

    Its kernels carry the per-input-row scale ``s`` (``InputScaledArray``): the matmul
    divides the inputs by ``s`` and multiplies by the stored ``Q(diag(s) W)`` in the
    weight-only form; a layout where ``s`` cannot be divided out of the inputs (a kernel
    reshaped by its layer, or stacked) multiplies by the dequantized kernel.

    Examples:
        >>> from jmp_policy._src.quantization.calibrated_schemes import AWQScheme
        >>> AWQScheme.parse("awq/4/-1").mode_text()
        'awq/4/-1'
    """

    mode: ClassVar[str] = "awq"
    grammar: ClassVar[tuple[str, ...]] = ("'awq/4/<group_size>'", "'awq/4/<group_size>/asym'")
    bits: ClassVar[tuple[int, ...]] = (4,)
    #: Whether a stored int8 kernel runs int8 x int8 at enough rows (SmoothQuant's).
    int8_compute: ClassVar[bool] = False

    def solve(
        self,
        x: Any,
        gram: Any,
        mean_abs: Any,
        options: Mapping[str, Any],
        in_axes: int = 1,
        abs_max: Any = None,
    ) -> Any:
        return awq.awq_quantize(
            x, mean_abs, gram, weight_bits=self.weight_bits, group_size=self.group_size,
            num_grid_points=options["num_grid_points"], in_axes=in_axes,
            clip_search=options.get("clip_search", False), symmetric=self.symmetric,
        )  # fmt: skip

    def matmul(self, kind: str, *, path: str, state: Any, kernel: Any) -> Callable[..., Any] | None:
        int8 = self.int8_compute
        if not isinstance(kernel, awq.InputScaledArray):
            if quantization.is_quantized(kernel):
                return matmuls.stored_kernel(kind, path, kernel, scheme=self, int8_compute=int8)
            return None
        plain = kernel.scaled_kernel()
        fast = matmuls.stored_kernel("dot_general", path, plain, scheme=self, int8_compute=int8)

        def dot_general(lhs: Any, rhs: Any, dimension_numbers: Any, *a: Any, **kw: Any) -> Any:
            dims = normalize_dims(dimension_numbers)
            (lc, rc), (lb, rb) = dims
            shape = tuple(getattr(rhs, "shape", kernel.shape))
            k = int(np.ndim(kernel.input_scale))
            if (
                shape == kernel.shape
                and not kernel.stacked
                and set(range(k)) <= set(rc)
                and not (lb or rb)
            ):
                lhs = jnp.asarray(lhs)
                axes = [lc[list(rc).index(j)] for j in range(k)]  # lhs axis of kernel axis j
                order = sorted(range(k), key=lambda j: axes[j])
                s = jnp.transpose(jnp.asarray(kernel.input_scale), order)
                shape_s = [1] * lhs.ndim
                for j in range(k):
                    shape_s[axes[j]] = kernel.shape[j]
                s = s.reshape(shape_s)
                return fast((lhs.astype(jnp.float32) / s).astype(lhs.dtype), rhs, dims, *a, **kw)
            label = f"{self.mode} {matmuls.storage_label(kernel)}"
            matmuls.record(path, f"{label} weights: dequantized (input scale not divisible)")
            compute = np.dtype(getattr(rhs, "dtype", jnp.asarray(lhs).dtype))
            w = kernel.dequantize(compute).reshape(shape)
            precision = a[0] if a else kw.get("precision")
            out = a[1] if len(a) > 1 else kw.get("preferred_element_type")
            return jax.lax.dot_general(
                jnp.asarray(lhs).astype(compute), w, dims, precision=precision,
                preferred_element_type=out,
            )  # fmt: skip

        return matmuls.of_kind(kind, dot_general)
