"""The GEMM stages: the forward GEMM of a dense op and its two backward GEMMs (dgrad, wgrad).

One ``lax.dot_general`` on two float8 operands with the product of their scales applied to the
result (the form XLA turns into a cuBLASLt FP8 GEMM) for per-tensor FP8; block-scaled GEMMs for
MXFP8 and NVFP4; and blockwise FP8's GEMM, which applies per-block scales inside K, exactly in
XLA everywhere (``blockwise_gemm_exact``) or by a Pallas kernel behind the kernel switch.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import Array, lax
from jax.sharding import PartitionSpec
from jax.typing import DTypeLike

from te_flax._ops.gemm_operands import grad_operand, leading_ones
from te_flax._ops.kernels import GradOperand, dispatch
from te_flax._ops.kernels.blockwise import blockwise_gemm_kernel, whole_operands
from te_flax._ops.kernels.blockwise_mosaic import (
    blockwise_gemm_kernel as blockwise_gemm_kernel_mosaic,
)
from te_flax._ops.kernels.switch import MOSAIC
from te_flax.quantize import (
    BlockOperand,
    BlockScaledTensor,
    GemmOperand,
    GemmPrecision,
    Quantizer,
    ScaledTensor,
    block_scaling,
)
from te_flax.sharding import LogicalAxes, gemm_out_sharding, spec_of

__all__ = [
    "DenseGrads",
    "blockwise_gemm_exact",
    "dense_backward",
    "forward_contracting",
    "gemm",
    "gemm_out_specs",
    "operand_ndim",
]


def _scaled_matmul(
    lhs: Array, rhs: Array, lhs_scales: Array, rhs_scales: Array, *, out_dtype: DTypeLike
) -> Array:
    # JAX's block-scaled GEMM: cuDNN on Blackwell; XLA dequantizes and runs a cuBLAS GEMM on
    # older GPUs.
    return jax.nn.scaled_matmul(lhs, rhs, lhs_scales, rhs_scales, preferred_element_type=out_dtype)


def _dequantized_matmul(
    lhs: Array, rhs: Array, lhs_scales: Array, rhs_scales: Array, *, out_dtype: DTypeLike
) -> Array:
    """``_scaled_matmul`` for GPUs without block-scaled GEMMs (before Blackwell): both operands
    dequantized to ``out_dtype`` by their block scales, then one cuBLAS GEMM.

    XLA does the same with ``jax.nn.scaled_matmul`` there, but from jax 0.12 on its expansion
    leaves the dot inside a loop fusion instead of a cuBLAS call (a deviceless H100 compile of
    a block-scaled step has no ``__cublas$lt$matmul`` at all), so te_flax writes it out.
    """

    def dequantize(data: Array, scales: Array) -> Array:
        block = data.shape[-1] // scales.shape[-1]
        # [1, rows, K] -> [1, rows, K / block, block], times each block's scale.
        blocks = data.astype(out_dtype).reshape(*scales.shape, block)
        return (blocks * scales.astype(out_dtype)[..., None]).reshape(data.shape)

    # The barrier keeps the quantized values: XLA (which may compute in excess precision)
    # would otherwise fold the cast to the narrow type and back into nothing.
    lhs, rhs, lhs_scales, rhs_scales = lax.optimization_barrier((lhs, rhs, lhs_scales, rhs_scales))
    lhs_values, rhs_values = dequantize(lhs, lhs_scales)[0], dequantize(rhs, rhs_scales)[0]
    # [M, K] x [N, K] -> [M, N], returned as [1, M, N]
    contracting = ((1,), (1,))
    product = lax.dot_general(
        lhs_values,
        rhs_values,
        (contracting, ((), ())),
        preferred_element_type=out_dtype,
        out_sharding=gemm_out_sharding(lhs_values, rhs_values, contracting),
    )
    return product[None]


def _block_scaled_gemm_for_cuda() -> Callable[..., Array]:
    """The CUDA branch of a block-scaled GEMM: cuDNN's block-scaled GEMM through
    ``jax.nn.scaled_matmul`` where the local GPU has one (compute capability 10 and newer),
    else (Hopper and older, or a deviceless compile for the H100) ``_dequantized_matmul``."""
    try:
        devices = jax.devices("cuda")
    except RuntimeError:  # no CUDA backend: a deviceless compile for the H100 target
        devices = []
    capability = str(getattr(devices[0], "compute_capability", "0")) if devices else "0"
    if float(capability) >= 10:
        return _scaled_matmul
    return _dequantized_matmul


def _scaled_dot(
    lhs: Array, rhs: Array, lhs_scales: Array, rhs_scales: Array, *, out_dtype: DTypeLike
) -> Array:
    # The same GEMM through lax.scaled_dot, which every XLA backend can lower
    # (jax.nn.scaled_matmul has GPU lowerings only).
    return lax.scaled_dot(
        lhs,
        rhs,
        lhs_scale=lhs_scales,
        rhs_scale=rhs_scales,
        dimension_numbers=(((2,), (2,)), ((0,), (0,))),
        preferred_element_type=out_dtype,
    )


def _accumulation_dtype(out_dtype: DTypeLike) -> DTypeLike:
    """The dtype a low-precision GEMM accumulates and is scaled in before its output dtype.

    float16 (largest value 65504) cannot hold the product of two quantized operands before
    their scales are applied (e4m3 reaches 448, an NVFP4 element 6 * 448), so a float16 GEMM
    runs in float32; bfloat16 has float32's range.
    """
    return jnp.float32 if jnp.dtype(out_dtype) == jnp.float16 else out_dtype


def blockwise_gemm_exact(
    lhs: Array, lhs_scale_inv: Array, rhs: Array, rhs_scale_inv: Array, out_dtype: DTypeLike
) -> Array:
    """Blockwise FP8's GEMM in XLA, exactly the recipe's math: ``lhs [M, K] . rhs [N, K]^T``.

    K is split into 128-wide chunks; each chunk's FP8 product is accumulated in float32 (one
    batched GEMM over the chunks), multiplied by the chunk's scales of both operands, and the
    chunks are summed in float32; the sum is rounded to ``out_dtype`` once. Scales are
    ``[rows, K / 128]`` or, for 128x128 blocks, ``[rows / 128, K / 128]``. The partial products
    take ``K / 128`` times the output's memory (the Pallas kernel keeps them in registers).
    """
    m, k = lhs.shape
    n = rhs.shape[0]
    chunks = k // block_scaling.FP8_BLOCK
    # [M, C, 128] x [N, C, 128] -> [C, M, N], split accumulation (full float32) within a chunk.
    partial_products = lax.dot_general(
        lhs.reshape(m, chunks, block_scaling.FP8_BLOCK),
        rhs.reshape(n, chunks, block_scaling.FP8_BLOCK),
        (((2,), (2,)), ((1,), (1,))),
        precision=lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )
    lhs_scales = block_scaling.expand_tile_rows(lhs_scale_inv, m).astype(jnp.float32)  # [M, C]
    rhs_scales = block_scaling.expand_tile_rows(rhs_scale_inv, n).astype(jnp.float32)  # [N, C]
    scaled = partial_products * lhs_scales.T[:, :, None] * rhs_scales.T[:, None, :]
    return jnp.sum(scaled, axis=0).astype(out_dtype)  # [M, N]


def _blockwise_gemm(lhs: BlockScaledTensor, rhs: BlockScaledTensor, out_dtype: DTypeLike) -> Array:
    """Blockwise FP8's GEMM: the Pallas kernel where the switch selects it, else the exact XLA
    form. The kernel takes one scale per row and chunk of each operand (a 128x128-block
    weight's scale grid repeated over its rows, 1/128 of its float8 bytes)."""

    def kernel(
        l_data: Array, l_scale: Array, r_data: Array, r_scale: Array, *, interpret: bool
    ) -> Array:
        l_scale = block_scaling.expand_tile_rows(l_scale, l_data.shape[0])
        r_scale = block_scaling.expand_tile_rows(r_scale, r_data.shape[0])
        mosaic = "blockwise_gemm" in MOSAIC
        gemm = blockwise_gemm_kernel_mosaic if mosaic else blockwise_gemm_kernel
        return gemm(l_data, l_scale, r_data, r_scale, out_dtype, interpret=interpret)

    operands = (lhs.data, lhs.scale_inv, rhs.data, rhs.scale_inv)
    return dispatch(
        "blockwise_gemm",
        kernel,
        partial(blockwise_gemm_exact, out_dtype=out_dtype),
        *operands,
        supported=whole_operands(),
    )


def _block_gemm(lhs: BlockScaledTensor, rhs: BlockScaledTensor, out_dtype: DTypeLike) -> Array:
    """``lhs [M, K] . rhs [N, K]`` with block scales -> ``[*lhs.row_shape, *rhs.row_shape]``.

    A Hadamard transform along K (NVFP4's weight-gradient operands) cancels in the product only
    when both operands have it. Float32 block scales are blockwise FP8's (``Float8BlockScaling``).
    """
    if lhs.scale_inv.dtype == jnp.float32:
        assert rhs.scale_inv.dtype == jnp.float32, "blockwise FP8 with another block scaling"
        out = _blockwise_gemm(lhs, rhs, out_dtype)
        return out.reshape(lhs.row_shape + rhs.row_shape)
    if lhs.has_rht_applied != rhs.has_rht_applied:
        raise ValueError(
            "an NVFP4 GEMM multiplies an operand quantized after the random Hadamard transform "
            "with one quantized without it, and the transform only cancels when both have it: "
            "give the x and dgrad quantizers of a set the same use_rht (build sets with "
            "QuantizerFactory.create_set(fp8_recipe=NVFP4BlockScaling(...)))"
        )
    if lhs.data.shape[-1] == 0:
        # A sum over no terms (the weight gradient of a batch of 0 tokens) is 0; the
        # block-scaled GEMMs cannot take K = 0 (they divide K by the number of block scales).
        empty = lax.dot_general(
            lhs.data.astype(out_dtype), rhs.data.astype(out_dtype), (((1,), (1,)), ((), ()))
        )  # [M, 0] x [N, 0] -> [M, N] of zeros
        return empty.reshape(lhs.row_shape + rhs.row_shape)
    operands = (lhs.data[None], rhs.data[None], lhs.scale_inv[None], rhs.scale_inv[None])
    # The output dtype is also the dequantization dtype of an emulated GEMM: block-scaled values
    # are exact in bfloat16, so a bfloat16 step runs bfloat16 GEMMs there.
    gemm_dtype = _accumulation_dtype(out_dtype)
    out = lax.platform_dependent(
        *operands,
        cuda=partial(_block_scaled_gemm_for_cuda(), out_dtype=gemm_dtype),
        default=partial(_scaled_dot, out_dtype=gemm_dtype),
    )[0]
    if lhs.tensor_scale_inv is not None:
        assert rhs.tensor_scale_inv is not None, "NVFP4 operands carry a tensor scale"
        tensor_scale_inv = lhs.tensor_scale_inv * rhs.tensor_scale_inv
        out = out.astype(jnp.float32) * tensor_scale_inv
    return out.astype(out_dtype).reshape(lhs.row_shape + rhs.row_shape)


def _contraction_layout(
    operand: ScaledTensor, axes: tuple[int, ...]
) -> tuple[Array, tuple[int, ...]]:
    """The operand's data for a GEMM contracting ``axes``, and the axes in that data.

    An operand with a ``transposed`` layout, contracted along its leading axes, gives that
    layout, in which they are the last: a GEMM contracting its operands' last axes needs no
    transpose (cuBLASLt's FP8 GEMMs take only that layout).
    """
    data, transposed = operand.data, operand.transposed
    n = len(axes)
    if transposed is None or tuple(axes) != tuple(range(n)) or n == data.ndim:
        return data, tuple(axes)
    assert transposed.shape == data.shape[n:] + data.shape[:n], "transposed at another split"
    return transposed, tuple(range(data.ndim - n, data.ndim))


def gemm(
    lhs: GemmOperand,
    rhs: GemmOperand,
    contracting: tuple[tuple[int, ...], tuple[int, ...]],
    out_dtype: DTypeLike,
    fp8_precision: lax.Precision,
    *,
    bias: Array | None = None,
    like: Array | None = None,
    defer_scale: bool = False,
) -> tuple[Array, Array | None]:
    """``lhs . rhs`` over ``contracting`` (+ ``bias``): the one GEMM stage, a float8 GEMM when
    both operands carry a scale.

    Block-scaled operands use the quantization they prepared for this contraction; per-tensor
    operands are read in the layout the contraction needs (``_contraction_layout``). ``bias``
    (the output's trailing axes) is added in the output dtype, so that XLA fuses it as the
    GEMM's BIAS epilogue (cuBLASLt takes no float32 bias for FP8 GEMMs). ``like``: the primal
    whose cotangent this product is (its sharding is the product's, see
    ``gemm_out_sharding``). Returns ``(product, scale)``: ``scale`` is None but with
    ``defer_scale`` for a per-tensor FP8 product, which then comes back without its scale.

    ``defer_scale`` is for a consumer that folds the scalar into a pass of its own. A GEMM
    contracting a sharded axis (dgrad of a column-parallel GEMM under tensor parallelism) is
    followed by an all-reduce of its partial sums; XLA folds the scale into the FP8 GEMM's
    alpha only when the multiply follows the GEMM directly, so after the all-reduce it would be
    one more pass over the whole [tokens, hidden] result on every device. A float16 output
    cannot hold the unscaled product: it is always scaled here.
    """
    if isinstance(lhs, BlockOperand):
        assert isinstance(rhs, BlockOperand), "mixed block-scaled and per-tensor GEMM"
        lhs_matrix = lhs.for_contraction(contracting[0])
        out = _block_gemm(lhs_matrix, rhs.for_contraction(contracting[1]), out_dtype)
        return _plus_bias(out, bias), None
    assert not isinstance(rhs, BlockOperand), "mixed block-scaled and per-tensor GEMM"
    fp8 = lhs.scale_inv is not None or rhs.scale_inv is not None
    # float8 x float8 with the scales applied to the product: XLA folds the multiply into the
    # cuBLASLt FP8 GEMM as its alpha. Precision DEFAULT selects fast accumulation there.
    gemm_dtype = _accumulation_dtype(out_dtype) if fp8 else out_dtype
    lhs_data, lhs_axes = _contraction_layout(lhs, contracting[0])
    rhs_data, rhs_axes = _contraction_layout(rhs, contracting[1])
    product = lax.dot_general(
        lhs_data,
        rhs_data,
        ((lhs_axes, rhs_axes), ((), ())),
        precision=fp8_precision if fp8 else None,
        preferred_element_type=gemm_dtype,
        out_sharding=gemm_out_sharding(lhs_data, rhs_data, (lhs_axes, rhs_axes), like),
    )
    if not fp8:
        return _plus_bias(product, bias), None
    scale = _product_scale(lhs, rhs)
    if defer_scale and gemm_dtype == out_dtype:
        assert bias is None, "a deferred scale applies before the bias"
        return product, scale
    return _plus_bias((product * scale.astype(gemm_dtype)).astype(out_dtype), bias), None


def _plus_bias(out: Array, bias: Array | None) -> Array:
    return out if bias is None else out + leading_ones(bias.astype(out.dtype), out)


def forward_contracting(
    lhs: GemmOperand, n_contract: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A forward GEMM's contraction: ``lhs[batch..., K...]``'s ``n_contract`` trailing axes
    with ``rhs[K..., F...]``'s as many leading ones."""
    lhs_ndim = operand_ndim(lhs)
    return (tuple(range(lhs_ndim - n_contract, lhs_ndim)), tuple(range(n_contract)))


def gemm_out_specs(
    x: Array, kernel: Array, n_contract: int = 1, norm_output: bool = False
) -> PartitionSpec | tuple[PartitionSpec | None, PartitionSpec] | None:
    """The ``out_specs`` of a fused op that ends in the GEMM of ``x``'s ``n_contract`` trailing
    axes by ``kernel``'s leading ones: that GEMM's output sharding (``gemm_out_sharding``), and
    with ``norm_output`` also x's, which the norm output keeps."""
    contracting = (range(x.ndim - n_contract, x.ndim), range(n_contract))
    out_spec = gemm_out_sharding(x, kernel, contracting)
    return (out_spec, spec_of(x)) if norm_output else out_spec


def _primal_layout(operand: GemmOperand) -> Array | None:
    """A per-tensor operand's data in the layout of the tensor it was made from (None for a
    block-scaled operand, whose matrices are flattened)."""
    return operand.data if isinstance(operand, ScaledTensor) else None


def _product_scale(lhs: ScaledTensor, rhs: ScaledTensor) -> Array:
    """The float32 scale that dequantizes the product of two per-tensor float8 operands."""
    assert lhs.scale_inv is not None and rhs.scale_inv is not None, "mixed FP8/non-FP8 GEMM"
    return lhs.scale_inv * rhs.scale_inv


_DEFAULT_PRECISION = GemmPrecision()


def operand_ndim(operand: GemmOperand) -> int:
    """The rank of the tensor an operand was made from."""
    return len(operand.shape) if isinstance(operand, BlockOperand) else operand.data.ndim


class DenseGrads(NamedTuple):
    lhs: Array
    rhs: Array
    bias: Array | None
    dgrad_quantizer: Quantizer | None
    # The scale ``lhs`` still needs (``dense_backward(defer_dgrad_scale=True)``), else None.
    lhs_scale: Array | None = None


def dense_backward(
    grad: Array | GradOperand,
    lhs: GemmOperand,
    rhs: GemmOperand,
    grad_quantizer: Quantizer | None,
    n_contract: int,
    lhs_dtype: DTypeLike,
    rhs_dtype: DTypeLike,
    bias_dtype: DTypeLike | None = None,
    grad_axes: LogicalAxes = None,
    precision: GemmPrecision = _DEFAULT_PRECISION,
    defer_dgrad_scale: bool = False,
) -> DenseGrads:
    """dgrad and wgrad of a forward ``gemm`` (and dbias when ``bias_dtype`` is given).

    ``grad`` (``[batch..., F...]``) is quantized once with ``grad_quantizer`` and feeds both
    GEMMs, which reuse the operands saved by the forward: ``dlhs = q(grad) . q(rhs)`` and
    ``drhs = q(lhs) . q(grad)``. A block-scaled ``grad`` is quantized once for each GEMM (along
    its features for dgrad, along its tokens for wgrad), and the saved block-scaled operands
    are the ones the forward prepared for these contractions. ``grad_axes``, the logical axes
    ``grad`` arrives in, keep its quantization on those shards, so that a gather for the GEMMs
    moves float8 (see ``constrained``). A ``GradOperand`` is used as prepared (by a kernel
    that made it with its producer); ``grad_quantizer``, ``bias_dtype`` and ``grad_axes`` are
    then not used. Per-tensor FP8 GEMMs run with ``precision.dgrad`` and ``precision.wgrad``.

    ``defer_dgrad_scale``: a per-tensor FP8 ``dlhs`` is returned without its scale, which is
    then ``lhs_scale`` (see ``gemm``'s ``defer_scale``), for a consumer that applies it in its
    own pass.
    """
    n_features = operand_ndim(rhs) - n_contract
    if not isinstance(grad, GradOperand):
        grad = grad_operand(grad, grad_quantizer, n_features, bias_dtype, grad_axes)
    grad_gemm_operand = grad.operand
    n_batch = operand_ndim(grad_gemm_operand) - n_features
    # By default the backward GEMMs accumulate with split (HIGHEST) precision: gradients are
    # summed over many tokens, where fast accumulation's error would grow.
    grad_ndim = n_batch + n_features
    feature_axes_of_grad = tuple(range(n_batch, grad_ndim))
    feature_axes_of_rhs = tuple(range(n_contract, n_contract + n_features))
    # [batch..., F...] x [K..., F...] -> [batch..., K...]
    dgrad_axes = (feature_axes_of_grad, feature_axes_of_rhs)
    # Each gradient takes its primal's sharding (JAX asks for one under Explicit mesh axes).
    lhs_like, rhs_like = _primal_layout(lhs), _primal_layout(rhs)
    d_lhs, d_lhs_scale = gemm(
        grad_gemm_operand,
        rhs,
        dgrad_axes,
        lhs_dtype,
        precision.dgrad,
        like=lhs_like,
        defer_scale=defer_dgrad_scale,
    )
    # [batch..., K...] x [batch..., F...] -> [K..., F...]
    batch_axes = tuple(range(n_batch))
    wgrad_axes = (batch_axes, batch_axes)
    d_rhs, _ = gemm(lhs, grad_gemm_operand, wgrad_axes, rhs_dtype, precision.wgrad, like=rhs_like)
    return DenseGrads(d_lhs, d_rhs, grad.bias, grad.quantizer, d_lhs_scale)
