"""The stages every op's forward and backward rule is built from.

Normalize (and its backward), quantize an operand, GEMM, bias. ``layernorm``, ``dense``,
``layernorm_dense`` and ``layernorm_mlp`` compose these; none of them re-implements a stage.
All functions here are pure and run inside ``jax.custom_vjp`` rules.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax.numpy as jnp
from jax import Array, lax

from te_flax.quantize import Quantizer, ScaledTensor, quantize_operand
from te_flax.sharding import LogicalAxes, with_logical_constraint

__all__ = [
    "NormSpec",
    "NormStats",
    "apply_norm",
    "dense_backward",
    "dense_forward",
    "norm_operand",
    "normalize",
    "normalize_backward",
    "sum_to_bias",
]


# ----------------------------------------------------------------------------- normalization


@dataclasses.dataclass(frozen=True)
class NormSpec:
    """Static description of a layernorm or rmsnorm over the last axis."""

    norm_type: str  # "layernorm" or "rmsnorm"
    zero_centered_gamma: bool
    epsilon: float


class NormStats(NamedTuple):
    """What the norm backward needs besides x: the mean (None for rmsnorm) and 1/sigma."""

    mean: Array | None  # f32[batch..., 1]
    rsigma: Array  # f32[batch..., 1]


def _leading_ones(vector: Array, ndim: int) -> Array:
    """``vector`` reshaped to broadcast against the trailing axes of an ``ndim`` array."""
    return vector.reshape((1,) * (ndim - vector.ndim) + vector.shape)


def _effective_gamma(gamma: Array, spec: NormSpec, ndim: int) -> Array:
    gamma = _leading_ones(gamma.astype(jnp.float32), ndim)
    return gamma + 1.0 if spec.zero_centered_gamma else gamma


def _normalized(x: Array, stats: NormStats) -> Array:
    x = x.astype(jnp.float32)
    centered = x if stats.mean is None else x - stats.mean
    return centered * stats.rsigma


def apply_norm(
    x: Array, stats: NormStats, gamma: Array, beta: Array | None, spec: NormSpec
) -> Array:
    """The norm output in float32 from saved statistics (no reduction over x)."""
    y = _normalized(x, stats) * _effective_gamma(gamma, spec, x.ndim)
    return y if beta is None else y + _leading_ones(beta.astype(jnp.float32), x.ndim)


def normalize(
    x: Array, gamma: Array, beta: Array | None, spec: NormSpec
) -> tuple[Array, NormStats]:
    """Layernorm or rmsnorm over the last axis, in float32, and the statistics for backward."""
    # Statistics in float32 whatever x's dtype: bf16 sums over thousands of features lose the
    # low bits that the variance is made of.
    x32 = x.astype(jnp.float32)
    if spec.norm_type == "layernorm":
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
    stats = NormStats(mean, lax.rsqrt(variance + spec.epsilon))
    return apply_norm(x, stats, gamma, beta, spec), stats


def normalize_backward(
    d_out: Array,
    x: Array,
    stats: NormStats,
    gamma: Array,
    beta: Array | None,
    spec: NormSpec,
) -> tuple[Array, Array, Array | None]:
    """Gradients of ``normalize`` for x, gamma and beta, computed in float32."""
    d_out = d_out.astype(jnp.float32)
    x_hat = _normalized(x, stats)  # [batch..., hidden]
    batch_axes = tuple(range(x.ndim - 1))
    d_gamma = jnp.sum(d_out * x_hat, axis=batch_axes).astype(gamma.dtype)
    d_beta = None if beta is None else jnp.sum(d_out, axis=batch_axes).astype(beta.dtype)
    d_x_hat = d_out * _effective_gamma(gamma, spec, x.ndim)
    projection = jnp.mean(d_x_hat * x_hat, axis=-1, keepdims=True)
    if spec.norm_type == "layernorm":
        d_x_hat = d_x_hat - jnp.mean(d_x_hat, axis=-1, keepdims=True)
    d_x = stats.rsigma * (d_x_hat - x_hat * projection)
    return d_x.astype(x.dtype), d_gamma, d_beta


def norm_operand(
    x: Array,
    stats: NormStats,
    gamma: Array,
    beta: Array | None,
    spec: NormSpec,
    quantizer: Quantizer | None,
    axes: LogicalAxes,
) -> tuple[ScaledTensor, Quantizer | None]:
    """The norm output as a GEMM operand: quantized straight from float32, or cast to x's dtype.

    The float32 norm output exists only inside this fusion; what leaves it is the operand.
    """
    ln = apply_norm(x, stats, gamma, beta, spec)  # f32[batch..., hidden]
    operand, new_quantizer = quantize_operand(ln, quantizer, x.dtype)
    return operand._replace(data=with_logical_constraint(operand.data, axes)), new_quantizer


# ----------------------------------------------------------------------------- GEMMs


def _gemm(
    lhs: ScaledTensor,
    rhs: ScaledTensor,
    contracting: tuple[tuple[int, ...], tuple[int, ...]],
    out_dtype,
    fp8_precision: lax.Precision,
) -> Array:
    """``lhs . rhs`` over ``contracting``: a float8 GEMM when both operands carry a scale."""
    dimension_numbers = (contracting, ((), ()))
    if lhs.scale_inv is None and rhs.scale_inv is None:
        return lax.dot_general(
            lhs.data, rhs.data, dimension_numbers, preferred_element_type=out_dtype
        )
    assert lhs.scale_inv is not None and rhs.scale_inv is not None, "mixed FP8/non-FP8 GEMM"
    # float8 x float8 with the scales applied to the product: XLA folds the multiply into the
    # cuBLASLt FP8 GEMM as its alpha. Precision DEFAULT selects fast accumulation there.
    out = lax.dot_general(
        lhs.data,
        rhs.data,
        dimension_numbers,
        precision=fp8_precision,
        preferred_element_type=out_dtype,
    )
    return out * (lhs.scale_inv * rhs.scale_inv).astype(out_dtype)


def dense_forward(
    lhs: ScaledTensor, rhs: ScaledTensor, n_contract: int, out_dtype, bias: Array | None
) -> Array:
    """``lhs[batch..., K...] . rhs[K..., F...] (+ bias[F...])`` -> ``[batch..., F...]``."""
    contracting = (
        tuple(range(lhs.data.ndim - n_contract, lhs.data.ndim)),
        tuple(range(n_contract)),
    )
    # Forward GEMM with fast accumulation: its error is far below e4m3's rounding.
    out = _gemm(lhs, rhs, contracting, out_dtype, lax.Precision.DEFAULT)
    # The bias is added in the output dtype so that XLA fuses it as the GEMM's BIAS epilogue
    # (cuBLASLt takes no float32 bias for FP8 GEMMs).
    return out if bias is None else out + _leading_ones(bias.astype(out_dtype), out.ndim)


def sum_to_bias(grad: Array, bias_ndim: int, bias_dtype) -> Array:
    """The bias gradient: ``grad`` summed in float32 over all but its last ``bias_ndim`` axes."""
    batch_axes = tuple(range(grad.ndim - bias_ndim))
    return jnp.sum(grad.astype(jnp.float32), axis=batch_axes).astype(bias_dtype)


class DenseGrads(NamedTuple):
    lhs: Array
    rhs: Array
    bias: Array | None
    dgrad_quantizer: Quantizer | None


def dense_backward(
    grad: Array,
    lhs: ScaledTensor,
    rhs: ScaledTensor,
    grad_quantizer: Quantizer | None,
    n_contract: int,
    lhs_dtype,
    rhs_dtype,
    bias_dtype=None,
) -> DenseGrads:
    """dgrad and wgrad of ``dense_forward`` (and dbias when ``bias_dtype`` is given).

    ``grad`` (``[batch..., F...]``) is quantized once with ``grad_quantizer`` and feeds both
    GEMMs, which reuse the operands saved by the forward: ``dlhs = q(grad) . q(rhs)`` and
    ``drhs = q(lhs) . q(grad)``.
    """
    n_features = rhs.data.ndim - n_contract
    n_batch = grad.ndim - n_features
    d_bias = None if bias_dtype is None else sum_to_bias(grad, n_features, bias_dtype)
    grad_operand, new_grad_quantizer = quantize_operand(grad, grad_quantizer, grad.dtype)
    # Backward GEMMs accumulate with split (HIGHEST) precision: gradients are summed over many
    # tokens, where fast accumulation's error would grow.
    precision = lax.Precision.HIGHEST
    feature_axes_of_grad = tuple(range(n_batch, grad.ndim))
    feature_axes_of_rhs = tuple(range(n_contract, rhs.data.ndim))
    # [batch..., F...] x [K..., F...] -> [batch..., K...]
    d_lhs = _gemm(
        grad_operand, rhs, (feature_axes_of_grad, feature_axes_of_rhs), lhs_dtype, precision
    )
    # [batch..., K...] x [batch..., F...] -> [K..., F...]
    batch_axes = tuple(range(n_batch))
    d_rhs = _gemm(lhs, grad_operand, (batch_axes, batch_axes), rhs_dtype, precision)
    return DenseGrads(d_lhs, d_rhs, d_bias, new_grad_quantizer)
