"""FP8 dot-product attention: the two attention GEMMs on float8 operands (``fp8_dpa``).

Under a recipe with ``fp8_dpa=True`` (``DelayedScaling`` or ``Float8CurrentScaling``) the
attention's two GEMMs are FP8 GEMMs, each with the quantizer set of one GEMM
(``QuantizerSet(x, kernel, dgrad)``), so that the attention's FP8 state has the GEMMs' form,
names, collection and max-merge rule:

* ``qk`` (scores = ``q . k``): ``x`` quantizes the queries, ``kernel`` the keys (e4m3), and
  ``dgrad`` the gradient of the scores (cuDNN's ``dP``; e5m2 under ``Format.HYBRID``), which
  the backward multiplies with the saved float8 keys (``dq``) and queries (``dk``).
* ``pv`` (output = ``p . v``): ``x`` quantizes the softmax probabilities (cuDNN's ``S``),
  ``kernel`` the values (e4m3), and ``dgrad`` the output gradient (``dO``; e5m2), which the
  backward multiplies with the saved float8 values (``dp``) and probabilities (``dv``).

Delayed scaling keeps the variables ``{x,kernel,grad}_qk_{amax_history,scale_inv}`` and
``{x,kernel,grad}_pv_{...}`` (postfixes ``_qk`` and ``_pv``), updated through the cotangent
slot as every GEMM's. Everything between the GEMMs (scale, bias, masks, score_mod, the
softmax in float32 with its sink, dropout) is the XLA attention's, differentiated by
autodiff. Each GEMM is ``lax.dot_general`` on two float8 operands accumulated in float32,
then multiplied by the two ``scale_inv``: exact emulation on CPU, FP8 GEMMs where XLA forms
them (cuBLASLt on Hopper).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple, cast

import jax.numpy as jnp
from jax import Array, lax

from te_flax._ops.custom_op import FusedOp, fused_op
from te_flax.quantize import (
    CurrentScaleQuantizer,
    DelayedScaleQuantizer,
    DelayedScaling,
    Float8CurrentScaling,
    QuantizerSet,
    Recipe,
    ScaledTensor,
    as_cotangent,
    float32_state,
    get_autocast_recipe,
)
from te_flax.quantize.state import quantizer_set as _quantizer_set

__all__ = [
    "FP8_ATTENTION_POSTFIXES",
    "AttentionQuantizers",
    "attention_quantizers",
    "attention_recipe",
    "fp8_context",
    "fp8_logits",
]

# The postfixes of the attention GEMMs' FP8 variables: scores (q . k), output (p . v).
FP8_ATTENTION_POSTFIXES = ("_qk", "_pv")


class AttentionQuantizers(NamedTuple):
    """The quantizer sets of the attention's two GEMMs (see the module docstring)."""

    qk: QuantizerSet
    pv: QuantizerSet


def attention_recipe(recipe: Recipe | None) -> Recipe | None:
    """The recipe FP8 attention runs under: the module's recipe (else the active
    ``te_flax.autocast`` one) when its ``fp8_dpa`` is True, else None (high precision)."""
    recipe = recipe if recipe is not None else get_autocast_recipe()
    if isinstance(recipe, DelayedScaling | Float8CurrentScaling) and recipe.fp8_dpa:
        return recipe
    return None


def attention_quantizers(
    recipe: Recipe, state_of: Callable[[str], dict[str, Array]]
) -> AttentionQuantizers:
    """The two GEMMs' quantizer sets under ``recipe``, their delayed-scaling state read from
    ``state_of(postfix)`` (a shell's variables; empty under current scaling)."""
    qk, pv = (
        _quantizer_set(recipe, postfix, state_of(postfix)) for postfix in FP8_ATTENTION_POSTFIXES
    )
    return AttentionQuantizers(qk, pv)


@dataclasses.dataclass(frozen=True)
class _Product:
    """One attention GEMM as einsum specs: the forward, and the two operands' gradients as
    products of the output gradient with the other operand; the dtypes of the output and of
    the operands (their gradients')."""

    forward: str
    lhs_grad: str
    rhs_grad: str
    out_dtype: Any
    lhs_dtype: Any
    rhs_dtype: Any


def _scaled_einsum(
    spec: str, lhs: ScaledTensor, rhs: ScaledTensor, precision: lax.Precision
) -> Array:
    """``einsum(spec, lhs, rhs)`` of two float8 operands in float32, times their scales.

    ``lax.dot_general`` on the float8 data (no promotion: e4m3 x e5m2 stays a float8 GEMM),
    then a transpose to ``spec``'s output order.
    """
    inputs, out = spec.split("->")
    a, b = inputs.split(",")
    batch = [c for c in a if c in b and c in out]
    contract = [c for c in a if c in b and c not in out]
    dims = (
        (tuple(a.index(c) for c in contract), tuple(b.index(c) for c in contract)),
        (tuple(a.index(c) for c in batch), tuple(b.index(c) for c in batch)),
    )
    result = lax.dot_general(
        lhs.data, rhs.data, dims, precision=precision, preferred_element_type=jnp.float32
    )
    order = batch + [c for c in a if c not in b] + [c for c in b if c not in a]
    result = jnp.transpose(result, [order.index(c) for c in out])
    assert lhs.scale_inv is not None and rhs.scale_inv is not None, "float8 operands"
    return result * (lhs.scale_inv * rhs.scale_inv).astype(jnp.float32)


def _quantize(
    quantizer: object, x: Array
) -> tuple[ScaledTensor, DelayedScaleQuantizer | CurrentScaleQuantizer]:
    """``x`` quantized per tensor (the recipes with ``fp8_dpa`` scale per tensor)."""
    assert isinstance(quantizer, DelayedScaleQuantizer | CurrentScaleQuantizer), quantizer
    return quantizer.quantize(x)


class _Operands(NamedTuple):
    lhs: Array
    rhs: Array
    quantizer_set: QuantizerSet


class _Residuals(NamedTuple):
    lhs: ScaledTensor  # the float8 operands the forward multiplied
    rhs: ScaledTensor
    quantizers: QuantizerSet  # x and kernel already updated by the forward


def _forward(
    product: _Product, operands: _Operands, for_backward: bool
) -> tuple[Array, _Residuals]:
    # The backward reads the forward's own float8 operands: nothing to skip without it.
    lhs, rhs, quantizer_set = operands
    lhs_q, x_quantizer = _quantize(quantizer_set.x, lhs)
    rhs_q, kernel_quantizer = _quantize(quantizer_set.kernel, rhs)
    out = _scaled_einsum(product.forward, lhs_q, rhs_q, quantizer_set.precision.fprop)
    quantizers = dataclasses.replace(quantizer_set, x=x_quantizer, kernel=kernel_quantizer)
    return out.astype(product.out_dtype), _Residuals(lhs_q, rhs_q, quantizers)


def _backward(product: _Product, residuals: _Residuals, grad: Array) -> _Operands:
    quantizers = residuals.quantizers
    # The output gradient quantized once (e5m2 under HYBRID), read by both backward GEMMs,
    # which sum over many terms: split (float32) accumulation, as the GEMMs' dgrad and wgrad.
    grad_q, dgrad_quantizer = _quantize(quantizers.dgrad, grad)
    precision = quantizers.precision
    d_lhs = _scaled_einsum(product.lhs_grad, grad_q, residuals.rhs, precision.dgrad)
    d_rhs = _scaled_einsum(product.rhs_grad, grad_q, residuals.lhs, precision.wgrad)
    new_state = dataclasses.replace(quantizers, dgrad=dgrad_quantizer)
    return _Operands(
        d_lhs.astype(product.lhs_dtype), d_rhs.astype(product.rhs_dtype), as_cotangent(new_state)
    )


_fp8_product: FusedOp[_Product, _Operands] = fused_op(_forward, _backward)


def fp8_logits(grouped: Array, key: Array, quantizer_set: QuantizerSet) -> Array:
    """``q . k`` ``[batch, kv_heads, group, q, kv]`` in float32 from float8 queries and keys.

    ``grouped``: the queries ``[batch, q, kv_heads, group, head_dim]``; ``key``: ``[batch,
    kv, kv_heads, head_dim]``.
    """
    # [batch, q, kv_heads, group, d] x [batch, kv, kv_heads, d] -> [batch, kv_heads, group, q, kv]
    specs = ("bqkgd,bskd->bkgqs", "bkgqs,bskd->bqkgd", "bkgqs,bqkgd->bskd")
    return _fp8_einsum(specs, grouped, key, quantizer_set, jnp.float32)


def fp8_context(probs: Array, value: Array, quantizer_set: QuantizerSet) -> Array:
    """``p . v`` ``[batch, q, kv_heads, group, head_dim]`` in ``value``'s dtype from float8
    probabilities ``[batch, kv_heads, group, q, kv]`` (float32 before quantization) and values
    ``[batch, kv, kv_heads, head_dim]``."""
    specs = ("bkgqs,bskd->bqkgd", "bqkgd,bskd->bkgqs", "bqkgd,bkgqs->bskd")
    return _fp8_einsum(specs, probs, value, quantizer_set, value.dtype)


def _fp8_einsum(
    specs: tuple[str, str, str], lhs: Array, rhs: Array, quantizer_set: QuantizerSet, out_dtype: Any
) -> Array:
    """The FP8 product of ``specs`` (forward, lhs gradient, rhs gradient einsums)."""
    product = _Product(*specs, out_dtype=out_dtype, lhs_dtype=lhs.dtype, rhs_dtype=rhs.dtype)
    return cast(Array, _fp8_product(product, _Operands(lhs, rhs, float32_state(quantizer_set))))
