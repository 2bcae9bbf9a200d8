"""The forward of a norm feeding a GEMM, shared by ``layernorm_dense`` and ``layernorm_mlp``
(its GEMM 1), and what the backward of either needs from it."""

from __future__ import annotations

from typing import NamedTuple, cast

from jax import Array

from te_flax._ops.gemm import forward_contracting, gemm
from te_flax._ops.gemm_operands import input_uses, kernel_operand
from te_flax._ops.norm import NormConfig, NormInput, apply_norm, norm_operand, normalize
from te_flax.quantize import GemmOperand, Quantizer, QuantizerSet, ScaledTensor
from te_flax.sharding import LogicalAxes, with_logical_constraint

__all__ = ["NormGemm", "norm_gemm_forward", "recomputed_norm_operand", "split_norm_output_grad"]


class NormGemm(NamedTuple):
    """``norm_gemm_forward``'s results."""

    out: Array  # [batch..., features...]
    norm: NormInput
    lhs: GemmOperand  # the (quantized) norm output, as the GEMM read it
    rhs: GemmOperand  # the (quantized) kernel, as the GEMM read it
    x_quantizer: Quantizer | None  # the set's x and kernel quantizers, updated
    kernel_quantizer: Quantizer | None
    norm_output: Array | None  # [batch..., hidden] in x's dtype, when asked for


def norm_gemm_forward(
    x: Array,
    gamma: Array,
    beta: Array | None,
    kernel: Array,
    bias: Array | None,
    config: NormConfig,
    quantizer_set: QuantizerSet,
    axes: tuple[LogicalAxes, LogicalAxes, LogicalAxes],
    kernel_in_scan: bool,
    for_backward: bool,
    with_norm_output: bool,
    fp8: bool,
) -> NormGemm:
    """``norm(x) . kernel + bias``: the norm output quantized straight from float32 (or cast to
    x's dtype) for a GEMM with the (quantized) kernel ``[hidden, features...]``.

    ``axes``: the logical axes of x, of the GEMM input (the norm output) and of the kernel.
    ``with_norm_output``: also return the norm output in x's dtype; ``fp8``: the op quantizes
    (then the norm output is a second cast of the float32 one, which XLA computes in the same
    fusion; without FP8 it is the GEMM operand itself).
    """
    input_axes, dot_input_axes, kernel_axes = axes
    x = with_logical_constraint(x, input_axes)
    _, stats = normalize(x, gamma, beta, config)
    norm = NormInput(x, stats, gamma, beta)
    lhs, x_quantizer = norm_operand(
        *norm, config, quantizer_set.x, dot_input_axes, input_uses(for_backward), input_axes
    )
    # Kernels are [inputs, outputs...]: the forward contracts the leading axis.
    rhs, kernel_quantizer = kernel_operand(
        kernel, quantizer_set.kernel, x.dtype, 1, for_backward, kernel_axes, kernel_in_scan
    )
    # [batch..., hidden] x [hidden, features...] -> [batch..., features...]
    # By default the forward GEMM uses fast accumulation: its error is far below e4m3's
    # rounding (the recipe's fp8_gemm_fprop can ask for split accumulation).
    precision = quantizer_set.precision.fprop
    out, _ = gemm(lhs, rhs, forward_contracting(lhs, 1), x.dtype, precision, bias=bias)
    norm_output = None
    if with_norm_output and fp8:
        norm_output = apply_norm(*norm, config).astype(x.dtype)
    elif with_norm_output:
        norm_output = cast(ScaledTensor, lhs).data  # the GEMM's operand itself, in x's dtype
    return NormGemm(out, norm, lhs, rhs, x_quantizer, kernel_quantizer, norm_output)


def recomputed_norm_operand(
    norm: NormInput, config: NormConfig, dot_input_axes: LogicalAxes, input_axes: LogicalAxes
) -> GemmOperand:
    """The unquantized norm output as the GEMM read it, recomputed from the saved input and
    statistics for the backward (without FP8 no [tokens, hidden] copy waits for it)."""
    return norm_operand(*norm, config, None, dot_input_axes, source_axes=input_axes)[0]


def split_norm_output_grad(
    grad: Array | tuple[Array, Array], with_norm_output: bool
) -> tuple[Array, Array | None]:
    """The output gradient of an op, and the norm output's (None when the op returns none)."""
    if with_norm_output:
        return cast(tuple[Array, Array], grad)
    return cast(Array, grad), None
