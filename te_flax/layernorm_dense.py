"""``layernorm_dense``: a layernorm (or rmsnorm) fused with the GEMM that consumes it."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, cast

from jax import Array

from te_flax._base import checks as check
from te_flax._ops.arguments import check_norm, check_quantizer_set
from te_flax._ops.custom_op import fused_op
from te_flax._ops.gemm import dense_backward, gemm_out_specs
from te_flax._ops.gemm_operands import saved_gemm_operands, unquantized_operand
from te_flax._ops.kernels import traced_in_scan
from te_flax._ops.norm import NormConfig, NormInput, normalize_backward
from te_flax._ops.norm_gemm import (
    norm_gemm_forward,
    recomputed_norm_operand,
    split_norm_output_grad,
)
from te_flax.quantize import (
    GemmOperand,
    QuantizerSet,
    as_cotangent,
    float32_state,
    noop_quantizer_set,
)
from te_flax.sharding import (
    LogicalAxes,
    Specs,
    explicit_specs,
    vary_like,
    with_explicit_specs,
    with_logical_constraint,
)

__all__ = ["layernorm_dense", "layernorm_dense_with_norm_output"]


@dataclasses.dataclass(frozen=True)
class _Config:
    norm: NormConfig
    layernorm_input_axes: tuple[str | None, ...] | None
    dot_input_axes: tuple[str | None, ...] | None
    kernel_axes: tuple[str | None, ...] | None
    kernel_dtype: Any
    bias_dtype: Any  # None without a bias
    # Also return the norm output (in x's dtype), for return_layernorm_output and LoRA.
    return_norm_output: bool = False
    kernel_in_scan: bool = False  # traced in a scan body (gemm_operands.kernel_operand)
    # The shardings of x, kernel, gamma, beta and bias under Explicit mesh axes, or None.
    grad_specs: Specs = None


class _Operands(NamedTuple):
    """The op's differentiable arguments, checked."""

    x: Array  # [batch..., hidden]
    kernel: Array  # [hidden, features...]
    gamma: Array  # [hidden]
    beta: Array | None  # [hidden], None for rmsnorm
    bias: Array | None  # [features...]
    quantizer_set: QuantizerSet


class _Residuals(NamedTuple):
    norm: NormInput
    # FP8: the quantized norm output and kernel as the backward GEMMs contract them (per-tensor:
    # the forward GEMM's own). Without FP8 the norm output is recomputed from x and the
    # statistics, and the kernel is the parameter itself, so that no high-precision
    # [tokens, hidden] copy is kept alive until the backward.
    ln_operand: GemmOperand | None
    kernel_operand: GemmOperand | Array
    quantizers: QuantizerSet  # x and kernel already updated by the forward


# The output: [batch..., features...], and the norm output too with return_norm_output.
_Output = Array | tuple[Array, Array]


def _forward(
    config: _Config, operands: _Operands, for_backward: bool
) -> tuple[_Output, _Residuals]:
    x, kernel, gamma, beta, bias, quantizer_set = operands
    fp8 = not quantizer_set.is_noop
    axes = (config.layernorm_input_axes, config.dot_input_axes, config.kernel_axes)
    # [batch..., hidden] -> norm -> x [hidden, features...] -> [batch..., features...]
    step = norm_gemm_forward(
        x, gamma, beta, kernel, bias, config.norm, quantizer_set, axes, config.kernel_in_scan,
        for_backward, config.return_norm_output, fp8,
    )  # fmt: skip
    ln_operand, kernel_residual = (
        saved_gemm_operands(step.lhs, step.rhs, quantizer_set) if fp8 else (None, kernel)
    )
    residuals = _Residuals(
        norm=step.norm,
        ln_operand=ln_operand,
        kernel_operand=kernel_residual,
        quantizers=dataclasses.replace(
            quantizer_set, x=step.x_quantizer, kernel=step.kernel_quantizer
        ),
    )
    if config.return_norm_output:
        return (step.out, cast(Array, step.norm_output)), residuals
    return step.out, residuals


def _backward(config: _Config, residuals: _Residuals, grad: _Output) -> _Operands:
    norm, quantizers = residuals.norm, residuals.quantizers
    out_grad, d_ln_output = split_norm_output_grad(grad, config.return_norm_output)
    lhs: GemmOperand
    rhs: GemmOperand
    if quantizers.is_noop:
        lhs = recomputed_norm_operand(
            norm, config.norm, config.dot_input_axes, config.layernorm_input_axes
        )
        # Without FP8 the kernel residual is the parameter itself.
        rhs = unquantized_operand(residuals.kernel_operand, norm.x.dtype)
    else:
        lhs = cast(GemmOperand, residuals.ln_operand)
        rhs = cast(GemmOperand, residuals.kernel_operand)
    grads = dense_backward(
        out_grad,
        lhs,
        rhs,
        quantizers.dgrad,
        1,
        norm.x.dtype,
        config.kernel_dtype,
        config.bias_dtype,
        precision=quantizers.precision,
        # The norm backward applies the dgrad's scale, unless the norm output's is added first.
        defer_dgrad_scale=d_ln_output is None,
    )
    d_ln = grads.lhs if d_ln_output is None else grads.lhs + d_ln_output
    d_ln = with_logical_constraint(d_ln, config.layernorm_input_axes)
    d_kernel = with_logical_constraint(grads.rhs, config.kernel_axes)
    d_x, d_gamma, d_beta = normalize_backward(d_ln, *norm, config.norm, grads.lhs_scale)
    new_state = dataclasses.replace(quantizers, dgrad=grads.dgrad_quantizer)
    primal_grads = (d_x, d_kernel, d_gamma, d_beta, grads.bias)
    return _Operands(*with_explicit_specs(primal_grads, config.grad_specs), as_cotangent(new_state))


def _out_specs(config: _Config, operands: _Operands) -> Any:
    return gemm_out_specs(operands.x, operands.kernel, 1, config.return_norm_output)


_layernorm_dense = fused_op(_forward, _backward, _out_specs)


def layernorm_dense(
    x: Array,
    kernel: Array,
    gamma: Array,
    beta: Array | None,
    bias: Array | None = None,
    norm_type: str = "layernorm",
    zero_centered_gamma: bool = False,
    epsilon: float = 1e-6,
    transpose_batch_sequence: bool = False,
    layernorm_input_axes: LogicalAxes = None,
    dot_input_axes: LogicalAxes = None,
    kernel_axes: LogicalAxes = None,
    quantizer_set: QuantizerSet = noop_quantizer_set,
    *,
    return_norm_output: bool = False,
) -> Array:
    """Layernorm (or rmsnorm) over the last axis of ``x``, then a GEMM with ``kernel``.

    ``y = norm(x) * gamma + beta`` (``1 + gamma`` with ``zero_centered_gamma``; no ``beta`` for
    rmsnorm), then ``out = y . kernel + bias``. The norm runs in float32. With an FP8
    ``quantizer_set`` the norm output and the kernel are quantized directly to float8 for the
    forward GEMM, and the output gradient for the two backward GEMMs; the new quantizer state
    comes back as the gradient of ``quantizer_set``. Only x, the norm statistics, gamma, beta
    and (under FP8) the float8 GEMM operands are saved for the backward.

    Args:
      x: ``[batch..., hidden]`` input, any number of leading axes.
      kernel: ``[hidden, features...]``, contracted over its first axis.
      gamma: ``[hidden]`` norm scale.
      beta: ``[hidden]`` norm shift for layernorm; None for rmsnorm.
      bias: ``[features...]`` or None (default).
      norm_type: ``"layernorm"`` (default) or ``"rmsnorm"``.
      zero_centered_gamma: multiply by ``1 + gamma`` instead of ``gamma`` (default False).
      epsilon: added to the variance (or mean square) before the square root (default 1e-6).
      transpose_batch_sequence: the input is ``[seq, batch, ...]`` (default False). It changes
        no math; the layout that sharding sees is given by the ``*_axes`` arguments.
      layernorm_input_axes: logical axes of ``x`` (and of the norm-input gradient).
      dot_input_axes: logical axes of the GEMM input, the (quantized) norm output.
      kernel_axes: logical axes of the (quantized) kernel and of its gradient.
      quantizer_set: the GEMM's quantizers (default ``noop_quantizer_set``: no FP8).
      return_norm_output: te_flax's; also return the norm output, ``(out, norm(x))``, as
        ``layernorm_dense_with_norm_output`` does (whose return type says so).

    Returns:
      ``[batch..., features...]`` in ``x.dtype``.

    Example usage::

      >>> import jax, jax.numpy as jnp
      >>> from te_flax.layernorm_dense import layernorm_dense
      >>> from te_flax.quantize import DelayedScaling, QuantizerFactory
      >>> x, kernel = jnp.ones((4, 8, 16), jnp.bfloat16), jnp.ones((16, 3, 32))
      >>> gamma, beta = jnp.ones(16), jnp.zeros(16)
      >>> qs = QuantizerFactory.create_set(fp8_recipe=DelayedScaling())
      >>> layernorm_dense(x, kernel, gamma, beta, quantizer_set=qs).shape
      (4, 8, 3, 32)
    """
    check.check_input(x, "x")
    check.check_floating(kernel, "kernel")
    if kernel.ndim < 2 or kernel.shape[0] != x.shape[-1]:
        raise ValueError(
            f"kernel has shape {kernel.shape} but must be [hidden, features...] with hidden = "
            f"x.shape[-1] = {x.shape[-1]}; the GEMM contracts x's last axis with kernel axis 0"
        )
    norm = check_norm(x, gamma, beta, norm_type, zero_centered_gamma, epsilon)
    if bias is not None:
        check.check_floating(bias, "bias")
        check.check_shape(bias, kernel.shape[1:], "bias", "it matches the kernel's feature axes")
    check.check_bool(transpose_batch_sequence, "transpose_batch_sequence")
    check.check_bool(return_norm_output, "return_norm_output")
    config = _Config(
        norm=norm,
        layernorm_input_axes=check.check_axes(
            layernorm_input_axes, x.ndim, "layernorm_input_axes", "x"
        ),
        dot_input_axes=check.check_axes(dot_input_axes, x.ndim, "dot_input_axes", "x"),
        kernel_axes=check.check_axes(kernel_axes, kernel.ndim, "kernel_axes", "kernel"),
        kernel_dtype=kernel.dtype,
        bias_dtype=None if bias is None else bias.dtype,
        return_norm_output=return_norm_output,
        kernel_in_scan=traced_in_scan(kernel),
        grad_specs=explicit_specs((x, kernel, gamma, beta, bias)),
    )
    kernel, gamma, beta, bias = vary_like(x, (kernel, gamma, beta, bias))
    quantizer_set = float32_state(check_quantizer_set(quantizer_set))
    return cast(
        Array, _layernorm_dense(config, _Operands(x, kernel, gamma, beta, bias, quantizer_set))
    )


def layernorm_dense_with_norm_output(*args: Any, **kwargs: Any) -> tuple[Array, Array]:
    """``layernorm_dense`` (the same arguments) that also returns the norm output,
    ``(out, norm(x))``.

    The norm output (in x's dtype) is differentiable: its gradient joins the GEMM's in the
    norm backward. The modules use it for ``return_layernorm_output`` and for low-rank
    adaptation, which reads the same normalized input as the main GEMM.

    Example usage::

      >>> import jax.numpy as jnp
      >>> from te_flax.layernorm_dense import layernorm_dense_with_norm_output
      >>> out, ln = layernorm_dense_with_norm_output(
      ...     jnp.ones((2, 8)), jnp.ones((8, 4)), jnp.ones(8), None, norm_type="rmsnorm")
      >>> out.shape, ln.shape
      ((2, 4), (2, 8))
    """
    return cast(tuple[Array, Array], layernorm_dense(*args, **kwargs, return_norm_output=True))
