"""How a :class:`~jmp_policy.QuantizedArray` stores its values: one frozen descriptor per
storage ``mode`` (the text its pytree metadata and checkpoints hold).

The array's checks (:mod:`jmp_policy._src.quantization.quantized_array_checks`), its
``quantize`` and ``dequantize`` and the matmul's choice of form
(:mod:`jmp_policy._src.quantization.kernel_matmul`) ask the descriptor (bits, signedness,
scales per channel or per block of rows, a zero point, the values' dtype) instead of testing
the mode's text: a new bit width is a new :class:`Storage` added with :func:`add`, not an
edit of those modules.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True, kw_only=True)
class Storage:
    """One way to store quantized values (frozen, keyword-only).

    Attributes:
        mode: the name a ``QuantizedArray``'s ``mode`` field, its tree metadata and its
            checkpoints hold (``"int8"``).
        bits: the bits of one value (4, 8).
        value_dtype: the dtype ``quantize`` writes the values in (``jnp.int4``).
        signed: values in ``[-qmax, qmax]`` (symmetric); else ``[0, 2**bits - 1]``.
        blocked: one scale per block of ``block_size`` rows along the layer's input axis
            and output channel (``block_size`` -1: one block); else one per output channel
            (``block_size`` ``None``).
        has_zero_point: every array of this storage is read with a zero point (an
            unsigned storage, say); no fast matmul form reads such values (they are
            dequantized first) and the symmetric ``quantize`` does not write them. The
            built-in signed storages take a zero point as a choice, per array
            (``QuantizedArray.zero_point``), and serve it folded into the fast forms.
        legacy_dtypes: older layouts that still load: two values a ``uint8`` byte along
            axis 0 (int4 before ``jnp.int4``).

    Examples:
        >>> from jmp_policy._src.quantization.storage import storage_of
        >>> int4 = storage_of("int4")
        >>> int4.bits, int4.qmax, int4.blocked, int4.dtype_names
        (4, 7.0, True, ('int4', 'uint8'))
    """

    mode: str
    bits: int
    value_dtype: Any
    signed: bool = True
    blocked: bool = False
    has_zero_point: bool = False
    legacy_dtypes: tuple[str, ...] = ()

    @property
    def qmax(self) -> float:
        """The largest value magnitude the grid holds (127.0 for signed 8 bits)."""
        return float(2 ** (self.bits - 1) - 1 if self.signed else 2**self.bits - 1)

    @property
    def dtype_names(self) -> tuple[str, ...]:
        """The names of the value dtypes that load: the written one first."""
        return (np.dtype(self.value_dtype).name, *self.legacy_dtypes)

    def is_packed(self, values: Any) -> bool:
        """Whether ``values`` are in a legacy packed layout (two a byte along axis 0)."""
        dtype = getattr(values, "dtype", None)
        return dtype is not None and np.dtype(dtype).name in self.legacy_dtypes

    @property
    def integer_gemm(self) -> bool:
        """Whether the values are the operand of an int8 x int8 GEMM as stored."""
        return self.bits == 8 and self.signed and not self.has_zero_point and not self.blocked


_STORAGES: dict[str, Storage] = {}


def add(storage: Storage) -> Storage:
    """Adds a storage mode (its ``mode`` text must be new)."""
    if not isinstance(storage, Storage):
        raise TypeError(f"`storage` must be a Storage. Received: storage={storage!r}")
    held = _STORAGES.get(storage.mode)
    if held is not None and held != storage:
        raise ValueError(
            f"The storage mode {storage.mode!r} is already {held!r}. Received: storage={storage!r}"
        )
    _STORAGES[storage.mode] = storage
    return storage


def remove(mode: str) -> None:
    """Removes a storage mode :func:`add` added (a test's cleanup); the built-in ones stay."""
    if mode not in (INT8.mode, INT4.mode):
        _STORAGES.pop(mode, None)


def modes() -> tuple[str, ...]:
    """Every storage mode, in the order they were added."""
    return tuple(_STORAGES)


def storage_of(mode: Any) -> Storage:
    """The storage of ``mode``.

    Raises:
        ValueError: ``mode`` names no storage (the message lists them).
    """
    found = _STORAGES.get(mode) if isinstance(mode, str) else None
    if found is None:
        raise ValueError(f"`mode` must be one of {modes()}. Received: mode={mode!r}")
    return found


def get(mode: Any) -> Storage | None:
    """The storage of ``mode``, ``None`` when it names none."""
    return _STORAGES.get(mode) if isinstance(mode, str) else None


INT8 = add(Storage(mode="int8", bits=8, value_dtype=jnp.int8))
INT4 = add(
    Storage(mode="int4", bits=4, value_dtype=jnp.int4, blocked=True, legacy_dtypes=("uint8",))
)
