"""FP8 numerics statistics of one quantized tensor, and the recorder that the ops fill with them.

``tensor_statistics(x, operand)`` compares a tensor in high precision with the GEMM operand a
quantizer made of it, as ``te_flax.inspect_fp8()`` reports it per tensor (float32 scalars, or
``[G]`` with one entry per group of a grouped GEMM):

- ``amax``: ``max |x|``.
- ``scale_inv``: the dequantization scale the tensor was quantized with (per-tensor recipes);
  for block-scaled recipes the tensor-wide scale (NVFP4's float32 scale, 1 for MXFP8 and
  blockwise FP8, which have none).
- ``saturation``: the fraction of entries clipped at the format's largest finite value: their
  scaled value ``|x / scale_inv|`` lies beyond it by more than the format's own rounding
  there (half its spacing at the top: 464 for e4m3, 61440 for e5m2, 7 for e2m1). An entry
  that rounds to the largest value, as a tensor's amax does under current or block scaling,
  is not saturated.
- ``underflow``: the fraction of the nonzero entries that quantize to zero (lost at the
  bottom).
- block-scaled recipes only: ``block_scale_min``, ``block_scale_max`` and
  ``block_scale_log2_range`` (``log2(max / min)``), over the blocks that hold a nonzero entry
  (each block's scale times the tensor scale).

A block-scaled operand is measured on the layout of the forward GEMM's (or, for a gradient,
dgrad's) contraction: the first layout it prepared that has no Hadamard transform.

While a fused op runs with a statistics slot (``te_flax.quantize.inspection``), every
quantization of a GEMM operand passes the tensor, the quantizer and the operand to ``record``;
the op matches them to its quantizer sets afterwards. Outside that nothing is recorded and no
statistic is traced.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar, cast

import jax
import jax.numpy as jnp
from jax import Array

from te_flax.quantize import block_scaling
from te_flax.quantize.tensors import LEADING, TRAILING, BlockOperand, BlockScaledTensor

__all__ = [
    "BLOCK_STATISTICS",
    "STATISTICS",
    "Recorded",
    "paused",
    "record",
    "recording",
    "recording_active",
    "records_groups",
    "records_rows",
    "saturation_limit",
    "statistic_names",
    "tensor_statistics",
]

STATISTICS = ("amax", "scale_inv", "saturation", "underflow")
BLOCK_STATISTICS = ("block_scale_min", "block_scale_max", "block_scale_log2_range")


def statistic_names(block_scaled: bool) -> tuple[str, ...]:
    """The statistics of a tensor quantized per tensor, or per block (``block_scaled``)."""
    return STATISTICS + (BLOCK_STATISTICS if block_scaled else ())


def saturation_limit(dtype: Any) -> float:
    """The scaled magnitude from which an entry of a tensor quantized to ``dtype`` counts as
    saturated: the largest finite value plus half the spacing of the values just below it
    (where rounding to nearest would pass the largest value, had the format a larger one)."""
    info = jnp.finfo(dtype)
    largest = float(info.max)
    spacing = 2.0 ** (math.floor(math.log2(largest)) - int(info.nmant))
    return largest + spacing / 2


@dataclasses.dataclass(frozen=True)
class _Rows:
    """Per-row partial statistics of a tensor viewed as ``[rows, columns]`` (float32 ``[R]``)."""

    amax: Array
    saturated: Array
    nonzero: Array
    underflow: Array
    block_min: Array | None = None  # smallest block scale among blocks with a nonzero entry
    block_max: Array | None = None


def _row_partials(
    values: Array, data: Array, scale_inv: Array, block_scales: Array | None = None
) -> _Rows:
    """``values`` (``[R, C]`` high precision) against its quantized ``data`` (``[R, C]``) with
    the dequantization scale of each entry, ``scale_inv`` (broadcastable to ``[R, C]``)."""
    magnitude = jnp.abs(values.astype(jnp.float32))
    limit = saturation_limit(data.dtype)
    nonzero = values != 0
    rows = _Rows(
        amax=jnp.max(magnitude, axis=1),
        saturated=jnp.sum(magnitude / scale_inv >= limit, axis=1, dtype=jnp.float32),
        nonzero=jnp.sum(nonzero, axis=1, dtype=jnp.float32),
        underflow=jnp.sum(nonzero & (data.astype(jnp.float32) == 0), axis=1, dtype=jnp.float32),
    )
    if block_scales is None:
        return rows
    blocks = block_scales.shape[1]
    occupied = jnp.any(nonzero.reshape(values.shape[0], blocks, -1), axis=2)  # [R, blocks]
    return dataclasses.replace(
        rows,
        block_min=jnp.min(jnp.where(occupied, block_scales, jnp.inf), axis=1),
        block_max=jnp.max(jnp.where(occupied, block_scales, 0.0), axis=1),
    )


def _finish(
    rows: _Rows, entries: Array, scale_inv: Array, groups: tuple[Array, int] | None
) -> dict[str, Array]:
    """The statistics from per-row partials: over all rows, or per group of rows."""
    if groups is None:
        amax, saturated = jnp.max(rows.amax), jnp.sum(rows.saturated)
        nonzero, underflow = jnp.sum(rows.nonzero), jnp.sum(rows.underflow)
        block_min = None if rows.block_min is None else jnp.min(rows.block_min)
        block_max = None if rows.block_max is None else jnp.max(rows.block_max)
    else:
        ids, n_groups = groups
        amax = jnp.maximum(jax.ops.segment_max(rows.amax, ids, n_groups), 0.0)
        saturated = jax.ops.segment_sum(rows.saturated, ids, n_groups)
        nonzero = jax.ops.segment_sum(rows.nonzero, ids, n_groups)
        underflow = jax.ops.segment_sum(rows.underflow, ids, n_groups)
        block_min = block_max = None
        if rows.block_min is not None and rows.block_max is not None:
            block_min = jax.ops.segment_min(rows.block_min, ids, n_groups)
            block_max = jnp.maximum(jax.ops.segment_max(rows.block_max, ids, n_groups), 0.0)
    stats = {
        "amax": amax,
        "scale_inv": jnp.broadcast_to(scale_inv, amax.shape).astype(jnp.float32),
        "saturation": saturated / jnp.maximum(entries, 1.0),
        "underflow": underflow / jnp.maximum(nonzero, 1.0),
    }
    if block_min is not None and block_max is not None:
        measured = jnp.isfinite(block_min) & (block_max > 0)
        low = jnp.where(measured, block_min, 1.0)
        stats["block_scale_min"] = jnp.where(measured, block_min, 0.0)
        stats["block_scale_max"] = jnp.where(measured, block_max, 0.0)
        stats["block_scale_log2_range"] = jnp.where(measured, jnp.log2(block_max / low), 0.0)
    return {name: value.astype(jnp.float32) for name, value in stats.items()}


def _as_matrix(x: Array, split: int, use: str) -> Array:
    """``x`` as the ``[rows, K]`` matrix a block-scaled use contracts along its last axis."""
    leading = 1
    for size in x.shape[:split]:
        leading *= size
    matrix = x.reshape(leading, -1)  # [leading, trailing]
    return matrix if use == TRAILING else matrix.T


def _measured_use(operand: BlockOperand) -> tuple[str, BlockScaledTensor]:
    prepared = [(TRAILING, operand.trailing), (LEADING, operand.leading)]
    present = [(use, tensor) for use, tensor in prepared if tensor is not None]
    assert present, "a block operand prepares at least one use"
    plain = [(use, tensor) for use, tensor in present if not tensor.has_rht_applied]
    return (plain or present)[0]


def _block_statistics(
    x: Array, operand: BlockOperand, groups: tuple[Array, int] | None
) -> dict[str, Array]:
    use, tensor = _measured_use(operand)
    values = _as_matrix(x, operand.split, use).astype(jnp.float32)  # [R, K]
    if tensor.has_rht_applied:
        values = block_scaling.random_hadamard_transform(values)
    rows, k = tensor.data.shape
    tensor_scale = (
        jnp.ones((), jnp.float32)
        if tensor.tensor_scale_inv is None
        else tensor.tensor_scale_inv.astype(jnp.float32).reshape(())
    )
    # Each block's scale per row ([R, K / block]) and each entry's ([R, K]).
    block_scales = block_scaling.expand_tile_rows(tensor.scale_inv, rows).astype(jnp.float32)
    block_scales = block_scales * tensor_scale
    ones = jnp.ones((rows, k), jnp.float32)
    entry_scales = block_scaling.dequantize_blocks(ones, tensor.scale_inv, tensor.tensor_scale_inv)
    partials = _row_partials(values, tensor.data, entry_scales, block_scales)
    entries = _entries(partials, k, groups)
    return _finish(partials, entries, tensor_scale, groups)


def _entries(partials: _Rows, columns: int, groups: tuple[Array, int] | None) -> Array:
    """How many entries the statistics are over: all, or each group's rows'."""
    row_entries = jnp.full(partials.amax.shape, float(columns), jnp.float32)
    if groups is None:
        return jnp.sum(row_entries)
    ids, n_groups = groups
    return jax.ops.segment_sum(row_entries, ids, n_groups)


def tensor_statistics(
    x: Array, operand: Any, groups: tuple[Array, int] | None = None
) -> dict[str, Array]:
    """The statistics (module docstring) of ``x`` quantized into ``operand``.

    Args:
      x: the tensor in high precision, as the quantizer read it.
      operand: the ``ScaledTensor`` (per-tensor FP8) or ``BlockOperand`` made of it.
      groups: ``(ids [M], n_groups)`` for rows ``x [M, K]`` sorted by group (a grouped GEMM's
        input or output gradient, a per-tensor operand holding one ``scale_inv`` per group):
        statistics per group, ``[n_groups]``. None: one set of statistics for the tensor.

    Returns:
      ``{name: float32 scalar or [n_groups]}`` for ``statistic_names(block_scaled)``.
    """
    if isinstance(operand, BlockOperand):
        return _block_statistics(x, operand, groups)
    data, scale_inv = operand.data, operand.scale_inv
    assert scale_inv is not None, "statistics of a quantized operand"
    scale_inv = scale_inv.astype(jnp.float32)
    if groups is not None:
        ids, _ = groups
        row_scale = jnp.take(scale_inv, ids, mode="fill", fill_value=1.0)[:, None]  # [M, 1]
        partials = _row_partials(x, data, row_scale)
        return _finish(partials, _entries(partials, x.shape[1], groups), scale_inv, groups)
    # One scale: reduced over every axis at once (no reshape of a sharded tensor).
    scale = scale_inv.reshape(())
    magnitude = jnp.abs(x.astype(jnp.float32))
    nonzero = x != 0
    underflow = jnp.sum(nonzero & (data.astype(jnp.float32) == 0), dtype=jnp.float32)
    rows = _Rows(
        amax=jnp.max(magnitude).reshape(1),
        saturated=jnp.sum(
            magnitude / scale >= saturation_limit(data.dtype), dtype=jnp.float32
        ).reshape(1),
        nonzero=jnp.sum(nonzero, dtype=jnp.float32).reshape(1),
        underflow=underflow.reshape(1),
    )
    return _finish(rows, jnp.asarray(float(x.size), jnp.float32), scale, None)


# ----------------------------------------------------------------------------- the recorder


@dataclasses.dataclass(frozen=True)
class Recorded:
    """One quantization a fused op made while recording: the quantizer it was given (matched by
    identity to the op's quantizer sets), the high-precision tensor and the operand."""

    quantizer: Any
    x: Array
    operand: Any
    groups: tuple[Array, int] | None = None
    grouped: bool = False  # the leaves have a leading group axis (quantized group by group)

    def statistics(self) -> dict[str, Array]:
        """``tensor_statistics`` of this quantization (``[G]`` for a grouped one)."""
        if self.grouped:
            return jax.vmap(tensor_statistics)(self.x, self.operand)
        return tensor_statistics(self.x, self.operand, self.groups)


class _Recorders(threading.local):
    def __init__(self) -> None:
        self.stack: list[list[Recorded] | None] = []


_RECORDERS = _Recorders()


@contextlib.contextmanager
def recording() -> Iterator[list[Recorded]]:
    """Collects what ``record`` is given inside the context (a fused op's rule, as it is
    traced); an enclosing recorder sees none of it."""
    found: list[Recorded] = []
    _RECORDERS.stack.append(found)
    try:
        yield found
    finally:
        _RECORDERS.stack.pop()


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Records nothing inside (a ``vmap`` over groups whose caller records the whole)."""
    _RECORDERS.stack.append(None)
    try:
        yield
    finally:
        _RECORDERS.stack.pop()


def recording_active() -> bool:
    """Whether a quantization traced now is recorded (the kernel switch then picks the XLA
    stages, which hold the tensor in high precision)."""
    return bool(_RECORDERS.stack) and _RECORDERS.stack[-1] is not None


def record(
    quantizer: Any,
    x: Array,
    operand: Any,
    groups: tuple[Array, int] | None = None,
    grouped: bool = False,
) -> None:
    """Notes that ``quantizer`` quantized ``x`` into ``operand`` (nothing when not recording)."""
    if recording_active():
        found = _RECORDERS.stack[-1]
        assert found is not None
        found.append(Recorded(quantizer, x, operand, groups, grouped))


Quantize = TypeVar("Quantize", bound=Callable[..., tuple[Any, Any]])


def records_rows(quantize: Quantize) -> Quantize:
    """Decorates a grouped GEMM's ``quantize(x, quantizer, ids, n_groups, ...) -> (operand,
    new quantizer)`` of rows ``x [M, K]`` sorted by group: the quantization is recorded as a
    whole, with statistics per group (what ``quantize`` records itself is not)."""

    @functools.wraps(quantize)
    def recorded(
        x: Array, quantizer: Any, ids: Array, n_groups: int, *args: Any, **kwargs: Any
    ) -> Any:
        with paused():
            operand, new_quantizer = quantize(x, quantizer, ids, n_groups, *args, **kwargs)
        if quantizer is not None:
            record(quantizer, x, operand, groups=(ids, n_groups))
        return operand, new_quantizer

    return cast(Quantize, recorded)


def records_groups(quantize: Quantize) -> Quantize:
    """Decorates a grouped GEMM's ``quantize(x, quantizer, ...) -> (operand, new quantizer)``
    of ``x [G, ...]`` quantized group by group (a ``vmap``): the quantization is recorded as
    a whole, with statistics per group (what ``quantize`` records inside is not)."""

    @functools.wraps(quantize)
    def recorded(x: Array, quantizer: Any, *args: Any, **kwargs: Any) -> Any:
        with paused():
            operand, new_quantizer = quantize(x, quantizer, *args, **kwargs)
        if quantizer is not None:
            record(quantizer, x, operand, grouped=True)
        return operand, new_quantizer

    return cast(Quantize, recorded)
