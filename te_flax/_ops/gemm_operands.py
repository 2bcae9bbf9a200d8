"""The operand stage of every GEMM: a tensor prepared for the GEMMs that read it.

A fused op composes normalize (``te_flax._ops.norm``), GEMM (``te_flax._ops.gemm``), the
activation (``te_flax._ops.mlp``) and the stages here: quantize a kernel or an output gradient
once for every GEMM that contracts it (in the layouts they read), constrain it to its logical
axes, and keep it for the backward. ``dense``, ``layernorm_dense`` and ``layernorm_mlp``
compose these; none of them re-implements a stage. All functions here are pure and run inside
``jax.custom_vjp`` rules; each kernel-backed stage has an XLA fallback behind the kernel switch
(``te_flax._ops.kernels``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import Array, lax
from jax.ad_checkpoint import checkpoint_name
from jax.experimental.layout import Layout, with_layout_constraint
from jax.typing import DTypeLike

from te_flax._ops.kernels import GradOperand, tiled_quantize_operand
from te_flax.quantize import (
    LEADING,
    TRAILING,
    BlockOperand,
    DelayedScaleQuantizer,
    GemmOperand,
    Quantizer,
    QuantizerSet,
    ScaledTensor,
    quantize_operand,
)
from te_flax.sharding import (
    LogicalAxes,
    sharded_along,
    with_logical_constraint,
)

__all__ = [
    "GradOperand",
    "constrained",
    "grad_operand",
    "input_uses",
    "kernel_operand",
    "kernel_uses",
    "leading_ones",
    "one_pass_layouts",
    "saved_gemm_operands",
    "saved_operand",
    "sum_to_bias",
    "unquantized_operand",
]


def leading_ones(vector: Array, x: Array) -> Array:
    """``vector`` reshaped to broadcast against the trailing axes of ``x``, and sharded as
    they are (``sharded_along``)."""
    vector = sharded_along(vector, x)
    return vector.reshape((1,) * (x.ndim - vector.ndim) + vector.shape)


def constrained(
    operand: GemmOperand, axes: LogicalAxes, source_axes: LogicalAxes = None
) -> GemmOperand:
    """A per-tensor operand with its data constrained to the logical ``axes``.

    With ``source_axes`` (the layout of the tensor the operand was quantized from) the data is
    first constrained to that layout: each device quantizes its own shard, and the all-gather
    that the GEMM's layout ``axes`` may need (the sequence under sequence parallelism) moves
    float8 rather than the float32 values before the cast. The scale is the same either way:
    the amax of a sharded array under ``jit`` is taken over all its shards.

    Block-scaled operands are flattened matrices, which the tensor's axes do not describe;
    they follow the sharding of the tensor they were quantized from. So does a ``transposed``
    layout, which only the Pallas kernels write (under ``"auto"`` only in programs that XLA
    does not partition).
    """
    if isinstance(operand, BlockOperand):
        return operand
    data = with_logical_constraint(operand.data, source_axes)
    return operand._replace(data=with_logical_constraint(data, axes))


def input_uses(for_backward: bool) -> tuple[str, ...]:
    """The block-scaled layouts of a GEMM input ``[tokens..., features...]``: contracted along
    its features by the forward GEMM and, when differentiated, along its tokens by wgrad."""
    return (TRAILING, LEADING) if for_backward else (TRAILING,)


def kernel_uses(for_backward: bool) -> tuple[str, ...]:
    """The block-scaled layouts of a kernel ``[inputs..., outputs...]``: contracted along its
    inputs by the forward GEMM and, when differentiated, along its outputs by dgrad."""
    return (LEADING, TRAILING) if for_backward else (LEADING,)


def saved_operand(operand: GemmOperand, use: str, name: str | None) -> GemmOperand:
    """A quantized GEMM operand as the backward keeps it: ``operand.keep(use)``, named ``name``
    with ``jax.ad_checkpoint.checkpoint_name`` when one is given (TransformerEngine's
    quantization checkpoint name), so that a ``jax.checkpoint`` policy can save the float8
    copy instead of recomputing the quantization in the backward."""
    kept = operand.keep(use)
    return kept if name is None else checkpoint_name(kept, name)


def saved_gemm_operands(
    lhs: GemmOperand, rhs: GemmOperand, quantizer_set: QuantizerSet
) -> tuple[GemmOperand, GemmOperand]:
    """A forward GEMM's quantized operands as its backward GEMMs contract them (per-tensor: the
    forward GEMM's own): the input along its tokens (wgrad), the kernel along its outputs
    (dgrad), named with the set's ``checkpoint_name`` (``saved_operand``)."""
    name = quantizer_set.checkpoint_name
    return saved_operand(lhs, LEADING, name), saved_operand(rhs, TRAILING, name)


def unquantized_operand(residual: GemmOperand | Array, dtype: DTypeLike) -> GemmOperand:
    """A parameter saved as itself (no FP8) as the backward GEMMs read it: cast to ``dtype``."""
    assert not isinstance(residual, BlockOperand | ScaledTensor), "saved without FP8"
    return ScaledTensor(residual.astype(dtype))


def one_pass_layouts(
    quantized: tuple[GemmOperand, Quantizer | None],
    uses: tuple[str, ...],
    pin_row_major: bool = False,
) -> tuple[GemmOperand, Quantizer | None]:
    """An XLA stage's delayed-scaling float8 operand, kept for XLA to write in one pass with
    its amax.

    The data does not depend on the amax there, so XLA can compute both in one fusion of the
    tensor's producer; but a reduction (the amax) and a transpose (the layout a ``LEADING``
    GEMM reads) do not share a fusion, and XLA puts the cast with the transpose: the tensor is
    then read twice in high precision. A barrier (no copy) on the data keeps the transpose to
    a pass over the float8 data.

    ``pin_row_major`` also pins the data's layout, for a kernel sliced from a stack by a scan
    (``kernel_operand``): otherwise XLA's layout assignment moves the transpose up to the
    float32 operand, i.e. transposes the whole stacked parameter before the loop (8 bytes per
    element: ``bench/RESULTS_model.md``, "Reading the figures"). Not in a program
    partitioned over a mesh, where the pinned layout changes which layouts XLA gathers.
    """
    operand, new_quantizer = quantized
    if (
        LEADING in uses
        and isinstance(operand, ScaledTensor)
        and operand.scale_inv is not None
        and isinstance(new_quantizer, DelayedScaleQuantizer)
    ):
        data = operand.data
        mesh = jax.sharding.get_abstract_mesh()
        if pin_row_major and (mesh.empty or mesh.size == 1):
            data = with_layout_constraint(data, Layout(major_to_minor=tuple(range(data.ndim))))
        operand = operand._replace(data=lax.optimization_barrier(data))
    return operand, new_quantizer


def kernel_operand(
    kernel: Array,
    quantizer: Quantizer | None,
    dtype: DTypeLike,
    n_contract: int,
    for_backward: bool,
    axes: LogicalAxes,
    in_scan: bool = False,
) -> tuple[GemmOperand, Quantizer | None]:
    """A kernel ``[K..., F...]`` as a GEMM operand, constrained to its logical ``axes``.

    Quantized for the forward GEMM (which contracts its ``n_contract`` leading axes) and, with
    ``for_backward``, for dgrad (its trailing axes); cast to ``dtype`` without a quantizer.
    ``in_scan``: the kernel was traced in a scan body (``traced_in_scan``), where it is a slice
    of a stacked parameter: the XLA stage then reads the slice in place.
    """
    uses = kernel_uses(for_backward)

    def xla_stage() -> tuple[GemmOperand, Quantizer | None]:
        quantized = quantize_operand(kernel, quantizer, dtype, n_contract, uses)
        return one_pass_layouts(quantized, uses, pin_row_major=in_scan)

    # Per-tensor FP8 on GPUs: one Pallas kernel reads the kernel once and writes the float8
    # data in both layouts and the amax (see te_flax._ops.kernels); elsewhere, and for a scanned
    # kernel (which a custom call would first copy out of its stack), the XLA stage.
    if in_scan:
        operand, new_quantizer = xla_stage()
    else:
        operand, new_quantizer = tiled_quantize_operand(
            kernel, quantizer, n_contract, uses, xla_stage
        )
    return constrained(operand, axes), new_quantizer


def sum_to_bias(grad: Array, bias_ndim: int, bias_dtype: DTypeLike) -> Array:
    """The bias gradient: ``grad`` summed in float32 over all but its last ``bias_ndim`` axes."""
    batch_axes = tuple(range(grad.ndim - bias_ndim))
    return jnp.sum(grad.astype(jnp.float32), axis=batch_axes).astype(bias_dtype)


def grad_operand(
    grad: Array,
    grad_quantizer: Quantizer | None,
    n_features: int,
    bias_dtype: DTypeLike | None = None,
    grad_axes: LogicalAxes = None,
) -> GradOperand:
    """An output gradient ``[batch..., F...]`` prepared for dgrad and wgrad (see
    ``dense_backward``): quantized once, and summed to the bias gradient with ``bias_dtype``."""
    n_batch = grad.ndim - n_features
    d_bias = None if bias_dtype is None else sum_to_bias(grad, n_features, bias_dtype)
    uses = (TRAILING, LEADING)
    quantized = quantize_operand(grad, grad_quantizer, grad.dtype, n_batch, uses)
    operand, new_quantizer = one_pass_layouts(quantized, uses)
    return GradOperand(constrained(operand, grad_axes), new_quantizer, d_bias)
