"""Grouped GEMM kernels in Pallas Mosaic GPU (Hopper): the three GEMMs of ``grouped_dense``.

``rows_gemm`` multiplies rows sorted by group with their group's matrix, ``[M, C] x [G, N, C] ->
[M, N]`` (the forward GEMM and dgrad); ``group_gemm`` contracts each group's rows on their own,
``[C, Mp] x [N, Mp] -> [G, C, N]`` (wgrad). Both take float8 (e4m3 x e4m3, e5m2 x e4m3) or
16-bit operands, both in the layout Hopper's float8 tensor-core instruction (``wgmma``) takes:
the contracted axis last. Each group's scale (the product of its two operands' ``scale_inv``)
multiplies the float32 accumulator before it is written, so a per-group scale costs no pass over
an output or a gradient. Group sizes stay on the device: the tables that map a kernel block to
its group are a few small XLA ops over ``group_sizes`` (``row_tiles``, ``aligned_columns``).

The grid is persistent: ``Tiles.programs`` blocks (one per SM of an H100), each looping over
output tiles in the L2-aware order of ``tile_order.tile_at`` (bands of ``Tiles.band`` row tiles
sweeping the columns, every other band backward). Each tile's loop over the contraction copies
operand tiles into shared memory ``stages - 1`` steps ahead (TMA copies, one barrier per stage)
while the tensor cores work on the current one; the barriers and buffers carry over from one
tile to the next. The copies are written out rather than with
``plgpu.emit_pipeline`` so that the kernels also run in Mosaic GPU's interpret mode, which is how
they are tested on a CPU against ``lax.ragged_dot_general``.

A block of rows straddling two groups is computed once per group; each pass writes only its
group's rows, with TMA stores of power-of-two heights (``store_rows``). Rows past
``sum(group_sizes)`` are written as zeros, as ``lax.ragged_dot_general`` gives them. For wgrad
the rows come in a group-aligned layout: each group's rows start at a multiple of the tile depth
and are padded with zeros (``aligned_columns``), so no tile mixes two groups.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax import Array, lax
from jax.experimental import pallas as pl
from jax.typing import DTypeLike

from te_flax._base.jax_compat import mixed_fp8_wgmma
from te_flax._ops.kernels import mosaic
from te_flax._ops.kernels.mosaic import plgpu
from te_flax._ops.kernels.tile_order import H100_SMS, band_for, tile_at

__all__ = [
    "PROMOTION_INTERVAL",
    "Accumulation",
    "Tiles",
    "aligned_columns",
    "group_gemm",
    "kernel_dtypes",
    "row_tiles",
    "rows_gemm",
    "store_rows",
    "supported_dtypes",
    "tiles_for",
]


@dataclasses.dataclass(frozen=True)
class Tiles:
    """One output tile ``rows x cols``, contracted ``depth`` at a time, ``stages`` copies deep;
    ``programs`` persistent blocks take the tiles in bands of ``band`` row tiles
    (``tile_order.tile_at``).

    The largest (128 x 128, 128 bytes deep, 4 stages) takes 160 KiB of an H100 block's 227 KiB
    of shared memory with a bfloat16 output tile: one block per SM, so ``programs`` is the
    H100's SM count (a grid of fewer tiles runs one block per tile).
    """

    rows: int = 128
    cols: int = 128
    depth: int = 128
    stages: int = 4
    programs: int = H100_SMS
    band: int = 8

    def __post_init__(self) -> None:
        if self.rows % 64 or self.cols % 8 or self.cols > 256 or self.stages < 2:
            raise ValueError(
                f"Tiles(rows={self.rows}, cols={self.cols}, stages={self.stages}): rows must be "
                "a multiple of 64 (one warpgroup instruction), cols a multiple of 8 up to 256, "
                "stages at least 2"
            )
        if self.programs < 1 or self.band < 1:
            raise ValueError(
                f"Tiles(programs={self.programs}, band={self.band}): both must be at least 1 "
                "(programs: the persistent grid's blocks, one per SM; band: the row tiles a "
                "wave sweeps the columns with)"
            )


# The most contraction elements Hopper's float8 tensor cores sum before a kernel that splits
# its accumulation adds their partial sum to float32 registers (DeepGEMM's interval).
PROMOTION_INTERVAL = 128


@dataclasses.dataclass(frozen=True)
class Accumulation:
    """How a kernel sums its contraction.

    Hopper's float8 ``wgmma`` accumulates with reduced precision (about 14 significant bits
    retained, DeepSeek-V3 technical report, section 3.3.2), over a whole contraction when
    left to it. ``split`` (a recipe's ``use_split_accumulator``, the split accumulation XLA's
    cuBLASLt GEMMs get from ``Precision.HIGHEST``) promotes the tensor cores' partial sum to a
    float32 sum in registers every contraction step, at most ``PROMOTION_INTERVAL`` elements.
    ``emulated_bits`` (interpret mode only, for tests): the tensor cores' accumulator keeps
    that many significant bits after each step (rounded toward zero), as on the hardware,
    where the interpreter sums in float32.
    """

    split: bool = False
    emulated_bits: int | None = None

    def check(self, tiles: Tiles, dtype: DTypeLike, interpret: bool) -> None:
        elements = tiles.depth
        if self.split and elements > PROMOTION_INTERVAL:
            raise ValueError(
                f"split accumulation promotes every contraction step, which must be at most "
                f"{PROMOTION_INTERVAL} elements; got Tiles(depth={elements}) for {dtype} "
                "operands: use tiles_for's depth (128 bytes)"
            )
        if self.emulated_bits is not None and not interpret:
            raise ValueError(
                "Accumulation(emulated_bits=...) emulates the tensor cores' accumulator in "
                "interpret mode; a GPU has its own: pass interpret=True or emulated_bits=None"
            )


def tiles_for(
    dtype: DTypeLike,
    rows: int,
    cols: int,
    depth: int,
    ragged_rows: bool = False,
    span: int | None = None,
) -> Tiles | None:
    """The tiles for an output of ``rows x cols`` (per group) contracted over ``depth``, with
    operands of ``dtype``; None where the kernels cannot tile it.

    128 x 128 output tiles where the axes allow, else 64. ``ragged_rows``: the rows are
    ``rows_gemm``'s, any number of them (it writes only its groups' rows; the last row tile
    reads past them, and the rows it computes there are not written). 128 bytes of
    contraction per step where ``depth`` is a multiple of them, else 64 bytes (a float8
    contraction of 64 or 192); the ragged contraction of wgrad: pass 0. The band of row tiles
    (``tile_order.band_for``) from the contraction a row tile's strip spans: ``span``
    elements (wgrad: a group's rows, about ``M / G``), else ``depth``.
    """
    itemsize = jnp.dtype(dtype).itemsize
    steps = [size // itemsize for size in (128, 64) if depth % (size // itemsize) == 0]
    if not steps or cols % 64 or (rows % 64 and not ragged_rows):
        return None
    tile_rows, tile_cols = (128 if size % 128 == 0 else 64 for size in (rows, cols))
    strip = tile_rows * (depth if span is None else span) * itemsize
    band = band_for(strip, pl.cdiv(rows, tile_rows))
    return Tiles(rows=tile_rows, cols=tile_cols, depth=steps[0], band=band)


def kernel_dtypes(lhs: DTypeLike, rhs: DTypeLike) -> tuple[jnp.dtype, jnp.dtype] | None:
    """The operand types the kernels multiply ``lhs`` by ``rhs`` in, or None where they do not.

    The types themselves where ``wgmma`` takes them (``supported_dtypes``). An e4m3 x e5m2
    pair (the gradient GEMMs of HYBRID FP8) where this JAX's Mosaic GPU has no mixed-type
    float8 ``wgmma`` (jax 0.10): both as bfloat16, which holds every e4m3 and e5m2 value
    exactly, so the product is the float8 one, summed in float32 (as split accumulation
    would), at BF16's tensor-core rate, instead of XLA's ``ragged_dot`` expanded over every
    group (``G`` times the FLOPs).
    """
    lhs, rhs = jnp.dtype(lhs), jnp.dtype(rhs)
    if supported_dtypes(lhs, rhs):
        return lhs, rhs
    floats8 = {jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)}
    if lhs in floats8 and rhs in floats8:
        return jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.bfloat16)
    return None


def supported_dtypes(lhs: DTypeLike, rhs: DTypeLike) -> bool:
    """Whether the kernels multiply ``lhs`` by ``rhs``: two float8 types (e4m3 and e5m2 mixed
    where ``mixed_fp8_wgmma()``), or one 16-bit float type."""
    floats8 = {jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)}
    lhs, rhs = jnp.dtype(lhs), jnp.dtype(rhs)
    if lhs in floats8 and rhs in floats8:
        return lhs == rhs or mixed_fp8_wgmma()
    return lhs == rhs and lhs in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _smem_transforms(dtype: DTypeLike, depth: int) -> tuple[Any, ...]:
    """The swizzled tiling ``wgmma`` reads its shared-memory operands in."""
    swizzle = plgpu.find_swizzle(depth * jnp.dtype(dtype).itemsize * 8)
    elements = swizzle // jnp.dtype(dtype).itemsize
    return (plgpu.TilingTransform((8, elements)), plgpu.SwizzleTransform(swizzle))


def _launch(
    name: str,
    body: Any,
    out: jax.ShapeDtypeStruct,
    grid: tuple[int, ...],
    tiles: Tiles,
    interpret: bool,
) -> Any:
    """The kernel ``te_flax_{name}`` of ``body(*inputs, out_ref, lhs_smem, rhs_smem, barriers,
    out_smem)`` on the persistent grid of ``grid``'s tiles (axis ``"program"``), called on
    ``(*tables, lhs, rhs)``: shared-memory stages for both operands (their dtypes read from the
    call), one barrier per stage, and the output tile."""

    def call(*inputs: Array) -> Array:
        *_, lhs, rhs = inputs
        buffers = [
            plgpu.SMEM(
                (tiles.stages, height, tiles.depth),
                operand.dtype,
                transforms=_smem_transforms(operand.dtype, tiles.depth),
            )
            for operand, height in ((lhs, tiles.rows), (rhs, tiles.cols))
        ]
        scratch = (
            *buffers,
            plgpu.Barrier(num_arrivals=2, num_barriers=tiles.stages),
            plgpu.SMEM((tiles.rows, tiles.cols), out.dtype),
        )
        programs = {"program": _programs(grid, tiles)}
        kernel = mosaic.kernel(name, body, out, programs, scratch, interpret, warpgroup=True)
        return kernel(*inputs)

    return call


def _contract(
    tile: tuple[int, int],
    lhs_tile: Any,
    rhs_tile: Any,
    steps: Any,
    buffers: tuple[Any, ...],
    accumulation: Accumulation,
) -> Array:
    """The float32 tile ``sum_i lhs_tile(i) @ rhs_tile(i).T`` over ``steps`` contraction steps.

    ``lhs_tile(i)`` / ``rhs_tile(i)``: the global-memory tiles of step ``i``. Step ``i + stages -
    1`` is copied while step ``i`` multiplies; its stage was last read by step ``i - 1``, whose
    ``wgmma`` has finished by then (waited for, or its product read). The tensor cores
    accumulate the whole contraction, or with ``accumulation.split`` one step at a time
    (``_stepwise_sum``).
    """
    lhs_smem, rhs_smem, barriers = buffers
    stages = lhs_smem.shape[0]

    def fetch(step: Any) -> None:
        slot = lax.rem(step, stages)
        plgpu.copy_gmem_to_smem(lhs_tile(step), lhs_smem.at[slot], barriers.at[slot])
        plgpu.copy_gmem_to_smem(rhs_tile(step), rhs_smem.at[slot], barriers.at[slot])

    for first in range(stages - 1):
        pl.when(first < steps)(partial(fetch, jnp.int32(first)))

    def multiply(step: Any, acc: Any) -> None:
        """Step ``step``'s ``wgmma`` into ``acc``, then the copy ``stages - 1`` steps ahead."""
        slot = lax.rem(step, stages)
        plgpu.barrier_wait(barriers.at[slot])
        plgpu.wgmma(acc, lhs_smem.at[slot], rhs_smem.at[slot].T)
        plgpu.wgmma_wait(1)  # step - 1's wgmma, the last reader of the stage fetched next
        ahead = step + stages - 1
        pl.when(ahead < steps)(partial(fetch, ahead))

    if accumulation.split or accumulation.emulated_bits is not None:
        return _stepwise_sum(tile, multiply, steps, accumulation)

    def accumulate(acc: Any) -> Any:
        def body(step: Any, carry: Any) -> Any:
            multiply(step, acc)
            return carry

        lax.fori_loop(jnp.int32(0), jnp.asarray(steps, jnp.int32), body, ())
        plgpu.wgmma_wait(0)
        return acc[...]

    return pl.run_scoped(accumulate, plgpu.WGMMAAccumulatorRef(tile))


def _stepwise_sum(
    tile: tuple[int, int], multiply: Any, steps: Any, accumulation: Accumulation
) -> Array:
    """``sum_i product(i)`` in float32 registers, each step's product from an accumulator of
    its own: with ``accumulation.split``, the tensor cores sum ``PROMOTION_INTERVAL``
    contraction elements at most (one step, at most 128 float8 elements) before their partial
    sum is promoted, as DeepGEMM promotes Hopper's float8 partial sums.

    With ``accumulation.emulated_bits`` (interpret mode) the tensor cores' accumulator keeps
    that many bits: each step's product, and without ``split`` the running sum too, which the
    accumulator of a whole contraction holds."""
    bits = accumulation.emulated_bits

    def body(step: Any, total: Array) -> Array:
        def product(acc: Any) -> Any:
            multiply(step, acc)
            return acc[...]  # waits for this step's wgmma

        partial_sum = pl.run_scoped(product, plgpu.WGMMAAccumulatorRef(tile))
        if bits is None:
            return total + partial_sum
        if accumulation.split:
            return total + _truncated(partial_sum, bits)
        return _truncated(total + partial_sum, bits)

    total = jnp.zeros(tile, jnp.float32)
    return lax.fori_loop(jnp.int32(0), jnp.asarray(steps, jnp.int32), body, total)


def _truncated(x: Array, bits: int) -> Array:
    """``x`` (float32) rounded toward zero to ``bits`` significant bits."""
    dropped = jnp.uint32((1 << (24 - bits)) - 1)
    kept = lax.bitcast_convert_type(x, jnp.uint32) & ~dropped
    return lax.bitcast_convert_type(kept, jnp.float32)


def store_rows(out_smem: Any, out_rows: Any, first: Any, count: Any, height: int) -> None:
    """Copy rows ``[first, first + count)`` of ``out_smem`` (``count <= height``) to the same
    rows of ``out_rows``: one TMA store per set bit of ``count``, each of a static height."""
    offset = first
    size = 1 << (height.bit_length() - 1)
    while size:
        piece = size

        @pl.when(lax.bitwise_and(count, piece) != 0)
        def _(piece: int = piece, offset: Any = offset) -> None:
            plgpu.copy_smem_to_gmem(
                out_smem.at[pl.ds(offset, piece)], out_rows.at[pl.ds(offset, piece)]
            )

        offset = offset + lax.bitwise_and(count, piece)
        size //= 2
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def row_tiles(group_sizes: Array, rows: int, height: int) -> Array:
    """The blocks of ``rows_gemm``: each (row tile, group) pair that holds rows of the group.

    Returns int32 ``[T, 4]`` (group, row tile, first row in the tile, row count) for ``T =
    cdiv(rows, height) + G`` work items (a tile straddles at most ``G`` boundaries). The
    pseudo-group ``G`` is the rows past ``sum(group_sizes)``, written as zeros; unused items
    have a count of 0.
    """
    sizes = group_sizes.astype(jnp.int32)
    tail = jnp.maximum(rows - jnp.sum(sizes), 0)
    sizes = jnp.concatenate([sizes, tail[None]])  # [G + 1]
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    first_tile = starts // height
    tiles = jnp.where(sizes > 0, (ends - 1) // height - first_tile + 1, 0)
    item_end = jnp.cumsum(tiles)  # [G + 1]
    n_items = pl.cdiv(rows, height) + sizes.shape[0] - 1
    item = jnp.arange(n_items, dtype=jnp.int32)
    group = jnp.minimum(jnp.searchsorted(item_end, item, side="right"), sizes.shape[0] - 1)
    tile = first_tile[group] + item - (item_end[group] - tiles[group])
    lo = jnp.maximum(starts[group], tile * height)
    hi = jnp.minimum(ends[group], (tile + 1) * height)
    count = jnp.where(item < item_end[-1], jnp.maximum(hi - lo, 0), 0)
    return jnp.stack([group, tile, lo - tile * height, count], axis=1).astype(jnp.int32)


def rows_gemm(
    lhs: Array,
    rhs: Array,
    group_sizes: Array,
    scale: Array | None,
    out_dtype: DTypeLike,
    tiles: Tiles,
    interpret: bool = False,
    accumulation: Accumulation = Accumulation(),
) -> Array:
    """``out[r] = scale[g] * lhs[r] @ rhs[g].T`` for the rows ``r`` of group ``g``.

    Args:
        lhs: ``[M, C]``, rows sorted by group; any ``M`` (the last row tile reads past it:
            those rows are computed and not written).
        rhs: ``[G, N, C]``; ``N`` a multiple of ``tiles.cols``, ``C`` of ``tiles.depth``.
        group_sizes: int32 ``[G]``; rows past their sum give zeros.
        scale: float32 ``[G]``, or None for none.
        out_dtype: float32, bfloat16 or float16.
        tiles: the tile shape and the persistent grid's order.
        interpret: run in Mosaic GPU's interpret mode (any platform; for tests).
        accumulation: how float8 products are summed (default: by the tensor cores alone).
    """
    accumulation.check(tiles, lhs.dtype, interpret)
    (m, c), (g, n, _) = lhs.shape, rhs.shape
    scale = jnp.ones((g,), jnp.float32) if scale is None else scale.astype(jnp.float32)
    table = row_tiles(group_sizes, m, tiles.rows)
    grid = (table.shape[0], n // tiles.cols)  # (work items, column tiles)
    steps = c // tiles.depth

    def tile(refs: tuple[Any, ...], item: Any, col: Any) -> None:
        """The output tile of work item ``item`` (a row tile and one of its groups) and column
        tile ``col``."""
        table_ref, scale_ref, lhs_ref, rhs_ref, out_ref, *buffers, out_smem = refs
        group, row_tile = table_ref[item, 0], table_ref[item, 1]
        first, count = table_ref[item, 2], table_ref[item, 3]
        real = group < g

        @pl.when(count > 0)
        def _() -> None:
            rows = pl.ds(row_tile * tiles.rows, tiles.rows)
            cols = pl.ds(col * tiles.cols, tiles.cols)
            kernel = rhs_ref.at[jnp.minimum(group, g - 1)]
            acc = _contract(
                (tiles.rows, tiles.cols),
                lambda s: lhs_ref.at[rows, pl.ds(s * tiles.depth, tiles.depth)],
                lambda s: kernel.at[cols, pl.ds(s * tiles.depth, tiles.depth)],
                jnp.where(real, steps, 0),
                tuple(buffers),
                accumulation,
            )
            factor = jnp.where(real, scale_ref[jnp.minimum(group, g - 1)], 0.0)
            out_smem[...] = (acc * factor).astype(out_smem.dtype)
            plgpu.commit_smem()
            store_rows(out_smem, out_ref.at[rows, cols], first, count, tiles.rows)

    out = jax.ShapeDtypeStruct((m, n), out_dtype)
    body = partial(_persistent, tile, grid, tiles)
    return _launch("rows_gemm", body, out, grid, tiles, interpret)(table, scale, lhs, rhs)


def _programs(grid: tuple[int, ...], tiles: Tiles) -> int:
    """The persistent grid's blocks: ``tiles.programs``, or one per tile of a smaller grid."""
    return max(1, min(tiles.programs, math.prod(grid)))


def _persistent(tile: Callable[..., None], grid: tuple[int, ...], tiles: Tiles, *refs: Any) -> None:
    """One persistent block: ``tile(refs, *index)`` for the tiles of ``grid`` it takes, the
    block's own of every ``programs`` tiles of the order ``tile_order.tile_at`` gives (the last
    two axes banded; a leading axis, wgrad's groups, slowest)."""
    programs = _programs(grid, tiles)
    total, (rows, cols) = math.prod(grid), grid[-2:]
    block = lax.axis_index("program")

    def step(wave: Any, carry: Any) -> Any:
        index = wave * programs + block

        @pl.when(index < total)
        def _() -> None:
            outer = lax.div(index, jnp.int32(rows * cols))
            row, col = tile_at(lax.rem(index, jnp.int32(rows * cols)), rows, cols, tiles.band)
            tile(refs, *((outer,) if len(grid) == 3 else ()), row, col)

        return carry

    lax.fori_loop(jnp.int32(0), jnp.int32(pl.cdiv(total, programs)), step, ())


def aligned_columns(group_sizes: Array, rows: int, depth: int) -> tuple[Array, Array, int]:
    """The group-aligned layout of ``rows`` rows sorted by group, as ``group_gemm`` reads them.

    Returns ``(source, first_tile, width)``: int32 ``[width]``, the row each column of the layout
    holds (``rows`` for a padding column, to be filled with zeros), and int32 ``[G + 1]``, the
    first tile of each group (the last entry one past the last tile). Each group starts at a
    multiple of ``depth``; ``width`` bounds the layout statically.
    """
    sizes = group_sizes.astype(jnp.int32)
    n_groups = sizes.shape[0]
    width = pl.cdiv(rows, depth) * depth + n_groups * depth
    tiles = pl.cdiv(sizes, depth)
    first_tile = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(tiles)])
    starts = jnp.cumsum(sizes) - sizes
    column = jnp.arange(width, dtype=jnp.int32)
    group = jnp.minimum(
        jnp.searchsorted(first_tile[1:] * depth, column, side="right"), n_groups - 1
    )
    within = column - first_tile[group] * depth
    real = (within < sizes[group]) & (column < first_tile[-1] * depth)
    source = jnp.where(real, starts[group] + within, rows)
    return source, first_tile, width


def group_gemm(
    lhs_t: Array,
    rhs_t: Array,
    first_tile: Array,
    scale: Array | None,
    out_dtype: DTypeLike,
    tiles: Tiles,
    interpret: bool = False,
    accumulation: Accumulation = Accumulation(),
) -> Array:
    """``out[g] = scale[g] * lhs_t[:, group g] @ rhs_t[:, group g].T``: ``[G, C, N]``.

    Args:
        lhs_t: ``[C, W]``, the rows in the group-aligned layout of ``aligned_columns`` (``depth =
            tiles.depth``); ``C`` a multiple of ``tiles.rows``.
        rhs_t: ``[N, W]`` in the same layout; ``N`` a multiple of ``tiles.cols``.
        first_tile: int32 ``[G + 1]`` from ``aligned_columns``.
        scale: float32 ``[G]``, or None for none.
        out_dtype: float32, bfloat16 or float16.
        tiles: the tile shape.
        interpret: run in Mosaic GPU's interpret mode (any platform; for tests).
        accumulation: how float8 products are summed (default: by the tensor cores alone).
    """
    accumulation.check(tiles, lhs_t.dtype, interpret)
    (c, _), (n, _) = lhs_t.shape, rhs_t.shape
    g = first_tile.shape[0] - 1
    scale = jnp.ones((g,), jnp.float32) if scale is None else scale.astype(jnp.float32)

    def tile(refs: tuple[Any, ...], group: Any, row: Any, col: Any) -> None:
        """Group ``group``'s output tile ``(row, col)``."""
        first_ref, scale_ref, lhs_ref, rhs_ref, out_ref, *buffers, out_smem = refs
        start = first_ref[group]
        rows = pl.ds(row * tiles.rows, tiles.rows)
        cols = pl.ds(col * tiles.cols, tiles.cols)

        def depth(s: Any) -> Any:
            return pl.ds((start + s) * tiles.depth, tiles.depth)

        acc = _contract(
            (tiles.rows, tiles.cols),
            lambda s: lhs_ref.at[rows, depth(s)],
            lambda s: rhs_ref.at[cols, depth(s)],
            first_ref[group + 1] - start,
            tuple(buffers),
            accumulation,
        )
        out_smem[...] = (acc * scale_ref[group]).astype(out_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, out_ref.at[group, rows, cols])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    grid = (g, c // tiles.rows, n // tiles.cols)
    out = jax.ShapeDtypeStruct((g, c, n), out_dtype)
    body = partial(_persistent, tile, grid, tiles)
    launch = _launch("group_gemm", body, out, grid, tiles, interpret)
    return launch(first_tile, scale, lhs_t, rhs_t)
