"""Kernel (1): normalize with saved statistics, quantize to float8 and reduce the amax, in one pass.

Reads ``x`` once and writes the float8 GEMM operand and one partial amax per program (reduced
by XLA to the tensor's amax: a maximum is exact in any order, so the result is the XLA stage's,
bit for bit). The float32 norm output exists only in registers. The arithmetic is the XLA
stage's, operation for operation (``(x - mean) * rsigma * gamma + beta``, then
``clip(y / scale_inv)``), so the float8 data is the same too.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax import Array
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jax.typing import DTypeLike

from te_flax._ops.kernels.common import RowBlocks, block_amax, lowered_once, saturating_cast

__all__ = ["norm_quantize"]


def _kernel(
    x_ref: Any,
    mean_ref: Any,
    rsigma_ref: Any,
    gamma_ref: Any,
    beta_ref: Any,
    scale_inv_ref: Any,
    *out_refs: Any,
    blocks: RowBlocks,
    q_dtype: DTypeLike | None,
) -> None:
    row, column, row_ok, column_ok = blocks.indices(pl.program_id(0))
    mask = row_ok[:, None] & column_ok[None, :]
    x = plgpu.load(x_ref.at[row[:, None], column[None, :]], mask=mask, other=0.0)
    x = x.astype(jnp.float32)  # [rows, hidden]
    rsigma = plgpu.load(rsigma_ref.at[row], mask=row_ok, other=0.0)  # [rows]
    gamma = plgpu.load(gamma_ref.at[column], mask=column_ok, other=0.0)  # [hidden]
    if mean_ref is not None:
        x = x - plgpu.load(mean_ref.at[row], mask=row_ok, other=0.0)[:, None]
    y = x * rsigma[:, None] * gamma[None, :]
    if beta_ref is not None:
        y = y + plgpu.load(beta_ref.at[column], mask=column_ok, other=0.0)[None, :]
    y = jnp.where(mask, y, 0.0)
    *data_ref, amax_ref = out_refs
    plgpu.store(amax_ref.at[pl.program_id(0)], block_amax(y))
    if q_dtype is not None:
        quantized = saturating_cast(y, scale_inv_ref[0], q_dtype)
        plgpu.store(data_ref[0].at[row[:, None], column[None, :]], quantized, mask=mask)


@lowered_once("q_dtype", "blocks", "interpret")
def norm_quantize(
    x: Array,
    mean: Array | None,
    rsigma: Array,
    gamma: Array,
    beta: Array | None,
    scale_inv: Array,
    q_dtype: DTypeLike | None,
    blocks: RowBlocks,
    *,
    interpret: bool,
) -> tuple[Array | None, Array]:
    """``quantize(norm(x))`` and the per-program amax partials of ``norm(x)``.

    Args:
      x: ``[rows, hidden]`` in its own dtype.
      mean: f32 ``[rows]``, or None for rmsnorm.
      rsigma: f32 ``[rows]``.
      gamma: f32 ``[hidden]``, the effective scale (``1 + gamma`` when zero-centered).
      beta: f32 ``[hidden]``, or None.
      scale_inv: f32 ``[1]``, the dequantization scale.
      q_dtype: the float8 dtype, or None to compute the amax partials only.
      blocks: the row blocks of ``x``.
      interpret: run in Pallas interpret mode (off GPUs).

    Returns:
      The ``[rows, hidden]`` float8 data (None without ``q_dtype``) and f32 ``[programs]``.
    """
    out_shape = [jax.ShapeDtypeStruct((blocks.programs,), jnp.float32)]
    if q_dtype is not None:
        out_shape.insert(0, jax.ShapeDtypeStruct(x.shape, q_dtype))
    kernel = partial(_kernel, blocks=blocks, q_dtype=q_dtype)
    inputs = [x, mean, rsigma, gamma, beta, scale_inv]
    present = [value is not None for value in inputs]

    def bound(*refs: Any) -> None:
        it = iter(refs)
        return kernel(*(next(it) if p else None for p in present), *it)

    outputs = pl.pallas_call(
        bound,
        out_shape=out_shape,
        grid=(blocks.programs,),
        compiler_params=blocks.compiler_params(),
        interpret=interpret,
        name="te_flax_norm_quantize",
    )(*(value for value in inputs if value is not None))
    if q_dtype is None:
        return None, outputs[0]
    return outputs[0], outputs[1]
