"""Block sizes and masked loads shared by the kernels.

Every kernel works on a ``[rows, hidden]`` matrix with whole rows in one block: the hidden axis
is padded to a power of two (Triton's tensors must have power-of-two sizes) and masked, and each
program takes ``block_rows`` rows.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar, cast

import jax
import jax.numpy as jnp
from jax import Array
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jax.typing import DTypeLike

__all__ = [
    "MAX_HIDDEN",
    "RowBlocks",
    "block_amax",
    "lowered_once",
    "row_blocks",
    "saturating_cast",
]

F = TypeVar("F", bound=Callable[..., Any])

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

    def __eq__(self, other: object) -> bool:  # a static argument of ``lowered_once``
        return isinstance(other, RowBlocks) and (other.rows, other.hidden) == (
            self.rows,
            self.hidden,
        )

    def __hash__(self) -> int:
        return hash((self.rows, self.hidden))

    def compiler_params(self) -> plgpu.CompilerParams:
        return plgpu.CompilerParams(num_warps=self.num_warps, num_stages=1)

    def indices(self, program: Array) -> tuple[Array, Array, Array, Array]:
        """Row and column indices of a program's block, and their in-bounds masks."""
        row = program * self.block_rows + jnp.arange(self.block_rows, dtype=jnp.int32)
        column = jnp.arange(self.block_hidden, dtype=jnp.int32)
        return row, column, row < self.rows, column < self.hidden


def lowered_once(*static: str) -> Callable[[F], F]:
    """A kernel's entry point under ``jax.jit``, its ``static`` arguments the kernel's settings.

    Each call of ``pallas_call`` is traced and lowered to Triton on its own
    (``bench/RESULTS_te_peer.md``, "Trace + compile time on a quiet host"), so a model of N
    identical layers paid for N copies of each kernel. A
    jitted entry point is traced once per operand shapes and settings, and JAX lowers identical
    jitted calls of one program once (XLA inlines them; the compiled program is the same).
    """
    return cast(Callable[[F], F], partial(jax.jit, static_argnames=static))


def row_blocks(rows: int, hidden: int) -> RowBlocks | None:
    """The blocks of a ``[rows, hidden]`` matrix, or None when a row does not fit a block."""
    if hidden > MAX_HIDDEN or rows < 1 or hidden < 1:
        return None
    return RowBlocks(rows, hidden)


# Triton's floating-point minimum and maximum ignore a NaN operand (``minnumf``/``maxnumf``),
# and so do Pallas' reductions in interpret mode; XLA's propagate it. These two keep the XLA
# stages' results for NaN: a NaN amax (which the quantizers record as "no information") and
# NaN float8 data, rather than a finite amax and data saturated to the format's limit.


def block_amax(values: Array) -> Array:
    """``max(|values|)`` of a 2-D block as a float32 scalar, NaN if any value is NaN."""
    magnitude = jnp.abs(values.astype(jnp.float32))
    largest = jnp.max(jnp.max(magnitude, axis=1), axis=0)
    nan = jnp.max(jnp.max(jnp.where(jnp.isnan(magnitude), 1.0, 0.0), axis=1), axis=0)
    return jnp.where(nan > 0.0, jnp.nan, largest)


def saturating_cast(values: Array, scale_inv: Array, q_dtype: DTypeLike) -> Array:
    """``clip(values / scale_inv, -limit, limit)`` cast to ``q_dtype``, a NaN or an infinity
    of ``values`` as NaN (``scaling.quantize``'s rule, bit for bit)."""
    limit = float(jnp.finfo(q_dtype).max)
    scaled = values / scale_inv
    clipped = jnp.minimum(jnp.maximum(scaled, -limit), limit)
    return jnp.where(jnp.isfinite(values), clipped, jnp.nan).astype(q_dtype)
