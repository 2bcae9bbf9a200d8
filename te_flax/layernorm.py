"""``layernorm``: layernorm or rmsnorm over the last axis, with a float32 backward."""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
from jax import Array

from te_flax._base import checks as check
from te_flax._ops.arguments import check_norm
from te_flax._ops.norm import NormConfig, NormStats, normalize, normalize_backward
from te_flax.quantize import (
    TRAILING,
    BlockOperand,
    Quantizer,
    as_cotangent,
    check_quantizer,
    float32_state,
    scaling,
)
from te_flax.sharding import explicit_specs, vary_like, with_explicit_specs

__all__ = ["layernorm"]


class _Residuals(NamedTuple):
    x: Array
    stats: NormStats
    gamma: Array
    beta: Array | None
    quantizer: Quantizer | None  # already updated by the forward


def _forward(
    config: NormConfig, x: Array, gamma: Array, beta: Array | None, quantizer: Quantizer | None
) -> tuple[Array, _Residuals]:
    out, stats = normalize(x, gamma, beta, config)  # f32
    if quantizer is not None:
        # Fake quantization: the output is the quantized value, dequantized to x's dtype
        # (block-scaled: in blocks along the hidden axis, as the next GEMM contracts it).
        operand, quantizer = quantizer.quantize(out, x.ndim - 1, (TRAILING,))
        if isinstance(operand, BlockOperand):
            assert operand.trailing is not None, "quantized for a trailing contraction"
            out = operand.trailing.dequantize().reshape(out.shape)
        else:
            assert operand.scale_inv is not None, "a quantizer's operand has a scale"
            out = scaling.dequantize(operand.data, operand.scale_inv)
    return out.astype(x.dtype), _Residuals(x, stats, gamma, beta, quantizer)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _layernorm(
    config: NormConfig, x: Array, gamma: Array, beta: Array | None, quantizer: Quantizer | None
) -> Array:
    return _forward(config, x, gamma, beta, quantizer)[0]


def _backward(
    config: NormConfig, residuals: _Residuals, grad: Array
) -> tuple[Array, Array, Array | None, Quantizer | None]:
    # The quantization of the output is treated as the identity (straight-through).
    d_x, d_gamma, d_beta = normalize_backward(
        grad, residuals.x, residuals.stats, residuals.gamma, residuals.beta, config
    )
    # Under Explicit mesh axes each gradient has its primal's sharding (x, gamma and beta are
    # the residuals themselves).
    primals = (residuals.x, residuals.gamma, residuals.beta)
    d_x, d_gamma, d_beta = with_explicit_specs((d_x, d_gamma, d_beta), explicit_specs(primals))
    return d_x, d_gamma, d_beta, as_cotangent(residuals.quantizer)


_layernorm.defvjp(_forward, _backward)


def layernorm(
    x: Array,
    gamma: Array,
    beta: Array | None,
    norm_type: str = "layernorm",
    zero_centered_gamma: bool = False,
    epsilon: float = 1e-6,
    quantizer: Quantizer | None = None,
) -> Array:
    """Layernorm or rmsnorm over the last axis of ``x``, computed in float32.

    layernorm: ``(x - mean) / sqrt(var + epsilon) * gamma + beta``; rmsnorm:
    ``x / sqrt(mean(x**2) + epsilon) * gamma``; with ``zero_centered_gamma`` the scale is
    ``1 + gamma``.

    Args:
      x: ``[batch..., hidden]``.
      gamma: ``[hidden]`` scale.
      beta: ``[hidden]`` shift for layernorm; None for rmsnorm.
      norm_type: ``"layernorm"`` (default) or ``"rmsnorm"``.
      zero_centered_gamma: multiply by ``1 + gamma`` (default False).
      epsilon: added before the square root (default 1e-6).
      quantizer: optional quantizer; the output is then quantized and dequantized (its new
        state is the gradient of ``quantizer``), and the gradient passes straight through.

    Returns:
      ``[batch..., hidden]`` in ``x.dtype``.

    Example usage::

      >>> import jax.numpy as jnp
      >>> from te_flax.layernorm import layernorm
      >>> y = layernorm(jnp.array([[1.0, 3.0]]), jnp.ones(2), jnp.zeros(2))
      >>> y.round(4)  # (x - 2) / sqrt(1 + epsilon); the last digits depend on the CPU's rsqrt
      Array([[-1.,  1.]], dtype=float32)
    """
    check.check_input(x, "x")
    config = check_norm(x, gamma, beta, norm_type, zero_centered_gamma, epsilon)
    if quantizer is not None:
        check_quantizer(quantizer, "quantizer")
    gamma, beta = vary_like(x, (gamma, beta))  # inside shard_map: their gradients summed
    return _layernorm(config, x, gamma, beta, float32_state(quantizer))
