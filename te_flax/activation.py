"""``activation``: TransformerEngine's activation op on the ``act`` axis, optionally quantized.

The same activations as ``LayerNormMLP``'s (``te_flax._ops.activations``): one name, or a gated
tuple such as ``("silu", "linear")`` (SwiGLU), applied to ``x [..., len(activation_type), H]``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax import Array

from te_flax._base import checks as check
from te_flax._ops.activations import (
    ClampedSwigluParams,
    activation_backward,
    activation_forward,
    canonical_activation_params,
    canonical_activation_type,
)
from te_flax.quantize import TRAILING, Quantizer, ScaledTensor, check_quantizer, quantize_operand

__all__ = ["activation"]


@partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _activation(x: Array, names: tuple[str, ...], params: ClampedSwigluParams | None) -> Array:
    return activation_forward(x, names, params)


def _forward(
    x: Array, names: tuple[str, ...], params: ClampedSwigluParams | None
) -> tuple[Array, Array]:
    return activation_forward(x, names, params), x


def _backward(
    names: tuple[str, ...], params: ClampedSwigluParams | None, x: Array, grad: Array
) -> tuple[Array]:
    # TE's activation-backward kernels: in float32, rounded once to the input's dtype.
    return (activation_backward(grad, x, names, params),)


_activation.defvjp(_forward, _backward)


def _dequantized(out: Array, quantizer: Quantizer) -> Array:
    """``out`` quantized by ``quantizer`` and read back in ``out``'s dtype."""
    operand, _ = quantize_operand(out, quantizer, out.dtype, out.ndim - 1, (TRAILING,))
    if isinstance(operand, ScaledTensor):
        assert operand.scale_inv is not None
        return (operand.data.astype(jnp.float32) * operand.scale_inv).astype(out.dtype)
    assert operand.trailing is not None
    return operand.trailing.dequantize(out.dtype).reshape(out.shape)


@jax.custom_vjp
def _straight_through(out: Array, quantizer: Quantizer) -> Array:
    return _dequantized(out, quantizer)


def _straight_through_forward(out: Array, quantizer: Quantizer) -> tuple[Array, Quantizer]:
    return _dequantized(out, quantizer), quantizer


def _straight_through_backward(quantizer: Quantizer, grad: Array) -> tuple[Array, Any]:
    # The quantization passes the gradient through; the quantizer gets none (as in TE).
    return grad, jax.tree.map(jnp.zeros_like, quantizer)


_straight_through.defvjp(_straight_through_forward, _straight_through_backward)


def activation(
    x: Array,
    activation_type: Sequence[str],
    quantizer: Quantizer | None = None,
    act_params: Mapping[str, float] | ClampedSwigluParams | None = None,
) -> Array:
    """The activation of ``x``'s ``act`` axis: ``[..., n_act, H]`` -> ``[..., H]``.

    Slice ``i`` of the ``act`` axis goes through ``activation_type[i]`` and the slices are
    multiplied, so ``("gelu",)`` is GELU of ``x[..., 0, :]`` and ``("silu", "linear")`` is
    ``silu(x[..., 0, :]) * x[..., 1, :]`` (SwiGLU); a tuple that starts with ``"linear"`` is
    read reversed, as in TransformerEngine. The backward is computed in float32.

    Args:
      x: ``[..., len(activation_type), H]``, floating point.
      activation_type: activation names, e.g. ``("gelu",)``, ``("relu", "relu")``,
        ``("silu", "linear")`` or ``("clamped_silu", "clamped_linear")``.
      quantizer: when given, the output is quantized with it and read back in ``x``'s dtype
        (its rounding stays in the output; the gradient passes through the quantization, and
        the quantizer's state is not updated, as in TransformerEngine).
      act_params: the clamped SwiGLU's parameters, a dict (``limit``, ``alpha``,
        ``glu_linear_offset``) or ``ClampedSwigluParams``; None: TE's defaults.

    Returns:
      ``[..., H]`` in ``x``'s dtype.

    Example usage::

      >>> import jax.numpy as jnp
      >>> from te_flax.activation import activation
      >>> x = jnp.stack([jnp.array([-1.0, 2.0]), jnp.array([3.0, 3.0])])  # [n_act=2, H=2]
      >>> activation(x, ("relu", "linear"))
      Array([0., 6.], dtype=float32)
    """
    check.check_floating(x, "x")
    names = canonical_activation_type(activation_type)
    if x.ndim < 2 or x.shape[-2] != len(names):
        raise ValueError(
            f"x has shape {x.shape}, but activation_type={names!r} needs x of shape "
            f"[..., {len(names)}, H] (one slice of axis -2 per activation); reshape x, e.g. "
            f"x.reshape(*x.shape[:-1], {len(names)}, -1) if the slices are concatenated on the "
            "last axis"
        )
    if isinstance(act_params, ClampedSwigluParams):
        act_params = {
            "limit": act_params.limit,
            "alpha": act_params.alpha,
            "glu_linear_offset": act_params.glu_linear_offset,
        }
    params = canonical_activation_params(names, act_params)
    out = _activation(x, names, params)
    if quantizer is None:
        return out
    check_quantizer(quantizer, "quantizer")
    return _straight_through(out, quantizer)
