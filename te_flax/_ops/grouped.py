"""Grouped GEMM stages: the quantize and GEMM stages of ``_stages`` with a group axis.

A grouped GEMM multiplies the rows of ``x [M, K]`` that belong to group ``g`` (rows sorted by
group, ``group_sizes[g]`` of them) with ``kernel[g] [K, N]``. Every per-tensor quantizer of a
grouped set holds one scale per group: delayed-scaling state is ``scale_inv [G, 1]`` and
``amax_history [G, L]`` (``grouped_quantizer_set``), current scaling takes each group's own amax.

Two layouts carry the rows through the GEMMs:
- ragged: ``x`` stays ``[M, K]`` (exact, no padding) and the GEMMs are te_flax's grouped GEMM
  kernels (``kernels/grouped_gemm.py``) where the kernel switch takes them (a CUDA GPU), else
  ``lax.ragged_dot_general``;
- capacity: each group's rows are gathered into a ``[G, capacity, K]`` buffer padded with zeros
  (``pack_rows``), and the ops run ``dense``'s stages under ``jax.vmap`` over groups, which makes
  every GEMM one batched ``dot_general`` (``unpack_rows`` scatters the output back).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array, lax
from jax.typing import DTypeLike

from te_flax._ops.activations import activation_backward, rounded_once_activation
from te_flax._ops.custom_op import FusedOp, fused_op
from te_flax._ops.grouped_activation import activation_grad_quantized
from te_flax._ops.grouped_kernels import kernel_tiles, rows_kernel, wgrad_kernel
from te_flax._ops.kernels.grouped_gemm import (
    Accumulation,
    kernel_dtypes,
    supported_dtypes,
    tiles_for,
)
from te_flax._ops.kernels.probes import grouped_gemm_probe
from te_flax._ops.kernels.switch import dispatch, gpu_host, takes_kernel
from te_flax.quantize import (
    LEADING,
    TRAILING,
    BlockOperand,
    CurrentScaleQuantizer,
    DelayedScaleQuantizer,
    GemmOperand,
    Quantizer,
    QuantizerSet,
    ScaledTensor,
    as_cotangent,
    quantize_operand,
    scaling,
)
from te_flax.quantize.quantizer_set import grouped_quantizer_set
from te_flax.quantize.statistics import records_groups, records_rows

__all__ = [
    "Fp8AtBf16RateWarning",
    "GroupedConfig",
    "RaggedOnGpuWarning",
    "activation_grad_by_xla",
    "capacity_on_kernels",
    "check_grouped_set",
    "group_ids",
    "grouped_quantizer_set",
    "pack_rows",
    "quantize_groups",
    "quantize_rows",
    "ragged_grouped_dense",
    "unpack_rows",
]


# ----------------------------------------------------------------------------- group layout


def group_ids(group_sizes: Array, rows: int) -> Array:
    """The group of each of ``rows`` rows sorted by group: int32 ``[rows]``, ``G`` for the rows
    past ``sum(group_sizes)`` (which belong to no group)."""
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))  # [G]
    return jnp.searchsorted(ends, jnp.arange(rows, dtype=jnp.int32), side="right").astype(jnp.int32)


def _slots(group_sizes: Array, capacity: int) -> tuple[Array, Array]:
    """For each group and slot of a ``[G, capacity]`` buffer: the row of x it holds, and whether
    it holds one (slots past the group's size, or past the capacity, are padding)."""
    sizes = group_sizes.astype(jnp.int32)
    starts = jnp.cumsum(sizes) - sizes  # [G]
    slot = jnp.arange(capacity, dtype=jnp.int32)  # [C]
    rows = starts[:, None] + slot[None, :]  # [G, C]
    return rows, slot[None, :] < sizes[:, None]


def pack_rows(x: Array, group_sizes: Array, capacity: int) -> Array:
    """``x [M, K]`` (rows sorted by group) as ``[G, capacity, K]``, zero-padded.

    A group with more rows than ``capacity`` keeps its first ``capacity`` rows; the others are
    dropped (their output is zero and they get no gradient), as capacity-based MoE layers drop
    tokens. Zero padding leaves each group's amax unchanged.
    """
    rows, valid = _slots(group_sizes, capacity)
    gathered = jnp.take(x, jnp.clip(rows, 0, x.shape[0] - 1), axis=0)  # [G, C, K]
    return jnp.where(valid[..., None], gathered, jnp.zeros((), x.dtype))


def unpack_rows(packed: Array, group_sizes: Array, rows: int) -> Array:
    """The inverse of ``pack_rows``: ``[G, capacity, N]`` back to ``[rows, N]``, zero for the
    rows that no slot holds (dropped rows and the rows past ``sum(group_sizes)``)."""
    n_groups, capacity = packed.shape[:2]
    ids = group_ids(group_sizes, rows)  # [M]
    sizes = group_sizes.astype(jnp.int32)
    starts = jnp.cumsum(sizes) - sizes
    slot = jnp.arange(rows, dtype=jnp.int32) - jnp.take(starts, ids, mode="fill", fill_value=0)
    held = (ids < n_groups) & (slot < capacity)
    flat = jnp.where(held, ids * capacity + slot, 0)  # [M]
    out = jnp.take(packed.reshape(n_groups * capacity, -1), flat, axis=0)  # [M, N]
    return jnp.where(held[:, None], out, jnp.zeros((), packed.dtype))


# ----------------------------------------------------------------------------- quantizers


def check_grouped_set(quantizer_set: QuantizerSet, n_groups: int) -> None:
    """Delayed-scaling state must hold one scale per group: ``scale_inv [G, 1]``."""
    for name in ("x", "kernel", "dgrad"):
        quantizer = getattr(quantizer_set, name)
        if not isinstance(quantizer, DelayedScaleQuantizer):
            continue
        if quantizer.scale_inv.shape != (n_groups, 1) or quantizer.amax_history.ndim != 2:
            raise ValueError(
                f"quantizer_set.{name} holds delayed-scaling state of shape "
                f"{tuple(quantizer.scale_inv.shape)} (scale_inv) and "
                f"{tuple(quantizer.amax_history.shape)} (amax_history), but grouped_dense with "
                f"{n_groups} groups needs one scale per group: ({n_groups}, 1) and "
                f"({n_groups}, amax_history_len); build the set with "
                f"QuantizerFactory.create_set(..., n_groups={n_groups}) or "
                f"te_flax.dense.grouped_quantizer_set(quantizer_set, n_groups={n_groups})"
            )


def _group_amax(
    x: Array, ids: Array, n_groups: int, distinct: frozenset[str] | None = None
) -> Array:
    """``max |x|`` over each group's rows: float32 ``[G]``, 0 for an empty group.

    ``distinct``: manual mesh axes whose devices hold other groups (``scaling.distinct_over``).
    """
    row_amax = jnp.max(jnp.abs(x), axis=tuple(range(1, x.ndim))).astype(jnp.float32)  # [M]
    # The rows' maxima as a result of their own: XLA then reduces them in the pass that
    # quantizes x (one read of x), where it would otherwise fold the reduction into the
    # segment max's scatter, a pass over x of its own (docs/moe.md, "MoEBlock in FP8 against
    # BF16").
    row_amax = lax.optimization_barrier(row_amax)
    amax = jax.ops.segment_max(row_amax, ids, num_segments=n_groups)  # [G]; -inf when empty
    amax = jnp.maximum(amax, 0.0)
    # As scaling.amax: inside shard_map each device holds a block of the rows.
    return scaling.max_over_devices(amax, distinct)


def _group_scales(quantizer: Quantizer, amax: Array) -> tuple[Array, Quantizer]:
    """Each group's ``scale_inv`` (float32 ``[G]``) for this step, and the updated quantizer."""
    if isinstance(quantizer, DelayedScaleQuantizer) and not quantizer.just_in_time:
        updated = jax.vmap(DelayedScaleQuantizer.update)(quantizer, amax)
        return quantizer.scale_inv[:, 0], updated
    if isinstance(quantizer, DelayedScaleQuantizer):  # each fresh group scaled from its amax
        scale_inv, updated = jax.vmap(DelayedScaleQuantizer.scale_and_update)(quantizer, amax)
        return scale_inv, updated
    assert isinstance(quantizer, CurrentScaleQuantizer), type(quantizer)
    return quantizer.scale_inv_for(amax), quantizer


@records_rows  # te_flax.inspect_fp8(): statistics per group
def quantize_rows(
    x: Array,
    quantizer: Quantizer | None,
    ids: Array,
    n_groups: int,
    dtype: DTypeLike,
    distinct: frozenset[str] | None = None,
) -> tuple[GemmOperand, Quantizer | None]:
    """Rows ``x [M, K]`` sorted by group, each group quantized with its own scale.

    The operand's ``scale_inv`` is float32 ``[G]``; without a quantizer x is cast to ``dtype``.
    A block-scaled quantizer quantizes x for both of its contractions (a ``BlockOperand``).
    """
    if quantizer is None:
        return ScaledTensor(x.astype(dtype)), None
    if quantizer.block_scaled:
        # Blocks along each GEMM's contraction: the features (per row) and, for wgrad, the
        # rows (blocks of rows that straddle two groups share a scale).
        return quantize_operand(x, quantizer, dtype, 1, (TRAILING, LEADING))
    scale_inv, quantizer = _group_scales(quantizer, _group_amax(x, ids, n_groups, distinct))
    return ScaledTensor(_by_group_scale(x, quantizer.q_dtype, scale_inv, ids), scale_inv), quantizer


def _by_group_scale(x: Array, q_dtype: DTypeLike, scale_inv: Array, ids: Array) -> Array:
    """Rows ``x [M, K]`` quantized with their group's ``scale_inv [G]`` (1 past the groups)."""
    row_scale_inv = jnp.take(scale_inv, ids, mode="fill", fill_value=1.0)  # [M]
    return scaling.quantize(x, q_dtype, row_scale_inv[:, None])


@records_groups  # te_flax.inspect_fp8(): statistics per group
def quantize_groups(
    x: Array, quantizer: Quantizer | None, dtype: DTypeLike, split: int, uses: tuple[str, ...]
) -> tuple[Any, Quantizer | None]:
    """``x [G, ...]`` quantized group by group with ``quantize_operand`` (one scale or one set
    of blocks per group): the operand's leaves get a leading group axis."""
    if quantizer is None:
        return quantize_operand(x, None, dtype)
    stateful = isinstance(quantizer, DelayedScaleQuantizer)
    in_axes = (0, 0 if stateful else None)
    return jax.vmap(
        lambda group, q: quantize_operand(group, q, dtype, split, uses),
        in_axes=in_axes,
        out_axes=(0, 0 if stateful else None),
    )(x, quantizer)


# ----------------------------------------------------------------------------- ragged GEMMs


def _gemm_input(
    operand: GemmOperand, use: str, dtype: DTypeLike, grouped: bool
) -> tuple[Array, Array | None]:
    """An operand as a ragged GEMM takes it: its data in the tensor's own layout and its group
    scales (float32 ``[G]``, None for high precision). ``grouped``: the operand's leaves have a
    leading group axis (a kernel quantized group by group)."""
    if isinstance(operand, ScaledTensor):
        return operand.data, operand.scale_inv
    # ragged_dot takes no block scales: a block-scaled operand enters as its values, as XLA
    # runs block-scaled GEMMs on GPUs without block-scaled tensor cores (exact in bfloat16
    # for MXFP8: e4m3 values times power-of-two scales).
    values = partial(_block_values, use=use, dtype=dtype)
    return (jax.vmap(values)(operand) if grouped else values(operand)), None


def _block_values(operand: BlockOperand, use: str, dtype: DTypeLike) -> Array:
    """The values of one prepared use of a block-scaled operand, in the tensor's shape."""
    prepared = operand.trailing if use == TRAILING else operand.leading
    assert prepared is not None, f"the {use} quantization was not prepared"
    matrix = prepared.dequantize(dtype)  # TRAILING: [leading, trailing]; LEADING: transposed
    return (matrix if use == TRAILING else matrix.T).reshape(operand.shape)


def _grouped_gemm(
    lhs: tuple[Array, Array | None],
    rhs: tuple[Array, Array | None],
    group_sizes: Array,
    ids: Array,
    contract: tuple[int, int],
    rhs_group_dims: tuple[int, ...],
    out_dtype: DTypeLike,
    precision: lax.Precision | None,
) -> Array:
    """The grouped GEMM of two ``_gemm_input`` operands, the lhs ragged along its rows (axis 0),
    with their group scales applied: te_flax's kernel where the switch takes it (a CUDA GPU),
    else ``lax.ragged_dot_general`` (``_xla_grouped_gemm``).

    With ``rhs_group_dims=(0,)`` each group of rows multiplies its own rhs matrix (the forward
    GEMM and dgrad, ``[M, N]``; scales per row); with ``()`` the rows are contracted group by
    group (wgrad, ``[G, K, N]``; scales per group).
    """
    (lhs_data, lhs_scale), (rhs_data, rhs_scale) = lhs, rhs
    scale = None if lhs_scale is None or rhs_scale is None else lhs_scale * rhs_scale
    xla = partial(
        _xla_grouped_gemm,
        contract=contract,
        rhs_group_dims=rhs_group_dims,
        out_dtype=out_dtype,
        precision=precision,
    )
    accumulation = Accumulation(split=_split_accumulation(lhs_data.dtype, precision))
    kernel: Callable[..., Array]
    if rhs_group_dims:
        kernel = partial(
            rows_kernel,
            forward=contract == (1, 1),
            out_dtype=out_dtype,
            accumulation=accumulation,
        )
    else:
        kernel = partial(wgrad_kernel, out_dtype=out_dtype, accumulation=accumulation)
    # 16-bit and float8 operands; float8 ones split their accumulation where the recipe asks.
    types = kernel_dtypes(lhs_data.dtype, rhs_data.dtype)
    fits = types is not None and (
        kernel_tiles(
            jax.ShapeDtypeStruct(lhs_data.shape, types[0]),
            jax.ShapeDtypeStruct(rhs_data.shape, types[1]),
            contract,
            group_sizes.shape[0],
        )
        is not None
    )
    operands = (lhs_data, rhs_data, group_sizes, ids, scale)
    on_kernel = takes_kernel("grouped_gemm", *operands, supported=fits)
    if gpu_host() and not on_kernel:
        warnings.warn(
            "grouped_dense's ragged lowering runs XLA's ragged_dot on this GPU, which XLA "
            "expands over every group (about G times the routed FLOPs): te_flax's grouped GEMM "
            "kernel takes float8 or 16-bit operands whose feature axes are multiples of 64 (any "
            "number of rows), one device or shard_map, and TE_FLAX_PALLAS auto or 1. "
            "Otherwise pass lowering='capacity' (docs/moe.md)",
            RaggedOnGpuWarning,
            stacklevel=2,
        )
    converted = types is not None and types != (lhs_data.dtype, rhs_data.dtype)
    if converted and gpu_host() and on_kernel:
        warnings.warn(
            f"grouped_dense multiplies {lhs_data.dtype} by {rhs_data.dtype} at BF16's "
            f"tensor-core rate on jax {jax.__version__}, whose Mosaic GPU has no e4m3 x e5m2 "
            "wgmma: the float8 operands enter te_flax's grouped GEMM kernel as bfloat16 (exact). "
            "HYBRID FP8's gradient GEMMs run in float8 from jax 0.11 on, or on this JAX with "
            "DelayedScaling(fp8_format=Format.E4M3) (docs/moe.md)",
            Fp8AtBf16RateWarning,
            stacklevel=2,
        )
    probe = grouped_gemm_probe(kernel, xla, operands, contract) if fits else None
    return dispatch("grouped_gemm", kernel, xla, *operands, supported=fits, probe=probe)


def _split_accumulation(dtype: DTypeLike, precision: lax.Precision | None) -> bool:
    """Whether a kernel GEMM promotes its partial sums to float32 every contraction step:
    float8 operands where the recipe asks for split accumulation (``use_split_accumulator``,
    ``Precision.HIGHEST``; XLA's cuBLASLt GEMMs turn off fast accumulation for any precision
    above DEFAULT). 16-bit products accumulate in float32 on the tensor cores already."""
    split = precision not in (None, lax.Precision.DEFAULT)
    return jnp.dtype(dtype).itemsize == 1 and split


def capacity_on_kernels(
    x: Array, kernel: Array, capacity: int, quantizer_set: QuantizerSet
) -> bool:
    """Whether the capacity lowering runs its GEMMs on the grouped GEMM kernels (each group
    ``capacity`` rows, ``ragged_grouped_dense`` on the packed rows): with per-tensor FP8, where
    the switch takes the kernels and they take all three GEMMs' operands.

    There each group's scales are applied to the kernels' accumulators: no pass over the weight
    gradient, which a batched cuBLASLt GEMM (one scalar scale) adds. Without FP8, and with
    block-scaled recipes (whose operands enter as 16-bit values), the batched cuBLAS GEMMs stay:
    by ``bench/moe.py``'s model they are the faster of the two there (docs/moe.md)."""
    quantizers = (quantizer_set.x, quantizer_set.kernel, quantizer_set.dgrad)
    if quantizer_set.is_noop or any(q is None or q.block_scaled for q in quantizers):
        return False
    fp8_x, fp8_kernel, fp8_grad = (q.q_dtype for q in quantizers if q is not None)
    groups, hidden, features = kernel.shape
    rows = groups * capacity
    gemms = [  # forward, dgrad (rows_gemm: any number of rows), wgrad
        (fp8_x, fp8_kernel, tiles_for(fp8_x, rows, features, hidden, ragged_rows=True)),
        (fp8_grad, fp8_kernel, tiles_for(fp8_grad, rows, hidden, features, ragged_rows=True)),
        (fp8_x, fp8_grad, tiles_for(fp8_x, hidden, features, 0)),
    ]
    # In float8 throughout: where the gradient GEMMs would take bfloat16 (jax 0.10, no mixed
    # float8 wgmma) the batched cuBLASLt FP8 GEMMs are the faster (bench/gpu_moe.py's model).
    fits = all(t is not None and supported_dtypes(a, b) for a, b, t in gemms)
    return takes_kernel("grouped_gemm", x, kernel, supported=fits)


class RaggedOnGpuWarning(UserWarning):
    """A ragged grouped GEMM on a GPU that takes XLA's ``ragged_dot`` (expanded over groups)."""


class Fp8AtBf16RateWarning(UserWarning):
    """A grouped GEMM of two float8 types on a GPU whose kernel multiplies them as bfloat16
    (jax 0.10: no e4m3 x e5m2 ``wgmma``): exact, at BF16's tensor-core rate."""


def _xla_grouped_gemm(
    lhs_data: Array,
    rhs_data: Array,
    group_sizes: Array,
    ids: Array,
    scale: Array | None,
    *,
    contract: tuple[int, int],
    rhs_group_dims: tuple[int, ...],
    out_dtype: DTypeLike,
    precision: lax.Precision | None,
) -> Array:
    """``lax.ragged_dot_general`` of the two operands' data, then their group scales."""
    # As the dense GEMM stage: float16 cannot hold a product of float8 values before scaling.
    fp8 = scale is not None
    gemm_dtype = jnp.float32 if fp8 and jnp.dtype(out_dtype) == jnp.float16 else out_dtype
    numbers = lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((contract[0],), (contract[1],)), ((), ())),
        lhs_ragged_dimensions=[0],
        rhs_group_dimensions=list(rhs_group_dims),
    )
    out = lax.ragged_dot_general(
        lhs_data,
        rhs_data,
        group_sizes,
        numbers,
        precision=precision,
        preferred_element_type=gemm_dtype,
    )
    if scale is None:
        return out.astype(out_dtype)
    if rhs_group_dims:
        # Rows past sum(group_sizes) are zero whatever their scale.
        scale = jnp.take(scale, ids, mode="fill", fill_value=0.0)[:, None]  # [M, 1]
    else:
        scale = scale[:, None, None]  # [G, 1, 1]
    # The product of the two scales multiplies the GEMM's output, as in dense's GEMM stage.
    return (out * scale.astype(out.dtype)).astype(out_dtype)


def _precision(precision: lax.Precision | None, operand: GemmOperand) -> lax.Precision | None:
    # Block-scaled GEMMs take no precision (as dense's); their values run as given.
    return None if isinstance(operand, BlockOperand) else precision


@dataclasses.dataclass(frozen=True)
class GroupedConfig:
    """Static description of a grouped GEMM."""

    n_groups: int
    x_dtype: Any
    out_dtype: Any
    kernel_dtype: Any
    bias_dtype: Any  # None without a bias
    precision: lax.Precision | None  # of the GEMMs without FP8
    # Manual mesh axes whose devices hold other groups (scaling.distinct_over at the forward).
    distinct_axes: frozenset[str] = frozenset()
    # A gated activation applied to the output inside the op (MoEBlock's first expert GEMM on a
    # GPU's kernels, ``grouped_activation``): its gradient is quantized in one pass.
    activation: tuple[str, ...] | None = None


class GroupedOperands(NamedTuple):
    """The ragged grouped GEMM's differentiable arguments, checked."""

    x: Array  # [M, K], rows sorted by group
    kernel: Array  # [G, K, N]
    group_sizes: Any  # int32 [G]; its cotangent float0 zeros
    bias: Array | None  # [G, N]
    quantizer_set: QuantizerSet


class _Residuals(NamedTuple):
    # FP8: x and the kernel as quantized by the forward (one scale per group), as wgrad and
    # dgrad contract them. Without FP8: x and the kernel cast to x's dtype.
    lhs: GemmOperand
    rhs: GemmOperand
    ids: Array  # int32 [M]
    group_sizes: Array
    quantizers: QuantizerSet  # x and kernel already updated by the forward
    pre_activation: Array | None  # the output before ``config.activation``


def _forward(
    config: GroupedConfig, operands: GroupedOperands, for_backward: bool
) -> tuple[Array, _Residuals]:
    # The backward reads the forward's own operands: nothing to skip without it.
    x, kernel, group_sizes, bias, quantizer_set = operands
    ids = group_ids(group_sizes, x.shape[0])  # [M]
    lhs, x_quantizer = quantize_rows(
        x, quantizer_set.x, ids, config.n_groups, x.dtype, config.distinct_axes
    )
    # [G, K, N]: one scale per group, as dense's kernel stage under vmap.
    rhs, kernel_quantizer = quantize_groups(
        kernel, quantizer_set.kernel, x.dtype, 1, (LEADING, TRAILING)
    )
    precision = config.precision if quantizer_set.is_noop else quantizer_set.precision.fprop
    # [M, K] x [G, K, N] -> [M, N], rows of group g with kernel[g].
    out = _grouped_gemm(
        _gemm_input(lhs, TRAILING, x.dtype, grouped=False),
        _gemm_input(rhs, LEADING, x.dtype, grouped=True),
        group_sizes,
        ids,
        (1, 1),
        (0,),
        config.out_dtype,
        _precision(precision, lhs),
    )
    if bias is not None:
        # [G, N] -> [M, N]; rows past sum(group_sizes) get no bias (their output stays zero).
        row_bias = jnp.take(bias.astype(config.out_dtype), ids, axis=0, mode="fill", fill_value=0)
        out = out + row_bias
    pre_activation = None
    if config.activation is not None:  # [M, n_act * F] -> [M, F], in float32, rounded once
        slices = out.reshape(out.shape[0], len(config.activation), -1)
        pre_activation, out = out, rounded_once_activation(slices, config.activation)
    residuals = _Residuals(
        lhs=lhs.keep(LEADING),
        rhs=rhs.keep(TRAILING),
        ids=ids,
        group_sizes=group_sizes,
        quantizers=dataclasses.replace(quantizer_set, x=x_quantizer, kernel=kernel_quantizer),
        pre_activation=pre_activation,
    )
    return out, residuals


def _backward(config: GroupedConfig, residuals: _Residuals, grad: Array) -> GroupedOperands:
    quantizers = residuals.quantizers
    lhs, rhs, ids = residuals.lhs, residuals.rhs, residuals.ids
    fp8 = not quantizers.is_noop
    d_bias = None
    if config.bias_dtype is not None:
        # [M, N] -> [G, N], summed in float32 as dense's bias gradient.
        grad32 = grad.astype(jnp.float32)
        d_bias = jax.ops.segment_sum(grad32, ids, num_segments=config.n_groups)
        d_bias = d_bias.astype(config.bias_dtype)
    if config.activation is not None:
        grad_operand, grad_quantizer = _activation_grad(config, residuals, grad)
    else:  # without FP8 the backward GEMMs run in x's dtype, as dense's
        grad_operand, grad_quantizer = quantize_rows(
            grad, quantizers.dgrad, ids, config.n_groups, config.x_dtype, config.distinct_axes
        )
    dtype = config.x_dtype
    grad_input = partial(_gemm_input, grad_operand, dtype=dtype, grouped=False)
    # [M, N] x [G, K, N] -> [M, K]
    d_x = _grouped_gemm(
        grad_input(TRAILING),
        _gemm_input(rhs, TRAILING, dtype, grouped=True),
        residuals.group_sizes,
        ids,
        (1, 2),
        (0,),
        config.x_dtype,
        _precision(config.precision if not fp8 else quantizers.precision.dgrad, rhs),
    )
    # [M, K] x [M, N] -> [G, K, N], each group's rows contracted on their own.
    d_kernel = _grouped_gemm(
        _gemm_input(lhs, LEADING, dtype, grouped=False),
        grad_input(LEADING),
        residuals.group_sizes,
        ids,
        (0, 0),
        (),
        config.kernel_dtype,
        _precision(config.precision if not fp8 else quantizers.precision.wgrad, lhs),
    )
    d_sizes = np.zeros(residuals.group_sizes.shape, jax.dtypes.float0)
    new_state = dataclasses.replace(quantizers, dgrad=grad_quantizer)
    return GroupedOperands(d_x, d_kernel, d_sizes, d_bias, as_cotangent(new_state))


def _activation_grad(
    config: GroupedConfig, residuals: _Residuals, grad: Array
) -> tuple[GemmOperand, Quantizer | None]:
    """The pre-activation's gradient quantized group by group in one pass from the gradient
    of the activation's output (``fuses`` chose the op: per-tensor delayed scaling, no bias)."""
    quantizer, pre = residuals.quantizers.dgrad, residuals.pre_activation
    assert isinstance(quantizer, DelayedScaleQuantizer) and pre is not None and config.activation
    scale_inv = quantizer.scale_inv[:, 0]
    operands = (pre, grad, residuals.group_sizes, scale_inv)
    data, amax = activation_grad_quantized(
        operands, config.activation, quantizer.q_dtype, activation_grad_by_xla
    )
    amax = scaling.max_over_devices(amax, config.distinct_axes)  # as _group_amax
    updated = jax.vmap(DelayedScaleQuantizer.update)(quantizer, amax)
    return ScaledTensor(data, scale_inv), updated


def activation_grad_by_xla(
    pre: Array,
    grad: Array,
    group_sizes: Array,
    scale_inv: Array,
    activation_type: tuple[str, ...],
    q_dtype: DTypeLike,
) -> tuple[Array, Array]:
    """``activation_grad_quantized``'s XLA stage: the activation's backward, then what
    ``quantize_rows`` does with the groups' ``scale_inv``: the float8 gradient and each
    group's amax (on this device's rows)."""
    rows, n_groups = grad.shape[0], group_sizes.shape[0]
    slices = pre.reshape(rows, len(activation_type), -1)
    d = activation_backward(grad, slices, activation_type).reshape(rows, -1)
    ids = group_ids(group_sizes, rows)
    return _by_group_scale(d, q_dtype, scale_inv, ids), _group_amax(d, ids, n_groups)


# The ragged lowering of grouped_dense on its checked operands.
ragged_grouped_dense: FusedOp[GroupedConfig, GroupedOperands] = fused_op(_forward, _backward)
