"""Kernel (2) in Pallas Mosaic GPU: a matrix quantized to float8 in one or both layouts, with
its amax, in one pass (the Pallas Triton version: ``quantize``).

Each block of the kernel grid owns one ``64 x 64`` tile: a TMA copy brings it into shared
memory, the block reads it into registers twice, as it is and through a transposed view of the
shared-memory buffer (a tiled register layout, which Mosaic GPU can read from a transposed
view), quantizes both (``clip(x / scale_inv)``, then the cast: ``common.saturating_cast``'s
arithmetic, so the float8 data is the XLA stage's bit for bit), and writes each float8 tile back
with a TMA copy. The tile's amax goes to one float32 per block; XLA reduces those, exact in any
order. The copies are written out (no ``plgpu.emit_pipeline``) so that the kernel also runs in
Mosaic GPU's interpret mode, which is how it is tested on a CPU.

The kernel takes matrices whose two sizes are multiples of 64 (``tileable``); other shapes
(a whole matrix, or a device's block in a partitioned program) are quantized here by the XLA
stage's arithmetic, with the same results.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from jax import Array, lax
from jax.experimental import pallas as pl
from jax.typing import DTypeLike

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

__all__ = ["TILE", "quantize_tiles", "tileable"]


def _body(
    q_dtype: DTypeLike | None, layouts: tuple[bool, bool], x_ref: Any, scale_inv_ref: Any,
    *refs: Any,
) -> None:  # fmt: skip
    """One tile: ``refs`` are the outputs (the layouts asked for, the tile maxima), then the
    input tile's buffer, a shared-memory buffer per layout, and the copy's barrier."""
    n_layouts = sum(layouts)
    outputs, scratch = refs[: n_layouts + 1], refs[n_layouts + 1 :]
    *data_refs, amax_ref = outputs
    x_smem, *data_smem, barrier = scratch
    halves = data_smem.pop() if x_smem.dtype.itemsize == 4 and layouts[1] else None
    i, j = lax.axis_index("row"), lax.axis_index("column")
    rows, columns = pl.ds(i * TILE, TILE), pl.ds(j * TILE, TILE)
    plgpu.copy_gmem_to_smem(x_ref.at[rows, columns], x_smem, barrier)
    plgpu.barrier_wait(barrier)
    x = x_smem[...].astype(jnp.float32)
    amax_ref[i, j] = tile_amax(x)
    if q_dtype is None:
        return
    targets = [data_refs[0].at[rows, columns]] if layouts[0] else []
    if layouts[1]:
        targets.append(data_refs[-1].at[columns, rows])
    # The transposed tile, read from the transposed view in the tiled register layout
    # ``wgmma`` uses (the strided layout cannot read a view whose minor axis is strided).
    x_t = transposed_tile(x, x_smem, halves) if layouts[1] else None
    write_layouts(x, x_t, scale_inv_ref[0], q_dtype, data_smem, targets)


@lowered_once("q_dtype", "layouts", "interpret")
def quantize_tiles(
    x: Array,
    scale_inv: Array,
    q_dtype: DTypeLike | None,
    layouts: tuple[bool, bool],
    *,
    interpret: bool,
) -> tuple[Array | None, Array | None, Array]:
    """``x`` quantized with ``scale_inv``, as is and transposed, and the per-tile amax.

    Args:
      x: ``[rows, columns]`` in its own dtype (float32, bfloat16 or float16).
      scale_inv: f32 ``[1]``, the dequantization scale.
      q_dtype: the float8 dtype, or None to compute the amax partials only.
      layouts: which float8 results to write: ``[rows, columns]``, ``[columns, rows]``.
      interpret: run in Mosaic GPU's interpret mode (any platform; for tests).

    Returns:
      The float8 ``[rows, columns]`` and ``[columns, rows]`` data (None where not asked for or
      without ``q_dtype``) and f32 ``[tiles]``, the tiles' amax.
    """
    rows, columns = x.shape
    layouts = layouts if q_dtype is not None else (False, False)
    if not tileable(rows, columns):
        return layouts_by_xla(x, scale_inv, q_dtype, layouts)
    out_type, buffers = layout_outputs(rows, columns, q_dtype, layouts)
    if x.dtype.itemsize == 4 and layouts[1]:  # the float32 tile's halves (``transposed_tile``)
        buffers.append(plgpu.SMEM((2, TILE, TILE), jnp.uint16))
    kernel = mosaic.kernel(
        "quantize",
        lambda *refs: _body(q_dtype, layouts, *refs),
        tuple(out_type),
        {"row": rows // TILE, "column": columns // TILE},
        (
            plgpu.SMEM((TILE, TILE), x.dtype),
            *buffers,
            plgpu.Barrier(num_arrivals=1),
        ),
        interpret,
    )
    return layout_results(kernel(x, scale_inv), layouts)
