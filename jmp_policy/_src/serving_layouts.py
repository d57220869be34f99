"""Serving with the weights in the device layouts XLA chooses (``compile_for_serving``).

A jitted function reads its arguments in JAX's default layout (row-major), so an int8
kernel stored ``[in, out]``, as Keras and Flax store kernels, reaches an int8 x int8 GEMM
with its contracted axis outermost. Hopper's 8-bit tensor-core instructions read both
operands with the contracted axis innermost, so XLA transposes every s8 kernel at every
call (compiled for an H100: one transpose per kernel). Compiled with ``Layout.AUTO`` for the
variables, XLA picks each variable's layout itself (``major_to_minor=(1, 0)`` for those
kernels: the same logical ``[in, out]`` array, stored ``[out, in]`` on the device), and the
transposes are gone. On one H200 the int8 x int8 GEMM on a kernel stored that way ran in
1.04x bf16's speed at 256 rows against 0.49x for the default layout (hand-written forms,
``benchmarks/int4_block_forms.py``, docs/benchmarks.md).

Nothing here changes a variable's shape, dtype, sharding or values: only how its bytes lie
in device memory, which the returned variables carry (``jax.Array.format``).
"""

from __future__ import annotations

import reprlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental.layout import Format, Layout

from jmp_policy._src.batch_checks import blaming

LAYOUTS = ("auto", "keep")


def _check(fn: Any, variables: Any, args: tuple[Any, ...], layouts: Any) -> None:
    if not callable(fn):
        raise TypeError(
            f"compile_for_serving: `fn` must be a function of (variables, *args), such as "
            f"jp.linen.apply(model, policy); got {reprlib.repr(fn)} of type "
            f"{type(fn).__name__}."
        )
    if not isinstance(layouts, str) or layouts not in LAYOUTS:
        raise ValueError(
            f"compile_for_serving: `layouts` must be 'auto' (XLA chooses each variable's "
            f"layout) or 'keep' (each variable's own, e.g. from an earlier call for another "
            f"input shape); got {layouts!r}."
        )
    flat = jax.tree_util.tree_flatten_with_path((variables, args))[0]
    for path, leaf in flat:
        if isinstance(leaf, jax.core.Tracer):
            where = "variables" if path[0].idx == 0 else "args"  # type: ignore[attr-defined]
            raise TypeError(
                f"compile_for_serving compiles ahead of time: call it outside jax.jit, "
                f"jax.grad and jax.vmap (a traced value was given in "
                f"{where}{jax.tree_util.keystr(path[1:])})."
            )


def _sharding(leaf: Any) -> Any:
    """A committed array's sharding (or a ``ShapeDtypeStruct``'s); ``None`` for the rest
    (an uncommitted array, a NumPy or Python value), which go where the program puts them,
    as under ``jax.jit``."""
    if isinstance(leaf, jax.Array) and not leaf.committed:
        return None
    return getattr(leaf, "sharding", None)


def _abstract(leaf: Any) -> Any:
    """``leaf`` as a ``ShapeDtypeStruct`` (its weak type kept, so the program computes in
    the dtypes ``jax.jit`` would)."""
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return leaf
    typeof = getattr(jax, "typeof", None) or getattr(jax.core, "get_aval")  # noqa: B009
    aval = typeof(leaf)
    return jax.ShapeDtypeStruct(
        aval.shape, aval.dtype, sharding=_sharding(leaf), weak_type=aval.weak_type
    )


def _format(leaf: Any, layouts: str) -> Any:
    """The input format ``layouts`` asks for one variable (``None``: JAX's default)."""
    if layouts == "auto":
        return Format(Layout.AUTO, _sharding(leaf))
    if isinstance(leaf, jax.Array) and leaf.committed:
        return getattr(leaf, "format", None)  # not in jax 0.10's type stubs
    return None


def serving_lowering(
    fn: Callable[..., Any], variables: Any, *args: Any, layouts: str = "auto"
) -> Any:
    """``jax.jit(fn)`` lowered on ``(variables, *args)`` with the variables' layouts as
    ``layouts`` asks (arrays or ``jax.ShapeDtypeStruct``); :func:`compile_for_serving`
    compiles it. Checks its arguments as that does."""
    _check(fn, variables, args, layouts)
    formats = jax.tree.map(lambda leaf: _format(leaf, layouts), variables)
    if layouts == "auto":  # jit takes Layout.AUTO for abstract values only
        variables = jax.tree.map(_abstract, variables)
    hint = "`args` must be example inputs of `fn(variables, *args)`, of its shapes and dtypes."
    with blaming("args", args, "compile_for_serving", hint):
        return _lower(fn, formats, variables, args)


def _lower(fn: Callable[..., Any], formats: Any, variables: Any, args: tuple[Any, ...]) -> Any:
    in_shardings = (formats, *(None for _ in args))
    return jax.jit(fn, in_shardings=in_shardings).lower(variables, *args)


def compile_for_serving(
    fn: Callable[..., Any], variables: Any, *args: Any, layouts: str = "auto"
) -> tuple[Any, Any]:
    """Compiles ``fn(variables, *args)`` with the variables' device layouts chosen by XLA,
    and returns the compiled function with the variables put in those layouts.

    For serving quantized weights on a GPU: an int8 kernel stored ``[in, out]`` (Keras's and
    Flax's layout) reaches the int8 x int8 GEMM transposed at every call in JAX's default
    layout; in the layout XLA picks (``jax.experimental.layout.Layout.AUTO``) it is stored
    ``[out, in]`` on the device, once, and the GEMM reads it as it is. Shapes, dtypes,
    shardings and values stay as they were; on a CPU the layouts chosen are the default
    ones. Like any ahead-of-time compiled function, the result takes arguments of the
    shapes it was compiled for: for another input shape (a decode step after a prefill)
    call this again with ``layouts="keep"`` and the returned variables, so that both
    programs read one copy of the weights.

    Args:
      fn: a function of ``(variables, *args)``, e.g. ``jp.linen.apply(model, policy)``
        (NNX: a function of the state).
      variables: the pytree of arrays ``fn`` takes first (``QuantizedArray`` leaves
        included); each committed array's sharding is kept.
      *args: example inputs, positional arrays or pytrees of arrays: their shapes and
        dtypes are the compiled function's.
      layouts: ``"auto"`` (XLA chooses each variable's layout) or ``"keep"`` (each
        variable's current ``jax.Array.format``).

    Returns:
      ``(compiled, variables)``: ``compiled(variables, *args)`` runs the program; the
      variables returned are in its layouts (where this JAX cannot put an array in the
      layout XLA asks, as jax 0.10 on a CPU for ``int4``, that array keeps its own and the
      program is called through ``jax.jit``, under a mesh too). The ones given are not
      changed; a returned array whose layout did not change may be the given one, so free
      the given variables by dropping them, not with ``delete()``.

    Raises:
      ValueError: ``layouts`` is neither ``"auto"`` nor ``"keep"``.
      TypeError: ``fn`` is not callable, or a value is traced (call this outside ``jit``).

    Examples:
        >>> import flax.linen as nn
        >>> import jax, jax.numpy as jnp
        >>> import jmp_policy as jp
        >>> model = nn.Dense(256)
        >>> x = jnp.ones((128, 256), jnp.bfloat16)
        >>> variables = jp.get("int8_from_float32").quantize(
        ...     model.init(jax.random.key(0), x))
        >>> serve = jp.linen.apply(model, "int8_from_mixed_bfloat16")
        >>> compiled, variables = jp.compile_for_serving(serve, variables, x)
        >>> y = compiled(variables, x)
        >>> y.dtype, bool(jnp.all(y == jax.jit(serve)(variables, x)))
        (dtype(bfloat16), True)
    """
    compiled = serving_lowering(fn, variables, *args, layouts=layouts).compile()
    wanted = compiled.input_formats[0][0]
    placed = jax.device_put(variables, wanted)
    leaves, tree = jax.tree.flatten(placed)
    formats = jax.tree.leaves(wanted)
    # a variable `fn` never reads has no layout in the program (`None`): any will do
    ok = [
        f.layout is None or a.format.layout == f.layout
        for a, f in zip(leaves, formats, strict=True)
    ]
    if not all(ok):
        # A layout this JAX cannot put an array in (jax 0.10's CPU client keeps int4
        # arrays unpacked where XLA asks for them packed): those variables keep the layout
        # they have (a copy, their sharding alone given), the others the one XLA chose.
        given = jax.tree.leaves(variables)
        copies = [
            a if good else jnp.array(g, copy=True)
            for a, g, good in zip(leaves, given, ok, strict=True)
        ]
        kept = [f if good else c.sharding for c, f, good in zip(copies, formats, ok, strict=True)]
        placed = jax.tree.unflatten(tree, copies)
        kept_formats = jax.tree.unflatten(tree, kept)
        compiled = _Unplaceable(
            _lower(fn, kept_formats, placed, args).compile(),
            jax.jit(fn, in_shardings=(kept_formats, *(None for _ in args))),
        )
    return compiled, placed


class _Unplaceable:
    """The compiled program for variables some of which this JAX cannot put in the layout
    XLA compiled for (jax 0.10's CPU client keeps ``int4`` arrays unpacked where the program
    reads them packed). Called, it runs the same program through ``jax.jit``, whose dispatch
    hands such arrays over in the program's layout: an ahead-of-time compiled program checks
    committed arguments' layouts (arrays under a mesh are committed) and refuses them.
    Everything else (``input_formats``, ``as_text()``...) is the compiled program's."""

    def __init__(self, compiled: Any, jitted: Callable[..., Any]) -> None:
        self._compiled, self._jitted = compiled, jitted

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._jitted(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._compiled, name)
