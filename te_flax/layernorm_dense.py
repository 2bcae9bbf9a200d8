"""``layernorm_dense``: a layernorm (or rmsnorm) fused with the GEMM that consumes it."""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any, NamedTuple, cast

import jax
from jax import Array

from te_flax._base import checks as check
from te_flax._ops.kernels import traced_in_scan
from te_flax._ops.stages import (
    NormSpec,
    NormStats,
    apply_norm,
    dense_backward,
    dense_forward,
    input_uses,
    kernel_operand,
    norm_operand,
    normalize,
    normalize_backward,
    run_op,
    saved_operand,
)
from te_flax.quantize import (
    LEADING,
    TRAILING,
    GemmOperand,
    QuantizerSet,
    ScaledTensor,
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
    norm: NormSpec
    layernorm_input_axes: tuple[str | None, ...] | None
    dot_input_axes: tuple[str | None, ...] | None
    kernel_axes: tuple[str | None, ...] | None
    kernel_dtype: Any
    bias_dtype: Any  # None without a bias
    # Also return the norm output (in x's dtype), for return_layernorm_output and LoRA.
    return_norm_output: bool = False
    kernel_in_scan: bool = False  # traced in a scan body (_stages.kernel_operand)
    # The shardings of x, kernel, gamma, beta and bias under Explicit mesh axes, or None.
    grad_specs: Specs = None


class _Residuals(NamedTuple):
    x: Array
    stats: NormStats
    gamma: Array
    beta: Array | None
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
    config: _Config,
    x: Array,
    kernel: Array,
    gamma: Array,
    beta: Array | None,
    bias: Array | None,
    quantizer_set: QuantizerSet,
    for_backward: bool = True,
) -> tuple[_Output, _Residuals]:
    x = with_logical_constraint(x, config.layernorm_input_axes)
    _, stats = normalize(x, gamma, beta, config.norm)
    lhs, x_quantizer = norm_operand(
        x,
        stats,
        gamma,
        beta,
        config.norm,
        quantizer_set.x,
        config.dot_input_axes,
        input_uses(for_backward),
        source_axes=config.layernorm_input_axes,
    )
    rhs, kernel_quantizer = kernel_operand(
        kernel, quantizer_set.kernel, x.dtype, 1, for_backward, config.kernel_axes,
        config.kernel_in_scan,
    )  # fmt: skip
    # [batch..., hidden] x [hidden, features...] -> [batch..., features...]
    out = dense_forward(lhs, rhs, 1, x.dtype, bias, quantizer_set.precision)
    fp8 = not quantizer_set.is_noop
    output: _Output = out
    if config.return_norm_output:
        # Without FP8 the GEMM operand is that very array; under FP8 a second cast of the
        # float32 norm output, which XLA computes in the same fusion.
        ln = apply_norm(x, stats, gamma, beta, config.norm) if fp8 else cast(ScaledTensor, lhs).data
        output = (out, ln.astype(x.dtype))
    residuals = _Residuals(
        x=x,
        stats=stats,
        gamma=gamma,
        beta=beta,
        ln_operand=saved_operand(lhs, LEADING, quantizer_set.checkpoint_name) if fp8 else None,
        kernel_operand=saved_operand(rhs, TRAILING, quantizer_set.checkpoint_name)
        if fp8
        else kernel,
        quantizers=dataclasses.replace(quantizer_set, x=x_quantizer, kernel=kernel_quantizer),
    )
    return output, residuals


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _layernorm_dense(
    config: _Config,
    x: Array,
    kernel: Array,
    gamma: Array,
    beta: Array | None,
    bias: Array | None,
    quantizer_set: QuantizerSet,
) -> _Output:
    # Not differentiated: no quantization for the backward GEMMs.
    args = (config, x, kernel, gamma, beta, bias, quantizer_set)
    return _forward(*args, for_backward=False)[0]


def _backward(
    config: _Config, residuals: _Residuals, grad: _Output
) -> tuple[Array, Array, Array, Array | None, Array | None, QuantizerSet]:
    x, quantizers = residuals.x, residuals.quantizers
    out_grad, d_ln_output = (
        cast(tuple[Array, Array], grad) if config.return_norm_output else (cast(Array, grad), None)
    )
    lhs: GemmOperand
    rhs: GemmOperand
    if quantizers.is_noop:
        lhs, _ = norm_operand(
            x,
            residuals.stats,
            residuals.gamma,
            residuals.beta,
            config.norm,
            None,
            config.dot_input_axes,
            source_axes=config.layernorm_input_axes,
        )
        # Without FP8 the kernel residual is the parameter itself.
        rhs = ScaledTensor(cast(Array, residuals.kernel_operand).astype(x.dtype))
    else:
        lhs = cast(GemmOperand, residuals.ln_operand)
        rhs = cast(GemmOperand, residuals.kernel_operand)
    grads = dense_backward(
        out_grad,
        lhs,
        rhs,
        quantizers.dgrad,
        1,
        x.dtype,
        config.kernel_dtype,
        config.bias_dtype,
        precision=quantizers.precision,
        # The norm backward applies the dgrad's scale, unless the norm output's is added first.
        defer_dgrad_scale=d_ln_output is None,
    )
    d_ln = grads.lhs if d_ln_output is None else grads.lhs + d_ln_output
    d_ln = with_logical_constraint(d_ln, config.layernorm_input_axes)
    d_kernel = with_logical_constraint(grads.rhs, config.kernel_axes)
    d_x, d_gamma, d_beta = normalize_backward(
        d_ln, x, residuals.stats, residuals.gamma, residuals.beta, config.norm, grads.lhs_scale
    )
    new_state = dataclasses.replace(quantizers, dgrad=grads.dgrad_quantizer)
    primal_grads = (d_x, d_kernel, d_gamma, d_beta, grads.bias)
    return (*with_explicit_specs(primal_grads, config.grad_specs), as_cotangent(new_state))


_layernorm_dense.defvjp(_forward, _backward)


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
    config = _config(**locals())
    return cast(Array, _run(config, x, kernel, gamma, beta, bias, quantizer_set))


def layernorm_dense_with_norm_output(
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
) -> tuple[Array, Array]:
    """``layernorm_dense`` that also returns the norm output, ``(out, norm(x))``.

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
    config = dataclasses.replace(_config(**locals()), return_norm_output=True)
    return cast(tuple[Array, Array], _run(config, x, kernel, gamma, beta, bias, quantizer_set))


def _run(config: _Config, x: Array, *operands: Any) -> _Output:
    """The op on ``x`` and ``(kernel, gamma, beta, bias, quantizer_set)``."""
    *params, quantizer_set = operands
    kernel, gamma, beta, bias = vary_like(x, tuple(params))
    quantizer_set = float32_state(quantizer_set)
    operands = (x, kernel, gamma, beta, bias, quantizer_set)
    block_scaled = quantizer_set.block_scaled
    return cast(
        _Output,
        run_op(_layernorm_dense, config, operands, kernel, block_scaled,
               norm_output=config.return_norm_output),
    )  # fmt: skip


def _config(
    x: Array,
    kernel: Array,
    gamma: Array,
    beta: Array | None,
    bias: Array | None,
    norm_type: str,
    zero_centered_gamma: bool,
    epsilon: float,
    transpose_batch_sequence: bool,
    layernorm_input_axes: LogicalAxes,
    dot_input_axes: LogicalAxes,
    kernel_axes: LogicalAxes,
    quantizer_set: QuantizerSet,
) -> _Config:
    """Validates the arguments of ``layernorm_dense`` and returns its static configuration."""
    check.check_floating(x, "x")
    if x.ndim < 1:
        raise ValueError("x must have at least one axis (the hidden axis it is normalized over)")
    check.check_floating(kernel, "kernel")
    if kernel.ndim < 2 or kernel.shape[0] != x.shape[-1]:
        raise ValueError(
            f"kernel has shape {kernel.shape} but must be [hidden, features...] with hidden = "
            f"x.shape[-1] = {x.shape[-1]}; the GEMM contracts x's last axis with kernel axis 0"
        )
    norm = check.check_norm(x, gamma, beta, norm_type, zero_centered_gamma, epsilon)
    if bias is not None:
        check.check_floating(bias, "bias")
        check.check_shape(bias, kernel.shape[1:], "bias", "it matches the kernel's feature axes")
    check.check_bool(transpose_batch_sequence, "transpose_batch_sequence")
    check.check_quantizer_set(quantizer_set)
    return _Config(
        norm=norm,
        layernorm_input_axes=check.check_axes(
            layernorm_input_axes, x.ndim, "layernorm_input_axes", "x"
        ),
        dot_input_axes=check.check_axes(dot_input_axes, x.ndim, "dot_input_axes", "x"),
        kernel_axes=check.check_axes(kernel_axes, kernel.ndim, "kernel_axes", "kernel"),
        kernel_dtype=kernel.dtype,
        bias_dtype=None if bias is None else bias.dtype,
        kernel_in_scan=traced_in_scan(kernel),
        grad_specs=explicit_specs((x, kernel, gamma, beta, bias)),
    )
