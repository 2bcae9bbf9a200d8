"""``layernorm_mlp``: a norm, two GEMMs and the (gated) activation between them, fused.

Built from the stages of ``layernorm_dense`` and ``dense`` (normalize, quantize an operand, GEMM,
bias) and the activation stage; it writes none of them again.
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

from te_flax import _validation as check
from te_flax._activations import (
    ClampedSwigluParams,
    activation_forward,
    canonical_activation_params,
    canonical_activation_type,
)
from te_flax._stages import (
    NormSpec,
    NormStats,
    activation_grad,
    constrained,
    dense_backward,
    dense_forward,
    input_uses,
    kernel_operand,
    norm_operand,
    normalize,
    normalize_backward,
    saved_operand,
)
from te_flax.quantize import (
    LEADING,
    TRAILING,
    GemmOperand,
    Quantizer,
    QuantizerSet,
    ScaledTensor,
    as_cotangent,
    float32_state,
    noop_quantizer_set,
    quantize_operand,
)
from te_flax.sharding import LogicalAxes, vary_like, with_logical_constraint

__all__ = ["layernorm_mlp"]


@dataclasses.dataclass(frozen=True)
class _Config:
    norm: NormSpec
    activation_type: tuple[str, ...]
    activation_params: ClampedSwigluParams | None
    norm_input_axes: tuple[str | None, ...] | None
    dot_1_input_axes: tuple[str | None, ...] | None
    dot_2_input_axes: tuple[str | None, ...] | None
    kernel_1_axes: tuple[str | None, ...] | None
    kernel_2_axes: tuple[str | None, ...] | None
    ffn1_ckpt_name: str
    ffn2_ckpt_name: str
    kernel_dtypes: tuple[Any, Any]
    bias_dtypes: tuple[Any, Any]  # None for a missing bias


class _Residuals(NamedTuple):
    x: Array
    stats: NormStats
    gamma: Array
    beta: Array | None
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


def _activation_operand(
    config: _Config,
    pre_activation: Array,
    quantizer: Quantizer | None,
    dtype: DTypeLike,
    uses: tuple[str, ...],
) -> tuple[GemmOperand, Quantizer | None]:
    activated = activation_forward(pre_activation, config.activation_type, config.activation_params)
    operand, new_quantizer = quantize_operand(activated, quantizer, dtype, activated.ndim - 1, uses)
    return constrained(operand, config.dot_2_input_axes), new_quantizer


def _forward(
    config: _Config,
    x: Array,
    gamma: Array,
    beta: Array | None,
    kernels: Sequence[Array],
    biases: Sequence[Array | None],
    quantizer_sets: tuple[QuantizerSet, QuantizerSet],
    for_backward: bool = True,
) -> tuple[Array, _Residuals]:
    set_1, set_2 = quantizer_sets
    kernel_1, kernel_2 = kernels
    input_layouts = input_uses(for_backward)
    x = with_logical_constraint(x, config.norm_input_axes)
    _, stats = normalize(x, gamma, beta, config.norm)
    ln, x_1 = norm_operand(
        x,
        stats,
        gamma,
        beta,
        config.norm,
        set_1.x,
        config.dot_1_input_axes,
        input_layouts,
        source_axes=config.norm_input_axes,
    )
    # Kernels are [inputs, outputs...]: the forward contracts the leading axis.
    k_1, kernel_q_1 = kernel_operand(
        kernel_1, set_1.kernel, x.dtype, 1, for_backward, config.kernel_1_axes
    )
    # [batch..., hidden] x [hidden, n_act, intermediate] -> [batch..., n_act, intermediate]
    pre_activation = dense_forward(ln, k_1, 1, x.dtype, biases[0], set_1.precision)
    if isinstance(k_1, ScaledTensor) and k_1.scale_inv is not None:
        # XLA's GEMM rewriter fuses a tanh GELU into the GEMM as an epilogue, with the
        # pre-activation as an auxiliary output when anything else reads it (the backward
        # does), and then fails to emit an FP8 cuBLASLt GEMM with an auxiliary output. The
        # barrier (no copy) keeps the activation out of the FP8 GEMM.
        pre_activation = lax.optimization_barrier(pre_activation)
    pre_activation = checkpoint_name(pre_activation, config.ffn1_ckpt_name)
    # [batch..., n_act, intermediate] -> [batch..., intermediate]
    activated, x_2 = _activation_operand(config, pre_activation, set_2.x, x.dtype, input_layouts)
    k_2, kernel_q_2 = kernel_operand(
        kernel_2, set_2.kernel, x.dtype, 1, for_backward, config.kernel_2_axes
    )
    # [batch..., intermediate] x [intermediate, hidden] -> [batch..., hidden]
    out = dense_forward(activated, k_2, 1, x.dtype, biases[1], set_2.precision)
    fp8 = not (set_1.is_noop and set_2.is_noop)
    residuals = _Residuals(
        x=x,
        stats=stats,
        gamma=gamma,
        beta=beta,
        ln_operand=saved_operand(ln, LEADING, set_1.checkpoint_name) if fp8 else None,
        kernel_1_operand=saved_operand(k_1, TRAILING, set_1.checkpoint_name) if fp8 else kernel_1,
        pre_activation=pre_activation,
        activation_operand=saved_operand(activated, LEADING, set_2.checkpoint_name)
        if fp8
        else None,
        kernel_2_operand=saved_operand(k_2, TRAILING, set_2.checkpoint_name) if fp8 else kernel_2,
        quantizer_sets=(
            dataclasses.replace(set_1, x=x_1, kernel=kernel_q_1),
            dataclasses.replace(set_2, x=x_2, kernel=kernel_q_2),
        ),
    )
    return out, residuals


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _layernorm_mlp(
    config: _Config,
    x: Array,
    gamma: Array,
    beta: Array | None,
    kernels: Sequence[Array],
    biases: Sequence[Array | None],
    quantizer_sets: tuple[QuantizerSet, QuantizerSet],
) -> Array:
    # Not differentiated: no quantization for the backward GEMMs.
    args = (config, x, gamma, beta, kernels, biases, quantizer_sets)
    return _forward(*args, for_backward=False)[0]


def _gemm_operands(
    config: _Config, residuals: _Residuals, dtype: DTypeLike
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
    ln, _ = norm_operand(
        residuals.x,
        residuals.stats,
        residuals.gamma,
        residuals.beta,
        config.norm,
        None,
        config.dot_1_input_axes,
        source_axes=config.norm_input_axes,
    )
    activated, _ = _activation_operand(config, residuals.pre_activation, None, dtype, ())
    # Without FP8 the kernel residuals are the parameters themselves.
    kernel_1 = ScaledTensor(cast(Array, residuals.kernel_1_operand).astype(dtype))
    kernel_2 = ScaledTensor(cast(Array, residuals.kernel_2_operand).astype(dtype))
    return ln, kernel_1, activated, kernel_2


def _backward(
    config: _Config, residuals: _Residuals, grad: Array
) -> tuple[
    Array,
    Array,
    Array | None,
    tuple[Array, Array],
    tuple[Array | None, Array | None],
    tuple[QuantizerSet, QuantizerSet],
]:
    x = residuals.x
    set_1, set_2 = residuals.quantizer_sets
    # TransformerEngine's assignment of the two gradient quantizers, so that TE's state names
    # mean the same tensors here: the first set's quantizes the layer's output gradient (GEMM
    # 2's), the second set's the activation gradient (GEMM 1's output gradient).
    output_grad_quantizer, activation_grad_quantizer = set_1.dgrad, set_2.dgrad
    ln, kernel_1, activated, kernel_2 = _gemm_operands(config, residuals, x.dtype)
    kernel_1_dtype, kernel_2_dtype = config.kernel_dtypes
    bias_1_dtype, bias_2_dtype = config.bias_dtypes
    # GEMM 2: [batch..., hidden] -> d activation [batch..., intermediate], d kernel_2. The
    # output is the residual stream, laid out as the norm input: its gradient is quantized on
    # those shards (gathered in float8 under sequence parallelism).
    grads_2 = dense_backward(
        grad,
        activated,
        kernel_2,
        output_grad_quantizer,
        1,
        x.dtype,
        kernel_2_dtype,
        bias_2_dtype,
        grad_axes=config.norm_input_axes,
        precision=set_2.precision,
    )
    d_activated = with_logical_constraint(grads_2.lhs, config.dot_2_input_axes)
    # On GPUs under per-tensor FP8, one kernel computes the activation's backward and
    # quantizes it for both GEMMs (see te_flax._kernels); elsewhere the XLA stages.
    d_pre_activation = activation_grad(
        d_activated,
        residuals.pre_activation,
        config.activation_type,
        activation_grad_quantizer,
        bias_1_dtype,
        config.activation_params,
    )
    # GEMM 1: d pre-activation [batch..., n_act, intermediate] -> d norm output, d kernel_1.
    grads_1 = dense_backward(
        d_pre_activation,
        ln,
        kernel_1,
        activation_grad_quantizer,
        1,
        x.dtype,
        kernel_1_dtype,
        bias_1_dtype,
        precision=set_1.precision,
    )
    # The norm-output gradient returns to the norm input's layout (a reduce-scatter under
    # sequence parallelism).
    d_ln = with_logical_constraint(grads_1.lhs, config.norm_input_axes)
    d_x, d_gamma, d_beta = normalize_backward(
        d_ln, x, residuals.stats, residuals.gamma, residuals.beta, config.norm
    )
    d_kernels = (
        with_logical_constraint(grads_1.rhs, config.kernel_1_axes),
        with_logical_constraint(grads_2.rhs, config.kernel_2_axes),
    )
    new_sets = (
        dataclasses.replace(set_1, dgrad=grads_2.dgrad_quantizer),
        dataclasses.replace(set_2, dgrad=grads_1.dgrad_quantizer),
    )
    return d_x, d_gamma, d_beta, d_kernels, (grads_1.bias, grads_2.bias), as_cotangent(new_sets)


_layernorm_mlp.defvjp(_forward, _backward)


def _check_kernels_and_biases(x: Array, kernels: object, biases: object, n_act: int) -> None:
    if not isinstance(kernels, Sequence) or len(kernels) != 2:
        raise TypeError(
            "kernels must be a pair [kernel_1 [hidden, n_act, intermediate], kernel_2 "
            f"[intermediate, hidden]], got {type(kernels).__name__}"
        )
    kernel_1, kernel_2 = kernels
    check.check_floating(kernel_1, "kernels[0]")
    check.check_floating(kernel_2, "kernels[1]")
    hidden = x.shape[-1]
    if kernel_1.ndim != 3 or kernel_1.shape[0] != hidden or kernel_1.shape[1] != n_act:
        raise ValueError(
            f"kernels[0] has shape {tuple(kernel_1.shape)} but must be [hidden, n_act, "
            f"intermediate] = [{hidden}, {n_act}, intermediate]: hidden is x.shape[-1] and n_act "
            "is len(activation_type) (2 for a gated pair such as ('silu', 'linear'))"
        )
    intermediate = kernel_1.shape[2]
    check.check_shape(
        kernel_2,
        (intermediate, hidden),
        "kernels[1]",
        "it maps the intermediate size of kernels[0] back to x's hidden size",
    )
    if not isinstance(biases, Sequence) or len(biases) != 2:
        raise TypeError(
            "biases must be a pair [bias_1 [n_act, intermediate] or None, bias_2 [hidden] or "
            f"None], got {biases!r}"
        )
    for index, (bias, shape, what) in enumerate(
        zip(
            biases,
            ((n_act, intermediate), (hidden,)),
            ("kernels[0]'s output axes", "the hidden size"),
            strict=True,
        )
    ):
        if bias is not None:
            check.check_floating(bias, f"biases[{index}]")
            check.check_shape(bias, shape, f"biases[{index}]", f"it matches {what}")


def _check_name(name: object, argument: str) -> str:
    if not isinstance(name, str):
        raise TypeError(f"{argument} must be a str (a jax.checkpoint name), got {name!r}")
    return name


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
    quantizer_sets: tuple[QuantizerSet, QuantizerSet] = (noop_quantizer_set, noop_quantizer_set),
) -> Array:
    """Norm, GEMM 1 (+ bias 1), activation, GEMM 2 (+ bias 2), as one differentiable op.

    ``y = norm(x)``; ``h = y . kernels[0] + biases[0]`` (``[..., n_act, intermediate]``);
    ``a = act(h[..., 0, :])`` (times ``h[..., 1, :]`` for a gated pair);
    ``out = a . kernels[1] + biases[1]``. The norm runs in float32, the activation in x's dtype.
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
      quantizer_sets: one ``QuantizerSet`` per GEMM (default: no FP8).

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
    check.check_floating(x, "x")
    if x.ndim < 1:
        raise ValueError("x must have at least one axis (the hidden axis it is normalized over)")
    activation_type = canonical_activation_type(activation_type)
    checked_params = canonical_activation_params(activation_type, activation_params)
    _check_kernels_and_biases(x, kernels, biases, len(activation_type))
    norm = check.check_norm(x, gamma, beta, norm_type, zero_centered_gamma, epsilon)
    check.check_bool(transpose_batch_sequence, "transpose_batch_sequence")
    if not isinstance(quantizer_sets, Sequence) or len(quantizer_sets) != 2:
        raise TypeError(
            "quantizer_sets must be a pair of QuantizerSets, one per GEMM, e.g. "
            f"QuantizerFactory.create_set(2, fp8_recipe=...); got {quantizer_sets!r}"
        )
    set_1, set_2 = (
        check.check_quantizer_set(qs, f"quantizer_sets[{i}]") for i, qs in enumerate(quantizer_sets)
    )
    kernel_1, kernel_2 = kernels
    bias_1, bias_2 = biases
    config = _Config(
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
        ffn1_ckpt_name=_check_name(ffn1_ckpt_name, "ffn1_ckpt_name"),
        ffn2_ckpt_name=_check_name(ffn2_ckpt_name, "ffn2_ckpt_name"),
        kernel_dtypes=(kernel_1.dtype, kernel_2.dtype),
        bias_dtypes=(
            None if bias_1 is None else bias_1.dtype,
            None if bias_2 is None else bias_2.dtype,
        ),
    )
    gamma, beta, kernels, biases = vary_like(x, (gamma, beta, tuple(kernels), tuple(biases)))
    out = _layernorm_mlp(config, x, gamma, beta, kernels, biases, float32_state((set_1, set_2)))
    # Named outside the custom_vjp, where remat policies see the op's output as a value.
    return checkpoint_name(out, config.ffn2_ckpt_name)
