"""Kernel (2) for LayerNormMLP's forward in Pallas Mosaic GPU: the activation quantized to
float8 in the layouts asked for, with its amax, in one pass (the Pallas Triton version:
``activation_quantize``).

Each block of the kernel grid owns one ``64 x 64`` tile of the activation: TMA copies bring the
matching tile of each pre-activation slice into shared memory, the block computes the
activation in registers (in float32, rounded once to the pre-activation's dtype: the XLA
stage's arithmetic) and its amax, and writes the float8 tile in each layout asked for as
``quantize_mosaic`` does. The transposed tile is read from a transposed view of shared memory,
so the activation goes there first: in its 16-bit dtype, or as a float32's two 16-bit halves.
The activation in high precision never leaves the block.

The kernel takes an activation whose rows and width are multiples of 64 (``mosaic.tileable``);
other shapes are computed here by the XLA stage's arithmetic, with the same results.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from jax import Array, lax
from jax.experimental import pallas as pl
from jax.typing import DTypeLike

from te_flax._ops.activations import activation_of_slices
from te_flax._ops.kernels import mosaic
from te_flax._ops.kernels.common import lowered_once
from te_flax._ops.kernels.mosaic import (
    TILE,
    layout_outputs,
    layout_results,
    layouts_by_xla,
    plgpu,
    tile_amax,
    tileable,
    transposed_tile,
    write_layouts,
)

__all__ = ["activation_quantize_tiles", "by_xla"]


def _activated(slices: list[Array], activation_type: tuple[str, ...], dtype: Any) -> Array:
    """The activation of the slices in float32, rounded once to ``dtype`` (the XLA stage's
    arithmetic), as float32."""
    activated = activation_of_slices([part.astype(jnp.float32) for part in slices], activation_type)
    return activated.astype(dtype).astype(jnp.float32)


def by_xla(
    pre_activation: Array,
    scale_inv: Array,
    activation_type: tuple[str, ...],
    q_dtype: DTypeLike | None,
    layouts: tuple[bool, bool],
) -> tuple[Array | None, Array | None, Array]:
    """The kernel's results by the XLA stage's arithmetic, for a block it does not tile (the
    amax as one partial)."""
    n_act = len(activation_type)
    intermediate = pre_activation.shape[1] // n_act
    slices = [pre_activation[:, k * intermediate : (k + 1) * intermediate] for k in range(n_act)]
    activated = _activated(slices, activation_type, pre_activation.dtype)
    return layouts_by_xla(activated, scale_inv, q_dtype, layouts)


def _body(
    activation_type: tuple[str, ...], q_dtype: DTypeLike | None, layouts: tuple[bool, bool],
    pre_ref: Any, scale_inv_ref: Any, *refs: Any,
) -> None:  # fmt: skip
    """One tile: ``refs`` are the outputs (the layouts asked for, the tile maxima), then the
    slices' buffer, a buffer per layout, the buffer the transposed read goes through, and the
    copies' barrier."""
    n_act, n_layouts = len(activation_type), sum(layouts)
    outputs, scratch = refs[: n_layouts + 1], refs[n_layouts + 1 :]
    *data_refs, amax_ref = outputs
    pre_smem, *data_smem, barrier = scratch
    staged: Any = data_smem.pop() if layouts[1] else None
    intermediate = pre_ref.shape[1] // n_act
    i, j = lax.axis_index("row"), lax.axis_index("column")
    rows, columns = pl.ds(i * TILE, TILE), pl.ds(j * TILE, TILE)
    for index in range(n_act):  # [TILE, TILE] of slice ``index``, one arrival each
        slice_columns = pl.ds(index * intermediate + j * TILE, TILE)
        plgpu.copy_gmem_to_smem(pre_ref.at[rows, slice_columns], pre_smem.at[index], barrier)
    plgpu.barrier_wait(barrier)
    dtype = pre_smem.dtype
    activated = _activated([pre_smem[index] for index in range(n_act)], activation_type, dtype)
    amax_ref[i, j] = tile_amax(activated)
    if q_dtype is None:
        return
    targets = [data_refs[0].at[rows, columns]] if layouts[0] else []
    activated_t = None
    if layouts[1]:
        targets.append(data_refs[-1].at[columns, rows])
        if dtype.itemsize == 4:  # ``staged``: the two 16-bit halves
            activated_t = transposed_tile(activated, None, staged)
        else:  # ``staged``: the activation in its 16-bit dtype, read back transposed
            staged[...] = activated.astype(dtype)
            activated_t = transposed_tile(activated, staged, None)
    write_layouts(activated, activated_t, scale_inv_ref[0], q_dtype, data_smem, targets)


@lowered_once("activation_type", "q_dtype", "layouts", "interpret")
def activation_quantize_tiles(
    pre_activation: Array,
    scale_inv: Array,
    activation_type: tuple[str, ...],
    q_dtype: DTypeLike | None,
    layouts: tuple[bool, bool],
    *,
    interpret: bool,
) -> tuple[Array | None, Array | None, Array]:
    """The activation quantized with ``scale_inv``, as is and transposed, and the tile maxima.

    Args:
      pre_activation: ``[rows, n_act * intermediate]``, the slices side by side, in float32,
        bfloat16 or float16.
      scale_inv: f32 ``[1]``, the dequantization scale.
      activation_type: the canonical activation names (see ``te_flax._ops.activations``).
      q_dtype: the float8 dtype, or None to compute the amax partials only.
      layouts: which float8 results to write: ``[rows, intermediate]``, ``[intermediate,
        rows]``.
      interpret: run in Mosaic GPU's interpret mode (any platform; for tests).

    Returns:
      The float8 activation ``[rows, intermediate]`` and ``[intermediate, rows]`` (None where
      not asked for or without ``q_dtype``) and f32 ``[tiles]``, the tiles' amax.
    """
    n_act = len(activation_type)
    rows, width = pre_activation.shape
    intermediate = width // n_act
    layouts = layouts if q_dtype is not None else (False, False)
    dtype = pre_activation.dtype
    if not tileable(rows, intermediate):
        return by_xla(pre_activation, scale_inv, activation_type, q_dtype, layouts)
    out_type, buffers = layout_outputs(rows, intermediate, q_dtype, layouts)
    if layouts[1]:  # the transposed read's 16-bit buffer (``transposed_tile``)
        staged = (2, TILE, TILE) if dtype.itemsize == 4 else (TILE, TILE)
        buffers.append(plgpu.SMEM(staged, jnp.uint16 if dtype.itemsize == 4 else dtype))
    kernel = mosaic.kernel(
        "activation_quantize",
        lambda *refs: _body(activation_type, q_dtype, layouts, *refs),
        tuple(out_type),
        {"row": rows // TILE, "column": intermediate // TILE},
        (
            plgpu.SMEM((n_act, TILE, TILE), dtype),
            *buffers,
            plgpu.Barrier(num_arrivals=n_act),
        ),
        interpret,
    )
    return layout_results(kernel(pre_activation, scale_inv), layouts)
