"""Block sizes and masked loads shared by the kernels.

Every kernel works on a ``[rows, hidden]`` matrix with whole rows in one block: the hidden axis
is padded to a power of two (Triton's tensors must have power-of-two sizes) and masked, and each
program takes ``block_rows`` rows.
"""

from __future__ import annotations

from jax import Array
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

__all__ = ["MAX_HIDDEN", "RowBlocks", "row_blocks"]

MAX_HIDDEN = 8192  # the widest row one block holds (8192 float32 values per program)
_ELEMENTS = 4096  # float32 values per program when rows are narrow


class RowBlocks:
    """How a ``[rows, hidden]`` matrix is split into programs of whole rows."""

    def __init__(self, rows: int, hidden: int) -> None:
        self.rows, self.hidden = rows, hidden
        self.block_hidden = pl.next_power_of_2(hidden)
        self.block_rows = max(1, _ELEMENTS // self.block_hidden)
        self.programs = pl.cdiv(rows, self.block_rows)
        self.num_warps = min(max(self.block_rows * self.block_hidden // 256, 1), 8)

    def compiler_params(self) -> plgpu.CompilerParams:
        return plgpu.CompilerParams(num_warps=self.num_warps, num_stages=1)

    def indices(self, program: Array) -> tuple[Array, Array, Array, Array]:
        """Row and column indices of a program's block, and their in-bounds masks."""
        import jax.numpy as jnp

        row = program * self.block_rows + jnp.arange(self.block_rows, dtype=jnp.int32)
        column = jnp.arange(self.block_hidden, dtype=jnp.int32)
        return row, column, row < self.rows, column < self.hidden


def row_blocks(rows: int, hidden: int) -> RowBlocks | None:
    """The blocks of a ``[rows, hidden]`` matrix, or None when a row does not fit a block."""
    if hidden > MAX_HIDDEN or rows < 1 or hidden < 1:
        return None
    return RowBlocks(rows, hidden)
