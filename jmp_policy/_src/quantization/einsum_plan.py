"""A layer's two-operand einsum as one ``dot_general`` with the kernel on the right.

``jnp.einsum`` hands its ``_dot_general`` the operands in whichever order spares a
transpose, and as tracers of its own ``jit``: for ``'BTD,CKDH->CBTKH'`` (a kernel with
leading free axes) the kernel comes first, and nothing inside tells it from the input.
The routed matmuls (int8/int4 kernels, float8 with a state per operand) need to know
which operand is the kernel, so a plain contraction (each name once per operand, every
name of an operand in the other or in the output) runs here as ``dot_general(input,
kernel)`` and one transpose into the output's order. Other subscripts return ``None``.

Nothing here knows Flax.
"""

from __future__ import annotations

from typing import Any, NamedTuple

_ELLIPSIS = "..."


class EinsumPlan(NamedTuple):
    """``dot_general(input, kernel, dims)`` then ``transpose(perm)`` (``None``: none)."""

    dims: tuple[tuple[tuple[int, ...], tuple[int, ...]], tuple[tuple[int, ...], tuple[int, ...]]]
    perm: tuple[int, ...] | None


def _expand(term: str, fresh: str) -> str:
    return term.replace(_ELLIPSIS, fresh, 1)


def plan(
    subscripts: Any, lhs_shape: tuple[int, ...], rhs_shape: tuple[int, ...]
) -> EinsumPlan | None:
    """The plan of ``einsum(subscripts, lhs, rhs)`` as one contraction, or ``None``.

    An ellipsis may stand in the input and the output (``'...F,FD->...D'``), not in the
    kernel.

    Examples:
        >>> from jmp_policy._src.quantization.einsum_plan import plan
        >>> plan("BTD,CKDH->CBTKH", (2, 6, 8), (2, 3, 8, 4))
        EinsumPlan(dims=(((2,), (2,)), ((), ())), perm=(2, 0, 1, 3, 4))
        >>> plan("BTNH,NHD->BTD", (2, 6, 3, 4), (3, 4, 8))
        EinsumPlan(dims=(((2, 3), (0, 1)), ((), ())), perm=None)
        >>> plan("ii,ij->j", (2, 2), (2, 3)) is None   # a repeated name: left to jnp.einsum
        True
    """
    if not isinstance(subscripts, str) or "->" not in subscripts:
        return None
    inputs, out = subscripts.replace(" ", "").split("->")
    terms = inputs.split(",")
    if len(terms) != 2 or _ELLIPSIS in terms[1]:
        return None
    a, b = terms
    extra = len(lhs_shape) - len(a.replace(_ELLIPSIS, "")) if _ELLIPSIS in a else 0
    unused = [chr(c) for c in range(0x3B1, 0x3CA) if chr(c) not in subscripts]
    if extra < 0 or extra > len(unused):
        return None
    a, out_names = _expand(a, "".join(unused[:extra])), _expand(out, "".join(unused[:extra]))
    names = (a, b, out_names)
    if len(a) != len(lhs_shape) or len(b) != len(rhs_shape):
        return None
    if any(len(set(n)) != len(n) or not all(c.isalpha() for c in n) for n in names):
        return None
    if set(out_names) - set(a) - set(b) or set(a) - set(b) - set(out_names):
        return None
    if set(b) - set(a) - set(out_names):
        return None
    shared = [c for c in a if c in b]
    if any(lhs_shape[a.index(c)] != rhs_shape[b.index(c)] for c in shared):
        return None  # a broadcast size-1 axis: jnp.einsum's own handling
    contract = [c for c in shared if c not in out_names]
    batch = [c for c in out_names if c in shared]
    dims = (
        (tuple(a.index(c) for c in contract), tuple(b.index(c) for c in contract)),
        (tuple(a.index(c) for c in batch), tuple(b.index(c) for c in batch)),
    )
    result = batch + [c for c in a if c not in shared] + [c for c in b if c not in shared]
    perm = tuple(result.index(c) for c in out_names)
    return EinsumPlan(dims, None if perm == tuple(range(len(perm))) else perm)
