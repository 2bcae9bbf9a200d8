"""The experts' activation gradient quantized with each expert's scale, in one pass (Pallas
Mosaic GPU): the kernel between the two grouped GEMMs of ``MoEBlock``'s FP8 backward.

The gradient of the first grouped GEMM's output (the gated pre-activation, ``[M, n_act * F]``,
rows sorted by expert) is the activation's backward of the gradient arriving from the second
(``[M, F]``). XLA computes that backward and writes it in bfloat16, then reads it back in the
pass that quantizes it with each row's expert scale and reduces its per-expert amax: it will not
repeat the backward of the joined slices in a pass that also reduces (docs/moe.md). This kernel
reads each tile of the slices and of the incoming gradient once and writes the float8 gradient
and its amax; the gradient in high precision exists only in registers.

Its blocks are ``rows_gemm``'s work items (``grouped_gemm.row_tiles``): a 64-row tile and one
expert whose rows it holds, so each block quantizes with one scale and writes only its expert's
rows, and its amax (one float32 per item, column tile and slice) covers those rows alone. The
rows past the experts (the pseudo-group ``G``) are quantized with scale 1 and left out of the
amax, as ``grouped.quantize_rows`` does. The arithmetic is ``activation_grad_mosaic``'s (the
activation's ``jax.vjp`` in float32, rounded to the pre-activation's dtype) and
``scaling.quantize``'s, bit for bit.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import Array, lax
from jax.experimental import pallas as pl
from jax.typing import DTypeLike

from te_flax._ops.kernels import mosaic
from te_flax._ops.kernels.activation_grad_mosaic import slices_backward
from te_flax._ops.kernels.common import lowered_once
from te_flax._ops.kernels.grouped_gemm import row_tiles, store_rows
from te_flax._ops.kernels.mosaic import TILE, plgpu, quantized_tile, tile_amax, tileable

__all__ = ["activation_grad_rows", "grouped_amax"]


_REFS: Any = plgpu  # ``load`` with a register layout (typed loosely)


def _tiled_layout() -> Any:
    return plgpu.Layout.WGMMA


def _load(tile_smem: Any) -> Array:
    """A 16-bit tile from shared memory in the tiled register layout ``wgmma`` uses."""
    return _REFS.load(tile_smem, layout=_tiled_layout(), optimized=False)


def _body(
    activation_type: tuple[str, ...], q_dtype: DTypeLike,
    table_ref: Any, scale_inv_ref: Any, pre_ref: Any, grad_ref: Any,
    data_ref: Any, amax_ref: Any,
    pre_smem: Any, grad_smem: Any, data_smem: Any, barrier: Any,
) -> None:  # fmt: skip
    """Work item ``item``'s tile in column tile ``j``: its expert's rows of each slice's
    gradient, quantized with the expert's scale, and their amax."""
    n_act, intermediate = len(activation_type), grad_ref.shape[1]
    item, j = lax.axis_index("item"), lax.axis_index("column")
    group, row_tile = table_ref[item, 0], table_ref[item, 1]
    first, count = table_ref[item, 2], table_ref[item, 3]
    for k in range(n_act):
        amax_ref[item, j, k] = jnp.float32(0.0)

    @pl.when(count > 0)
    def _() -> None:
        rows, columns = pl.ds(row_tile * TILE, TILE), pl.ds(j * TILE, TILE)
        slice_columns = [pl.ds(k * intermediate + j * TILE, TILE) for k in range(n_act)]
        plgpu.copy_gmem_to_smem(grad_ref.at[rows, columns], grad_smem, barrier)
        for k in range(n_act):  # one arrival per copy
            plgpu.copy_gmem_to_smem(pre_ref.at[rows, slice_columns[k]], pre_smem.at[k], barrier)
        plgpu.barrier_wait(barrier)
        # In the tiled register layout, which the rows' mask below can be cast to.
        slices = [_load(pre_smem.at[k]) for k in range(n_act)]
        d_slices = slices_backward(_load(grad_smem), slices, activation_type)
        row = plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, (TILE, TILE), 0), _tiled_layout())
        held = (row >= first) & (row < first + count)
        scale_inv = scale_inv_ref[group]
        for k, d_slice in enumerate(d_slices):
            d = d_slice.astype(jnp.float32)
            amax_ref[item, j, k] = tile_amax(jnp.where(held, d, 0.0), tiled=True)
            _REFS.store(data_smem, quantized_tile(d, scale_inv, q_dtype), optimized=False)
            plgpu.commit_smem()
            store_rows(data_smem, data_ref.at[rows, slice_columns[k]], first, count, TILE)


def grouped_amax(partials: Array, table: Array, n_groups: int) -> Array:
    """Each group's amax (float32 ``[G]``, 0 for an empty one) from ``activation_grad_rows``'s
    partials and its work items: NaN where any of the group's rows is NaN."""
    item_amax = jnp.max(partials.reshape(partials.shape[0], -1), axis=1)  # [items]
    nan = jax.ops.segment_max(jnp.isnan(item_amax).astype(jnp.float32), table[:, 0], n_groups)
    amax = jax.ops.segment_max(item_amax, table[:, 0], num_segments=n_groups)
    return jnp.where(nan > 0.0, jnp.nan, jnp.maximum(amax, 0.0))


@lowered_once("activation_type", "q_dtype", "interpret")
def activation_grad_rows(
    pre_activation: Array,
    grad: Array,
    group_sizes: Array,
    scale_inv: Array,
    activation_type: tuple[str, ...],
    q_dtype: DTypeLike,
    *,
    interpret: bool,
) -> tuple[Array, Array]:
    """The activation's gradient of rows sorted by group, each group quantized with its scale.

    Args:
      pre_activation: ``[M, n_act * F]``, the slices side by side, bfloat16 or float16.
      grad: ``[M, F]``, the gradient of the activation's output, the same dtype.
      group_sizes: int32 ``[G]``; the rows past their sum are quantized with scale 1.
      scale_inv: float32 ``[G]``, each group's dequantization scale.
      activation_type: the canonical activation names (``te_flax._ops.activations``).
      q_dtype: the float8 dtype.
      interpret: run in Mosaic GPU's interpret mode (any platform; for tests).

    Returns:
      The float8 gradient ``[M, n_act * F]`` and each group's amax, float32 ``[G]``.
    """
    rows, intermediate = grad.shape
    n_act, width = len(activation_type), pre_activation.shape[1]
    assert tileable(rows, intermediate) and width == n_act * intermediate, (rows, width)
    n_groups = group_sizes.shape[0]
    table = row_tiles(group_sizes, rows, TILE)
    scales = jnp.concatenate([scale_inv.astype(jnp.float32), jnp.ones((1,), jnp.float32)])
    grid = {"item": table.shape[0], "column": intermediate // TILE}
    kernel = mosaic.kernel(
        "activation_grad_rows",
        lambda *refs: _body(activation_type, q_dtype, *refs),
        (
            jax.ShapeDtypeStruct((rows, width), q_dtype),
            jax.ShapeDtypeStruct((table.shape[0], intermediate // TILE, n_act), jnp.float32),
        ),
        grid,
        (
            plgpu.SMEM((n_act, TILE, TILE), pre_activation.dtype),
            plgpu.SMEM((TILE, TILE), grad.dtype),
            plgpu.SMEM((TILE, TILE), q_dtype),
            plgpu.Barrier(num_arrivals=n_act + 1),
        ),
        interpret,
    )
    data, partials = kernel(table, scales, pre_activation, grad)
    return data, grouped_amax(partials, table, n_groups)
