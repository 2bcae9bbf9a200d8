"""Kernel (2): quantize a matrix to float8 in one or both layouts and reduce its amax, in one pass.

XLA fuses a quantization with the transposes its GEMMs need, but not with the amax reduction
of the same tensor (a reduction and a transpose do not share a fusion), so every quantized
kernel is read twice from memory, once in float32 for the amax alone. This kernel reads each
``[block_rows, block_columns]`` tile once and writes the float8 tile, its transpose (the
layout a GEMM contracting the other axis needs) and the tile's amax. The arithmetic is the
XLA stage's (``clip(x / scale_inv)``, then the cast), so the float8 data is the same bit for
bit; the tile maxima are reduced by XLA, exact in any order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax import Array
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jax.typing import DTypeLike

from te_flax._ops.kernels.common import block_amax, lowered_once, saturating_cast

__all__ = ["Tiles", "layouts_call", "quantize_tiles", "store_quantized"]

_TILE = 64  # rows and columns of a tile: 4096 values, transposed in registers


class Tiles:
    """How a ``[rows, columns]`` matrix is split into square tiles, one per program."""

    def __init__(self, rows: int, columns: int) -> None:
        self.rows, self.columns = rows, columns
        # Triton's tensors have power-of-two sizes; a narrow matrix gets a narrower tile.
        self.block_rows = min(_TILE, pl.next_power_of_2(rows))
        self.block_columns = min(_TILE, pl.next_power_of_2(columns))
        self.grid = (pl.cdiv(rows, self.block_rows), pl.cdiv(columns, self.block_columns))
        self.programs = self.grid[0] * self.grid[1]

    def compiler_params(self) -> plgpu.CompilerParams:
        warps = min(max(self.block_rows * self.block_columns // 1024, 1), 4)
        return plgpu.CompilerParams(num_warps=warps, num_stages=1)

    def indices(self) -> tuple[Array, Array, Array]:
        """The running program's row and column indices and its in-bounds mask."""
        i, j = pl.program_id(0), pl.program_id(1)
        row = i * self.block_rows + jnp.arange(self.block_rows, dtype=jnp.int32)
        column = j * self.block_columns + jnp.arange(self.block_columns, dtype=jnp.int32)
        return row, column, (row < self.rows)[:, None] & (column < self.columns)[None, :]


def _kernel(
    x_ref: Any,
    scale_inv_ref: Any,
    *out_refs: Any,
    tiles: Tiles,
    q_dtype: DTypeLike | None,
    layouts: tuple[bool, bool],
) -> None:
    row, column, mask = tiles.indices()
    x = plgpu.load(x_ref.at[row[:, None], column[None, :]], mask=mask, other=0.0)
    store_quantized(x.astype(jnp.float32), scale_inv_ref, out_refs, tiles, q_dtype, layouts)


def store_quantized(
    x: Array,
    scale_inv_ref: Any,
    out_refs: Sequence[Any],
    tiles: Tiles,
    q_dtype: DTypeLike | None,
    layouts: tuple[bool, bool],
) -> None:
    """Stores the program's float32 tile ``x`` quantized (``clip(x / scale_inv)``, the cast)
    in the ``layouts`` asked for and its amax: ``out_refs`` are the layouts' outputs, then the
    tile maxima. Without ``q_dtype``, the amax alone."""
    row, column, mask = tiles.indices()
    *data_refs, amax_ref = out_refs
    plgpu.store(amax_ref.at[pl.program_id(0) * tiles.grid[1] + pl.program_id(1)], block_amax(x))
    if q_dtype is None:
        return
    quantized = saturating_cast(x, scale_inv_ref[0], q_dtype)
    refs = iter(data_refs)
    if layouts[0]:
        plgpu.store(next(refs).at[row[:, None], column[None, :]], quantized, mask=mask)
    if layouts[1]:
        transposed_ref = next(refs)
        plgpu.store(transposed_ref.at[column[:, None], row[None, :]], quantized.T, mask=mask.T)


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
      x: ``[rows, columns]`` in its own dtype.
      scale_inv: f32 ``[1]``, the dequantization scale.
      q_dtype: the float8 dtype, or None to compute the amax partials only.
      layouts: which float8 results to write: ``[rows, columns]``, ``[columns, rows]``.
      interpret: run in Pallas interpret mode (off GPUs).

    Returns:
      The float8 ``[rows, columns]`` and ``[columns, rows]`` data (None where not asked for or
      without ``q_dtype``) and f32 ``[programs]``, the tiles' amax.
    """
    tiles = Tiles(*x.shape)
    return layouts_call(
        partial(_kernel, tiles=tiles, q_dtype=q_dtype),
        (x, scale_inv),
        tiles,
        q_dtype,
        layouts,
        "te_flax_quantize",
        interpret=interpret,
    )


def layouts_call(
    kernel: Callable[..., None],
    operands: tuple[Array, ...],
    tiles: Tiles,
    q_dtype: DTypeLike | None,
    layouts: tuple[bool, bool],
    name: str,
    *,
    interpret: bool,
) -> tuple[Array | None, Array | None, Array]:
    """Runs a kernel that ends with ``store_quantized`` (given ``layouts=`` here) over the
    tiles of a ``[rows, columns]`` result: its float8 layouts asked for (None otherwise, or
    without ``q_dtype``) and the f32 ``[programs]`` tile maxima."""
    layouts = layouts if q_dtype is not None else (False, False)
    shapes = [(tiles.rows, tiles.columns), (tiles.columns, tiles.rows)]
    out_shape = [
        jax.ShapeDtypeStruct(s, q_dtype) for s, on in zip(shapes, layouts, strict=True) if on
    ]
    out_shape.append(jax.ShapeDtypeStruct((tiles.programs,), jnp.float32))
    outputs = pl.pallas_call(
        partial(kernel, layouts=layouts),
        out_shape=out_shape,
        grid=tiles.grid,
        compiler_params=tiles.compiler_params(),
        interpret=interpret,
        name=name,
    )(*operands)
    results = iter(outputs[:-1])
    data = next(results) if layouts[0] else None
    transposed = next(results) if layouts[1] else None
    return data, transposed, outputs[-1]
