"""Kernel (2) for LayerNormMLP's inner gradient in Pallas Mosaic GPU: the activation's backward
quantized to float8 in both layouts, with its amax and column sums, in one pass (the Pallas
Triton version: ``activation_grad``).

Each block of the kernel grid owns one ``64 x 64`` tile of the incoming gradient: TMA copies
bring it and the matching tile of each pre-activation slice into shared memory, the block
computes each slice's gradient in registers (the activation's ``jax.vjp`` in float32, rounded
to the pre-activation's dtype: the XLA stage's arithmetic), its amax, and writes it in float8
in both layouts as ``quantize_mosaic`` does. The transposed tile is read from a transposed view
of shared memory (the gradient in its 16-bit dtype, or a float32's two 16-bit halves); the
column sums for the bias gradient are that tile's row sums, which the tiled register layout
reduces. The gradient in high precision never leaves the block.

The kernel takes a gradient whose rows and width are multiples of 64 (``mosaic.tileable``);
other shapes are computed here by the XLA stage's arithmetic, with the same results.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
from jax import Array, lax
from jax.experimental import pallas as pl
from jax.extend import core as jax_core
from jax.typing import DTypeLike

from te_flax._ops.activations import activation_backward_of_slices
from te_flax._ops.kernels import mosaic
from te_flax._ops.kernels.common import lowered_once
from te_flax._ops.kernels.mosaic import (
    TILE,
    layouts_by_xla,
    plgpu,
    tile_amax,
    tileable,
    transposed_tile,
    write_layouts,
)

__all__ = ["activation_grad_tiles", "by_xla", "slices_backward"]

# ``store`` with a register layout (typed loosely: jax 0.10, which runs the Triton version, has
# none).
_REFS: Any = plgpu
_Results = tuple[Array | None, Array | None, Array, Array | None]


def _evaluated(jaxpr: jax_core.Jaxpr, consts: list[Any], args: list[Any]) -> list[Any]:
    """``jaxpr`` evaluated on ``args``, its ``add_any`` (a ``vjp``'s sum of two cotangents,
    which Mosaic GPU does not lower) as ``add``, which XLA compiles it to: the same arithmetic.
    Nested ``jit`` calls are inlined."""
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))

    def read(var: Any) -> Any:
        return var.val if isinstance(var, jax_core.Literal) else env[var]

    for eqn in jaxpr.eqns:
        values = [read(var) for var in eqn.invars]
        if eqn.primitive is jax_core.primitives.add_jaxvals_p:
            outputs = [lax.add(*values)]
        elif eqn.primitive is jax_core.primitives.jit_p:
            inner = eqn.params["jaxpr"]
            outputs = _evaluated(inner.jaxpr, inner.consts, values)
        else:
            result = eqn.primitive.bind(*values, **eqn.params)
            outputs = result if eqn.primitive.multiple_results else [result]
        env.update(zip(eqn.outvars, outputs, strict=True))
    return [read(var) for var in jaxpr.outvars]


def slices_backward(
    grad: Array, slices: list[Array], activation_type: tuple[str, ...]
) -> list[Array]:
    """``activation_backward_of_slices`` in the operations Mosaic GPU lowers (``_evaluated``)."""
    closed = jax.make_jaxpr(
        lambda grad, *slices: activation_backward_of_slices(grad, slices, activation_type)
    )(grad, *slices)
    return _evaluated(closed.jaxpr, closed.consts, [grad, *slices])


def _transposed(d: Array, staged: Any) -> Array:
    """The float32 tile ``d`` (values of the pre-activation's dtype) transposed, through
    ``staged``: two uint16 buffers for a float32 tile, else a buffer of that 16-bit dtype."""
    if len(staged.shape) == 3:
        return transposed_tile(d, None, staged)
    staged[...] = d.astype(staged.dtype)
    return transposed_tile(d, staged, None)


def _body(
    activation_type: tuple[str, ...], q_dtype: DTypeLike | None, with_bias: bool,
    pre_ref: Any, grad_ref: Any, scale_inv_ref: Any, *refs: Any,
) -> None:  # fmt: skip
    """One tile: ``refs`` are the outputs (the float8 layouts, the tile maxima, the column
    sums, as asked for), then the slices' buffer, the gradient's, the buffer the transposed
    read goes through, the column sums', the two float8 buffers, and the copies' barrier."""
    quantized, n_act = q_dtype is not None, len(activation_type)
    results: Iterator[Any] = iter(refs)
    data_refs = [next(results), next(results)] if quantized else []  # as is, transposed
    amax_ref = next(results)
    sums_ref = next(results) if with_bias else None
    pre_smem, grad_smem = next(results), next(results)
    staged = next(results) if quantized or with_bias else None
    sums_smem = next(results) if with_bias else None
    data_smem = [next(results), next(results)] if quantized else []
    barrier = next(results)
    intermediate = grad_ref.shape[1]
    i, j = lax.axis_index("row"), lax.axis_index("column")
    rows, columns = pl.ds(i * TILE, TILE), pl.ds(j * TILE, TILE)
    slice_columns = [pl.ds(k * intermediate + j * TILE, TILE) for k in range(n_act)]
    plgpu.copy_gmem_to_smem(grad_ref.at[rows, columns], grad_smem, barrier)
    for k in range(n_act):  # [TILE, TILE] of slice k; one arrival per copy
        plgpu.copy_gmem_to_smem(pre_ref.at[rows, slice_columns[k]], pre_smem.at[k], barrier)
    plgpu.barrier_wait(barrier)
    slices = [pre_smem[k] for k in range(n_act)]
    d_slices = slices_backward(grad_smem[...], slices, activation_type)
    for k, d_slice in enumerate(d_slices):
        d = d_slice.astype(jnp.float32)
        amax_ref[i, j, k] = tile_amax(d)
        if staged is None:
            continue  # the amax pass of current scaling
        d_t = _transposed(d, staged)  # [TILE (columns), TILE (rows)]
        if sums_smem is not None:  # the tile's column sums: its transpose's row sums
            _REFS.store(sums_smem.at[k], jnp.sum(d_t, axis=1), optimized=False)
        if q_dtype is not None:
            targets = [
                data_refs[0].at[rows, slice_columns[k]],
                data_refs[1].at[slice_columns[k], rows],
            ]
            write_layouts(d, d_t, scale_inv_ref[0], q_dtype, data_smem, targets)
    if sums_ref is not None and sums_smem is not None:
        plgpu.commit_smem()
        for k in range(n_act):
            plgpu.copy_smem_to_gmem(sums_smem.at[k], sums_ref.at[i, slice_columns[k]])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def by_xla(
    pre_activation: Array, grad: Array, scale_inv: Array, activation_type: tuple[str, ...],
    q_dtype: DTypeLike | None, with_bias: bool,
) -> _Results:  # fmt: skip
    """The kernel's results by XLA, for a block the kernel does not tile (one row of sums)."""
    intermediate = grad.shape[1]
    slices = [
        pre_activation[:, k * intermediate : (k + 1) * intermediate]
        for k in range(len(activation_type))
    ]
    d_slices = activation_backward_of_slices(grad, slices, activation_type)
    d = jnp.concatenate(d_slices, axis=1)  # [rows, n_act * intermediate]
    layouts = (True, True) if q_dtype is not None else (False, False)
    data, transposed, amax = layouts_by_xla(d, scale_inv, q_dtype, layouts)
    sums = jnp.sum(d.astype(jnp.float32), axis=0, keepdims=True) if with_bias else None
    return data, transposed, amax, sums


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
) -> _Results:
    """The activation's gradient quantized in both layouts, its tile maxima and column sums.

    Args:
      pre_activation: ``[rows, n_act * intermediate]``, the slices side by side, in float32,
        bfloat16 or float16.
      grad: ``[rows, intermediate]``, the gradient of the activation's output.
      scale_inv: f32 ``[1]``, the dequantization scale.
      activation_type: the canonical activation names (see ``te_flax._ops.activations``).
      q_dtype: the float8 dtype, or None for the amax partials (and column sums) only.
      with_bias: also return the column sums (for the bias gradient).
      interpret: run in Mosaic GPU's interpret mode (any platform; for tests).

    Returns:
      The float8 gradient ``[rows, n_act * intermediate]`` and ``[n_act * intermediate,
      rows]`` (None without ``q_dtype``), f32 ``[tiles * n_act]`` tile maxima, and f32
      ``[row tiles, n_act * intermediate]`` column sums (None without ``with_bias``).
    """
    rows, intermediate = grad.shape
    n_act, width = len(activation_type), pre_activation.shape[1]
    if not tileable(rows, intermediate):
        return by_xla(pre_activation, grad, scale_inv, activation_type, q_dtype, with_bias)
    dtype = pre_activation.dtype
    grid = (rows // TILE, intermediate // TILE)
    out_type = []
    if q_dtype is not None:
        out_type += [
            jax.ShapeDtypeStruct((rows, width), q_dtype),
            jax.ShapeDtypeStruct((width, rows), q_dtype),
        ]
    out_type.append(jax.ShapeDtypeStruct((*grid, n_act), jnp.float32))
    buffers = []
    if q_dtype is not None or with_bias:  # the transposed read's 16-bit buffer
        wide = dtype.itemsize == 4
        buffers.append(
            plgpu.SMEM((2, TILE, TILE) if wide else (TILE, TILE), jnp.uint16 if wide else dtype)
        )
    if with_bias:
        out_type.append(jax.ShapeDtypeStruct((grid[0], width), jnp.float32))
        buffers.append(plgpu.SMEM((n_act, TILE), jnp.float32))
    if q_dtype is not None:
        buffers += [plgpu.SMEM((TILE, TILE), q_dtype)] * 2
    kernel = mosaic.kernel(
        "activation_grad",
        lambda *refs: _body(activation_type, q_dtype, with_bias, *refs),
        tuple(out_type),
        dict(zip(("row", "column"), grid, strict=True)),
        (
            plgpu.SMEM((n_act, TILE, TILE), dtype),
            plgpu.SMEM((TILE, TILE), grad.dtype),
            *buffers,
            plgpu.Barrier(num_arrivals=n_act + 1),
        ),
        interpret,
    )
    outputs = list(kernel(pre_activation, grad, scale_inv))
    data, transposed = (outputs.pop(0), outputs.pop(0)) if q_dtype is not None else (None, None)
    amax = outputs.pop(0).reshape(-1)
    column_sums = outputs.pop(0) if with_bias else None
    return data, transposed, amax, column_sums
