"""``layernorm_mlp``: a norm, two GEMMs and the (gated) activation between them, fused.

Built from the stages of ``layernorm_dense`` and ``dense`` (normalize, quantize an operand, GEMM,
bias) and the activation stage; it writes none of them again. The intermediate dropout (its mask
drawn inside the op from a key, applied before the second GEMM's quantization and drawn again
from the same key in the backward), low-rank adaptation of both GEMMs and the norm output are
part of the op. ``LayerNormMLP`` runs this op in every configuration but one: without the norm
(``enable_layernorm=False``) there is no norm for the op to fuse (it always normalizes, as
TransformerEngine's fused op does, which that configuration does not use either), so the layer
composes two ``dense`` ops around the activation, with the gradient quantizers assigned as here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from functools import partial
from typing import Any, NamedTuple, cast

import jax
from jax import Array, lax
from jax.ad_checkpoint import checkpoint_name
from jax.typing import DTypeLike

from te_flax._base import checks as check
from te_flax._ops.activations import (
    activation_backward,
    canonical_activation_params,
    canonical_activation_type,
)
from te_flax._ops.arguments import check_norm
from te_flax._ops.custom_op import fused_op
from te_flax._ops.gemm import DenseGrads, dense_backward, forward_contracting, gemm, gemm_out_specs
from te_flax._ops.gemm_operands import (
    constrained,
    input_uses,
    kernel_operand,
    saved_gemm_operands,
    unquantized_operand,
)
from te_flax._ops.kernels import GradOperand, traced_in_scan
from te_flax._ops.lora import lora_delta
from te_flax._ops.mlp import (
    LoraKernels,
    MlpConfig,
    MlpOperands,
    activation_gemm_operand,
    activation_grad,
    activation_operand,
    apply_dropout,
    check_collective_op_sets,
    check_dropout,
    check_kernels_and_biases,
    check_lora,
    check_lora_alpha,
    check_name,
    check_quantizer_sets,
    dropout_mask,
    dropped_activation,
    with_dropout,
)
from te_flax._ops.norm import NormInput, apply_norm, normalize_backward
from te_flax._ops.norm_gemm import (
    NormGemm,
    norm_gemm_forward,
    recomputed_norm_operand,
    split_norm_output_grad,
)
from te_flax.collective import CollectiveOpSet, noop_collective_op_set
from te_flax.quantize import (
    GemmOperand,
    Quantizer,
    QuantizerSet,
    ScaledTensor,
    as_cotangent,
    float32_state,
    noop_quantizer_set,
)
from te_flax.sharding import (
    LogicalAxes,
    explicit_specs,
    vary_like,
    with_explicit_specs,
    with_logical_constraint,
)

__all__ = [
    "LoraKernels",
    "apply_dropout",
    "dropout_mask",
    "layernorm_mlp",
    "layernorm_mlp_with_norm_output",
]


class _Residuals(NamedTuple):
    norm: NormInput
    # FP8: the quantized operands of both GEMMs as the backward GEMMs contract them (per-tensor:
    # the forward GEMMs' own). Without FP8 the norm output and the activation output are
    # recomputed (from x and the statistics, from the pre-activation), so that no
    # high-precision [tokens, hidden] or [tokens, intermediate] copy waits for the backward.
    ln_operand: GemmOperand | None
    kernel_1_operand: GemmOperand | Array
    pre_activation: Array  # [batch..., n_act, intermediate], named ffn1_ckpt_name for remat
    activation_operand: GemmOperand | None
    kernel_2_operand: GemmOperand | Array
    quantizer_sets: tuple[QuantizerSet, QuantizerSet]  # x and kernel already updated
    # The dropout key (the backward draws the same mask again: no mask is saved) and the
    # low-rank kernels, or None.
    dropout_rng: Array | None
    lora_kernels: LoraKernels | None


# The output: [batch..., hidden], and the norm output too with return_norm_output.
_Output = Array | tuple[Array, Array]


def _lora(config: MlpConfig, x: Array, a: Array, b: Array) -> Array:
    """``x . A . B * alpha / rank`` in x's dtype."""
    return lora_delta(x, a, b, 1, a.shape[-1], config.lora_alpha).astype(x.dtype)


# ----------------------------------------------------------------------------- forward


def _pre_activation(config: MlpConfig, step: NormGemm, lora_kernels: LoraKernels | None) -> Array:
    """GEMM 1's output (+ its adapter's), ``[batch..., n_act, intermediate]``, named
    ``ffn1_ckpt_name``."""
    pre_activation = step.out
    if lora_kernels is not None:
        norm_output = cast(Array, step.norm_output)
        pre_activation = pre_activation + _lora(config, norm_output, *lora_kernels[:2])
    if isinstance(step.rhs, ScaledTensor) and step.rhs.scale_inv is not None:
        # XLA's GEMM rewriter fuses a tanh GELU into the GEMM as an epilogue, with the
        # pre-activation as an auxiliary output when anything else reads it (the backward
        # does), and then fails to emit an FP8 cuBLASLt GEMM with an auxiliary output. The
        # barrier (no copy) keeps the activation out of the FP8 GEMM.
        pre_activation = lax.optimization_barrier(pre_activation)
    return checkpoint_name(pre_activation, config.ffn1_ckpt_name)


def _gemm_2_input(
    config: MlpConfig,
    pre_activation: Array,
    quantizer: Quantizer | None,
    dropout_rng: Array | None,
    with_lora: bool,
    uses: tuple[str, ...],
) -> tuple[GemmOperand, Quantizer | None, Array | None]:
    """The activation (and dropout): ``[batch..., n_act, intermediate]`` -> GEMM 2's
    ``[batch..., intermediate]`` operand, its quantizer, and the dropped activation in high
    precision where the adapter of GEMM 2 reads it (else None)."""
    dtype = pre_activation.dtype
    if config.dropout_rate == 0.0 and not with_lora:
        # The activation straight to GEMM 2's operand (one pass on GPUs under per-tensor FP8).
        activated, new_quantizer = activation_operand(
            pre_activation,
            config.activation_type,
            config.activation_params,
            quantizer,
            dtype,
            uses,
        )
        return constrained(activated, config.dot_2_input_axes), new_quantizer, None
    dropped = dropped_activation(config, pre_activation, dropout_rng, quantizer is not None)
    activated, new_quantizer = activation_gemm_operand(dropped, config, quantizer, dtype, uses)
    return activated, new_quantizer, dropped


def _forward(
    config: MlpConfig, operands: MlpOperands, for_backward: bool
) -> tuple[_Output, _Residuals]:
    x, gamma, beta, (kernel_1, kernel_2), biases, quantizer_sets, dropout_rng, lora_kernels = (
        operands
    )
    set_1, set_2 = quantizer_sets
    fp8 = not (set_1.is_noop and set_2.is_noop)
    # Norm and GEMM 1: [batch..., hidden] x [hidden, n_act, intermediate]
    axes = (config.norm_input_axes, config.dot_1_input_axes, config.kernel_1_axes)
    with_norm_output = config.return_norm_output or lora_kernels is not None
    step_1 = norm_gemm_forward(
        x, gamma, beta, kernel_1, biases[0], config.norm, set_1, axes, config.kernels_in_scan[0],
        for_backward, with_norm_output, fp8,
    )  # fmt: skip
    pre_activation = _pre_activation(config, step_1, lora_kernels)
    # [batch..., n_act, intermediate] -> [batch..., intermediate]
    with_lora, uses = lora_kernels is not None, input_uses(for_backward)
    activated, x_2, dropped = _gemm_2_input(
        config, pre_activation, set_2.x, dropout_rng, with_lora, uses
    )
    k_2, kernel_q_2 = kernel_operand(
        kernel_2, set_2.kernel, x.dtype, 1, for_backward, config.kernel_2_axes,
        config.kernels_in_scan[1],
    )  # fmt: skip
    # [batch..., intermediate] x [intermediate, hidden] -> [batch..., hidden]
    contracting = forward_contracting(activated, 1)
    out, _ = gemm(activated, k_2, contracting, x.dtype, set_2.precision.fprop, bias=biases[1])
    if lora_kernels is not None:
        out = out + _lora(config, cast(Array, dropped), *lora_kernels[2:])
    ln_operand, kernel_1_residual = (
        saved_gemm_operands(step_1.lhs, step_1.rhs, set_1) if fp8 else (None, kernel_1)
    )
    activation_residual, kernel_2_residual = (
        saved_gemm_operands(activated, k_2, set_2) if fp8 else (None, kernel_2)
    )
    residuals = _Residuals(
        norm=step_1.norm,
        ln_operand=ln_operand,
        kernel_1_operand=kernel_1_residual,
        pre_activation=pre_activation,
        activation_operand=activation_residual,
        kernel_2_operand=kernel_2_residual,
        quantizer_sets=(
            dataclasses.replace(set_1, x=step_1.x_quantizer, kernel=step_1.kernel_quantizer),
            dataclasses.replace(set_2, x=x_2, kernel=kernel_q_2),
        ),
        dropout_rng=dropout_rng,
        lora_kernels=lora_kernels,
    )
    if config.return_norm_output:
        return (out, cast(Array, step_1.norm_output)), residuals
    return out, residuals


# ----------------------------------------------------------------------------- backward


def _gemm_operands(
    config: MlpConfig, residuals: _Residuals, dtype: DTypeLike
) -> tuple[GemmOperand, GemmOperand, GemmOperand, GemmOperand]:
    """The four GEMM operands of the forward, recomputed where they were not saved."""
    if residuals.ln_operand is not None:
        # FP8: all four were saved as quantized operands.
        return (
            residuals.ln_operand,
            cast(GemmOperand, residuals.kernel_1_operand),
            cast(GemmOperand, residuals.activation_operand),
            cast(GemmOperand, residuals.kernel_2_operand),
        )
    ln = recomputed_norm_operand(
        residuals.norm, config.norm, config.dot_1_input_axes, config.norm_input_axes
    )
    dropped = dropped_activation(config, residuals.pre_activation, residuals.dropout_rng, False)
    activated, _ = activation_gemm_operand(dropped, config, None, dtype, ())
    # Without FP8 the kernel residuals are the parameters themselves.
    kernel_1 = unquantized_operand(residuals.kernel_1_operand, dtype)
    kernel_2 = unquantized_operand(residuals.kernel_2_operand, dtype)
    return ln, kernel_1, activated, kernel_2


class _ActivationGrads(NamedTuple):
    pre_activation: Array | GradOperand  # as GEMM 1's backward takes its output gradient
    norm_output: Array | None  # the adapter of GEMM 1's share of the norm-output gradient
    lora: LoraKernels | None  # the four adapter kernels' gradients


def _activation_backward(
    config: MlpConfig, residuals: _Residuals, out_grad: Array, d_dropped: Array
) -> _ActivationGrads:
    """GEMM 2's input gradient ``[batch..., intermediate]`` back through the adapter of GEMM 2,
    the dropout and the activation to the pre-activation ``[batch..., n_act, intermediate]``,
    and through the adapter of GEMM 1."""
    set_2 = residuals.quantizer_sets[1]
    lora_kernels, pre_activation = residuals.lora_kernels, residuals.pre_activation
    rng = residuals.dropout_rng
    if rng is not None:
        # A barrier (no copy) on the key: XLA would otherwise merge this draw with the
        # forward's and keep the random bits alive between them; drawing again costs no memory.
        rng = lax.optimization_barrier(rng)
    if lora_kernels is None:
        d_dropped = with_logical_constraint(d_dropped, config.dot_2_input_axes)
        # The dropout's backward: the same mask (drawn again from the key) and the same scale.
        # On GPUs under per-tensor FP8, one kernel computes the activation's backward and
        # quantizes it for both GEMMs (see te_flax._ops.kernels); elsewhere the XLA stages.
        d_pre_activation = activation_grad(
            with_dropout(config, d_dropped, rng),
            pre_activation,
            config.activation_type,
            set_2.dgrad,  # the activation gradient's quantizer (see _backward)
            config.bias_dtypes[0],
            config.activation_params,
        )
        return _ActivationGrads(d_pre_activation, None, None)
    # The adapter of GEMM 2 reads the (dropped) activation output in high precision.
    dropped = dropped_activation(config, pre_activation, rng, set_2.x is not None)
    _, lora_2_vjp = jax.vjp(partial(_lora, config), dropped, *lora_kernels[2:])
    d_dropped_lora, *lora_2_grads = lora_2_vjp(out_grad)
    d_dropped = with_logical_constraint(d_dropped + d_dropped_lora, config.dot_2_input_axes)
    # The adapter of GEMM 1 needs the pre-activation gradient in high precision: the XLA
    # stage, whose output GEMM 1's backward quantizes as any output gradient.
    d_pre_activation = activation_backward(
        with_dropout(config, d_dropped, rng),
        pre_activation,
        config.activation_type,
        config.activation_params,
    )
    norm = residuals.norm
    norm_output = apply_norm(*norm, config.norm).astype(norm.x.dtype)
    _, lora_1_vjp = jax.vjp(partial(_lora, config), norm_output, *lora_kernels[:2])
    d_ln_lora, *lora_1_grads = lora_1_vjp(d_pre_activation)
    lora_grads = cast(LoraKernels, tuple(lora_1_grads + lora_2_grads))
    return _ActivationGrads(d_pre_activation, d_ln_lora, lora_grads)


def _norm_backward(
    config: MlpConfig, residuals: _Residuals, grads_1: DenseGrads, extras: list[Array]
) -> tuple[Array, Array, Array | None]:
    """GEMM 1's input gradient (plus ``extras``, other terms of the norm output's gradient)
    back through the norm: the gradients of x, gamma and beta."""
    d_ln = sum(extras, grads_1.lhs)
    # The norm-output gradient returns to the norm input's layout (a reduce-scatter under
    # sequence parallelism).
    d_ln = with_logical_constraint(d_ln, config.norm_input_axes)
    return normalize_backward(d_ln, *residuals.norm, config.norm, grads_1.lhs_scale)


def _backward(config: MlpConfig, residuals: _Residuals, grad: _Output) -> MlpOperands:
    dtype = residuals.norm.x.dtype
    out_grad, norm_output_grad = split_norm_output_grad(grad, config.return_norm_output)
    set_1, set_2 = residuals.quantizer_sets
    # TransformerEngine's assignment of the two gradient quantizers, so that TE's state names
    # mean the same tensors here: the first set's quantizes the layer's output gradient (GEMM
    # 2's), the second set's the activation gradient (GEMM 1's output gradient).
    output_grad_quantizer, activation_grad_quantizer = set_1.dgrad, set_2.dgrad
    ln, kernel_1, activated, kernel_2 = _gemm_operands(config, residuals, dtype)
    (kernel_1_dtype, kernel_2_dtype), (bias_1_dtype, bias_2_dtype) = (
        config.kernel_dtypes,
        config.bias_dtypes,
    )
    # GEMM 2: [batch..., hidden] -> d activation [batch..., intermediate], d kernel_2. The
    # output is the residual stream, laid out as the norm input: its gradient is quantized on
    # those shards (gathered in float8 under sequence parallelism).
    grads_2 = dense_backward(
        out_grad, activated, kernel_2, output_grad_quantizer, 1, dtype, kernel_2_dtype,
        bias_2_dtype, grad_axes=config.norm_input_axes, precision=set_2.precision,
    )  # fmt: skip
    d_activation = _activation_backward(config, residuals, out_grad, grads_2.lhs)
    # GEMM 1: d pre-activation [batch..., n_act, intermediate] -> d norm output, d kernel_1.
    extras = [g for g in (d_activation.norm_output, norm_output_grad) if g is not None]
    grads_1 = dense_backward(
        d_activation.pre_activation, ln, kernel_1, activation_grad_quantizer, 1, dtype,
        kernel_1_dtype, bias_1_dtype, precision=set_1.precision,
        # The norm backward applies the dgrad's scale, unless other terms are added first.
        defer_dgrad_scale=not extras,
    )  # fmt: skip
    d_x, d_gamma, d_beta = _norm_backward(config, residuals, grads_1, extras)
    d_kernels = (
        with_logical_constraint(grads_1.rhs, config.kernel_1_axes),
        with_logical_constraint(grads_2.rhs, config.kernel_2_axes),
    )
    new_sets = (
        dataclasses.replace(set_1, dgrad=grads_2.dgrad_quantizer),
        dataclasses.replace(set_2, dgrad=grads_1.dgrad_quantizer),
    )
    d_x, d_gamma, d_beta, d_kernels, d_biases = with_explicit_specs(
        (d_x, d_gamma, d_beta, d_kernels, (grads_1.bias, grads_2.bias)), config.grad_specs
    )
    # No gradient for the dropout key.
    return MlpOperands(
        d_x, d_gamma, d_beta, d_kernels, d_biases, as_cotangent(new_sets), None, d_activation.lora
    )


def _out_specs(config: MlpConfig, operands: MlpOperands) -> Any:
    return gemm_out_specs(operands.x, operands.kernels[1], 1, config.return_norm_output)


# The output is named ffn2_ckpt_name for jax.checkpoint policies.
_layernorm_mlp = fused_op(
    _forward, _backward, _out_specs, output_name=lambda config: config.ffn2_ckpt_name
)


# ----------------------------------------------------------------------------- the op


def layernorm_mlp(
    x: Array,
    gamma: Array,
    beta: Array | None,
    kernels: Sequence[Array],
    biases: Sequence[Array | None],
    norm_type: str,
    zero_centered_gamma: bool = False,
    epsilon: float = 1e-6,
    transpose_batch_sequence: bool = False,
    norm_input_axes: LogicalAxes = None,
    dot_1_input_axes: LogicalAxes = None,
    dot_2_input_axes: LogicalAxes = None,
    kernel_1_axes: LogicalAxes = None,
    kernel_2_axes: LogicalAxes = None,
    ffn1_ckpt_name: str = "ffn1",
    ffn2_ckpt_name: str = "ffn2",
    activation_type: Sequence[str] = ("gelu",),
    activation_params: dict[str, float] | None = None,
    collective_op_sets: tuple[CollectiveOpSet, CollectiveOpSet] = (
        noop_collective_op_set,
        noop_collective_op_set,
    ),
    quantizer_sets: tuple[QuantizerSet, QuantizerSet] = (noop_quantizer_set, noop_quantizer_set),
    *,
    intermediate_dropout_rate: float = 0.0,
    intermediate_dropout_rng: Array | None = None,
    intermediate_dropout_dims: Sequence[int] = (),
    low_rank_adaptation_kernels: Sequence[Array] | None = None,
    low_rank_adaptation_alpha: float | None = None,
    return_norm_output: bool = False,
) -> Array:
    """Norm, GEMM 1 (+ bias 1), activation, dropout, GEMM 2 (+ bias 2), as one differentiable op.

    ``y = norm(x)``; ``h = y . kernels[0] + biases[0]`` (``[..., n_act, intermediate]``);
    ``a = act(h[..., 0, :])`` (times ``h[..., 1, :]`` for a gated pair);
    ``d = dropout(a)``; ``out = d . kernels[1] + biases[1]``. The norm runs in float32, the
    activation in x's dtype (quantized for an FP8 GEMM 2: computed in float32 and rounded once
    to x's dtype, as TransformerEngine's activation kernels compute it).
    With FP8 quantizer sets, the norm output, kernel 1, the activation output and kernel 2 are
    quantized directly to float8 for the forward GEMMs, and the two output gradients for the
    backward GEMMs: all six GEMMs of a training step are FP8. As in TransformerEngine's fused
    op, ``quantizer_sets[0]``'s gradient quantizer takes the layer's output gradient (GEMM 2's)
    and ``quantizer_sets[1]``'s the activation gradient (GEMM 1's output gradient), so the
    state named ``grad_0_*`` / ``grad_1_*`` holds the same tensors' history as in TE. The new
    state of both sets comes back as the gradient of ``quantizer_sets``.

    Args:
      x: ``[batch..., hidden]`` input.
      gamma: ``[hidden]`` norm scale.
      beta: ``[hidden]`` norm shift for layernorm; None for rmsnorm.
      kernels: ``[kernel_1 [hidden, n_act, intermediate], kernel_2 [intermediate, hidden]]``.
      biases: ``[bias_1 [n_act, intermediate] or None, bias_2 [hidden] or None]``.
      norm_type: ``"layernorm"`` or ``"rmsnorm"``.
      zero_centered_gamma: multiply by ``1 + gamma`` instead of ``gamma`` (default False).
      epsilon: added to the variance (or mean square) before the square root (default 1e-6).
      transpose_batch_sequence: the input is ``[seq, batch, ...]`` (default False). It changes
        no math; the layout that sharding sees is given by the ``*_axes`` arguments.
      norm_input_axes: logical axes of x (and of the norm-input gradient), and of the output
        gradient, whose layout the output (the residual stream) shares.
      dot_1_input_axes: logical axes of GEMM 1's input, the (quantized) norm output.
      dot_2_input_axes: logical axes of GEMM 2's input, the (quantized) activation output.
      kernel_1_axes: logical axes of kernel 1 and its gradient, e.g. ``("embed", "act", "mlp")``.
      kernel_2_axes: logical axes of kernel 2 and its gradient, e.g. ``("mlp", "embed")``.
      ffn1_ckpt_name: ``jax.checkpoint`` name of the pre-activation (default ``"ffn1"``).
      ffn2_ckpt_name: ``jax.checkpoint`` name of the output (default ``"ffn2"``).
      activation_type: ``("gelu",)`` (default), any of ``gelu``, ``gelu_exact``, ``silu``,
        ``relu``, ``quick_gelu``, ``squared_relu``, ``linear``, or a gated pair of one of them
        with ``"linear"`` (``("silu", "linear")`` is SwiGLU; the order within the pair does not
        matter), or ``("clamped_silu", "clamped_linear")``, TransformerEngine's clamped SwiGLU
        (gpt-oss): ``a = min(h0, limit) * sigmoid(alpha * min(h0, limit)) * (clip(h1, -limit,
        limit) + glu_linear_offset)``.
      activation_params: the clamped SwiGLU's parameters as TE's dict, keys ``limit`` (default
        7.0), ``alpha`` (1.702) and ``glu_linear_offset`` (1.0); None (default) for TE's
        defaults. Any other activation takes none.
      collective_op_sets: TransformerEngine's collective GEMMs, one set per GEMM; only the
        default (``noop_collective_op_set`` twice): XLA places the collectives that logical
        axis rules ask for (``te_flax.collective``).
      quantizer_sets: one ``QuantizerSet`` per GEMM (default: no FP8).
      intermediate_dropout_rate: dropout probability of the activation output (default 0.0:
        none). The mask is drawn inside the op from ``intermediate_dropout_rng`` exactly as
        ``flax.linen.Dropout`` draws it from that key, applied before GEMM 2's quantization,
        and drawn again from the key in the backward (no mask is saved).
      intermediate_dropout_rng: the dropout's PRNG key; required when the rate is above 0.
      intermediate_dropout_dims: axes of the activation output that share one mask value.
      low_rank_adaptation_kernels: None (default) or TransformerEngine's four LoRA kernels
        ``(A_1 [hidden, n_act, r], B_1 [n_act, r, intermediate], A_2 [intermediate, r], B_2 [r,
        hidden])``: GEMM 1's output gains ``norm(x) . A_1 . B_1 * alpha / r`` and GEMM 2's
        ``d . A_2 . B_2 * alpha / r``, both in high precision.
      low_rank_adaptation_alpha: the LoRA ``alpha``; None (default) scales by 1.
      return_norm_output: also return the norm output, ``(out, norm(x))``, as
        ``layernorm_mlp_with_norm_output`` does (whose return type says so).

    Returns:
      ``[batch..., hidden]`` in ``x.dtype``.

    Example usage::

      >>> import jax.numpy as jnp
      >>> from te_flax.layernorm_mlp import layernorm_mlp
      >>> from te_flax.quantize import DelayedScaling, QuantizerFactory
      >>> x = jnp.ones((2, 8, 16), jnp.bfloat16)
      >>> kernels = [jnp.ones((16, 2, 64)) / 16, jnp.ones((64, 16)) / 64]
      >>> sets = QuantizerFactory.create_set(2, fp8_recipe=DelayedScaling())
      >>> out = layernorm_mlp(x, jnp.ones(16), None, kernels, [None, None], "rmsnorm",
      ...                     activation_type=("silu", "linear"), quantizer_sets=sets)
      >>> out.shape, out.dtype
      ((2, 8, 16), dtype(bfloat16))
    """
    check_collective_op_sets(collective_op_sets)
    check.check_input(x, "x")
    activation_type = canonical_activation_type(activation_type)
    checked_params = canonical_activation_params(activation_type, activation_params)
    check_kernels_and_biases(x, kernels, biases, len(activation_type))
    norm = check_norm(x, gamma, beta, norm_type, zero_centered_gamma, epsilon)
    check.check_bool(transpose_batch_sequence, "transpose_batch_sequence")
    check.check_bool(return_norm_output, "return_norm_output")
    quantizer_sets = check_quantizer_sets(quantizer_sets)
    (kernel_1, kernel_2), (bias_1, bias_2) = kernels, biases
    dropout_rate, dropout_dims = check_dropout(
        intermediate_dropout_rate, intermediate_dropout_rng, intermediate_dropout_dims, x.ndim
    )
    lora_kernels = check_lora(low_rank_adaptation_kernels, x, *kernel_1.shape[1:])
    config = MlpConfig(
        norm=norm,
        activation_type=activation_type,
        activation_params=checked_params,
        norm_input_axes=check.check_axes(norm_input_axes, x.ndim, "norm_input_axes", "x"),
        dot_1_input_axes=check.check_axes(dot_1_input_axes, x.ndim, "dot_1_input_axes", "x"),
        dot_2_input_axes=check.check_axes(
            dot_2_input_axes, x.ndim, "dot_2_input_axes", "the activation output"
        ),
        kernel_1_axes=check.check_axes(kernel_1_axes, 3, "kernel_1_axes", "kernels[0]"),
        kernel_2_axes=check.check_axes(kernel_2_axes, 2, "kernel_2_axes", "kernels[1]"),
        ffn1_ckpt_name=check_name(ffn1_ckpt_name, "ffn1_ckpt_name"),
        ffn2_ckpt_name=check_name(ffn2_ckpt_name, "ffn2_ckpt_name"),
        kernel_dtypes=(kernel_1.dtype, kernel_2.dtype),
        bias_dtypes=(
            None if bias_1 is None else bias_1.dtype,
            None if bias_2 is None else bias_2.dtype,
        ),
        dropout_rate=dropout_rate,
        dropout_dims=dropout_dims,
        lora_alpha=check_lora_alpha(low_rank_adaptation_alpha),
        return_norm_output=return_norm_output,
        kernels_in_scan=(traced_in_scan(kernel_1), traced_in_scan(kernel_2)),
        grad_specs=explicit_specs((x, gamma, beta, tuple(kernels), tuple(biases))),
    )
    gamma, beta, (kernel_1, kernel_2), (bias_1, bias_2) = vary_like(
        x, (gamma, beta, (kernel_1, kernel_2), (bias_1, bias_2))
    )
    operands = MlpOperands(
        x=x,
        gamma=gamma,
        beta=beta,
        kernels=(kernel_1, kernel_2),
        biases=(bias_1, bias_2),
        quantizer_sets=float32_state(quantizer_sets),
        dropout_rng=None if dropout_rate == 0.0 else intermediate_dropout_rng,
        lora_kernels=None if lora_kernels is None else vary_like(x, lora_kernels),
    )
    return cast(Array, _layernorm_mlp(config, operands))


def layernorm_mlp_with_norm_output(*args: Any, **kwargs: Any) -> tuple[Array, Array]:
    """``layernorm_mlp`` (the same arguments) that also returns the norm output,
    ``(out, norm(x))``.

    The norm output (in x's dtype) is differentiable: its gradient joins GEMM 1's in the norm
    backward. The modules use it for ``return_layernorm_output``.

    Example usage::

      >>> import jax.numpy as jnp
      >>> from te_flax.layernorm_mlp import layernorm_mlp_with_norm_output
      >>> kernels = [jnp.ones((8, 1, 32)) / 8, jnp.ones((32, 8)) / 32]
      >>> out, ln = layernorm_mlp_with_norm_output(
      ...     jnp.ones((2, 8)), jnp.ones(8), None, kernels, [None, None], "rmsnorm")
      >>> out.shape, ln.shape
      ((2, 8), (2, 8))
    """
    return cast(tuple[Array, Array], layernorm_mlp(*args, **kwargs, return_norm_output=True))
