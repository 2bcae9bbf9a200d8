"""The blockwise FP8 GEMM kernel in Pallas Mosaic GPU (Hopper; the Pallas Triton version:
``blockwise``).

``Float8BlockScaling``'s GEMM multiplies two float8 matrices whose scales change every 128
elements of K. Each block of the kernel grid owns one output tile and keeps its float32 running
sum in registers: for each 128-wide chunk of K, the tensor cores (``wgmma``) multiply the two
float8 tiles into an accumulator of the chunk alone, which the block then multiplies by the
outer product of the chunk's row scales of both operands and adds to the sum. Only the output
tile is written, through shared memory with a TMA store.

The chunk's operand tiles and scales come into shared memory ``stages - 1`` chunks ahead (TMA
copies, one barrier per stage), while the tensor cores work on the current chunk. The copies
are written out rather than with ``plgpu.emit_pipeline`` so that the kernel also runs in Mosaic
GPU's interpret mode, which is how it is tested on a CPU against XLA's exact form
(``te_flax._ops.gemm.blockwise_gemm_exact``): the same float8 products and the same order of
scaling, ``(partial * lhs_scale) * rhs_scale``, summed chunk after chunk in float32.

Both operands hold K last, the layout float8 ``wgmma`` reads. Operands whose rows are not a
multiple of the tile are padded with zeros (and zero scales) to whole tiles, and the output is
sliced back.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax import Array, lax
from jax.experimental import pallas as pl
from jax.typing import DTypeLike

from te_flax._ops.kernels import mosaic
from te_flax._ops.kernels.common import lowered_once
from te_flax._ops.kernels.mosaic import plgpu
from te_flax.quantize.block_scaling import FP8_BLOCK

__all__ = ["BLOCK", "Tiles", "blockwise_gemm_kernel", "tiles_for"]

BLOCK = FP8_BLOCK  # K chunk: one scale per operand row and chunk (128 float8 bytes)


@dataclasses.dataclass(frozen=True)
class Tiles:
    """One output tile ``rows x cols``, its operand chunks copied ``stages`` deep.

    ``rows`` is one warpgroup's instruction height: the chunk's accumulator and the running sum
    each take ``rows * cols / 128`` float32 registers of a thread.
    """

    rows: int = 64
    cols: int = 128
    stages: int = 4

    def __post_init__(self) -> None:
        if self.rows != 64 or self.cols not in (64, 128) or self.stages < 2:
            raise ValueError(
                f"Tiles(rows={self.rows}, cols={self.cols}, stages={self.stages}): rows must be "
                "64 (one warpgroup instruction), cols 64 or 128, stages at least 2"
            )


def tiles_for(rows: int, cols: int) -> Tiles:
    """The tiles for a ``[rows, cols]`` output: 128 columns where they divide ``cols`` once
    padded to a multiple of 64, else 64."""
    padded = -(-cols // 64) * 64
    return Tiles(cols=128 if padded % 128 == 0 else 64)


def _smem_transforms(dtype: DTypeLike) -> tuple[Any, ...]:
    """The swizzled tiling ``wgmma`` reads a float8 chunk ``[height, 128]`` in."""
    swizzle = plgpu.find_swizzle(BLOCK * jnp.dtype(dtype).itemsize * 8)
    elements = swizzle // jnp.dtype(dtype).itemsize
    return (plgpu.TilingTransform((8, elements)), plgpu.SwizzleTransform(swizzle))


def _chunk_sum(tiles: Tiles, refs: tuple[Any, ...], scratch: tuple[Any, ...]) -> Any:
    """The tile's float32 ``sum_c (lhs_c @ rhs_c.T * lhs_scale_c[:, None]) * rhs_scale_c[None]``
    over the chunks ``c`` of K.

    Chunk ``c + stages - 1`` is copied while chunk ``c`` multiplies; its stage was last read by
    chunk ``c - 1``, whose product was read (so its ``wgmma`` finished) before this one began.
    """
    lhs_ref, rhs_ref, lhs_scale_ref, rhs_scale_ref = refs
    lhs_smem, rhs_smem, lhs_scale_smem, rhs_scale_smem, barriers = scratch
    chunks = lhs_ref.shape[1] // BLOCK
    rows = pl.ds(lax.axis_index("row") * tiles.rows, tiles.rows)
    cols = pl.ds(lax.axis_index("col") * tiles.cols, tiles.cols)

    def fetch(chunk: Any) -> None:
        slot, depth = lax.rem(chunk, tiles.stages), pl.ds(chunk * BLOCK, BLOCK)
        plgpu.copy_gmem_to_smem(lhs_ref.at[rows, depth], lhs_smem.at[slot], barriers.at[slot])
        plgpu.copy_gmem_to_smem(rhs_ref.at[cols, depth], rhs_smem.at[slot], barriers.at[slot])
        plgpu.copy_gmem_to_smem(
            lhs_scale_ref.at[chunk, rows], lhs_scale_smem.at[slot], barriers.at[slot]
        )
        plgpu.copy_gmem_to_smem(
            rhs_scale_ref.at[chunk, cols], rhs_scale_smem.at[slot], barriers.at[slot]
        )

    for first in range(min(tiles.stages - 1, chunks)):
        fetch(jnp.int32(first))

    def body(chunk: Any, total: Any) -> Any:
        slot = lax.rem(chunk, tiles.stages)
        plgpu.barrier_wait(barriers.at[slot])

        def product(acc: Any) -> Any:
            plgpu.wgmma(acc, lhs_smem.at[slot], rhs_smem.at[slot].T)
            ahead = chunk + tiles.stages - 1
            pl.when(ahead < chunks)(partial(fetch, ahead))
            return acc[...]

        # [rows, 128] x [cols, 128] -> [rows, cols]: this chunk's float8 products in float32.
        partial_product = pl.run_scoped(
            product, plgpu.WGMMAAccumulatorRef((tiles.rows, tiles.cols))
        )
        lhs_scale = lax.broadcast_in_dim(lhs_scale_smem[slot], partial_product.shape, [0])
        rhs_scale = lax.broadcast_in_dim(rhs_scale_smem[slot], partial_product.shape, [1])
        # The exact form's order: the chunk's float32 product times the lhs scale, then the
        # rhs scale, added to the sum of the earlier chunks.
        return total + partial_product * lhs_scale * rhs_scale

    total = jnp.zeros((tiles.rows, tiles.cols), jnp.float32)
    return lax.fori_loop(jnp.int32(0), jnp.int32(chunks), body, total)


def _padded(x: Array, multiple: int) -> Array:
    """``x`` with zero rows appended up to a multiple of ``multiple`` rows."""
    return jnp.pad(x, ((0, (-x.shape[0]) % multiple), (0, 0)))


@lowered_once("out_dtype", "interpret")
def blockwise_gemm_kernel(
    lhs: Array,
    lhs_scale_inv: Array,
    rhs: Array,
    rhs_scale_inv: Array,
    out_dtype: DTypeLike,
    *,
    interpret: bool,
) -> Array:
    """``lhs [M, K] . rhs [N, K]^T`` with per-row, per-128-of-K scales -> ``[M, N]``.

    Args:
      lhs: float8 ``[M, K]``, ``K`` a multiple of 128.
      lhs_scale_inv: float32 ``[M, K / 128]``, the dequantization scale of each row's chunk.
      rhs: float8 ``[N, K]`` (e4m3 and e5m2 mixed from jax 0.11 on).
      rhs_scale_inv: float32 ``[N, K / 128]``.
      out_dtype: the output dtype (the float32 sum is rounded to it once).
      interpret: run in Mosaic GPU's interpret mode (any platform; for tests).
    """
    (m, k), n = lhs.shape, rhs.shape[0]
    if k % BLOCK or k == 0 or rhs.shape[1] != k:
        raise ValueError(
            f"blockwise_gemm_kernel takes lhs [M, K] and rhs [N, K] with K a positive multiple "
            f"of {BLOCK}, got lhs {lhs.shape} and rhs {rhs.shape}; quantize both along K with "
            "Float8BlockScaling"
        )
    tiles = tiles_for(m, n)
    lhs, rhs = _padded(lhs, tiles.rows), _padded(rhs, tiles.cols)
    # [rows, K / 128] -> [K / 128, rows]: a chunk's scales of a tile are one contiguous copy.
    lhs_scale_t = _padded(lhs_scale_inv.astype(jnp.float32), tiles.rows).T
    rhs_scale_t = _padded(rhs_scale_inv.astype(jnp.float32), tiles.cols).T

    def body(*refs: Any) -> None:
        # The four operands, the output, then the scratch buffers of ``scratch_types``.
        operands, out_ref, buffers, out_smem = refs[:4], refs[4], refs[5:-1], refs[-1]
        total = _chunk_sum(tiles, operands, buffers)
        out_smem[...] = total.astype(out_smem.dtype)
        plgpu.commit_smem()
        rows = pl.ds(lax.axis_index("row") * tiles.rows, tiles.rows)
        cols = pl.ds(lax.axis_index("col") * tiles.cols, tiles.cols)
        plgpu.copy_smem_to_gmem(out_smem, out_ref.at[rows, cols])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    stages = tiles.stages
    kernel = mosaic.kernel(
        "blockwise_gemm",
        body,
        jax.ShapeDtypeStruct((lhs.shape[0], rhs.shape[0]), out_dtype),
        {"row": lhs.shape[0] // tiles.rows, "col": rhs.shape[0] // tiles.cols},
        (
            plgpu.SMEM(
                (stages, tiles.rows, BLOCK), lhs.dtype, transforms=_smem_transforms(lhs.dtype)
            ),
            plgpu.SMEM(
                (stages, tiles.cols, BLOCK), rhs.dtype, transforms=_smem_transforms(rhs.dtype)
            ),
            plgpu.SMEM((stages, tiles.rows), jnp.float32),
            plgpu.SMEM((stages, tiles.cols), jnp.float32),
            plgpu.Barrier(num_arrivals=4, num_barriers=stages),  # four copies per chunk
            plgpu.SMEM((tiles.rows, tiles.cols), out_dtype),
        ),
        interpret,
        warpgroup=True,
    )
    out = kernel(lhs, rhs, lhs_scale_t, rhs_scale_t)
    return out[:m, :n]
