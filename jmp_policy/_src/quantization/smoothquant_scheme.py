"""The SmoothQuant format, ``"smoothquant/8"`` (:mod:`~jmp_policy._src.quantization.smoothquant`).

A calibrated format as GPTQ and AWQ are (named in a map, solved by ``calibrate`` from each
layer's statistics): its kernels are int8 per output channel times the smoothing scale
``s``, stored with ``s`` as AWQ's are, and its layers run int8 x int8 (the inputs divided by
``s``, then quantized per row) from :data:`~jmp_policy._src.quantization.kernel_matmul.
INT8_GEMM_MIN_ROWS` rows, weight-only below, as an int8 policy's layers do.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

from jmp_policy._src import schemes
from jmp_policy._src.dtypes import bounded_repr
from jmp_policy._src.quantization import smoothquant
from jmp_policy._src.quantization.calibrated_schemes import AWQScheme


@dataclasses.dataclass(frozen=True, kw_only=True)
class SmoothQuantScheme(AWQScheme):
    """SmoothQuant (Xiao et al., 2023): ``"smoothquant/8"``, int8 weights and int8 x int8
    compute, with ``alpha`` (the migration strength; 0.5 the paper's default).

    Examples:
        >>> from jmp_policy._src.quantization.smoothquant_scheme import SmoothQuantScheme
        >>> scheme = SmoothQuantScheme.parse("smoothquant/8")
        >>> scheme.mode_text(), scheme.alpha, scheme.storage_mode
        ('smoothquant/8', 0.5, 'int8')
    """

    mode: ClassVar[str] = "smoothquant"
    grammar: ClassVar[tuple[str, ...]] = ("'smoothquant/8'", "'smoothquant'")
    bits: ClassVar[tuple[int, ...]] = (8,)
    int8_compute: ClassVar[bool] = True

    weight_bits: int = 8
    group_size: int = -1
    alpha: float = smoothquant.DEFAULT_ALPHA

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "alpha", smoothquant.check_alpha(self.alpha))

    @classmethod
    def parse(cls, text: str) -> SmoothQuantScheme | None:
        base, sep, rest = text.partition("/")
        if base != cls.mode:
            return None
        if sep and rest not in ("8", "8/-1"):  # the bare token: "smoothquant/8" too
            cls_name = schemes.class_of(cls).__name__
            raise ValueError(
                f"Invalid mode for {cls_name}. Expected 'smoothquant/8' (int8 weights per "
                f"output channel, int8 x int8 compute). Received: mode={bounded_repr(text)}"
            )
        return cls()

    def mode_text(self, given: str | None = None) -> str:
        return f"{self.mode}/8"

    def describe(self, kernel: Any) -> str:
        # "smoothquant int8 weights: int8 x int8" (the stored kernel, its scale divided out
        # of the inputs before; a layer calibrate did not see holds plain int8).
        return f"smoothquant {kernel.mode}"

    def config_fields(self) -> dict[str, Any]:
        """``alpha`` where it is not the default (configs of the default carry none)."""
        return {} if self.alpha == smoothquant.DEFAULT_ALPHA else {"alpha": self.alpha}

    def solve(
        self,
        x: Any,
        gram: Any,
        mean_abs: Any,
        options: Mapping[str, Any],
        in_axes: int = 1,
        abs_max: Any = None,
    ) -> Any:
        if abs_max is None:
            raise ValueError("SmoothQuant needs each layer's `max |x|` (`abs_max`).")
        return smoothquant.smoothquant_quantize(x, abs_max, alpha=self.alpha, in_axes=in_axes)
