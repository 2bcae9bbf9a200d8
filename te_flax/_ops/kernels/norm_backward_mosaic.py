"""Kernel (3) in Pallas Mosaic GPU: the norm backward (dx, and per-program partial dgamma and
dbeta) in one pass over the output gradient and ``x`` (the Pallas Triton version:
``norm_backward``).

Each block of the kernel grid owns a run of consecutive rows. A TMA copy brings a row of the
output gradient and of ``x`` into shared memory (the next row's copy in flight while the block
computes, where two rows fit), and the block walks the row in chunks twice: the first walk sums
the projection ``d_x_hat . x_hat`` and, for layernorm, ``d_x_hat`` in registers (a chunk is a
1-D array spread over the warpgroup's threads; one reduction across them per row), the second
computes ``dx`` into the row's own buffer, which a TMA copy writes back, and adds the row's
``dgamma`` and ``dbeta`` terms to float32 sums in shared memory. Those are the block's partial
sums: one row of a ``[programs, hidden]`` array each, which XLA adds up (float32 sums in another
order than the XLA stage's: equal within float32 rounding). The copies are written out (no
``plgpu.emit_pipeline``) so that the kernel also runs in Mosaic GPU's interpret mode, which is
how it is tested on a CPU.

The kernel takes a hidden size that is a multiple of 256 (``fits``); other shapes are computed
here by the XLA stage's arithmetic, with one partial row.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import Array, lax
from jax.experimental import pallas as pl
from jax.typing import DTypeLike

from te_flax._ops.kernels import mosaic
from te_flax._ops.kernels.common import MAX_HIDDEN, RowBlocks, lowered_once
from te_flax._ops.kernels.mosaic import plgpu

__all__ = ["by_xla", "fits", "norm_backward"]

# ``load`` and ``store`` with a register layout (typed loosely: jax 0.10, which runs the Triton
# version, has neither).
_REFS: Any = plgpu
_PROGRAMS = 256  # blocks of rows: a few per SM, few enough that the partial sums stay small
_CHUNKS = (1024, 512, 256)  # the widths a row is walked in, widest first
_VECTOR = 2  # values per thread and access: float32 pairs, the same layout for every dtype
_SMEM_BYTES = 200 * 1024  # what the buffers may take of a block's shared memory


def fits(hidden: int) -> bool:
    """Whether the kernel takes rows of ``hidden`` values: a multiple of the narrowest chunk,
    at most ``MAX_HIDDEN`` (whose float32 rows, one in flight, take 160 KiB of shared memory)."""
    return 0 < hidden <= MAX_HIDDEN and hidden % _CHUNKS[-1] == 0


def _chunk(hidden: int) -> int:
    return next(width for width in _CHUNKS if hidden % width == 0)


def _slots(hidden: int, row_bytes: int, with_beta: bool) -> int:
    """Rows in flight: two (one computed, the next copied in) where they fit shared memory."""
    sums = hidden * 4 * (2 + with_beta)  # gamma, dgamma and dbeta in float32
    return 2 if 2 * hidden * row_bytes + sums <= _SMEM_BYTES else 1


def _row(
    d_out_row: Any, x_row: Any, gamma_smem: Any, sums: tuple[Any, Any | None],
    mean: Array | None, rsigma: Array, weight: Array,
) -> None:  # fmt: skip
    """One row in shared memory, in chunks: the first walk sums the projection (and for
    layernorm ``d_x_hat``), the second writes ``dx`` over ``x_row`` and adds the row's terms,
    times ``weight`` (0 for a repeated row), to the dgamma and dbeta ``sums``."""
    hidden = x_row.shape[0]
    width = _chunk(hidden)
    layout = _REFS.Layout.WG_STRIDED((width,), _VECTOR)
    zeros = _REFS.layout_cast(jnp.zeros((width,), jnp.float32), layout)  # a loop's carry

    def chunk(j: Array) -> Any:
        return pl.ds(pl.multiple_of(j * width, width), width)

    def terms(j: Array) -> tuple[Array, Array, Array]:
        """The chunk's ``d_out``, ``x_hat`` and ``d_x_hat`` in float32."""
        d_out = _REFS.load(d_out_row.at[chunk(j)], layout=layout).astype(jnp.float32)
        x = _REFS.load(x_row.at[chunk(j)], layout=layout).astype(jnp.float32)
        x_hat = (x if mean is None else x - mean) * rsigma
        return d_out, x_hat, d_out * _REFS.load(gamma_smem.at[chunk(j)], layout=layout)

    def walk(j: Array, acc: tuple[Array, Array]) -> tuple[Array, Array]:
        _, x_hat, d_x_hat = terms(j)
        return acc[0] + d_x_hat * x_hat, acc[1] + d_x_hat

    acc = lax.fori_loop(0, hidden // width, walk, (zeros, zeros))
    projection = jnp.sum(acc[0]) / hidden
    centre = None if mean is None else jnp.sum(acc[1]) / hidden

    def d_x(j: Array, carry: None) -> None:
        d_out, x_hat, d_x_hat = terms(j)
        d_x_hat = d_x_hat if centre is None else d_x_hat - centre
        d_x = rsigma * (d_x_hat - x_hat * projection)
        _REFS.store(x_row.at[chunk(j)], d_x.astype(x_row.dtype), optimized=False)
        d_out = d_out * weight
        for total, term in zip(sums, (d_out * x_hat, d_out), strict=True):
            if total is not None:
                value = _REFS.load(total.at[chunk(j)], layout=layout)
                _REFS.store(total.at[chunk(j)], value + term, optimized=False)

    lax.fori_loop(0, hidden // width, d_x, None)


def _body(
    rows: int, per_program: int, with_beta: bool, layernorm: bool, *refs: Any
) -> None:  # fmt: skip
    """The rows of one block: ``refs`` are the inputs (the output gradient, ``x``, the mean
    for layernorm, rsigma, gamma), the outputs (``dx``, the partial dgamma, dbeta if asked
    for), then the buffers: the gradient's and ``x``'s rows, gamma, the sums, the barriers."""
    n_in = 4 + layernorm
    inputs, refs = refs[:n_in], refs[n_in:]
    d_out_ref, x_ref, *stats, gamma_ref = inputs
    mean_ref = stats[0] if layernorm else None
    rsigma_ref = stats[-1]
    d_x_ref, d_gamma_ref, *rest = refs
    d_beta_ref = rest.pop(0) if with_beta else None
    d_out_smem, x_smem, gamma_smem, d_gamma_smem, *rest = rest
    d_beta_smem = rest.pop(0) if with_beta else None
    row_barriers, gamma_barrier = rest
    hidden, slots = x_smem.shape[1], x_smem.shape[0]
    width = _chunk(hidden)
    layout = _REFS.Layout.WG_STRIDED((width,), _VECTOR)
    program = lax.axis_index("program")
    first = program * per_program

    def row_of(i: Array) -> Array:  # a block past the last row repeats it, adding nothing
        return jnp.minimum(first + i, rows - 1)

    def copy_in(source: Any, target: Any, barrier: Any) -> None:
        # Whole rows, in bounds: one contiguous bulk copy each, whatever their length.
        in_bounds = _REFS.OOBFillMode.PROMISE_IN_BOUNDS
        _REFS.copy_gmem_to_smem(source, target, barrier, oob_mode=in_bounds)

    def fetch(i: Array, slot: Array) -> None:
        barrier = row_barriers.at[slot]
        copy_in(d_out_ref.at[row_of(i)], d_out_smem.at[slot], barrier)
        copy_in(x_ref.at[row_of(i)], x_smem.at[slot], barrier)

    copy_in(gamma_ref, gamma_smem, gamma_barrier)
    fetch(jnp.int32(0), jnp.int32(0))
    zeros = _REFS.layout_cast(jnp.zeros((width,), jnp.float32), layout)  # a loop's carry
    for j in range(hidden // width):  # the sums start at zero
        _REFS.store(d_gamma_smem.at[pl.ds(j * width, width)], zeros, optimized=False)
        if d_beta_smem is not None:
            _REFS.store(d_beta_smem.at[pl.ds(j * width, width)], zeros, optimized=False)
    plgpu.barrier_wait(gamma_barrier)

    def row_step(i: Array, carry: None) -> None:
        slot = lax.rem(i, slots)
        plgpu.barrier_wait(row_barriers.at[slot])
        if slots == 2:  # the next row's copy, once the last dx copy has read its buffer

            @pl.when(i + 1 < per_program)
            def _() -> None:
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                fetch(i + 1, 1 - slot)

        row = row_of(i)
        mean = None if mean_ref is None else mean_ref[row]
        weight = jnp.where(first + i < rows, 1.0, 0.0).astype(jnp.float32)
        x_row = x_smem.at[slot]
        sums = (d_gamma_smem, d_beta_smem)
        _row(d_out_smem.at[slot], x_row, gamma_smem, sums, mean, rsigma_ref[row], weight)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(x_row, d_x_ref.at[row])
        if slots == 1:  # the buffer is the next row's: its copy in once dx is out

            @pl.when(i + 1 < per_program)
            def _() -> None:
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                fetch(i + 1, jnp.int32(0))

    lax.fori_loop(0, per_program, row_step, None)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(d_gamma_smem, d_gamma_ref.at[program])
    if d_beta_ref is not None and d_beta_smem is not None:
        plgpu.copy_smem_to_gmem(d_beta_smem, d_beta_ref.at[program])
    plgpu.wait_smem_to_gmem(0)


def by_xla(
    d_out: Array, x: Array, mean: Array | None, rsigma: Array, gamma: Array, with_beta: bool,
    dx_dtype: DTypeLike,
) -> tuple[Array, Array, Array | None]:  # fmt: skip
    """The kernel's results by the XLA stage's arithmetic, for rows it does not take (one
    partial row of sums)."""
    d_out = d_out.astype(jnp.float32)
    x32 = x.astype(jnp.float32)
    x_hat = (x32 if mean is None else x32 - mean[:, None]) * rsigma[:, None]
    d_gamma = jnp.sum(d_out * x_hat, axis=0, keepdims=True)
    d_beta = jnp.sum(d_out, axis=0, keepdims=True) if with_beta else None
    d_x_hat = d_out * gamma[None, :]
    projection = jnp.mean(d_x_hat * x_hat, axis=-1, keepdims=True)
    if mean is not None:
        d_x_hat = d_x_hat - jnp.mean(d_x_hat, axis=-1, keepdims=True)
    d_x = rsigma[:, None] * (d_x_hat - x_hat * projection)
    return d_x.astype(dx_dtype), d_gamma, d_beta


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
      dx_dtype: the dtype of ``dx``: ``x``'s (the kernel writes ``dx`` into ``x``'s buffer).
      blocks: the rows and hidden size of ``x`` (the Triton version's blocks, whose sizes
        this kernel does not use).
      interpret: run in Mosaic GPU's interpret mode (any platform; for tests).

    Returns:
      ``dx [rows, hidden]``, f32 ``[programs, hidden]`` partial ``dgamma`` and ``dbeta``.
    """
    rows, hidden = blocks.rows, blocks.hidden
    if not fits(hidden) or jnp.dtype(dx_dtype) != x.dtype:
        return by_xla(d_out, x, mean, rsigma, gamma, with_beta, dx_dtype)
    per_program = pl.cdiv(rows, _PROGRAMS)
    programs = pl.cdiv(rows, per_program)
    slots = _slots(hidden, d_out.dtype.itemsize + x.dtype.itemsize, with_beta)
    partial_sum = jax.ShapeDtypeStruct((programs, hidden), jnp.float32)
    out_type = [jax.ShapeDtypeStruct(x.shape, x.dtype), partial_sum]
    sums = [plgpu.SMEM((hidden,), jnp.float32)] * (2 + with_beta)  # gamma, dgamma, dbeta
    if with_beta:
        out_type.append(partial_sum)
    kernel = mosaic.kernel(
        "norm_backward",
        lambda *refs: _body(rows, per_program, with_beta, mean is not None, *refs),
        tuple(out_type),
        {"program": programs},
        (
            plgpu.SMEM((slots, hidden), d_out.dtype),
            plgpu.SMEM((slots, hidden), x.dtype),
            *sums,
            plgpu.Barrier(num_arrivals=2, num_barriers=slots),
            plgpu.Barrier(num_arrivals=1),
        ),
        interpret,
    )
    inputs = [value for value in (d_out, x, mean, rsigma, gamma) if value is not None]
    outputs = kernel(*inputs)
    return outputs[0], outputs[1], outputs[2] if with_beta else None
