"""The stages every op's forward and backward rule is built from.

Normalize (and its backward), quantize an operand, GEMM, bias. ``layernorm``, ``dense``,
``layernorm_dense`` and ``layernorm_mlp`` compose these; none of them re-implements a stage.
All functions here are pure and run inside ``jax.custom_vjp`` rules.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import Array, lax
from jax.ad_checkpoint import checkpoint_name
from jax.experimental.layout import Layout, with_layout_constraint
from jax.typing import DTypeLike

from te_flax._ops.activations import ClampedSwigluParams, activation_backward, activation_forward
from te_flax._ops.kernels import (
    GradOperand,
    activation_grad_operand,
    activation_quantize_operand,
    dispatch,
    norm_backward_grads,
    norm_quantize_operand,
    tiled_quantize_operand,
)
from te_flax._ops.kernels.blockwise import blockwise_gemm_kernel, whole_operands
from te_flax.quantize import (
    LEADING,
    TRAILING,
    BlockOperand,
    BlockScaledTensor,
    DelayedScaleQuantizer,
    GemmOperand,
    GemmPrecision,
    Quantizer,
    ScaledTensor,
    block_scaling,
    quantize_operand,
)
from te_flax.sharding import (
    LogicalAxes,
    gemm_out_sharding,
    on_auto_axes,
    sharded_along,
    spec_of,
    whole_last_axis,
    with_logical_constraint,
)

__all__ = [
    "GradOperand",
    "NormSpec",
    "NormStats",
    "activation_grad",
    "activation_operand",
    "activation_output",
    "apply_norm",
    "blockwise_gemm_exact",
    "constrained",
    "dense_backward",
    "dense_forward",
    "grad_operand",
    "input_uses",
    "kernel_operand",
    "kernel_uses",
    "norm_operand",
    "normalize",
    "normalize_backward",
    "one_pass_layouts",
    "run_op",
    "saved_operand",
    "sum_to_bias",
]


def run_op(
    op: Callable[..., Any],
    config: Any,
    operands: tuple[Any, ...],
    kernel: Array,
    block_scaled: bool,
    n_contract: int = 1,
    norm_output: bool = False,
) -> Any:
    """``op(config, *operands)``: a fused op's ``custom_vjp``, ``operands[0]`` its input x.

    On ``Explicit`` mesh axes (``config.grad_specs`` is set there) a block-scaled op runs with
    the axes as ``Auto`` inside (``sharding.on_auto_axes``): its quantization reshapes sharded
    axes into blocks, which JAX cannot type axis by axis. Its output then takes the sharding of
    the GEMM of x (its ``n_contract`` trailing axes) by ``kernel`` that the op ends in, and its
    norm output (``norm_output``) x's.
    """
    if config.grad_specs is None or not block_scaled:
        return op(config, *operands)
    x = operands[0]
    contracting = (range(x.ndim - n_contract, x.ndim), range(n_contract))
    out_spec = gemm_out_sharding(x, kernel, contracting)
    out_specs = (out_spec, spec_of(x)) if norm_output else out_spec
    config = dataclasses.replace(config, grad_specs=None)
    return on_auto_axes(partial(op, config), out_specs, *operands)


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


def _leading_ones(vector: Array, x: Array) -> Array:
    """``vector`` reshaped to broadcast against the trailing axes of ``x``, and sharded as
    they are (``sharded_along``)."""
    vector = sharded_along(vector, x)
    return vector.reshape((1,) * (x.ndim - vector.ndim) + vector.shape)


def _effective_gamma(gamma: Array, spec: NormSpec, x: Array | None = None) -> Array:
    """The factor the normalized ``x`` is multiplied by (``1 + gamma`` when zero-centered),
    float32, shaped to broadcast against ``x`` (None: the 1-D vector)."""
    gamma = gamma.astype(jnp.float32)
    if x is not None:
        gamma = _leading_ones(gamma, x)
    return gamma + 1.0 if spec.zero_centered_gamma else gamma


def _normalized(x: Array, stats: NormStats) -> Array:
    x = x.astype(jnp.float32)
    centered = x if stats.mean is None else x - stats.mean
    return centered * stats.rsigma


def apply_norm(
    x: Array, stats: NormStats, gamma: Array, beta: Array | None, spec: NormSpec
) -> Array:
    """The norm output in float32 from saved statistics (no reduction over x)."""
    y = _normalized(x, stats) * _effective_gamma(gamma, spec, x)
    return y if beta is None else y + _leading_ones(beta.astype(jnp.float32), x)


def normalize(
    x: Array, gamma: Array, beta: Array | None, spec: NormSpec
) -> tuple[Array, NormStats]:
    """Layernorm or rmsnorm over the last axis, in float32, and the statistics for backward."""
    # Statistics in float32 whatever x's dtype: bf16 sums over thousands of features lose the
    # low bits that the variance is made of.
    x = whole_last_axis(x)
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
        d_x_hat = d_out32 * _effective_gamma(gamma, spec, x)
        projection = jnp.mean(d_x_hat * x_hat, axis=-1, keepdims=True)
        if spec.norm_type == "layernorm":
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
        _effective_gamma(gamma, spec),
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
    spec: NormSpec,
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
        ln = apply_norm(x, stats, gamma, beta, spec)  # f32[batch..., hidden]
        return one_pass_layouts(quantize_operand(ln, quantizer, x.dtype, x.ndim - 1, uses), uses)

    # Per-tensor FP8 on GPUs: one Pallas kernel reads x and writes the float8 operand and the
    # amax (see te_flax._ops.kernels); elsewhere, and for other quantizers, the XLA stage.
    gamma_1d = _effective_gamma(gamma, spec)  # f32[hidden]
    beta_1d = None if beta is None else beta.astype(jnp.float32)
    operand, new_quantizer = norm_quantize_operand(
        x, stats.mean, stats.rsigma, gamma_1d, beta_1d, quantizer, xla_stage
    )
    return constrained(operand, axes, source_axes), new_quantizer


def constrained(
    operand: GemmOperand, axes: LogicalAxes, source_axes: LogicalAxes = None
) -> GemmOperand:
    """A per-tensor operand with its data constrained to the logical ``axes``.

    With ``source_axes`` (the layout of the tensor the operand was quantized from) the data is
    first constrained to that layout: each device quantizes its own shard, and the all-gather
    that the GEMM's layout ``axes`` may need (the sequence under sequence parallelism) moves
    float8 rather than the float32 values before the cast. The scale is the same either way:
    the amax of a sharded array under ``jit`` is taken over all its shards.

    Block-scaled operands are flattened matrices, which the tensor's axes do not describe;
    they follow the sharding of the tensor they were quantized from. So does a ``transposed``
    layout, which only the Pallas kernels write (under ``"auto"`` only in programs that XLA
    does not partition).
    """
    if isinstance(operand, BlockOperand):
        return operand
    data = with_logical_constraint(operand.data, source_axes)
    return operand._replace(data=with_logical_constraint(data, axes))


# ----------------------------------------------------------------------------- GEMMs


def input_uses(for_backward: bool) -> tuple[str, ...]:
    """The block-scaled layouts of a GEMM input ``[tokens..., features...]``: contracted along
    its features by the forward GEMM and, when differentiated, along its tokens by wgrad."""
    return (TRAILING, LEADING) if for_backward else (TRAILING,)


def kernel_uses(for_backward: bool) -> tuple[str, ...]:
    """The block-scaled layouts of a kernel ``[inputs..., outputs...]``: contracted along its
    inputs by the forward GEMM and, when differentiated, along its outputs by dgrad."""
    return (LEADING, TRAILING) if for_backward else (LEADING,)


def saved_operand(operand: GemmOperand, use: str, name: str | None) -> GemmOperand:
    """A quantized GEMM operand as the backward keeps it: ``operand.keep(use)``, named ``name``
    with ``jax.ad_checkpoint.checkpoint_name`` when one is given (TransformerEngine's
    quantization checkpoint name), so that a ``jax.checkpoint`` policy can save the float8
    copy instead of recomputing the quantization in the backward."""
    kept = operand.keep(use)
    return kept if name is None else checkpoint_name(kept, name)


def one_pass_layouts(
    quantized: tuple[GemmOperand, Quantizer | None],
    uses: tuple[str, ...],
    pin_row_major: bool = False,
) -> tuple[GemmOperand, Quantizer | None]:
    """An XLA stage's delayed-scaling float8 operand, kept for XLA to write in one pass with
    its amax.

    The data does not depend on the amax there, so XLA can compute both in one fusion of the
    tensor's producer; but a reduction (the amax) and a transpose (the layout a ``LEADING``
    GEMM reads) do not share a fusion, and XLA puts the cast with the transpose: the tensor is
    then read twice in high precision. A barrier (no copy) on the data keeps the transpose to
    a pass over the float8 data.

    ``pin_row_major`` also pins the data's layout, for a kernel sliced from a stack by a scan
    (``kernel_operand``): otherwise XLA's layout assignment moves the transpose up to the
    float32 operand, i.e. transposes the whole stacked parameter before the loop (8 bytes per
    element; in the example GPT's scanned step at hidden 4096, 3 GiB of 39). Not in a program
    partitioned over a mesh, where the pinned layout changes which layouts XLA gathers.
    """
    operand, new_quantizer = quantized
    if (
        LEADING in uses
        and isinstance(operand, ScaledTensor)
        and operand.scale_inv is not None
        and isinstance(new_quantizer, DelayedScaleQuantizer)
    ):
        data = operand.data
        mesh = jax.sharding.get_abstract_mesh()
        if pin_row_major and (mesh.empty or mesh.size == 1):
            data = with_layout_constraint(data, Layout(major_to_minor=tuple(range(data.ndim))))
        operand = operand._replace(data=lax.optimization_barrier(data))
    return operand, new_quantizer


def kernel_operand(
    kernel: Array,
    quantizer: Quantizer | None,
    dtype: DTypeLike,
    n_contract: int,
    for_backward: bool,
    axes: LogicalAxes,
    in_scan: bool = False,
) -> tuple[GemmOperand, Quantizer | None]:
    """A kernel ``[K..., F...]`` as a GEMM operand, constrained to its logical ``axes``.

    Quantized for the forward GEMM (which contracts its ``n_contract`` leading axes) and, with
    ``for_backward``, for dgrad (its trailing axes); cast to ``dtype`` without a quantizer.
    ``in_scan``: the kernel was traced in a scan body (``traced_in_scan``), where it is a slice
    of a stacked parameter: the XLA stage then reads the slice in place.
    """
    uses = kernel_uses(for_backward)

    def xla_stage() -> tuple[GemmOperand, Quantizer | None]:
        quantized = quantize_operand(kernel, quantizer, dtype, n_contract, uses)
        return one_pass_layouts(quantized, uses, pin_row_major=in_scan)

    # Per-tensor FP8 on GPUs: one Pallas kernel reads the kernel once and writes the float8
    # data in both layouts and the amax (see te_flax._ops.kernels); elsewhere, and for a scanned
    # kernel (which a custom call would first copy out of its stack), the XLA stage.
    if in_scan:
        operand, new_quantizer = xla_stage()
    else:
        operand, new_quantizer = tiled_quantize_operand(
            kernel, quantizer, n_contract, uses, xla_stage
        )
    return constrained(operand, axes), new_quantizer


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
        return blockwise_gemm_kernel(
            l_data, l_scale, r_data, r_scale, out_dtype, interpret=interpret
        )

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


def _gemm(
    lhs: GemmOperand,
    rhs: GemmOperand,
    contracting: tuple[tuple[int, ...], tuple[int, ...]],
    out_dtype: DTypeLike,
    fp8_precision: lax.Precision,
    like: Array | None = None,
) -> Array:
    """``lhs . rhs`` over ``contracting``: a float8 GEMM when both operands carry a scale.

    Block-scaled operands use the quantization they prepared for this contraction. ``like``:
    the primal whose cotangent this product is (its sharding is the product's, see
    ``gemm_out_sharding``).
    """
    if isinstance(lhs, BlockOperand):
        assert isinstance(rhs, BlockOperand), "mixed block-scaled and per-tensor GEMM"
        lhs_matrix = lhs.for_contraction(contracting[0])
        return _block_gemm(lhs_matrix, rhs.for_contraction(contracting[1]), out_dtype)
    assert not isinstance(rhs, BlockOperand), "mixed block-scaled and per-tensor GEMM"
    if lhs.scale_inv is None and rhs.scale_inv is None:
        return _dot(lhs, rhs, contracting, out_dtype, None, like)
    assert lhs.scale_inv is not None and rhs.scale_inv is not None, "mixed FP8/non-FP8 GEMM"
    # float8 x float8 with the scales applied to the product: XLA folds the multiply into the
    # cuBLASLt FP8 GEMM as its alpha. Precision DEFAULT selects fast accumulation there.
    gemm_dtype = _accumulation_dtype(out_dtype)
    out = _dot(lhs, rhs, contracting, gemm_dtype, fp8_precision, like)
    return (out * _product_scale(lhs, rhs).astype(gemm_dtype)).astype(out_dtype)


def _dot(
    lhs: ScaledTensor,
    rhs: ScaledTensor,
    contracting: tuple[tuple[int, ...], tuple[int, ...]],
    out_dtype: DTypeLike,
    precision: lax.Precision | None,
    like: Array | None = None,
) -> Array:
    """The product of two per-tensor operands' data (no scale), in the layouts it needs."""
    lhs_data, lhs_axes = _contraction_layout(lhs, contracting[0])
    rhs_data, rhs_axes = _contraction_layout(rhs, contracting[1])
    dimension_numbers = ((lhs_axes, rhs_axes), ((), ()))
    out_sharding = gemm_out_sharding(lhs_data, rhs_data, (lhs_axes, rhs_axes), like)
    return lax.dot_general(
        lhs_data,
        rhs_data,
        dimension_numbers,
        precision=precision,
        preferred_element_type=out_dtype,
        out_sharding=out_sharding,
    )


def _primal_layout(operand: GemmOperand) -> Array | None:
    """A per-tensor operand's data in the layout of the tensor it was made from (None for a
    block-scaled operand, whose matrices are flattened)."""
    return operand.data if isinstance(operand, ScaledTensor) else None


def _product_scale(lhs: ScaledTensor, rhs: ScaledTensor) -> Array:
    """The float32 scale that dequantizes the product of two per-tensor float8 operands."""
    assert lhs.scale_inv is not None and rhs.scale_inv is not None, "mixed FP8/non-FP8 GEMM"
    return lhs.scale_inv * rhs.scale_inv


def _gemm_unscaled(
    lhs: GemmOperand,
    rhs: GemmOperand,
    contracting: tuple[tuple[int, ...], tuple[int, ...]],
    out_dtype: DTypeLike,
    fp8_precision: lax.Precision,
    like: Array | None = None,
) -> tuple[Array, Array | None]:
    """``_gemm``, with a per-tensor FP8 product's scale returned beside it instead of applied:
    ``(product, scale)``; ``scale`` is None where ``_gemm`` applied it (no FP8, block scales,
    or a float16 output, which cannot hold the unscaled product).

    For a consumer that folds the scalar into a pass of its own. A GEMM contracting a sharded
    axis (dgrad of a column-parallel GEMM under tensor parallelism) is followed by an
    all-reduce of its partial sums; XLA folds the scale into the FP8 GEMM's alpha only when the
    multiply follows the GEMM directly, so after the all-reduce it would be one more pass over
    the whole [tokens, hidden] result on every device.
    """
    if isinstance(lhs, BlockOperand) or isinstance(rhs, BlockOperand):
        return _gemm(lhs, rhs, contracting, out_dtype, fp8_precision, like), None
    if lhs.scale_inv is None or _accumulation_dtype(out_dtype) != out_dtype:
        return _gemm(lhs, rhs, contracting, out_dtype, fp8_precision, like), None
    product = _dot(lhs, rhs, contracting, out_dtype, fp8_precision, like)
    return product, _product_scale(lhs, rhs)


_DEFAULT_PRECISION = GemmPrecision()


def dense_forward(
    lhs: GemmOperand,
    rhs: GemmOperand,
    n_contract: int,
    out_dtype: DTypeLike,
    bias: Array | None,
    precision: GemmPrecision = _DEFAULT_PRECISION,
) -> Array:
    """``lhs[batch..., K...] . rhs[K..., F...] (+ bias[F...])`` -> ``[batch..., F...]``.

    A per-tensor FP8 GEMM runs with ``precision.fprop`` (the quantizer set's ``precision``).
    """
    lhs_ndim = operand_ndim(lhs)
    contracting = (tuple(range(lhs_ndim - n_contract, lhs_ndim)), tuple(range(n_contract)))
    # By default the forward GEMM uses fast accumulation: its error is far below e4m3's
    # rounding (the recipe's fp8_gemm_fprop can ask for split accumulation).
    out = _gemm(lhs, rhs, contracting, out_dtype, precision.fprop)
    # The bias is added in the output dtype so that XLA fuses it as the GEMM's BIAS epilogue
    # (cuBLASLt takes no float32 bias for FP8 GEMMs).
    return out if bias is None else out + _leading_ones(bias.astype(out_dtype), out)


def sum_to_bias(grad: Array, bias_ndim: int, bias_dtype: DTypeLike) -> Array:
    """The bias gradient: ``grad`` summed in float32 over all but its last ``bias_ndim`` axes."""
    batch_axes = tuple(range(grad.ndim - bias_ndim))
    return jnp.sum(grad.astype(jnp.float32), axis=batch_axes).astype(bias_dtype)


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


def grad_operand(
    grad: Array,
    grad_quantizer: Quantizer | None,
    n_features: int,
    bias_dtype: DTypeLike | None = None,
    grad_axes: LogicalAxes = None,
) -> GradOperand:
    """An output gradient ``[batch..., F...]`` prepared for dgrad and wgrad (see
    ``dense_backward``): quantized once, and summed to the bias gradient with ``bias_dtype``."""
    n_batch = grad.ndim - n_features
    d_bias = None if bias_dtype is None else sum_to_bias(grad, n_features, bias_dtype)
    uses = (TRAILING, LEADING)
    quantized = quantize_operand(grad, grad_quantizer, grad.dtype, n_batch, uses)
    operand, new_quantizer = one_pass_layouts(quantized, uses)
    return GradOperand(constrained(operand, grad_axes), new_quantizer, d_bias)


def activation_operand(
    pre_activation: Array,
    activation_type: tuple[str, ...],
    activation_params: ClampedSwigluParams | None,
    quantizer: Quantizer | None,
    dtype: DTypeLike,
    uses: tuple[str, ...],
) -> tuple[GemmOperand, Quantizer | None]:
    """``activation_forward``'s ``[batch..., intermediate]`` output as a GEMM input (see
    ``input_uses``): quantized by ``quantizer`` (the activation computed in float32 and
    rounded once to the pre-activation's dtype), or cast to ``dtype``.

    Per-tensor FP8 on GPUs: one kernel reads the pre-activation once and writes the float8
    activation in the layouts of both GEMMs that read it, and the amax; the activation in high
    precision is never written (see te_flax._ops.kernels). Elsewhere the XLA stage.
    """

    def xla_stage() -> tuple[GemmOperand, Quantizer | None]:
        activated = activation_output(
            pre_activation, activation_type, activation_params, quantizer is not None
        )
        operand = quantize_operand(activated, quantizer, dtype, activated.ndim - 1, uses)
        return one_pass_layouts(operand, uses)

    return activation_quantize_operand(pre_activation, activation_type, quantizer, uses, xla_stage)


def activation_output(
    pre_activation: Array,
    activation_type: tuple[str, ...],
    activation_params: ClampedSwigluParams | None,
    quantized: bool,
) -> Array:
    """``activation_forward(pre_activation)`` in the pre-activation's dtype. For a quantized
    GEMM input (``quantized``) computed in float32 and rounded once to that dtype, as the
    activation kernel (and TransformerEngine's activation kernels) compute it."""
    if not quantized:
        return activation_forward(pre_activation, activation_type, activation_params)
    pre32 = pre_activation.astype(jnp.float32)
    activated = activation_forward(pre32, activation_type, activation_params)
    return activated.astype(pre_activation.dtype)


def activation_grad(
    grad: Array,
    pre_activation: Array,
    activation_type: tuple[str, ...],
    grad_quantizer: Quantizer | None,
    bias_dtype: DTypeLike | None,
    activation_params: ClampedSwigluParams | None = None,
) -> Array | GradOperand:
    """The gradient of ``activation_forward``'s ``[batch..., n_act, intermediate]`` input, as
    ``dense_backward`` takes its output gradient: in high precision (the XLA stage), or
    prepared with ``grad_quantizer`` and ``bias_dtype`` by the kernel that fuses the
    activation's backward with the quantization (on GPUs, per-tensor FP8). The kernel takes
    no activation parameters: the clamped SwiGLU always runs the XLA stage."""

    def xla_stage() -> Array:
        # The barrier (no copy) keeps XLA from sharing the float32 backward's first operations
        # with the forward's activation when both are in one program: it would write the
        # shared float32 values from the forward and read them back here, and give up fusing
        # this backward into the gradient's quantization.
        pre = lax.optimization_barrier(pre_activation)
        return activation_backward(grad, pre, activation_type, activation_params)

    def prepare(d_pre_activation: Array) -> GradOperand:
        return grad_operand(d_pre_activation, grad_quantizer, 2, bias_dtype)

    return activation_grad_operand(
        grad, pre_activation, activation_type, grad_quantizer, bias_dtype, xla_stage, prepare
    )


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
    """dgrad and wgrad of ``dense_forward`` (and dbias when ``bias_dtype`` is given).

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
    then ``lhs_scale`` (see ``_gemm_unscaled``), for a consumer that applies it in its own pass.
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
    if defer_dgrad_scale:
        d_lhs, d_lhs_scale = _gemm_unscaled(
            grad_gemm_operand, rhs, dgrad_axes, lhs_dtype, precision.dgrad, lhs_like
        )
    else:
        d_lhs = _gemm(grad_gemm_operand, rhs, dgrad_axes, lhs_dtype, precision.dgrad, lhs_like)
        d_lhs_scale = None
    # [batch..., K...] x [batch..., F...] -> [K..., F...]
    batch_axes = tuple(range(n_batch))
    wgrad_axes = (batch_axes, batch_axes)
    d_rhs = _gemm(lhs, grad_gemm_operand, wgrad_axes, rhs_dtype, precision.wgrad, rhs_like)
    return DenseGrads(d_lhs, d_rhs, grad.bias, grad.quantizer, d_lhs_scale)
