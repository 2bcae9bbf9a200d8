"""The grouped GEMM stage's kernel side: the three GEMMs of ``grouped_dense`` on te_flax's grouped
GEMM kernels (``kernels/grouped_gemm.py``), in the operand types and with the tiles they take.

``rows_kernel`` runs the forward GEMM and dgrad (``rows_gemm``), ``wgrad_kernel`` the weight
gradient (``group_gemm`` over the group-aligned layout); both as ``switch.dispatch`` calls a
kernel, beside the XLA stage of ``grouped.py``. ``kernel_tiles`` is the tiles each GEMM gets (its
grid's persistent blocks and band included), which ``bench/grouped_traffic.py`` replays.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import Array, lax
from jax.typing import DTypeLike

from te_flax._ops.kernels.grouped_gemm import (
    Accumulation,
    Tiles,
    aligned_columns,
    group_gemm,
    kernel_dtypes,
    rows_gemm,
    tiles_for,
)

__all__ = ["kernel_tiles", "on_kernel_types", "rows_kernel", "wgrad_kernel"]

# An operand or its shape and type alone (the stage asks for tiles before it converts).
Operand = Array | jax.ShapeDtypeStruct


def kernel_tiles(
    lhs: Operand, rhs: Operand, contract: tuple[int, int], groups: int, programs: int | None = None
) -> Tiles | None:
    """The kernel's tiles for the forward GEMM (``contract`` (1, 1): ``[M, K] x [G, K, N]``),
    dgrad ((1, 2): ``[M, N] x [G, K, N]``) or wgrad ((0, 0): ``[M, K] x [M, N]``), over
    ``groups`` groups; ``programs``: the persistent grid's blocks (None: one per H100 SM)."""
    if contract == (0, 0):  # a band's strips span a group's rows, M / G on average
        span = max(lhs.shape[0] // max(groups, 1), 1)
        tiles = tiles_for(lhs.dtype, lhs.shape[1], rhs.shape[1], 0, span=span)
    else:
        cols = rhs.shape[1 if contract == (1, 2) else 2]
        tiles = tiles_for(lhs.dtype, lhs.shape[0], cols, lhs.shape[1], ragged_rows=True)
    if tiles is None or programs is None:
        return tiles
    return dataclasses.replace(tiles, programs=programs)


def on_kernel_types(
    lhs: Array, rhs: Array, accumulation: Accumulation
) -> tuple[Array, Array, Accumulation]:
    """The operands in the types the kernels multiply them in (``kernel_dtypes``), and how
    they accumulate: a float8 pair converted to bfloat16 (exact) sums in float32 on the tensor
    cores, with nothing to promote."""
    types = kernel_dtypes(lhs.dtype, rhs.dtype)
    assert types is not None
    if types == (lhs.dtype, rhs.dtype):
        return lhs, rhs, accumulation
    return (
        lhs.astype(types[0]),
        rhs.astype(types[1]),
        dataclasses.replace(accumulation, split=False),
    )


def rows_kernel(
    lhs: Array,
    rhs: Array,
    group_sizes: Array,
    ids: Array,
    scale: Array | None,
    *,
    forward: bool,
    out_dtype: DTypeLike,
    accumulation: Accumulation,
    interpret: bool,
    programs: int | None = None,
) -> Array:
    """The forward GEMM (``forward``) or dgrad on the kernel; rows_gemm's rhs is ``[G, N, C]``,
    so the forward's kernel ``[G, K, N]`` is transposed (float8 tensor cores take the
    contraction last). ``programs``: the persistent grid's blocks (None: the H100's SMs)."""
    del ids
    lhs, rhs, accumulation = on_kernel_types(lhs, rhs, accumulation)
    contract = (1, 1) if forward else (1, 2)
    tiles = kernel_tiles(lhs, rhs, contract, group_sizes.shape[0], programs)
    assert tiles is not None
    if forward and jnp.dtype(rhs.dtype).itemsize == 1:
        # The forward's layout transposed from the float8 copy (dgrad's layout): XLA then
        # reads the float32 kernel once, in the pass that quantizes it and reduces its amax,
        # where it would write both layouts from it in one transposing pass and read it again
        # for the amax (docs/moe.md, "MoEBlock in FP8 against BF16").
        rhs = lax.optimization_barrier(rhs)
    rhs = jnp.swapaxes(rhs, 1, 2) if forward else rhs
    return rows_gemm(lhs, rhs, group_sizes, scale, out_dtype, tiles, interpret, accumulation)


def wgrad_kernel(
    lhs: Array,
    rhs: Array,
    group_sizes: Array,
    ids: Array,
    scale: Array | None,
    *,
    out_dtype: DTypeLike,
    accumulation: Accumulation,
    interpret: bool,
    programs: int | None = None,
) -> Array:
    """wgrad on the kernel: both operands gathered into the group-aligned layout, transposed
    (the contraction last, as float8 tensor cores take it); padding columns are zeros."""
    del ids
    lhs, rhs, accumulation = on_kernel_types(lhs, rhs, accumulation)
    tiles = kernel_tiles(lhs, rhs, (0, 0), group_sizes.shape[0], programs)
    assert tiles is not None
    source, first_tile, _ = aligned_columns(group_sizes, lhs.shape[0], tiles.depth)

    def aligned(x: Array) -> Array:
        return jnp.take(x, source, axis=0, mode="fill", fill_value=0).T

    return group_gemm(
        aligned(lhs), aligned(rhs), first_tile, scale, out_dtype, tiles, interpret, accumulation
    )
