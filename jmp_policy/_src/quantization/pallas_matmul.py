"""A Pallas kernel (Triton backend) for weight-only ``x @ dequant(W)`` at few rows.

``x`` (1 to :data:`MAX_ROWS` rows, bf16/f16/f32) times an int8 kernel (a scale per output
channel) or an int4 kernel (per channel, or in blocks of rows), the scales applied in the
kernel, accumulated in float32, the result in the compute dtype. A decode step multiplies
a few rows by a large kernel: its time is the weight bytes read, so the kernel splits the
input dimension (split-K) as well as the output one, so that one row still starts enough
programs to fill every SM; the partial sums (float32, ``[splits, rows, out]``, kept to a
quarter of the weight bytes: fewer splits at more rows) are added by XLA after the kernel.

Layout. The weights are read as stored, with no copy: int8 as ``[in, out]``; int4
(``jnp.int4``, which XLA stores two per byte along the last axis) bitcast to int8
``[in, out / 2]``, each byte holding output columns ``2j`` (low nibble) and ``2j + 1``
(high nibble), unpacked in the kernel into two products whose results are interleaved
after it (so int4 needs an even number of output features). Shapes that are not
multiples of the tiles are masked: rows are padded (``x`` is small), the input dimension
is masked in the kernel and out-of-range output columns are never written.

Tiles (:data:`TILES`) were tuned on an H100, where the kernel reads weights at about 1.4
TB/s (int8), short of XLA's own weight-only GEMM (2.0 TB/s): it stays opt-in (see
:mod:`~jmp_policy._src.quantization.serving_kernels`). ``interpret=True`` runs the same
kernel on any backend (the tests run it on CPUs).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

# The most rows the kernel takes (the decode sizes it is made for; Triton's dot needs at
# least 16, so fewer are padded to 16).
MAX_ROWS = 64
# int4 block sizes the kernel takes: one block is one step of its loop over the input
# dimension (a power of two, for Triton's tensors, of at least 16 rows, for its dot).
BLOCK_SIZES = (16, 32, 64, 128, 256)


@dataclasses.dataclass(frozen=True)
class Tiles:
    """The kernel's tiles: ``out`` output columns (int4: bytes, two columns each) and
    ``step`` input rows per step of a program's loop, the ``programs`` to start at least
    (the split over the input dimension grows until there are that many), and the most
    bytes of float32 partial sums, as a fraction of the weight bytes (``partials``: more
    rows, fewer splits)."""

    out: int = 128
    step: int = 128
    programs: int = 264
    partials: float = 0.25
    warps: int | None = None  # Triton's num_warps (None: Pallas's default, 4)
    stages: int | None = None  # Triton's num_stages (None: Pallas's default, 3)
    # At most this many rows (a power of two) are multiplied on CUDA cores: each row's
    # products summed over the input, no padding to Triton's 16-row dot (0: never).
    fma_rows: int = 0
    # Zero the weights beyond the input dimension (a select per weight byte). Not needed
    # for the result: ``x`` is zero-padded there and integer weights are finite.
    mask_weights: bool = True


# Tuned on an H100 (jax 0.11.2, 2026-11-27; benchmarks/pallas_tune.py, docs/benchmarks.md):
# 64 columns and four programs per SM (528 of 132 SMs) were the fastest of 14 tiles for
# int4 and int4/128 at 1 and 16 rows, and within 6% of the fastest for int8 (step 64).
TILES = Tiles(out=64, programs=528)


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _steps_per_split(steps: int, blocks: int, tiles: Tiles, most: float) -> int:
    """Steps per split (a power of two): as many splits as start ``tiles.programs``, at
    most ``most`` of them."""
    want = max(1, min(-(-tiles.programs // blocks), int(most)))
    return _pow2(-(-steps // min(steps, want)))


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What one program of the kernel needs to know: the input features ``k``, ``step``
    input rows per step and ``per`` steps per program, the padded ``rows`` of ``x``, ``out``
    columns per program, the weights' storage and the compute dtype."""

    k: int
    step: int
    per: int
    rows: int
    out: int
    int4: bool
    blocked: bool
    compute: np.dtype
    fma: bool = False  # rows on CUDA cores; ``x`` then comes transposed, ``[in, rows]``
    mask: bool = True


def _body(plan: _Plan, *refs: Any) -> None:
    """One program: its split of the input dimension times its block of output columns,
    float32 partial sums scaled (int4 blocks: per step), written to its slot."""
    x_ref, w_ref = refs[:2]
    halves = 2 if plan.int4 else 1
    s_refs, o_refs = refs[2 : 2 + halves], refs[2 + halves :]
    first = pl.program_id(1) * plan.per * plan.step
    precision = jax.lax.Precision.HIGHEST if plan.compute == np.float32 else None

    def products(at: Any, xs: Any, wv: Any) -> list[Any]:
        """This step's products: one ``[rows, out]`` dot, or on CUDA cores one ``[1, out]``
        sum a row (``x`` transposed, each row a column read from the ref)."""
        if not plan.fma:
            return [jnp.dot(
                xs, wv.astype(plan.compute), precision=precision,
                preferred_element_type=jnp.float32,
            )]  # fmt: skip
        w32 = wv.astype(jnp.float32)
        return [
            jnp.sum(x_ref[pl.ds(at, plan.step), pl.ds(r, 1)].astype(jnp.float32) * w32, axis=0,
                    keepdims=True)
            for r in range(plan.rows)
        ]  # fmt: skip

    def one_step(i: Any, accs: Any) -> Any:
        at = i * plan.step
        xs = None
        if not plan.fma:
            valid = first + at + jax.lax.broadcasted_iota(jnp.int32, (plan.step,), 0) < plan.k
            xs = jnp.where(valid[None, :], x_ref[:, pl.ds(at, plan.step)], 0)
            xs = xs.astype(plan.compute)
        packed = w_ref[pl.ds(at, plan.step), :]
        if plan.mask:  # else x's zero padding meets the weights past the input dimension
            valid = first + at + jax.lax.broadcasted_iota(jnp.int32, (plan.step,), 0) < plan.k
            packed = jnp.where(valid[:, None], packed, 0)
        if plan.int4:  # sign-extended nibbles: low (even columns), then high (odd ones)
            ws = [jnp.right_shift(jnp.left_shift(packed, 4), 4), jnp.right_shift(packed, 4)]
        else:
            ws = [packed]
        new = []
        for acc, wv, s_ref in zip(accs, ws, s_refs, strict=True):
            parts = products(at, xs, wv)
            if plan.blocked:
                parts = [part * s_ref[pl.ds(i, 1), :] for part in parts]
            new.append(tuple(a + part for a, part in zip(acc, parts, strict=True)))
        return tuple(new)

    shape = (1, plan.out) if plan.fma else (plan.rows, plan.out)
    groups = plan.rows if plan.fma else 1
    zero = tuple(tuple(jnp.zeros(shape, jnp.float32) for _ in range(groups)) for _ in o_refs)
    accs = jax.lax.fori_loop(0, plan.per, one_step, zero) if plan.per > 1 else one_step(0, zero)
    for acc, s_ref, o_ref in zip(accs, s_refs, o_refs, strict=True):
        for r, part in enumerate(acc):
            value = part if plan.blocked else part * s_ref[...]
            if plan.fma:
                o_ref[pl.ds(r, 1), :] = value
            else:
                o_ref[...] = value


def weight_only_matmul(
    x: jax.Array,
    values: jax.Array,
    scale: jax.Array,
    block_size: int | None = None,
    out_dtype: Any = None,
    *,
    interpret: bool = False,
    tiles: Tiles | None = None,
) -> jax.Array:
    """``x @ (values * scale)`` by the Pallas kernel (see the module docstring).

    Args:
        x: ``[rows, in]``, rows at most :data:`MAX_ROWS`, in the compute dtype.
        values: ``[in, out]``, ``int8`` or ``int4`` (int4: ``out`` even).
        scale: float32, ``(out,)`` or ``(1, out)`` per channel, ``(blocks, out)`` for
            int4 blocks of ``block_size`` rows.
        block_size: int4's rows per block (one of :data:`BLOCK_SIZES`); ``None`` or ``-1``
            per channel.
        out_dtype: the result's dtype (default: ``x``'s).
        interpret: run the kernel in Pallas's interpreter (any backend).
        tiles: the kernel's :class:`Tiles` (default: :data:`TILES`, read at each call).

    Returns:
        ``[rows, out]`` in ``out_dtype``.
    """
    tiles = TILES if tiles is None else tiles
    m, k = x.shape
    n = values.shape[1]
    compute = np.dtype(x.dtype)
    out_dtype = np.dtype(out_dtype or compute)
    int4 = np.dtype(values.dtype) == np.dtype(jnp.int4)
    blocked = block_size not in (None, -1)
    scale = jnp.asarray(scale, jnp.float32).reshape(-1, n)
    if int4:
        # XLA stores int4 two per byte along the last axis: this bitcast reads those bytes.
        w = jax.lax.bitcast_convert_type(values.reshape(k, n // 2, 2), jnp.int8)
        scales = [scale[:, 0::2], scale[:, 1::2]]
    else:
        w, scales = values, [scale]
    cols = w.shape[1]
    fma = _pow2(m) <= tiles.fma_rows
    rows = _pow2(m) if fma else max(16, _pow2(m))
    step = int(block_size) if blocked else tiles.step  # type: ignore[arg-type]
    out_blocks = -(-cols // tiles.out)
    steps = -(-k // step)
    weight_bytes = k * n * (0.5 if int4 else 1.0)
    per = _steps_per_split(steps, out_blocks, tiles, tiles.partials * weight_bytes / (4 * rows * n))
    splits = -(-steps // per)
    chunk = per * step
    # x and the block scales are small: padded to whole splits (zeros), never read out of range.
    x = jnp.pad(x, ((0, rows - m), (0, splits * chunk - k)))
    if blocked:
        scales = [jnp.pad(s, ((0, splits * per - s.shape[0]), (0, 0))) for s in scales]

    plan = _Plan(k, step, per, rows, tiles.out, int4, blocked, compute, fma, tiles.mask_weights)
    x_spec = pl.BlockSpec((rows, chunk), lambda j, s: (0, s))
    if fma:  # transposed: each row a column, which broadcasts against the weight tile
        x, x_spec = x.T, pl.BlockSpec((chunk, rows), lambda j, s: (s, 0))
    scale_rows = per if blocked else 1
    scale_index = (lambda j, s: (s, j)) if blocked else (lambda j, s: (0, j))
    partial = pl.pallas_call(
        functools.partial(_body, plan),
        # The partial sums hold the padded rows too: on a GPU a block taller than its array
        # is not masked (1 row written as 16 overwrote the next split's sums, H100 2026-11-27).
        out_shape=[jax.ShapeDtypeStruct((splits, rows, cols), jnp.float32) for _ in scales],
        grid=(out_blocks, splits),
        in_specs=[
            x_spec,
            pl.BlockSpec((chunk, tiles.out), lambda j, s: (s, j)),
            *(pl.BlockSpec((scale_rows, tiles.out), scale_index) for _ in scales),
        ],
        out_specs=[pl.BlockSpec((None, rows, tiles.out), lambda j, s: (s, 0, j)) for _ in scales],
        interpret=interpret,
        **_compiler_params(tiles, interpret),
    )(x, w, *scales)
    ys = [p[:, :m].sum(0) for p in partial]
    y = ys[0] if len(ys) == 1 else jnp.stack(ys, axis=-1).reshape(m, n)
    return y.astype(out_dtype)


def _compiler_params(tiles: Tiles, interpret: bool) -> dict[str, Any]:
    """Triton's warps and stages, where :class:`Tiles` sets them."""
    if interpret or (tiles.warps is None and tiles.stages is None):
        return {}
    from jax.experimental.pallas import triton as pl_triton

    params = pl_triton.CompilerParams(num_warps=tiles.warps, num_stages=tiles.stages)
    return {"compiler_params": params}


def supports(values: jax.Array, block_size: int | None, rows: int) -> bool:
    """Whether the kernel takes a 2-D kernel of these ``values`` at ``rows`` rows."""
    if values.ndim != 2 or not 1 <= rows <= MAX_ROWS:
        return False
    dtype = np.dtype(values.dtype)
    if dtype == np.dtype(jnp.int8):
        return True
    if dtype != np.dtype(jnp.int4) or values.shape[1] % 2:
        return False
    return block_size in (None, -1) or block_size in BLOCK_SIZES
