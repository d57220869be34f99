"""The integer formats: int8 (weights, and int8 compute) and int4 (per channel or blocks).

``"int8"``: kernels stored as int8 with a scale per output channel; a layer whose int8
kernel reaches it whole reads it (int8 x int8 at enough rows), and a layer with a float
kernel computes int8 x int8 with both operands quantized in the step (quantization-aware
training, straight-through). ``"int4"`` / ``"int4/<block>"``: kernels stored as int4 per
channel or in blocks of rows (codes ``-8..7``, the full range); a layer reads its stored kernel whole, a float kernel runs
as written.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np

from jmp_policy._src.dtypes import MAX_INT4_BLOCK, bounded_repr
from jmp_policy._src.int_arguments import int_from_text
from jmp_policy._src.quantization import matmuls, quantized_matmul, symmetric_grid, zero_point
from jmp_policy._src.quantization import quantized_array as quantization
from jmp_policy._src.quantization.asymmetric_grid import ASYM, check_symmetric
from jmp_policy._src.quantization.quantized_array_checks import is_bad_block
from jmp_policy._src.schemes import Scheme

#: The end of an int4 mode on the full range, the default grid (a synonym: ``"int4/128/full"``).
FULL = "/full"
#: The end of an int4 mode on the 15-code grid ``-7..7`` (``"int4/128/narrow"``).
NARROW = "/narrow"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Int8Scheme(Scheme):
    """int8 weights and int8 compute (``"int8_from_<source>"``); ``symmetric=False``
    (``"int8/asym"``): a zero point per output channel and all 256 codes
    (:mod:`~jmp_policy._src.quantization.zero_point`), served weight-only.

    Examples:
        >>> from jmp_policy._src.quantization.int_schemes import Int8Scheme
        >>> Int8Scheme.parse("int8"), Int8Scheme().stores_weights
        (Int8Scheme(symmetric=True), True)
        >>> Int8Scheme.parse("int8/asym").mode_text()
        'int8/asym'
    """

    mode: ClassVar[str] = "int8"
    grammar: ClassVar[tuple[str, ...]] = ("'int8'", "'int8/asym'")

    #: ``False`` stores a zero point per output channel (``"/asym"`` in names).
    symmetric: bool = True

    def __post_init__(self) -> None:
        check_symmetric(self.symmetric, 8, allow_asymmetric=True)

    @classmethod
    def parse(cls, text: str) -> Int8Scheme | None:
        if text == "int8":
            return cls()
        if text == "int8" + ASYM:
            return cls(symmetric=False)
        if text.startswith("int8/"):
            raise ValueError(
                "Invalid quantization mode. int8 takes no block size: 'int8' (a scale per "
                f"channel) or 'int8/asym' (with a zero point). Received: mode={bounded_repr(text)}"
            )
        return None

    def mode_text(self, given: str | None = None) -> str:
        return "int8" if self.symmetric else "int8" + ASYM

    def check_source(self, compute: Any, text: str, source_name: str) -> None:
        if compute == np.float16:
            raise ValueError(
                f"Quantization mode='{text}' doesn't work well with compute_dtype='float16'. "
                "Use a bfloat16 or float32 source policy, such as 'mixed_bfloat16'. "
                f"Received: source_name={source_name!r}"
            )

    def quantize(self, x: Any, stacked: int) -> Any:
        if not self.symmetric:
            return zero_point.quantize_asymmetric(x, None, stacked, mode="int8")
        return quantization.quantize(x, "int8", None, stacked)

    def describe(self, kernel: Any) -> str:
        # By its storage: the kernel may have been quantized under another int format.
        return matmuls.storage_label(kernel)

    def matmul(self, kind: str, *, path: str, state: Any, kernel: Any) -> Callable[..., Any] | None:
        if quantization.is_quantized(kernel):
            return matmuls.stored_kernel(kind, path, kernel, scheme=self, int8_compute=True)

        def qat(lhs: Any, rhs: Any, dims: Any, *args: Any, **kw: Any) -> Any:
            matmuls.record(path, "int8 x int8 (both quantized in the step), straight-through")
            return quantized_matmul.int8_dot_general(lhs, rhs, dims, *args, **kw)

        return matmuls.of_kind(kind, qat)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Int4Scheme(Scheme):
    """int4 weights, per channel (``block_size=-1``, ``"int4"``) or in blocks of rows
    (``"int4/<block>"``), symmetric on the full range: ``scale = amax / 7.5`` and codes
    ``-8..7`` (qwix's default int4; :mod:`~jmp_policy._src.quantization.symmetric_grid`;
    ``"int4/<block>/full"`` is a synonym); ``symmetric=False`` (``"int4/<block>/asym"``): a
    zero point per group (:mod:`~jmp_policy._src.quantization.zero_point`);
    ``full_range=False`` (``"int4/<block>/narrow"``): the 15 codes ``-7..7``, ``amax / 7``
    (the default before the full range).

    Examples:
        >>> from jmp_policy._src.quantization.int_schemes import Int4Scheme
        >>> scheme = Int4Scheme.parse("int4/128")
        >>> scheme, scheme.mode_text(), Int4Scheme.parse("int4").mode_text("int4")
        (Int4Scheme(block_size=128, symmetric=True), 'int4/128', 'int4')
        >>> Int4Scheme.parse("int4/64/asym").mode_text(), Int4Scheme.parse("int4/64/full")
        ('int4/64/asym', Int4Scheme(block_size=64, symmetric=True))
    """

    mode: ClassVar[str] = "int4"
    grammar: ClassVar[tuple[str, ...]] = (
        "'int4'", "'int4/<block>'", "'int4/<block>/asym'", "'int4/<block>/narrow'",
        "'int4/<block>/full'",
    )  # fmt: skip

    block_size: int = -1  # type: ignore[assignment]
    #: Keras's spelling: ``False`` stores a zero point per group (``"/asym"`` in names).
    symmetric: bool = True
    #: ``False``: the narrow grid, ``amax / 7`` and codes ``-7..7`` (``"/narrow"`` in names).
    full_range: bool = dataclasses.field(default=True, repr=False)

    def __post_init__(self) -> None:
        if self.full_range is not False and self.full_range is not True:
            raise TypeError(
                f"`full_range` must be a bool. Received: full_range={self.full_range!r}"
            )
        if not self.full_range and not self.symmetric:
            raise ValueError(
                "`full_range=False` is the narrow symmetric grid's (a zero point uses all 16 "
                "codes): 'int4/<block>/narrow' or 'int4/<block>/asym', not both."
            )
        if is_bad_block(self.block_size):
            raise ValueError(
                f"`block_size` must be -1 (per channel) or from 1 to {MAX_INT4_BLOCK}. "
                f"Received: block_size={self.block_size!r}"
            )
        check_symmetric(self.symmetric)

    def __repr__(self) -> str:
        narrow = "" if self.full_range else ", full_range=False"
        return f"Int4Scheme(block_size={self.block_size}, symmetric={self.symmetric}{narrow})"

    @classmethod
    def parse(cls, text: str) -> Int4Scheme | None:
        base, sep, block_text = text.partition("/")
        if base != "int4":
            return None
        for end, grid in (
            (ASYM, {"symmetric": False}),
            (NARROW, {"full_range": False}),
            (FULL, {}),
        ):
            if block_text.endswith(end) and block_text.count("/") == 1:
                scheme = cls.parse(text[: -len(end)])
                return None if scheme is None else cls(block_size=scheme.block_size, **grid)
        if not sep or block_text == "None":  # Keras's legacy "int4/None": per channel
            return cls(block_size=-1)
        block = int_from_text(block_text, -1, MAX_INT4_BLOCK)
        if block is None or block == 0:
            raise ValueError(
                f"Invalid quantization mode. The block size of `mode` must be -1 "
                f"(per channel) or from 1 to {MAX_INT4_BLOCK} in ASCII digits, as in "
                f"'int4/128' (a zero point per group: 'int4/128/asym'). "
                f"Received: mode={bounded_repr(text)}"
            )
        return cls(block_size=block)

    def mode_text(self, given: str | None = None) -> str:
        # "int4" stays "int4" (Keras's own spelling); a given block is written canonically.
        if given is not None and "/" not in given and self.symmetric and self.full_range:
            return "int4"
        grid = NARROW if not self.full_range else "" if self.symmetric else ASYM
        return f"int4/{self.block_size}{grid}"

    def quantize(self, x: Any, stacked: int) -> Any:
        if not self.symmetric:
            return zero_point.quantize_asymmetric(x, self.block_size, stacked)
        grid = symmetric_grid.INT4 if self.full_range else symmetric_grid.INT4_NARROW
        return quantization.quantize(x, "int4", self.block_size, stacked, grid)

    def describe(self, kernel: Any) -> str:
        # By its storage: the kernel may have been quantized under another int format.
        return matmuls.storage_label(kernel)

    def matmul(self, kind: str, *, path: str, state: Any, kernel: Any) -> Callable[..., Any] | None:
        if quantization.is_quantized(kernel):
            return matmuls.stored_kernel(kind, path, kernel, scheme=self, int8_compute=False)
        return None
