"""Quantizers: how one tensor is scaled into a low-precision GEMM operand.

A quantizer knows one tensor's low-precision dtype and scaling rule and, for delayed scaling,
carries that tensor's state (``scale_inv`` f32[1] and ``amax_history`` f32[L]) as pytree leaves.
Per-tensor quantizers return one ``ScaledTensor``; block-scaled quantizers take ``split`` and
the ``uses`` to prepare and return a ``BlockOperand`` (see ``te_flax.quantize.tensors``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import Array, lax
from jax.typing import DTypeLike

from te_flax.quantize import block_scaling, scaling, statistics
from te_flax.quantize.recipes import DelayedScaling
from te_flax.quantize.scaling_modes import ScalingMode
from te_flax.quantize.tensors import (
    LEADING,
    TRAILING,
    BlockOperand,
    BlockScaledTensor,
    GemmOperand,
    ScaledTensor,
)
from te_flax.quantize.tensors import static_field as _static

__all__ = [
    "BlockScaleQuantizer",
    "CurrentScaleQuantizer",
    "DelayedScaleQuantizer",
    "Float8BlockQuantizer",
    "NVFP4Quantizer",
    "Quantizer",
    "check_quantizer",
    "quantize_operand",
]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DelayedScaleQuantizer:
    """Quantizes with the scale of the previous step and records this step's amax.

    Attributes:
      scale_inv: f32[1], the dequantization scale this step uses.
      amax_history: f32[L], past amax values, newest at index 0.
      q_dtype: the float8 dtype (static).
      margin: powers of two of headroom (static).
      amax_compute_algo: ``"max"``, ``"most_recent"`` or a function of the history (static).
      recipe: the recipe the quantizer was made from (static), or None. When its
        ``scaling_factor_compute_algo`` is set, that function computes the new scale.
      just_in_time: while the state is still fresh (``scale_inv`` 1 and an all-zero
        history: never updated), quantize with the scale this step's own amax gives (the
        ``scale_inv`` that ``update`` computes from it) instead of 1 (static, default False).
        The ops set it where the new state cannot leave the step (``te_flax._ops.custom_op``):
        the state is still pushed the same way, but the tensor is read twice (its amax comes
        before its quantization), so the training step that updates the state keeps the
        one-pass form.
    """

    block_scaled = False  # quantizes per block along a contraction
    scaling_mode = ScalingMode.DELAYED_TENSOR_SCALING  # TransformerEngine's name for the rule

    scale_inv: Array
    amax_history: Array
    q_dtype: Any = _static(jnp.float8_e4m3fn)  # noqa: RUF009
    margin: float = _static(0)
    amax_compute_algo: str | Callable[[Array], Array] = _static("max")  # noqa: RUF009
    recipe: DelayedScaling | None = _static(None)  # noqa: RUF009
    just_in_time: bool = _static(False)

    @classmethod
    def fresh(cls, q_dtype: DTypeLike, recipe: DelayedScaling) -> DelayedScaleQuantizer:
        """A quantizer with the initial state: ``scale_inv = 1`` and an all-zero history."""
        return cls(
            scale_inv=jnp.ones((1,), jnp.float32),
            amax_history=jnp.zeros((recipe.amax_history_len,), jnp.float32),
            q_dtype=q_dtype,
            margin=recipe.margin,
            amax_compute_algo=recipe.amax_compute_algo,
            recipe=recipe,
        )

    def quantize(
        self, x: Array, split: int | None = None, uses: Sequence[str] = ()
    ) -> tuple[ScaledTensor, DelayedScaleQuantizer]:
        """Returns ``x`` quantized with the stored scale, and the quantizer with the new state.

        One scale serves every use, so ``split`` and ``uses`` do not matter.
        """
        del split, uses
        if self.just_in_time:
            scale_inv, updated = self.scale_and_update(scaling.amax(x))
            return ScaledTensor(scaling.quantize(x, self.q_dtype, scale_inv), scale_inv), updated
        scale_inv = self.scale_inv.reshape(())
        quantized = ScaledTensor(scaling.quantize(x, self.q_dtype, scale_inv), scale_inv)
        return quantized, self.update(scaling.amax(x))

    def scale_and_update(self, amax_value: Array) -> tuple[Array, DelayedScaleQuantizer]:
        """The scalar ``scale_inv`` to quantize a tensor with amax ``amax_value`` with, and the
        state after the step.

        The stored scale; with ``just_in_time`` and a fresh state (``scale_inv`` 1, history all
        zeros) the scale of the new state instead, the one the next step would use: the
        recipe's ``amax * 2**margin / fp8_max`` of this very tensor. A state set by hand (a
        scale other than 1) is kept whatever its history.
        """
        updated = self.update(amax_value)
        scale_inv = self.scale_inv.reshape(())
        if not self.just_in_time:
            return scale_inv, updated
        history = self.amax_history
        never_updated = lax.reduce_and(history == 0, tuple(range(history.ndim)))
        fresh = never_updated & (scale_inv == 1)
        return scaling.where(fresh, updated.scale_inv.reshape(()), scale_inv), updated

    def update(self, amax_value: Array) -> DelayedScaleQuantizer:
        """The state after a step whose tensor had ``amax_value``.

        The new ``scale_inv`` is computed from the history *including* this step, and is used
        by the next step: so step ``t`` always quantizes with the scale of step ``t - 1``.
        """
        history = scaling.push_amax(self.amax_history, amax_value)
        reduced = scaling.reduce_history(history, self.amax_compute_algo)
        custom = None if self.recipe is None else self.recipe.scaling_factor_compute_algo
        if custom is None:
            scale_inv = scaling.compute_scale_inv(
                reduced, self.q_dtype, self.margin, self.scale_inv
            )
        else:
            scale_inv = scaling.scale_inv_from_scaling_factor(
                custom, reduced, self.q_dtype, self.scale_inv, self.recipe
            )
        return dataclasses.replace(self, scale_inv=scale_inv.reshape(1), amax_history=history)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CurrentScaleQuantizer:
    """Quantizes with a scale from the tensor's own amax; keeps no state.

    Attributes:
      q_dtype: the float8 dtype (static).
      power_2_scale: round the scale to a power of two (static; see
        ``scaling.compute_scale_inv``).
    """

    block_scaled = False  # quantizes per block along a contraction
    scaling_mode = ScalingMode.CURRENT_TENSOR_SCALING  # TransformerEngine's name for the rule

    q_dtype: Any = _static(jnp.float8_e4m3fn)  # noqa: RUF009
    power_2_scale: bool = _static(False)

    def scale_inv_for(self, amax_value: Array) -> Array:
        """The scalar ``scale_inv`` of a tensor whose amax is ``amax_value``: ``amax / fp8_max``
        (a power of two at or above it with ``power_2_scale``), 1 for a zero or non-finite amax.
        """
        one = jnp.ones((), jnp.float32)
        return scaling.compute_scale_inv(amax_value, self.q_dtype, 0, one, self.power_2_scale)

    def scale_and_update(self, amax_value: Array) -> tuple[Array, CurrentScaleQuantizer]:
        """``scale_inv_for(amax_value)`` and this (stateless) quantizer, as
        ``DelayedScaleQuantizer.scale_and_update`` returns them."""
        return self.scale_inv_for(amax_value), self

    def quantize(
        self, x: Array, split: int | None = None, uses: Sequence[str] = ()
    ) -> tuple[ScaledTensor, CurrentScaleQuantizer]:
        """Returns ``x`` quantized with ``amax(x) / fp8_max``, and this (stateless) quantizer."""
        del split, uses
        scale_inv = self.scale_inv_for(scaling.amax(x))
        return ScaledTensor(scaling.quantize(x, self.q_dtype, scale_inv), scale_inv), self


def _as_matrix(x: Array, split: int, use: str) -> tuple[Array, tuple[int, ...]]:
    """``x`` as ``[rows, K]`` with the contracted axes of ``use`` last, and the rows' shape."""
    leading, trailing = x.shape[:split], x.shape[split:]
    matrix = x.reshape(math.prod(leading), math.prod(trailing))  # [leading, trailing]
    if use == TRAILING:
        return matrix, leading
    return matrix.T, trailing  # [trailing, leading]


def _block_operand(
    recipe: str,
    block: int,
    x: Array,
    split: int,
    uses: Sequence[str],
    quantize_matrix: Callable[[Array, str], tuple[Array, Array, Array | None]],
    transformed_uses: Sequence[str] = (),
    blocked_uses: Sequence[str] = (),
    one_d_fix: str = "disable_2d_quantization=True",
) -> BlockOperand:
    """``x`` quantized for each of ``uses`` by ``quantize_matrix(matrix, use)``, in blocks of
    ``block`` along each use's contraction (refused where that is not a multiple of it, and
    along the contraction of each of ``blocked_uses`` too: square tiles, which the recipe
    argument ``one_d_fix`` turns off).

    The quantizations of ``transformed_uses`` are of Hadamard-transformed values."""
    prepared: dict[str, BlockScaledTensor] = {}
    for use in uses:
        contracted = x.shape[split:] if use == TRAILING else x.shape[:split]
        size = math.prod(contracted)
        if size % block:
            raise ValueError(
                f"{recipe} quantizes in blocks of {block} consecutive elements along each GEMM's "
                f"contraction, but a GEMM contracts the {use} axes {contracted} ({size} elements)"
                f" of a tensor of shape {tuple(x.shape)}, which is not a multiple of {block}. "
                "Every contracted size must be one: the input features, the output features "
                "and, for training, the tokens (batch x sequence) of the weight-gradient GEMM; "
                f"pad them to a multiple of {block} or use a per-tensor recipe such as "
                "DelayedScaling()"
            )
    for use in blocked_uses:
        axes = x.shape[split:] if use == TRAILING else x.shape[:split]
        if math.prod(axes) % block:
            raise ValueError(
                f"{recipe} quantizes this tensor in {block}x{block} tiles (TransformerEngine's 2D "
                f"quantization), but the {use} axes {axes} of the tensor of shape "
                f"{tuple(x.shape)} hold {math.prod(axes)} elements, not a multiple of {block}; "
                f"pad the features to a multiple of {block} or use 1x{block} blocks with "
                f"{recipe}({one_d_fix})"
            )
    for use in uses:
        matrix, row_shape = _as_matrix(x, split, use)
        data, scale_inv, tensor_scale_inv = quantize_matrix(matrix, use)
        prepared[use] = BlockScaledTensor(
            data, scale_inv, tensor_scale_inv, row_shape, use in transformed_uses
        )
    return BlockOperand(
        prepared.get(TRAILING), prepared.get(LEADING), shape=tuple(x.shape), split=split
    )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockScaleQuantizer:
    """MXFP8: blocks of 32 along the contraction, float8 data, e8m0 power-of-two scales."""

    block_scaled = True  # quantizes per block along a contraction
    scaling_mode = ScalingMode.MXFP8_1D_SCALING  # TransformerEngine's name for the rule

    q_dtype: Any = _static(jnp.float8_e4m3fn)  # noqa: RUF009
    block_size: int = _static(block_scaling.MXFP8_BLOCK)

    def quantize(
        self, x: Array, split: int, uses: Sequence[str]
    ) -> tuple[BlockOperand, BlockScaleQuantizer]:
        """``x`` quantized for each of ``uses`` (``TRAILING``, ``LEADING``), and this quantizer."""

        def quantize_matrix(matrix: Array, use: str) -> tuple[Array, Array, Array | None]:
            del use
            data, scale_inv = block_scaling.quantize_mxfp8(matrix, self.q_dtype, self.block_size)
            return data, scale_inv, None

        operand = _block_operand(
            "MXFP8BlockScaling", self.block_size, x, split, uses, quantize_matrix
        )
        return operand, self


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NVFP4Quantizer:
    """NVFP4: blocks of 16 along the contraction, e2m1 data, e4m3 scales, a float32 tensor scale.

    Attributes:
      key: the RNG key of stochastic rounding (a leaf), or None to round to nearest.
      q_dtype: ``float4_e2m1fn`` (static).
      block_size: 16 (static).
      use_rht: apply TransformerEngine's random Hadamard transform to the ``LEADING`` use, the
        column-wise usage that the weight-gradient GEMM contracts along the tokens: each 16
        consecutive tokens are multiplied by ``block_scaling.rht_matrix()`` before quantizing,
        with a tensor scale of their own from the transformed amax (static, default False).
        Both wgrad operands (the GEMM input and the output gradient) must use it, so that it
        cancels in their product.
      use_2d: one scale per 16x16 tile of the ``[leading, trailing]`` matrix, rounded to nearest
        (TransformerEngine's 2D quantization of kernels): both uses are the same quantized
        values, one the transpose of the other (static, default False). Both sizes must then
        be multiples of 16.

    ``NVFP4BlockScaling()`` sets ``use_rht`` on the ``x`` and ``dgrad`` quantizers and
    ``use_2d`` on the ``kernel`` one, as TransformerEngine does; a quantizer built directly
    has neither.
    """

    block_scaled = True  # quantizes per block along a contraction

    @property
    def scaling_mode(self) -> ScalingMode:
        """``NVFP4_2D_SCALING`` with 16x16 tiles, else ``NVFP4_1D_SCALING``."""
        return ScalingMode.NVFP4_2D_SCALING if self.use_2d else ScalingMode.NVFP4_1D_SCALING

    key: Array | None = None
    q_dtype: Any = _static(jnp.float4_e2m1fn)  # noqa: RUF009
    block_size: int = _static(block_scaling.NVFP4_BLOCK)
    use_rht: bool = _static(False)
    use_2d: bool = _static(False)

    def quantize(
        self, x: Array, split: int, uses: Sequence[str]
    ) -> tuple[BlockOperand, NVFP4Quantizer]:
        """``x`` quantized for each of ``uses`` with one tensor scale, and this quantizer.

        The Hadamard-transformed ``LEADING`` use (``use_rht``) has a tensor scale of its own.
        """
        amax_value = scaling.amax_or_nan(x)
        tensor_scale_inv = block_scaling.nvfp4_tensor_scale_inv(amax_value)
        tiled: list[tuple[Array, Array]] = []

        def quantize_tiles(matrix: Array, use: str) -> tuple[Array, Array]:
            # Quantized once as [leading, trailing]; the LEADING use is its exact transpose.
            if not tiled:
                leading_first = matrix if use == TRAILING else matrix.T
                tiled.append(
                    block_scaling.quantize_nvfp4_2d(
                        leading_first, tensor_scale_inv, self.block_size
                    )
                )
            data, tile_scales = tiled[0]
            if use == LEADING:
                data, tile_scales = data.T, tile_scales.T
            # The GEMM takes a scale per row and block of K: each tile's scale for its 16 rows.
            return data, jnp.repeat(tile_scales, self.block_size, axis=0)

        def quantize_matrix(matrix: Array, use: str) -> tuple[Array, Array, Array | None]:
            # e2m1 has no NaN: a NaN or an infinity in x shows as a NaN tensor scale, which
            # every GEMM that reads the operand multiplies by (scaling.flag_nonfinite).
            if self.use_2d:
                data, tile_scales = quantize_tiles(matrix, use)
                return data, tile_scales, scaling.flag_nonfinite(tensor_scale_inv, amax_value)
            key = None if self.key is None else jax.random.fold_in(self.key, int(use == LEADING))
            matrix_scale_inv = tensor_scale_inv
            if use in transformed:
                matrix = block_scaling.random_hadamard_transform(matrix)
                matrix_scale_inv = block_scaling.nvfp4_tensor_scale_inv(scaling.amax(matrix))
            data, scale_inv = block_scaling.quantize_nvfp4(
                matrix, matrix_scale_inv, key, self.block_size
            )
            return data, scale_inv, scaling.flag_nonfinite(matrix_scale_inv, amax_value)

        transformed = (LEADING,) if self.use_rht and not self.use_2d else ()
        operand = _block_operand(
            "NVFP4BlockScaling",
            self.block_size,
            x,
            split,
            uses,
            quantize_matrix,
            transformed_uses=transformed,
            blocked_uses=(TRAILING, LEADING) if self.use_2d else (),
        )
        return operand, self


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Float8BlockQuantizer:
    """Blockwise FP8 (``Float8BlockScaling``): float32 scales per 1x128 tile or 128x128 block.

    Attributes:
      q_dtype: the float8 dtype (static).
      block_dims: 1 for one scale per ``1 x block_size`` tile along each GEMM's contraction,
        each use quantized from high precision; 2 for one scale per ``block_size x
        block_size`` block of the ``[leading, trailing]`` matrix, quantized once, the
        ``LEADING`` use being its exact transpose with the transposed scale grid (static,
        default 1).
      power_2_scale: round each scale up to a power of two (static, default True).
      block_size: 128 (static).

    The scales are block-local: no amax is reduced across blocks, shards or devices, so a
    sharded tensor quantizes each of its blocks where they lie. A grouped GEMM's operands
    (``[groups, rows, K]``) quantize group by group (``jax.vmap`` over the leading axis).
    """

    block_scaled = True  # quantizes per block along a contraction

    @property
    def scaling_mode(self) -> ScalingMode:
        """``FP8_1D_BLOCK_SCALING`` (1x128 tiles) or ``FP8_2D_BLOCK_SCALING`` (128x128)."""
        if self.block_dims == 2:
            return ScalingMode.FP8_2D_BLOCK_SCALING
        return ScalingMode.FP8_1D_BLOCK_SCALING

    q_dtype: Any = _static(jnp.float8_e4m3fn)  # noqa: RUF009
    block_dims: int = _static(1)
    power_2_scale: bool = _static(True)
    block_size: int = _static(block_scaling.FP8_BLOCK)

    def quantize(
        self, x: Array, split: int, uses: Sequence[str]
    ) -> tuple[BlockOperand, Float8BlockQuantizer]:
        """``x`` quantized for each of ``uses`` (``TRAILING``, ``LEADING``), and this quantizer."""
        tiled: list[tuple[Array, Array]] = []

        def quantize_matrix(matrix: Array, use: str) -> tuple[Array, Array, Array | None]:
            if self.block_dims == 1:
                data, scale_inv = block_scaling.quantize_fp8_blocks(
                    matrix, self.q_dtype, self.power_2_scale, self.block_size
                )
                return data, scale_inv, None
            # 128x128 blocks: quantized once as [leading, trailing]; LEADING is the transpose.
            if not tiled:
                leading_first = matrix if use == TRAILING else matrix.T
                tiled.append(
                    block_scaling.quantize_fp8_tiles(
                        leading_first, self.q_dtype, self.power_2_scale, self.block_size
                    )
                )
            data, tile_scales = tiled[0]
            if use == LEADING:
                data, tile_scales = data.T, tile_scales.T
            return data, tile_scales, None

        dim_field = "w_block_scaling_dim=1 (or x_/grad_block_scaling_dim=1)"
        operand = _block_operand(
            "Float8BlockScaling",
            self.block_size,
            x,
            split,
            uses,
            quantize_matrix,
            blocked_uses=(TRAILING, LEADING) if self.block_dims == 2 else (),
            one_d_fix=dim_field,
        )
        return operand, self


Quantizer = (
    DelayedScaleQuantizer
    | CurrentScaleQuantizer
    | Float8BlockQuantizer
    | BlockScaleQuantizer
    | NVFP4Quantizer
)
_QUANTIZER_TYPES = (
    DelayedScaleQuantizer,
    CurrentScaleQuantizer,
    Float8BlockQuantizer,
    BlockScaleQuantizer,
    NVFP4Quantizer,
)
_FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
_DTYPES = {
    DelayedScaleQuantizer: _FP8_DTYPES,
    CurrentScaleQuantizer: _FP8_DTYPES,
    Float8BlockQuantizer: _FP8_DTYPES,
    BlockScaleQuantizer: _FP8_DTYPES,
    NVFP4Quantizer: (jnp.dtype(jnp.float4_e2m1fn),),
}


def check_quantizer(quantizer: object, argument: str) -> None:
    """Raises a clear error unless ``quantizer`` is a quantizer to a dtype it supports."""
    if not isinstance(quantizer, _QUANTIZER_TYPES):
        names = [cls.__name__ for cls in _QUANTIZER_TYPES]
        raise TypeError(
            f"{argument} must be a {', '.join(names[:-1])} or {names[-1]} (or None), got "
            f"{quantizer!r}"
        )
    supported = _DTYPES[type(quantizer)]
    if jnp.dtype(quantizer.q_dtype) not in supported:
        raise ValueError(
            f"{argument} quantizes to {jnp.dtype(quantizer.q_dtype)}, but only "
            f"{' and '.join(str(d) for d in supported)} are supported by "
            f"{type(quantizer).__name__}"
        )


def quantize_operand(
    x: Array,
    quantizer: Quantizer | None,
    compute_dtype: DTypeLike,
    split: int | None = None,
    uses: tuple[str, ...] = (TRAILING,),
) -> tuple[GemmOperand, Quantizer | None]:
    """A GEMM operand from ``x``: quantized by ``quantizer``, or cast to ``compute_dtype``.

    ``split`` and ``uses`` say how the GEMMs contract ``x`` (see the module docstring); only
    block-scaled quantizers need them. Inside a fused op run by ``te_flax.inspect_fp8()`` the
    quantization is recorded for its statistics (``te_flax.quantize.statistics.record``).
    """
    if quantizer is None:
        return ScaledTensor(x.astype(compute_dtype)), None
    quantized: tuple[GemmOperand, Quantizer]
    if quantizer.block_scaled:
        if split is None:
            raise AssertionError("a block-scaled quantization needs the contraction split")
        quantized = quantizer.quantize(x, split, uses)
    else:
        # Only block-scaled quantizers need the split; the per-tensor ones take None.
        quantized = quantizer.quantize(x, split, uses)  # type: ignore[arg-type]
    statistics.record(quantizer, x, quantized[0])
    return quantized
