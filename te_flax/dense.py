"""``dense``: a GEMM of ``x``'s trailing axes with a kernel's leading axes, FP8 or not."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from functools import partial
from typing import Any, NamedTuple, cast

import jax
import numpy as np
from jax import Array

from te_flax import _validation as check
from te_flax._stages import (
    constrained,
    dense_backward,
    dense_forward,
    input_uses,
    kernel_operand,
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
    quantize_operand,
)
from te_flax.sharding import LogicalAxes, vary_like, with_logical_constraint

__all__ = ["dense"]


@dataclasses.dataclass(frozen=True)
class _Config:
    n_contract: int
    input_axes: tuple[str | None, ...] | None
    kernel_axes: tuple[str | None, ...] | None
    output_axes: tuple[str | None, ...] | None
    kernel_dtype: Any
    bias_dtype: Any  # None without a bias


class _Residuals(NamedTuple):
    # FP8: the quantized operands as the backward GEMMs contract them (per-tensor: the forward
    # GEMM's own). Without FP8: x and the kernel themselves.
    lhs: GemmOperand | Array
    rhs: GemmOperand | Array
    quantizers: QuantizerSet  # x and kernel already updated by the forward


def _forward(
    config: _Config,
    x: Array,
    kernel: Array,
    bias: Array | None,
    quantizer_set: QuantizerSet,
    for_backward: bool = True,
) -> tuple[Array, _Residuals]:
    # The forward GEMM contracts x's trailing axes and the kernel's leading ones; wgrad then
    # contracts x's leading (token) axes, dgrad the kernel's trailing (feature) axes.
    n_batch = x.ndim - config.n_contract
    x = with_logical_constraint(x, config.input_axes)
    lhs, x_quantizer = quantize_operand(
        x, quantizer_set.x, x.dtype, n_batch, input_uses(for_backward)
    )
    lhs = constrained(lhs, config.input_axes)
    rhs, kernel_quantizer = kernel_operand(
        kernel, quantizer_set.kernel, x.dtype, config.n_contract, for_backward, config.kernel_axes
    )
    # [batch..., K...] x [K..., features...] -> [batch..., features...]
    out = dense_forward(lhs, rhs, config.n_contract, x.dtype, bias, quantizer_set.precision)
    out = with_logical_constraint(out, config.output_axes)
    fp8 = not quantizer_set.is_noop
    residuals = _Residuals(
        lhs=saved_operand(lhs, LEADING, quantizer_set.checkpoint_name) if fp8 else x,
        rhs=saved_operand(rhs, TRAILING, quantizer_set.checkpoint_name) if fp8 else kernel,
        quantizers=dataclasses.replace(quantizer_set, x=x_quantizer, kernel=kernel_quantizer),
    )
    return out, residuals


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _dense(
    config: _Config, x: Array, kernel: Array, bias: Array | None, quantizer_set: QuantizerSet
) -> Array:
    # Not differentiated: no quantization for the backward GEMMs.
    return _forward(config, x, kernel, bias, quantizer_set, for_backward=False)[0]


def _backward(
    config: _Config, residuals: _Residuals, grad: Array
) -> tuple[Array, Array, Array | None, QuantizerSet]:
    quantizers = residuals.quantizers
    grad = with_logical_constraint(grad, config.output_axes)
    lhs: GemmOperand
    rhs: GemmOperand
    if quantizers.is_noop:
        # Without FP8 the residuals are x and the kernel themselves.
        x, kernel = cast(Array, residuals.lhs), cast(Array, residuals.rhs)
        lhs, rhs = ScaledTensor(x), ScaledTensor(kernel.astype(x.dtype))
    else:
        lhs, rhs = cast(GemmOperand, residuals.lhs), cast(GemmOperand, residuals.rhs)
    compute_dtype = grad.dtype
    grads = dense_backward(
        grad,
        lhs,
        rhs,
        quantizers.dgrad,
        config.n_contract,
        compute_dtype,
        config.kernel_dtype,
        config.bias_dtype,
        grad_axes=config.output_axes,
        precision=quantizers.precision,
    )
    d_x = with_logical_constraint(grads.lhs, config.input_axes)
    d_kernel = with_logical_constraint(grads.rhs, config.kernel_axes)
    new_state = dataclasses.replace(quantizers, dgrad=grads.dgrad_quantizer)
    return d_x, d_kernel, grads.bias, as_cotangent(new_state)


_dense.defvjp(_forward, _backward)


def _contraction_size(
    x: Array, kernel: Array, contracting_dims: tuple[Sequence[int], Sequence[int]] | None
) -> int:
    """How many trailing axes of x contract with as many leading axes of kernel."""
    if contracting_dims is None:
        contracting_dims = ((x.ndim - 1,), (0,))
    x_dims: tuple[int, ...] | None
    kernel_dims: tuple[int, ...] | None
    try:
        x_dims, kernel_dims = (tuple(dims) for dims in contracting_dims)
    except (TypeError, ValueError):
        x_dims = kernel_dims = None
    if (
        x_dims is None
        or kernel_dims is None
        or not all(
            isinstance(d, int | np.integer) and not isinstance(d, bool)
            for d in x_dims + kernel_dims
        )
    ):
        raise TypeError(
            "contracting_dims must be a pair of tuples of ints, e.g. ((x.ndim - 1,), (0,)); "
            f"got {contracting_dims!r}"
        )
    for dims, array, name in ((x_dims, x, "x"), (kernel_dims, kernel, "kernel")):
        for d in dims:
            if not -array.ndim <= d < array.ndim:
                raise ValueError(
                    f"contracting_dims axis {d} is out of range for {name} with {array.ndim} "
                    f"dimensions (shape {array.shape})"
                )
    x_dims = tuple(int(d) % x.ndim for d in x_dims)
    kernel_dims = tuple(int(d) % kernel.ndim for d in kernel_dims)
    n = len(x_dims)
    trailing = tuple(range(x.ndim - n, x.ndim))
    leading = tuple(range(n))
    if n == 0 or len(kernel_dims) != n or x_dims != trailing or kernel_dims != leading:
        raise ValueError(
            f"contracting_dims={contracting_dims!r} is not supported for x of shape {x.shape} "
            f"and kernel of shape {kernel.shape}: x must contract its trailing axes and kernel "
            f"its leading axes, in order, e.g. contracting_dims=(({x.ndim - 1},), (0,))"
        )
    x_sizes, kernel_sizes = x.shape[x.ndim - n :], kernel.shape[:n]
    if x_sizes != kernel_sizes:
        raise ValueError(
            f"kernel has {kernel_sizes} input features but x has {x_sizes} "
            f"(x.shape[{x.ndim - n}:]); check the kernel's leading axes or contracting_dims"
        )
    if kernel.ndim == n:
        raise ValueError(
            f"kernel of shape {kernel.shape} has no output axes; it must be [K..., features...]"
        )
    return n


def dense(
    x: Array,
    kernel: Array,
    bias: Array | None = None,
    contracting_dims: tuple[Sequence[int], Sequence[int]] | None = None,
    transpose_batch_sequence: bool = False,
    input_axes: LogicalAxes = None,
    kernel_axes: LogicalAxes = None,
    output_axes: LogicalAxes = None,
    quantizer_set: QuantizerSet = noop_quantizer_set,
) -> Array:
    """``x . kernel + bias``, contracting x's trailing axes with the kernel's leading axes.

    With an FP8 ``quantizer_set`` x and the kernel are quantized directly to float8 for the
    forward GEMM and the output gradient for the two backward GEMMs; the new quantizer state
    comes back as the gradient of ``quantizer_set``. Block-scaled sets (MXFP8, NVFP4) quantize
    each tensor once per GEMM that contracts it, so the contracted sizes must be multiples of
    the block (input and output features; the tokens when differentiated).

    Args:
      x: ``[batch..., K...]``.
      kernel: ``[K..., features...]``.
      bias: ``[features...]`` or None (default).
      contracting_dims: ``(x_dims, kernel_dims)``; None (default) contracts x's last axis with
        kernel axis 0. x's dims must be its trailing axes and the kernel's its leading ones.
      transpose_batch_sequence: the input is ``[seq, batch, ...]`` (default False). It changes
        no math; the layout that sharding sees is given by the ``*_axes`` arguments.
      input_axes: logical axes of x (and of its gradient).
      kernel_axes: logical axes of the (quantized) kernel and of its gradient.
      output_axes: logical axes of the output (and of the incoming gradient).
      quantizer_set: the GEMM's quantizers (default ``noop_quantizer_set``: no FP8).

    Returns:
      ``[batch..., features...]`` in ``x.dtype``.

    Example usage::

      >>> import jax.numpy as jnp
      >>> from te_flax.dense import dense
      >>> dense(jnp.ones((2, 5, 8)), jnp.ones((8, 4)), bias=jnp.ones(4))[0, 0]
      Array([9., 9., 9., 9.], dtype=float32)
    """
    check.check_floating(x, "x")
    check.check_floating(kernel, "kernel")
    n_contract = _contraction_size(x, kernel, contracting_dims)
    if bias is not None:
        check.check_floating(bias, "bias")
        check.check_shape(
            bias, kernel.shape[n_contract:], "bias", "it matches the kernel's output axes"
        )
    check.check_bool(transpose_batch_sequence, "transpose_batch_sequence")
    quantizer_set = check.check_quantizer_set(quantizer_set)
    out_ndim = x.ndim - n_contract + kernel.ndim - n_contract
    config = _Config(
        n_contract=n_contract,
        input_axes=check.check_axes(input_axes, x.ndim, "input_axes", "x"),
        kernel_axes=check.check_axes(kernel_axes, kernel.ndim, "kernel_axes", "kernel"),
        output_axes=check.check_axes(output_axes, out_ndim, "output_axes", "the output"),
        kernel_dtype=kernel.dtype,
        bias_dtype=None if bias is None else bias.dtype,
    )
    kernel, bias = vary_like(x, (kernel, bias))
    return _dense(config, x, kernel, bias, float32_state(quantizer_set))
