"""Kernel (2) for LayerNormMLP's inner gradient: activation backward, quantize, amax in one pass.

The gradient of the first GEMM's output (the pre-activation) is the activation's backward of
the gradient arriving from the second GEMM. XLA fuses that backward into the quantization,
and the transposes into both GEMM layouts, but reduces the amax (and the bias gradient) in
separate fusions that compute the backward again from the same two inputs. This kernel reads
each tile of the pre-activation slices and of the incoming gradient once and writes the float8
gradient in both layouts, the tile's amax and, with a bias, the tile's column sums. The
gradient in high precision exists only in registers.

The arithmetic is the XLA stage's: the activation's ``jax.vjp`` on the slices in the
pre-activation's dtype, then ``clip(grad / scale_inv)`` and the cast.
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

from te_flax._ops.activations import activation_backward_of_slices
from te_flax._ops.kernels.common import block_amax, lowered_once, saturating_cast
from te_flax._ops.kernels.quantize import Tiles

__all__ = ["KERNEL_ACTIVATIONS", "activation_grad_tiles"]

# The activations whose backward this kernel computes as XLA does. ReLU and squared ReLU are
# left out: Triton's maximum ignores NaN, so a NaN pre-activation would become 0; the exact
# GELU is left out: Triton has no erf. The clamped SwiGLU is left out for both reasons it could
# differ: its clamps are a minimum and a maximum (NaN would become the limit), and its
# parameters are not passed to the kernel; it always runs the XLA stage.
KERNEL_ACTIVATIONS = frozenset({"gelu", "silu", "quick_gelu", "linear"})


def _kernel(
    pre_ref: Any,
    grad_ref: Any,
    scale_inv_ref: Any,
    *out_refs: Any,
    tiles: Tiles,
    activation_type: tuple[str, ...],
    q_dtype: DTypeLike | None,
    with_bias: bool,
) -> None:
    i, j = pl.program_id(0), pl.program_id(1)
    row = i * tiles.block_rows + jnp.arange(tiles.block_rows, dtype=jnp.int32)
    column = j * tiles.block_columns + jnp.arange(tiles.block_columns, dtype=jnp.int32)
    column_ok = column < tiles.columns
    mask = (row < tiles.rows)[:, None] & column_ok[None, :]
    grad = plgpu.load(grad_ref.at[row[:, None], column[None, :]], mask=mask, other=0.0)
    n_act = len(activation_type)
    slices = [
        plgpu.load(
            pre_ref.at[row[:, None], index * tiles.columns + column[None, :]], mask=mask, other=0.0
        )
        for index in range(n_act)
    ]
    d_slices = activation_backward_of_slices(grad, slices, activation_type)
    refs = iter(out_refs)
    data_ref, transposed_ref = (next(refs), next(refs)) if q_dtype is not None else (None, None)
    amax_ref = next(refs)
    bias_ref = next(refs) if with_bias else None
    program = i * tiles.grid[1] + j
    for index, d_slice in enumerate(d_slices):
        d_slice = jnp.where(mask, d_slice, 0.0).astype(d_slice.dtype)
        plgpu.store(amax_ref.at[program * n_act + index], block_amax(d_slice))
        slice_column = index * tiles.columns + column
        if bias_ref is not None:
            sums = jnp.sum(d_slice.astype(jnp.float32), axis=0)
            plgpu.store(bias_ref.at[i, slice_column], sums, mask=column_ok)
        if q_dtype is None or data_ref is None or transposed_ref is None:
            continue  # the amax pass of current scaling
        quantized = saturating_cast(d_slice.astype(jnp.float32), scale_inv_ref[0], q_dtype)
        plgpu.store(data_ref.at[row[:, None], slice_column[None, :]], quantized, mask=mask)
        plgpu.store(
            transposed_ref.at[slice_column[:, None], row[None, :]], quantized.T, mask=mask.T
        )


@lowered_once("activation_type", "q_dtype", "with_bias", "interpret")
def activation_grad_tiles(
    pre_activation: Array,
    grad: Array,
    scale_inv: Array,
    activation_type: tuple[str, ...],
    q_dtype: DTypeLike | None,
    with_bias: bool,
    *,
    interpret: bool,
) -> tuple[Array | None, Array | None, Array, Array | None]:
    """The activation's gradient quantized in both layouts, its tile maxima and column sums.

    Args:
      pre_activation: ``[rows, n_act * intermediate]``, the slices side by side.
      grad: ``[rows, intermediate]``, the gradient of the activation's output.
      scale_inv: f32 ``[1]``, the dequantization scale.
      activation_type: the canonical activation names (see ``te_flax._ops.activations``).
      q_dtype: the float8 dtype, or None for the amax partials (and column sums) only.
      with_bias: also return the column sums (for the bias gradient).
      interpret: run in Pallas interpret mode (off GPUs).

    Returns:
      The float8 gradient ``[rows, n_act * intermediate]`` and ``[n_act * intermediate,
      rows]`` (None without ``q_dtype``), f32 ``[programs * n_act]`` tile maxima, and f32
      ``[row tiles, n_act * intermediate]`` column sums (None without ``with_bias``).
    """
    rows, intermediate = grad.shape
    width = pre_activation.shape[1]
    tiles = Tiles(rows, intermediate)
    out_shape = []
    if q_dtype is not None:
        out_shape += [
            jax.ShapeDtypeStruct((rows, width), q_dtype),
            jax.ShapeDtypeStruct((width, rows), q_dtype),
        ]
    out_shape.append(jax.ShapeDtypeStruct((tiles.programs * len(activation_type),), jnp.float32))
    if with_bias:
        out_shape.append(jax.ShapeDtypeStruct((tiles.grid[0], width), jnp.float32))
    kernel = partial(
        _kernel,
        tiles=tiles,
        activation_type=activation_type,
        q_dtype=q_dtype,
        with_bias=with_bias,
    )
    outputs = list(
        pl.pallas_call(
            kernel,
            out_shape=out_shape,
            grid=tiles.grid,
            compiler_params=tiles.compiler_params(),
            interpret=interpret,
            name="te_flax_activation_grad",
        )(pre_activation, grad, scale_inv)
    )
    data, transposed = (outputs.pop(0), outputs.pop(0)) if q_dtype is not None else (None, None)
    amax = outputs.pop(0)
    column_sums = outputs.pop(0) if with_bias else None
    return data, transposed, amax, column_sums
