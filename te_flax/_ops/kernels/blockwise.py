"""The blockwise FP8 GEMM kernel: per-block scales applied inside K (as DeepGEMM does).

``Float8BlockScaling``'s GEMM multiplies two float8 matrices whose scales change every 128
elements of K, so no GEMM library call can take them as one scale per operand. XLA's exact form
(``te_flax._ops.gemm.blockwise_gemm_exact``) runs one batched FP8 GEMM over K's chunks and writes
every chunk's float32 partial product ``[K / 128, M, N]`` to memory before it scales and sums
them. This kernel keeps the float32 accumulator of a ``[64, 64]`` output tile in registers: for
each 128-wide chunk of K it multiplies the two float8 tiles (tensor cores on Hopper), multiplies
the partial product by the chunk's row scales of both operands, and adds it, so that the
float32 promotion happens once per 128 of K and nothing but the output is written.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax import Array, lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jax.typing import DTypeLike

from te_flax._ops.kernels.common import lowered_once
from te_flax.quantize.block_scaling import FP8_BLOCK

__all__ = ["BLOCK", "blockwise_gemm_kernel", "whole_operands"]

BLOCK = FP8_BLOCK  # K chunk: one scale per operand row and chunk
_TILE = 64  # output rows and columns of one program


def whole_operands() -> bool:
    """True where the kernel sees whole operands: no mesh of several devices, or every mesh
    axis manual (``shard_map``: each device's block). The kernel has no partitioning rule, so
    a program that XLA partitions over a mesh keeps the exact XLA GEMM, which it can split."""
    mesh = jax.sharding.get_abstract_mesh()
    return mesh.empty or mesh.size == 1 or set(mesh.manual_axes) == set(mesh.axis_names)


def _kernel(
    lhs_ref: Any,
    rhs_ref: Any,
    lhs_scale_ref: Any,
    rhs_scale_ref: Any,
    out_ref: Any,
    *,
    m: int,
    n: int,
    chunks: int,
) -> None:
    row = pl.program_id(0) * _TILE + jnp.arange(_TILE, dtype=jnp.int32)
    column = pl.program_id(1) * _TILE + jnp.arange(_TILE, dtype=jnp.int32)
    row_ok, column_ok = row < m, column < n
    k = jnp.arange(BLOCK, dtype=jnp.int32)

    def chunk(c: Array, accumulator: Array) -> Array:
        ks = c * BLOCK + k
        # Rows past the edge are left unloaded (Triton has no float8 fill value): they reach
        # only the output rows and columns that the masked store drops.
        lhs = plgpu.load(lhs_ref.at[row[:, None], ks[None, :]], mask=row_ok[:, None])
        rhs = plgpu.load(rhs_ref.at[column[:, None], ks[None, :]], mask=column_ok[:, None])
        # [64, 128] x [64, 128] -> [64, 64]: products of float8 values are exact in float32.
        partial_product = lax.dot_general(
            lhs, rhs, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
        )
        lhs_scale = plgpu.load(lhs_scale_ref.at[row, c], mask=row_ok, other=0.0)
        rhs_scale = plgpu.load(rhs_scale_ref.at[column, c], mask=column_ok, other=0.0)
        return accumulator + partial_product * lhs_scale[:, None] * rhs_scale[None, :]

    accumulator = lax.fori_loop(0, chunks, chunk, jnp.zeros((_TILE, _TILE), jnp.float32))
    mask = row_ok[:, None] & column_ok[None, :]
    out = accumulator.astype(out_ref.dtype)
    plgpu.store(out_ref.at[row[:, None], column[None, :]], out, mask=mask)


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
      rhs: float8 ``[N, K]``.
      rhs_scale_inv: float32 ``[N, K / 128]``.
      out_dtype: the output dtype (the float32 accumulator is rounded to it once).
      interpret: run in Pallas interpret mode (off GPUs).
    """
    m, k = lhs.shape
    n = rhs.shape[0]
    grid = (pl.cdiv(m, _TILE), pl.cdiv(n, _TILE))
    return pl.pallas_call(
        partial(_kernel, m=m, n=n, chunks=k // BLOCK),
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid=grid,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="te_flax_blockwise_gemm",
    )(lhs, rhs, lhs_scale_inv.astype(jnp.float32), rhs_scale_inv.astype(jnp.float32))
