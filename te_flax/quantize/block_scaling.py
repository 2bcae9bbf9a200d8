"""The scale math of block-scaled quantization (blockwise FP8, MXFP8, NVFP4), as pure functions.

A block-scaled operand is a matrix ``[rows, K]`` whose last axis is the GEMM's contraction,
cut into blocks of ``block`` consecutive elements, each with its own scale:
``x[r, k] ~= data[r, k] * scale_inv[r, k // block] (* tensor_scale_inv)``.

* Blockwise FP8 (``Float8BlockScaling``): float8 data, float32 scales (powers of two by
  default), 128 elements per block (``quantize_fp8_blocks``), or one scale per 128x128 tile of
  a kernel (``quantize_fp8_tiles``, whose ``scale_inv`` is ``[rows // 128, K // 128]``).
* MXFP8: float8 data, ``float8_e8m0fnu`` scales (powers of two), 32 elements per block.
* NVFP4: ``float4_e2m1fn`` data, ``float8_e4m3fn`` scales, 16 elements per block, and one
  float32 scale for the whole tensor that brings the block scales into e4m3's range.
  TransformerEngine's NVFP4 recipe adds two variants: one scale per 16x16 tile of a kernel
  (``quantize_nvfp4_2d``), and a random Hadamard transform of the weight-gradient GEMM's
  operands before they are quantized (``random_hadamard_transform``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array, lax
from jax.typing import DTypeLike

from te_flax.quantize import scaling
from te_flax.quantize._block_recipes import FP8_BLOCK_SIZE

__all__ = [
    "E2M1_MAX",
    "FP8_BLOCK",
    "MXFP8_BLOCK",
    "NVFP4_BLOCK",
    "NVFP4_RHT_SIGNS",
    "dequantize_blocks",
    "e8m0_round_up",
    "expand_tile_rows",
    "nvfp4_tensor_scale_inv",
    "quantize_fp8_blocks",
    "quantize_fp8_tiles",
    "quantize_mxfp8",
    "quantize_nvfp4",
    "quantize_nvfp4_2d",
    "random_hadamard_transform",
    "rht_matrix",
    "stochastic_round_e2m1",
]

FP8_BLOCK = FP8_BLOCK_SIZE  # Float8BlockScaling's 1x128 tiles and 128x128 blocks
MXFP8_BLOCK = 32
NVFP4_BLOCK = 16
E2M1_MAX = 6.0
_E4M3_MAX = 448.0
_F32 = jnp.finfo(jnp.float32)
# TransformerEngine's fixed random signs of the weight-gradient Hadamard transform (the same
# for every tensor and call), one per row of the 16x16 Hadamard matrix.
NVFP4_RHT_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)


def _blocks(x: Array, block: int) -> Array:
    """``[rows, K]`` -> ``[rows, K // block, block]`` in float32."""
    rows, k = x.shape
    return x.astype(jnp.float32).reshape(rows, k // block, block)


def _block_amax(blocks: Array) -> Array:
    return jnp.max(jnp.abs(blocks), axis=-1)


def e8m0_round_up(scale: Array) -> Array:
    """The smallest power of two ``>= scale`` (float32, non-negative) as ``float8_e8m0fnu``.

    e8m0 holds ``2**(byte - 127)`` for bytes 0..254 and NaN for 255. The float32 exponent is
    the byte of ``scale`` rounded down; a non-zero mantissa rounds it up. Scales at or below
    ``2**-127`` (zero and most denormals) become byte 0, ``2**-127``; denormals above it byte 1.
    An infinite or NaN scale becomes NaN.
    """
    bits = lax.bitcast_convert_type(scale.astype(jnp.float32), jnp.uint32)
    exponent = bits >> 23
    mantissa = bits & 0x7FFFFF
    denormal_at_most_smallest = (exponent == 0) & (mantissa <= 0x400000)
    # exponent 0xFE cannot round up (0xFF is NaN); 0xFF is already inf or NaN.
    round_up = (mantissa > 0) & (exponent < 0xFE) & ~denormal_at_most_smallest
    byte = (exponent + round_up.astype(jnp.uint32)).astype(jnp.uint8)
    return lax.bitcast_convert_type(byte, jnp.float8_e8m0fnu)


def _e8m0_reciprocal(scale: Array) -> Array:
    """``1 / scale`` in float32, exactly: ``2**(127 - byte)`` (NaN for a NaN scale).

    Built from the exponent bits rather than divided: the smallest scales are float32
    denormals, which some backends flush to zero before dividing.
    """
    byte = lax.bitcast_convert_type(scale, jnp.uint8).astype(jnp.int32)
    # Bytes 0..253 give float32 exponents 254..1; a finite amax never reaches byte 254.
    bits = (jnp.clip(254 - byte, 1, 254) << 23).astype(jnp.uint32)
    reciprocal = lax.bitcast_convert_type(bits, jnp.float32)
    return jnp.where(byte == 255, jnp.nan, reciprocal)


def quantize_mxfp8(x: Array, dtype: DTypeLike, block: int = MXFP8_BLOCK) -> tuple[Array, Array]:
    """``x [rows, K]`` -> (float8 data ``[rows, K]``, e8m0 scales ``[rows, K // block]``).

    Each block's scale is ``amax(block) / fp8_max`` rounded up to a power of two, so every
    element of the block divided by it stays within ``+-fp8_max``; the division by a power of
    two is exact, and only the cast to float8 rounds.
    """
    blocks = _blocks(x, block)
    scale = e8m0_round_up(_block_amax(blocks) / scaling.fp8_max(dtype))
    scaled = blocks * _e8m0_reciprocal(scale)[..., None]
    limit = scaling.fp8_max(dtype)
    data = jnp.clip(scaled, -limit, limit).astype(dtype)
    return data.reshape(x.shape), scale


def _fp8_block_scaled(
    values: Array, block_amax: Array, dtype: DTypeLike, power_2_scale: bool
) -> tuple[Array, Array]:
    """The float8 ``values`` divided by their block's scale (``block_amax`` shaped to broadcast
    against them), and the float32 scales: ``amax / fp8_max`` (a power of two at or above it
    with ``power_2_scale``), 1 for an all-zero or non-finite block, as current scaling does
    for a whole tensor (``scaling.compute_scale_inv``)."""
    one = jnp.ones((), jnp.float32)
    scale_inv = scaling.compute_scale_inv(block_amax, dtype, 0, one, power_2_scale)
    return scaling.quantize(values, dtype, scale_inv), scale_inv


def quantize_fp8_blocks(
    x: Array, dtype: DTypeLike, power_2_scale: bool = True, block: int = FP8_BLOCK
) -> tuple[Array, Array]:
    """``x [rows, K]`` -> (float8 data ``[rows, K]``, float32 scales ``[rows, K // block]``):
    one scale per ``1 x block`` tile along K (``Float8BlockScaling``'s activations and
    gradients)."""
    blocks = _blocks(x, block)  # [rows, K / block, block]
    data, scale_inv = _fp8_block_scaled(
        blocks, _block_amax(blocks)[..., None], dtype, power_2_scale
    )
    return data.reshape(x.shape), scale_inv[..., 0]


def quantize_fp8_tiles(
    x: Array, dtype: DTypeLike, power_2_scale: bool = True, block: int = FP8_BLOCK
) -> tuple[Array, Array]:
    """``x [rows, K]`` -> (float8 data ``[rows, K]``, float32 scales
    ``[rows // block, K // block]``): one scale per ``block x block`` tile (``Float8BlockScaling``'s
    kernels). A tile of ``x`` is a tile of ``x.T``: the transposed data with the transposed
    scale grid is the quantization of ``x.T``, so both GEMMs of a kernel use the same values."""
    rows, k = x.shape
    tiles = x.astype(jnp.float32).reshape(rows // block, block, k // block, block)
    amax = jnp.max(jnp.abs(tiles), axis=(1, 3), keepdims=True)  # [rows/b, 1, K/b, 1]
    data, scale_inv = _fp8_block_scaled(tiles, amax, dtype, power_2_scale)
    return data.reshape(x.shape), scale_inv[:, 0, :, 0]


def nvfp4_tensor_scale_inv(amax_value: Array) -> Array:
    """NVFP4's tensor-level scale: ``amax / (6 * 448)``, so the largest block scale is e4m3's
    maximum; 1 for a zero, NaN or infinite amax, and clipped to float32's normal range."""
    scale_inv = amax_value / (E2M1_MAX * _E4M3_MAX)
    valid = jnp.isfinite(amax_value) & (amax_value > 0)
    scale_inv = jnp.where(valid, scale_inv, 1.0)
    return jnp.clip(scale_inv, _F32.tiny, _F32.max).astype(jnp.float32)


def stochastic_round_e2m1(y: Array, key: Array) -> Array:
    """``y`` (float32 within ``+-6``) rounded to a neighbouring e2m1 value, up with probability
    equal to its distance from the lower one, so that the expected result is ``y``.

    e2m1's positive values are 0, 0.5, 1, 1.5 (spacing 0.5), 2, 3 (spacing 1), 4 and 6 (spacing
    2); ``floor(|y| / spacing + u) * spacing`` with ``u ~ U[0, 1)`` picks one of the two
    neighbours with those probabilities.
    """
    magnitude = jnp.abs(y)
    spacing = jnp.where(magnitude < 2.0, 0.5, jnp.where(magnitude < 4.0, 1.0, 2.0))
    noise = jax.random.uniform(key, y.shape, jnp.float32)
    rounded = jnp.minimum(jnp.floor(magnitude / spacing + noise) * spacing, E2M1_MAX)
    return jnp.copysign(rounded, y)


def _nvfp4_scaled(values: Array, block_amax: Array, tensor_scale_inv: Array) -> tuple[Array, Array]:
    """The e4m3 block scales of ``block_amax`` (shaped to broadcast against ``values``) and the
    float32 ``values`` divided by them and the tensor scale, clipped to e2m1's range."""
    block_scale = block_amax / E2M1_MAX / tensor_scale_inv
    scale = jnp.clip(block_scale, 0.0, _E4M3_MAX).astype(jnp.float8_e4m3fn)
    divisor = scale.astype(jnp.float32) * tensor_scale_inv
    scaled = jnp.where(divisor > 0, values / jnp.where(divisor > 0, divisor, 1.0), 0.0)
    return scale, jnp.clip(scaled, -E2M1_MAX, E2M1_MAX)


def quantize_nvfp4(
    x: Array, tensor_scale_inv: Array, key: Array | None = None, block: int = NVFP4_BLOCK
) -> tuple[Array, Array]:
    """``x [rows, K]`` -> (e2m1 data ``[rows, K]``, e4m3 scales ``[rows, K // block]``).

    The block scale is ``amax(block) / 6 / tensor_scale_inv`` rounded to nearest e4m3 (it can
    round down, and the block's largest elements then saturate at 6); the data is
    ``x / (block scale * tensor_scale_inv)`` rounded to e2m1, to nearest or, with ``key``,
    stochastically. A block whose scale is 0 (all zeros, or far below the tensor's amax) is 0.
    """
    blocks = _blocks(x, block)  # [rows, K / block, block]
    amax = jnp.max(jnp.abs(blocks), axis=-1, keepdims=True)
    scale, scaled = _nvfp4_scaled(blocks, amax, tensor_scale_inv)
    if key is not None:
        scaled = stochastic_round_e2m1(scaled, key)
    return scaled.astype(jnp.float4_e2m1fn).reshape(x.shape), scale[..., 0]


def quantize_nvfp4_2d(
    x: Array, tensor_scale_inv: Array, block: int = NVFP4_BLOCK
) -> tuple[Array, Array]:
    """``x [rows, K]`` -> (e2m1 data ``[rows, K]``, e4m3 scales ``[rows // block, K // block]``).

    NVFP4 with one scale per ``block x block`` tile (TransformerEngine's 2D quantization of
    kernels): the rules of ``quantize_nvfp4`` with the tile's amax, rounded to nearest. A tile
    is a tile of the transpose too, so quantizing ``x.T`` gives exactly the transposed data and
    scales: the two GEMMs that contract a kernel along either axis use the same values.
    """
    rows, k = x.shape
    tiles = x.astype(jnp.float32).reshape(rows // block, block, k // block, block)
    amax = jnp.max(jnp.abs(tiles), axis=(1, 3), keepdims=True)  # [rows/b, 1, K/b, 1]
    scale, scaled = _nvfp4_scaled(tiles, amax, tensor_scale_inv)
    return scaled.astype(jnp.float4_e2m1fn).reshape(x.shape), scale[:, 0, :, 0]


def rht_matrix() -> np.ndarray:
    """TransformerEngine's 16x16 random Hadamard matrix, ``diag(signs) @ H16 / 4`` (float32).

    ``H16`` is Sylvester's Hadamard matrix (entries +-1, ``H16 @ H16.T = 16 I``) and ``signs``
    are ``NVFP4_RHT_SIGNS``; the ``1/4 = 1/sqrt(16)`` makes the matrix orthogonal
    (``M @ M.T = I``), and its entries (+-0.25) are exact in every float format.
    """
    hadamard = np.ones((1, 1), np.float32)
    while hadamard.shape[0] < NVFP4_BLOCK:
        hadamard = np.block([[hadamard, hadamard], [hadamard, -hadamard]])
    signs = np.asarray(NVFP4_RHT_SIGNS, np.float32)
    return (signs[:, None] * hadamard / np.sqrt(NVFP4_BLOCK)).astype(np.float32)


def _walsh_hadamard(blocks: Array) -> Array:
    """``blocks [..., 16] @ H16`` (Sylvester's matrix, symmetric) as four butterfly stages of
    additions and subtractions: elementwise work that XLA fuses with the quantization around
    it, where a 16x16 matrix product would be a GEMM of its own."""
    shape = blocks.shape
    half = 1
    while half < NVFP4_BLOCK:
        pairs = blocks.reshape(*shape[:-1], NVFP4_BLOCK // (2 * half), 2, half)
        low, high = pairs[..., 0, :], pairs[..., 1, :]
        blocks = jnp.stack([low + high, low - high], axis=-2).reshape(shape)
        half *= 2
    return blocks


def random_hadamard_transform(x: Array, inverse: bool = False) -> Array:
    """``x [rows, K]`` with every 16 consecutive elements along K multiplied by ``rht_matrix()``
    (by its transpose, the inverse, with ``inverse``), in ``x``'s dtype.

    Applied to both operands of a GEMM along its contraction it cancels in the product
    (``(a M)(b M)^T = a b^T``), while each 16 elements' outliers are spread over all 16 before
    they are quantized. Computed in float32 and rounded to ``x``'s dtype, as TransformerEngine
    does (its reference multiplies in the input's dtype).
    """
    rows, k = x.shape
    signs = jnp.asarray(NVFP4_RHT_SIGNS, jnp.float32).reshape(1, 1, NVFP4_BLOCK)
    blocks = x.astype(jnp.float32).reshape(rows, k // NVFP4_BLOCK, NVFP4_BLOCK)
    # M = diag(signs) H16 / 4, so x M = H16(x * signs) / 4 and x M^T = H16(x) / 4 * signs; the
    # signs and the 1/4 are exact.
    if inverse:
        transformed = _walsh_hadamard(blocks) * 0.25 * signs
    else:
        transformed = _walsh_hadamard(blocks * signs) * 0.25
    return transformed.reshape(rows, k).astype(x.dtype)


def dequantize_blocks(
    data: Array,
    scale_inv: Array,
    tensor_scale_inv: Array | None = None,
    dtype: DTypeLike = jnp.float32,
) -> Array:
    """``data [rows, K] * scale_inv`` repeated over each block (``* tensor_scale_inv``).

    ``scale_inv`` is ``[rows, K // block]``, or ``[rows // block, K // block]`` for square
    tiles (``quantize_fp8_tiles``)."""
    rows, k = data.shape
    block = k // scale_inv.shape[-1]
    scale_inv = expand_tile_rows(scale_inv, rows)
    values = data.astype(jnp.float32).reshape(rows, k // block, block)
    values = values * scale_inv.astype(jnp.float32)[..., None]
    if tensor_scale_inv is not None:
        values = values * tensor_scale_inv
    return values.reshape(rows, k).astype(dtype)


def expand_tile_rows(scale_inv: Array, rows: int) -> Array:
    """Block scales as one row per data row: ``[rows // b, n]`` tile scales repeated ``b``
    times along rows, ``[rows, n]`` scales as they are."""
    if scale_inv.shape[0] == rows:
        return scale_inv
    return jnp.repeat(scale_inv, rows // scale_inv.shape[0], axis=0)
