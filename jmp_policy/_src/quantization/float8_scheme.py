"""The float8 format: explicit float8 matmuls with delayed or current scaling.

``"float8_from_<source>"`` (delayed scaling, the default, as in Keras and Flax: a tensor's
scale comes from an amax history kept as each layer's state) and
``"float8_current_from_<source>"`` (current scaling: the tensor's own amax, no state).
Kernels are not stored quantized: they are quantized to e4m3 at compute time
(:mod:`jmp_policy._src.quantization.float8_matmul`; the scaling is :mod:`jmp_policy._src.quantization.float8`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar

from jmp_policy._src.dtypes import MAX_AMAX_HISTORY
from jmp_policy._src.int_arguments import check_int
from jmp_policy._src.quantization import float8, float8_matmul, matmuls
from jmp_policy._src.schemes import Scheme

SCALINGS = float8.SCALINGS
DEFAULT_AMAX_HISTORY_LENGTH = 1024


@dataclasses.dataclass(frozen=True, kw_only=True)
class Float8Scheme(Scheme):
    """float8 with ``scaling`` ``"delayed"`` (state: an amax history of
    ``amax_history_length`` steps per tensor) or ``"current"`` (no state).

    Examples:
        >>> from jmp_policy._src.quantization.float8_scheme import Float8Scheme
        >>> Float8Scheme.parse("float8_current")
        Float8Scheme(scaling='current', amax_history_length=1024)
        >>> Float8Scheme(amax_history_length=4).init_state()["input_amax_history"].shape
        (4,)
    """

    mode: ClassVar[str] = "float8"
    tokens: ClassVar[tuple[str, ...]] = ("float8", "float8_current")
    grammar: ClassVar[tuple[str, ...]] = ("'float8'",)
    stores_weights: ClassVar[bool] = False
    reads_stored_kernels: ClassVar[bool] = False
    needs_routed_layers: ClassVar[bool] = True
    state_kind: ClassVar[str | None] = "float8"

    scaling: str = "delayed"
    amax_history_length: int = DEFAULT_AMAX_HISTORY_LENGTH

    def __post_init__(self) -> None:
        scaling, length = self.scaling, self.amax_history_length
        if not isinstance(scaling, str) or scaling not in SCALINGS:
            raise ValueError(f"`scaling` must be one of {SCALINGS}. Received: scaling={scaling!r}")
        why = " (amaxes kept per tensor)"
        length = check_int(length, "amax_history_length", 1, MAX_AMAX_HISTORY, why=why)
        object.__setattr__(self, "amax_history_length", length)  # a NumPy int as an int

    @classmethod
    def parse(cls, text: str) -> Float8Scheme | None:
        if text == "float8":
            return cls()
        return cls(scaling="current") if text == "float8_current" else None

    def mode_text(self, given: str | None = None) -> str:
        return "float8_current" if self.scaling == "current" else "float8"

    def config_mode(self, text: str) -> str:
        return "float8"

    def config_fields(self) -> dict[str, Any]:
        fields: dict[str, Any] = {"amax_history_length": self.amax_history_length}
        if self.scaling != "delayed":  # Keras's own configs stay as Keras writes them
            fields["scaling"] = self.scaling
        return fields

    def quantize(self, x: Any, stacked: int) -> Any:
        raise ValueError("float8 scales inputs and kernels at compute time.")

    def stateless(self) -> Float8Scheme:
        """Current scaling: the scale a delayed history settles on for the same batches."""
        return dataclasses.replace(self, scaling="current")

    def matmul(self, kind: str, *, path: str, state: Any, kernel: Any) -> Callable[..., Any] | None:
        scaling = self.scaling

        def fp8_for(_: Any) -> Callable[..., Any]:
            inner = float8_matmul.dot_general(state)

            def dot_general(lhs: Any, rhs: Any, dims: Any, *args: Any, **kw: Any) -> Any:
                matmuls.record_float8(path, *matmuls.shapes(lhs, rhs, dims), scaling)
                return inner(lhs, rhs, dims, *args, **kw)

            return dot_general

        return matmuls.as_einsum(fp8_for) if kind == "einsum" else fp8_for(None)

    def init_state(self) -> Any:
        if self.scaling != "delayed":
            return None
        return float8.init_state(self.amax_history_length)

    @property
    def stateful(self) -> bool:
        return self.scaling == "delayed"
