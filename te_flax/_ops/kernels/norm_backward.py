"""Kernel (3): the norm backward (dx, and per-program partial dgamma and dbeta) in one pass.

Reads the output gradient and ``x`` once and writes ``dx``; each program sums ``dgamma`` and
``dbeta`` over its rows into one row of a ``[programs, hidden]`` partial sum, which XLA adds up
(float32 sums in another order than the XLA stage's: equal within float32 rounding). The row
reductions (the projection and, for layernorm, the mean of the gradient) stay in the program,
so nothing of width ``hidden`` is written in float32 for a second pass.
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

from te_flax._ops.kernels.common import RowBlocks, lowered_once

__all__ = ["norm_backward"]

# Row blocks per program: enough programs to fill a GPU, few enough that the partial sums stay
# small against the gradient itself.
_PROGRAMS = 256
_MAX_CHUNKS = 32


def chunks_per_program(blocks: RowBlocks) -> int:
    """How many row blocks each program of the backward walks through."""
    return max(1, min(_MAX_CHUNKS, blocks.programs // _PROGRAMS))


def _kernel(
    d_out_ref: Any,
    x_ref: Any,
    mean_ref: Any,
    rsigma_ref: Any,
    gamma_ref: Any,
    d_x_ref: Any,
    d_gamma_ref: Any,
    d_beta_ref: Any,
    *,
    blocks: RowBlocks,
    chunks: int,
) -> None:
    program = pl.program_id(0)
    _, column, _, column_ok = blocks.indices(program)
    gamma = plgpu.load(gamma_ref.at[column], mask=column_ok, other=0.0)  # [hidden]

    def chunk(index: Array, sums: tuple[Array, Array]) -> tuple[Array, Array]:
        row, _, row_ok, _ = blocks.indices(program * chunks + index)
        mask = row_ok[:, None] & column_ok[None, :]
        at = (row[:, None], column[None, :])
        d_out = plgpu.load(d_out_ref.at[at], mask=mask, other=0.0).astype(jnp.float32)
        x = plgpu.load(x_ref.at[at], mask=mask, other=0.0).astype(jnp.float32)
        rsigma = plgpu.load(rsigma_ref.at[row], mask=row_ok, other=0.0)[:, None]
        if mean_ref is not None:
            x = x - plgpu.load(mean_ref.at[row], mask=row_ok, other=0.0)[:, None]
        x_hat = jnp.where(mask, x * rsigma, 0.0)  # [rows, hidden]
        d_out = jnp.where(mask, d_out, 0.0)
        d_x_hat = d_out * gamma[None, :]
        projection = jnp.sum(d_x_hat * x_hat, axis=1) / blocks.hidden  # [rows]
        if mean_ref is not None:
            d_x_hat = d_x_hat - (jnp.sum(d_x_hat, axis=1) / blocks.hidden)[:, None]
        d_x = rsigma * (d_x_hat - x_hat * projection[:, None])
        plgpu.store(d_x_ref.at[at], d_x.astype(d_x_ref.dtype), mask=mask)
        d_gamma, d_beta = sums
        return d_gamma + jnp.sum(d_out * x_hat, axis=0), d_beta + jnp.sum(d_out, axis=0)

    zeros = jnp.zeros((blocks.block_hidden,), jnp.float32)
    d_gamma, d_beta = lax.fori_loop(0, chunks, chunk, (zeros, zeros))
    plgpu.store(d_gamma_ref.at[program, column], d_gamma, mask=column_ok)
    if d_beta_ref is not None:
        plgpu.store(d_beta_ref.at[program, column], d_beta, mask=column_ok)


@lowered_once("with_beta", "dx_dtype", "blocks", "interpret")
def norm_backward(
    d_out: Array,
    x: Array,
    mean: Array | None,
    rsigma: Array,
    gamma: Array,
    with_beta: bool,
    dx_dtype: DTypeLike,
    blocks: RowBlocks,
    *,
    interpret: bool,
) -> tuple[Array, Array, Array | None]:
    """``dx`` and the partial sums of ``dgamma`` and ``dbeta`` (None without beta).

    Args:
      d_out: ``[rows, hidden]``, the gradient of the norm output (any float dtype).
      x: ``[rows, hidden]``; mean: f32 ``[rows]`` or None (rmsnorm); rsigma: f32 ``[rows]``.
      gamma: f32 ``[hidden]``, the effective scale.
      with_beta: whether to sum ``dbeta``.
      dx_dtype: the dtype of ``dx``.
      blocks: the row blocks of ``x``.
      interpret: run in Pallas interpret mode (off GPUs).

    Returns:
      ``dx [rows, hidden]``, f32 ``[programs, hidden]`` partial ``dgamma`` and ``dbeta``.
    """
    chunks = chunks_per_program(blocks)
    programs = pl.cdiv(blocks.programs, chunks)
    partial_sum = jax.ShapeDtypeStruct((programs, blocks.hidden), jnp.float32)
    out_shape = [jax.ShapeDtypeStruct(x.shape, dx_dtype), partial_sum]
    if with_beta:
        out_shape.append(partial_sum)
    kernel = partial(_kernel, blocks=blocks, chunks=chunks)

    def bound(*refs: Any) -> None:
        if mean is None:
            refs = (*refs[:2], None, *refs[2:])
        if not with_beta:
            refs = (*refs, None)
        kernel(*refs)

    inputs = [value for value in (d_out, x, mean, rsigma, gamma) if value is not None]
    outputs = pl.pallas_call(
        bound,
        out_shape=out_shape,
        grid=(programs,),
        compiler_params=blocks.compiler_params(),
        interpret=interpret,
        name="te_flax_norm_backward",
    )(*inputs)
    return outputs[0], outputs[1], outputs[2] if with_beta else None
