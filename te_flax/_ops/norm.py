"""The norm stages: layernorm and rmsnorm over the last axis, their backward, and the norm
output as a GEMM operand (quantized straight from float32).

Used by ``layernorm``, ``layernorm_dense`` and ``layernorm_mlp``; the statistics and the
backward run in float32 whatever x's dtype. On GPUs Pallas kernels fuse the norm with the
quantization and its backward into one pass (``te_flax._ops.kernels``); elsewhere the XLA
stages here.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax.numpy as jnp
from jax import Array, lax

from te_flax._ops.gemm_operands import constrained, leading_ones, one_pass_layouts
from te_flax._ops.kernels import norm_backward_grads, norm_quantize_operand
from te_flax.quantize import TRAILING, GemmOperand, Quantizer, quantize_operand
from te_flax.sharding import LogicalAxes, whole_last_axis

__all__ = [
    "NormConfig",
    "NormInput",
    "NormStats",
    "apply_norm",
    "norm_operand",
    "normalize",
    "normalize_backward",
]


@dataclasses.dataclass(frozen=True)
class NormConfig:
    """Static configuration of a layernorm or rmsnorm over the last axis."""

    norm_type: str  # "layernorm" or "rmsnorm"
    zero_centered_gamma: bool
    epsilon: float


class NormStats(NamedTuple):
    """What the norm backward needs besides x: the mean (None for rmsnorm) and 1/sigma."""

    mean: Array | None  # f32[batch..., 1]
    rsigma: Array  # f32[batch..., 1]


def _effective_gamma(gamma: Array, config: NormConfig, x: Array | None = None) -> Array:
    """The factor the normalized ``x`` is multiplied by (``1 + gamma`` when zero-centered),
    float32, shaped to broadcast against ``x`` (None: the 1-D vector)."""
    gamma = gamma.astype(jnp.float32)
    if x is not None:
        gamma = leading_ones(gamma, x)
    return gamma + 1.0 if config.zero_centered_gamma else gamma


def _normalized(x: Array, stats: NormStats) -> Array:
    x = x.astype(jnp.float32)
    centered = x if stats.mean is None else x - stats.mean
    return centered * stats.rsigma


def apply_norm(
    x: Array, stats: NormStats, gamma: Array, beta: Array | None, config: NormConfig
) -> Array:
    """The norm output in float32 from saved statistics (no reduction over x)."""
    y = _normalized(x, stats) * _effective_gamma(gamma, config, x)
    return y if beta is None else y + leading_ones(beta.astype(jnp.float32), x)


def normalize(
    x: Array, gamma: Array, beta: Array | None, config: NormConfig
) -> tuple[Array, NormStats]:
    """Layernorm or rmsnorm over the last axis, in float32, and the statistics for backward."""
    # Statistics in float32 whatever x's dtype: bf16 sums over thousands of features lose the
    # low bits that the variance is made of.
    x = whole_last_axis(x)
    x32 = x.astype(jnp.float32)
    if config.norm_type == "layernorm":
        # One pass over x for both moments, so that XLA fuses the statistics with the
        # normalize-and-quantize that follows. Shifting by each row's first element keeps the
        # one-pass variance accurate when the mean is large against the spread (E[x^2] - E[x]^2
        # of unshifted data would cancel catastrophically).
        shifted = x32 - x32[..., :1]
        shifted_mean = jnp.mean(shifted, axis=-1, keepdims=True)
        variance = jnp.mean(jnp.square(shifted), axis=-1, keepdims=True) - jnp.square(shifted_mean)
        variance = jnp.maximum(variance, 0.0)
        mean = shifted_mean + x32[..., :1]
    else:
        mean = None
        variance = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
    stats = NormStats(mean, lax.rsqrt(variance + config.epsilon))
    return apply_norm(x, stats, gamma, beta, config), stats


def normalize_backward(
    d_out: Array,
    x: Array,
    stats: NormStats,
    gamma: Array,
    beta: Array | None,
    config: NormConfig,
    d_out_scale: Array | None = None,
) -> tuple[Array, Array, Array | None]:
    """Gradients of ``normalize`` for x, gamma and beta, computed in float32.

    ``d_out_scale``: a float32 scale ``d_out`` still needs (a dgrad GEMM's, see
    ``dense_backward(defer_dgrad_scale=True)``), applied in this pass.
    """
    if d_out_scale is not None:
        d_out_scale = d_out_scale.reshape(())  # a per-tensor scale_inv has shape [1]

    def xla_stage() -> tuple[Array, Array, Array | None]:
        d_out32 = d_out.astype(jnp.float32)
        if d_out_scale is not None:
            d_out32 = d_out32 * d_out_scale
        x_hat = _normalized(x, stats)  # [batch..., hidden]
        batch_axes = tuple(range(x.ndim - 1))
        d_gamma = jnp.sum(d_out32 * x_hat, axis=batch_axes).astype(gamma.dtype)
        d_beta = None if beta is None else jnp.sum(d_out32, axis=batch_axes).astype(beta.dtype)
        d_x_hat = d_out32 * _effective_gamma(gamma, config, x)
        projection = jnp.mean(d_x_hat * x_hat, axis=-1, keepdims=True)
        if config.norm_type == "layernorm":
            d_x_hat = d_x_hat - jnp.mean(d_x_hat, axis=-1, keepdims=True)
        d_x = stats.rsigma * (d_x_hat - x_hat * projection)
        return d_x.astype(x.dtype), d_gamma, d_beta

    # On GPUs one Pallas kernel reads d_out and x once and writes dx and partial sums of
    # dgamma and dbeta (see te_flax._ops.kernels); elsewhere the XLA stage.
    return norm_backward_grads(
        d_out,
        x,
        stats.mean,
        stats.rsigma,
        _effective_gamma(gamma, config),
        gamma.dtype,
        None if beta is None else beta.dtype,
        xla_stage,
        d_out_scale,
    )


def norm_operand(
    x: Array,
    stats: NormStats,
    gamma: Array,
    beta: Array | None,
    config: NormConfig,
    quantizer: Quantizer | None,
    axes: LogicalAxes,
    uses: tuple[str, ...] = (TRAILING,),
    source_axes: LogicalAxes = None,
) -> tuple[GemmOperand, Quantizer | None]:
    """The norm output as a GEMM operand: quantized straight from float32, or cast to x's dtype.

    The float32 norm output exists only inside this fusion; what leaves it is the operand.
    ``uses`` are the block-scaled layouts to prepare (the forward GEMM contracts the hidden
    axis, ``TRAILING``; the weight gradient the tokens, ``LEADING``). ``source_axes`` are the
    logical axes of ``x`` (see ``constrained``).
    """

    def xla_stage() -> tuple[GemmOperand, Quantizer | None]:
        ln = apply_norm(x, stats, gamma, beta, config)  # f32[batch..., hidden]
        return one_pass_layouts(quantize_operand(ln, quantizer, x.dtype, x.ndim - 1, uses), uses)

    # Per-tensor FP8 on GPUs: one Pallas kernel reads x and writes the float8 operand and the
    # amax (see te_flax._ops.kernels); elsewhere, and for other quantizers, the XLA stage.
    gamma_1d = _effective_gamma(gamma, config)  # f32[hidden]
    beta_1d = None if beta is None else beta.astype(jnp.float32)
    operand, new_quantizer = norm_quantize_operand(
        x, stats.mean, stats.rsigma, gamma_1d, beta_1d, quantizer, xla_stage
    )
    return constrained(operand, axes, source_axes), new_quantizer


class NormInput(NamedTuple):
    """A norm's input and what its backward needs with it, as a fused op saves them; in the
    argument order of ``apply_norm``, ``norm_operand`` and ``normalize_backward``."""

    x: Array  # [batch..., hidden]
    stats: NormStats
    gamma: Array  # [hidden]
    beta: Array | None  # [hidden], None for rmsnorm
