"""Where the FLOPs really run: matmul FLOPs and bytes produced per dtype, read from a jaxpr."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.extend
import numpy as np

from jmp_policy._src import dtypes as dt

_MATMULS = ("dot_general", "conv_general_dilated")
_WRAPPER = re.compile(r"^(?:jvp|transpose|vmap|remat|checkpoint)\((.*)\)$")


@dataclasses.dataclass(frozen=True)
class DTypeProfile:
    """FLOPs of matmuls/convolutions and bytes of arrays produced, per dtype name.

    ``matmul_flops`` maps the operands' dtype (``"bfloat16"``; ``"bfloat16+int8"`` when
    the two operands differ) to FLOPs (2·M·N·K per matmul); ``bytes`` maps a dtype to the
    bytes of every array the program produces in it; ``sources`` maps a dtype to the
    name scopes (Flax module names) of the matmuls computed in it.
    """

    matmul_flops: Mapping[str, int]
    bytes: Mapping[str, int]
    sources: Mapping[str, tuple[str, ...]]

    def fraction(self, dtype: Any) -> float:
        """The fraction of matmul FLOPs whose operands are ``dtype``: a dtype or its name,
        or a key of :attr:`matmul_flops` (``"bfloat16+int8"``); 0.0 for a dtype not used.

        Raises:
            ValueError: ``dtype`` is none of those (the accepted names are listed).
        """
        key = _flops_key(dtype, self.matmul_flops)
        total = sum(self.matmul_flops.values())
        return self.matmul_flops.get(key, 0) / total if total else 0.0

    def summary(self) -> str:
        """``"92% of matmul FLOPs in bfloat16, 8% in float32 (head, norm)"``."""
        total = sum(self.matmul_flops.values())
        if not total:
            return "no matmul FLOPs"
        ranked = sorted(self.matmul_flops.items(), key=lambda kv: -kv[1])
        parts = []
        for i, (dtype, flops) in enumerate(ranked):
            share = f"{_percent(flops / total)} {'of matmul FLOPs ' if i == 0 else ''}in {dtype}"
            if i > 0 and self.sources.get(dtype):
                names = self.sources[dtype]
                shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
                share += f" ({shown})"
            parts.append(share)
        return ", ".join(parts)

    def __str__(self) -> str:
        w = max([16, *(len(d) for d in (*self.matmul_flops, *self.bytes))])
        lines = [
            self.summary(),
            f"{'dtype':<{w}} {'matmul FLOPs':>14} {'share':>7} {'bytes produced':>15} {'share':>7}",
        ]
        flops_total = sum(self.matmul_flops.values())
        bytes_total = sum(self.bytes.values())
        dtypes = sorted(
            set(self.matmul_flops) | set(self.bytes),
            key=lambda d: (-self.matmul_flops.get(d, 0), -self.bytes.get(d, 0), d),
        )
        for d in dtypes:
            f, b = self.matmul_flops.get(d, 0), self.bytes.get(d, 0)
            lines.append(
                f"{d:<{w}} {_si(f):>14} {_percent(f / flops_total if flops_total else 0):>7} "
                f"{_si(b, 'B'):>15} {_percent(b / bytes_total if bytes_total else 0):>7}"
            )
        return "\n".join(lines)


def _flops_key(dtype: Any, flops: Mapping[str, int]) -> str:
    """``dtype`` as a key of ``flops``: the key itself, or a dtype's (or dtypes') name."""
    if isinstance(dtype, str) and dtype in flops:
        return dtype
    parts = dtype.split("+") if isinstance(dtype, str) else [dtype]
    found = [dt.dtype_or_none(p) for p in parts]
    if all(f is not None for f in found):
        return "+".join(np.dtype(f).name for f in found)
    hint = dt.did_you_mean(dtype, [*flops, *dt.DTYPE_NAMES]) if isinstance(dtype, str) else ""
    raise ValueError(
        f"`dtype` must be a dtype or its name: this profile's are {sorted(flops)}, and any of "
        f"{sorted(dt.DTYPE_NAMES)} is accepted (a fraction of 0.0 where unused).{hint} "
        f"Received: dtype={dt.bounded_repr(dtype)}"
    )


def _percent(x: float) -> str:
    return f"{100 * x:.0f}%" if x == 0 or x >= 0.01 or x == 1 else f"{100 * x:.2f}%"


def _si(n: float, unit: str = "") -> str:
    for div, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if n >= div:
            return f"{n / div:.2f} {prefix}{unit}"
    return f"{int(n)} {unit}".rstrip()


def _scope(eqn: Any) -> str:
    """The eqn's name scope without transform wrappers and the root's own name."""
    parts = []
    for part in str(eqn.source_info.name_stack).split("/"):
        while (match := _WRAPPER.match(part)) is not None:
            part = match.group(1)
        if part:
            parts.append(part)
    return "/".join(parts[1:]) if len(parts) > 1 else "/".join(parts)


def _matmul_flops(eqn: Any) -> int:
    out = eqn.outvars[0].aval
    lhs, rhs = (v.aval for v in eqn.invars[:2])
    if eqn.primitive.name == "dot_general":
        (contract, _), _ = eqn.params["dimension_numbers"]
        k = int(np.prod([lhs.shape[d] for d in contract], dtype=np.int64))
    else:  # each output element reads the kernel's input features and window
        out_feature_dim = eqn.params["dimension_numbers"].rhs_spec[0]
        k = int(np.prod(rhs.shape, dtype=np.int64)) // max(rhs.shape[out_feature_dim], 1)
    return 2 * int(np.prod(out.shape, dtype=np.int64)) * k


def _operand_dtype(eqn: Any, origin: Mapping[Any, str]) -> str:
    names = sorted({_name(v, origin) for v in eqn.invars[:2]})
    return "+".join(names)


def _name(var: Any, origin: Mapping[Any, str]) -> str:
    """A value's dtype name, or the float8 dtype it was dequantized from."""
    found = origin.get(var) if isinstance(var, jax.extend.core.Var) else None
    return found if found is not None else np.dtype(var.aval.dtype).name


def _is_number(dtype: Any) -> bool:
    """Whether ``dtype`` is a number dtype (PRNG key arrays, ``key<fry>``, are not)."""
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        return False
    return bool(jax.dtypes.issubdtype(dtype, np.number) or jax.dtypes.issubdtype(dtype, np.bool_))


def _is_float8(dtype: Any) -> bool:
    return np.dtype(dtype).name.startswith("float8")


def _sub_jaxprs(value: Any) -> list[Any]:
    found = []
    for sub in value if isinstance(value, (tuple, list)) else (value,):
        if isinstance(sub, jax.extend.core.ClosedJaxpr):
            found.append(sub.jaxpr)
        elif isinstance(sub, jax.extend.core.Jaxpr):
            found.append(sub)
    return found


def _walk(
    jaxpr: Any,
    times: int,
    flops: dict[str, int],
    nbytes: dict[str, int],
    sources: dict[str, list[str]],
    origin_in: Mapping[Any, str] | None = None,
) -> list[str | None]:
    """Counts ``jaxpr`` into the tallies; returns the float8 origin of each output."""
    origin: dict[Any, str] = dict(origin_in or {})
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        for var in eqn.outvars:
            aval = var.aval
            if hasattr(aval, "dtype") and hasattr(aval, "shape") and _is_number(aval.dtype):
                dtype = np.dtype(aval.dtype)
                size = int(np.prod(aval.shape, dtype=np.int64)) * dtype.itemsize
                nbytes[dtype.name] = nbytes.get(dtype.name, 0) + times * size
        if name in _MATMULS:
            key = _operand_dtype(eqn, origin)
            flops[key] = flops.get(key, 0) + times * _matmul_flops(eqn)
            scope = _scope(eqn)
            if scope and scope not in sources.setdefault(key, []):
                sources[key].append(scope)
        if name == "cond":  # one branch runs: count the one with the most FLOPs
            best: tuple[int, Any] | None = None
            for branch in eqn.params["branches"]:
                f: dict[str, int] = {}
                _walk(branch.jaxpr, times, f, {}, {})
                if best is None or sum(f.values()) > best[0]:
                    best = (sum(f.values()), branch.jaxpr)
            if best is not None:
                _walk(best[1], times, flops, nbytes, sources)
            continue
        inner = times * int(eqn.params.get("length", 1)) if name == "scan" else times
        for key, value in eqn.params.items():
            if name == "while" and key == "cond_jaxpr":
                continue
            for sub in _sub_jaxprs(value):
                # jit, custom_vjp and scan bodies take the equation's inputs in order.
                same = len(sub.invars) == len(eqn.invars)
                inner_origin = (
                    {s: origin[v] for s, v in zip(sub.invars, eqn.invars, strict=True)
                     if isinstance(v, jax.extend.core.Var) and v in origin}
                    if same
                    else None
                )  # fmt: skip
                outs = _walk(sub, inner, flops, nbytes, sources, inner_origin)
                if len(outs) == len(eqn.outvars):
                    for var, found in zip(eqn.outvars, outs, strict=True):
                        if found is not None:
                            origin[var] = found
    return [origin.get(v) if isinstance(v, jax.extend.core.Var) else None for v in jaxpr.outvars]


def dtype_profile(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> DTypeProfile:
    """Traces ``fn(*args, **kwargs)`` (nothing runs) and counts, per dtype, the FLOPs of
    its matmuls and convolutions and the bytes of the arrays it produces.

    Answers "why is my step no faster?": how much of it really runs in bfloat16 (or
    float8). A matmul's FLOPs are 2·M·N·K (a convolution's: 2 * output size * the
    kernel's input features and window), keyed by the dtypes its operands really have
    (``"float8_e4m3fn"``, ``"float8_e4m3fn+float8_e5m2"`` for a float8 gradient matmul):
    an operand converted from float8 before the matmul counts as what it was converted
    to, since that is what the matmul reads. The bytes are those of every array
    an op produces; values that are not numbers (PRNG key arrays, ``jax.random.key``
    and the keys ``jax.random`` makes of a ``PRNGKey`` inside) are skipped. Sub-programs
    count: ``jit``, ``remat``,
    ``custom_vjp`` and each iteration of a ``scan`` (times its length); a ``while`` loop's
    body is counted once (its trip count is unknown), a ``cond`` as its costliest branch.
    Profile the training step itself (``jax.value_and_grad(loss)``) to count the
    backward pass too.

    Args:
        fn: any function JAX can trace (``jax.make_jaxpr``).
        *args: its arguments (arrays or ``jax.ShapeDtypeStruct``).
        **kwargs: its keyword arguments (static: closed over).

    Returns:
        A :class:`DTypeProfile`: ``matmul_flops``, ``bytes``, ``fraction(dtype)`` and a
        readable ``str`` (a summary line, then a table).

    Examples:
        >>> import jax.numpy as jnp
        >>> import jmp_policy as jp
        >>> def f(x, w1, w2):
        ...     h = x.astype(jnp.bfloat16) @ w1.astype(jnp.bfloat16)
        ...     return h.astype(jnp.float32) @ w2
        >>> x, w1, w2 = jnp.ones((8, 16)), jnp.ones((16, 32)), jnp.ones((32, 4))
        >>> profile = jp.dtype_profile(f, x, w1, w2)
        >>> profile.matmul_flops   # 2*8*32*16 and 2*8*4*32
        {'bfloat16': 8192, 'float32': 2048}
        >>> print(profile.summary())
        80% of matmul FLOPs in bfloat16, 20% in float32
    """
    if not callable(fn):
        raise TypeError(f"`fn` must be callable. Received: fn={fn!r}")
    closed = jax.make_jaxpr(lambda *a: fn(*a, **kwargs))(*args)
    flops: dict[str, int] = {}
    nbytes: dict[str, int] = {}
    sources: dict[str, list[str]] = {}
    _walk(closed.jaxpr, 1, flops, nbytes, sources)
    return DTypeProfile(flops, nbytes, {k: tuple(v) for k, v in sources.items()})
