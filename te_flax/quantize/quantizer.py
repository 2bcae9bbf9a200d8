"""Quantizers: the state of each quantized tensor as a pytree, and the sets the ops take.

A quantizer knows one tensor's low-precision dtype and scaling rule and, for delayed scaling,
carries that tensor's state (``scale_inv`` f32[1] and ``amax_history`` f32[L]) as pytree leaves.
The ops take a ``QuantizerSet(x, kernel, dgrad)`` per GEMM as a differentiable argument; the
"gradient" they return for it is the set with its new state.

Per-tensor quantizers turn a tensor into one ``ScaledTensor``, which every GEMM that uses the
tensor shares. Block-scaled quantizers need to know how the tensor is contracted: ``quantize``
takes ``split`` (the tensor is ``[leading..., trailing...]`` with ``split`` leading axes) and the
``uses`` to prepare, ``TRAILING`` (a GEMM contracts the trailing axes) and/or ``LEADING``; each
use is quantized from high precision into its own ``BlockScaledTensor``, in a ``BlockOperand``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple, TypeVar, overload

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array, lax
from jax.typing import DTypeLike

from te_flax.quantize import block_scaling, scaling
from te_flax.quantize.autocast import get_autocast_recipe
from te_flax.quantize.recipes import (
    DelayedScaling,
    Float8CurrentScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    Recipe,
    check_recipe,
)

__all__ = [
    "LEADING",
    "TRAILING",
    "BlockOperand",
    "BlockScaleQuantizer",
    "BlockScaledTensor",
    "CurrentScaleQuantizer",
    "DelayedScaleQuantizer",
    "GemmOperand",
    "GemmPrecision",
    "NVFP4Quantizer",
    "Quantizer",
    "QuantizerFactory",
    "QuantizerSet",
    "ScaledTensor",
    "as_cotangent",
    "check_quantizer",
    "noop_quantizer_set",
]

TRAILING = "trailing"  # a GEMM contracts the tensor's axes from ``split`` on
LEADING = "leading"  # a GEMM contracts the tensor's first ``split`` axes
T = TypeVar("T")


class ScaledTensor(NamedTuple):
    """A GEMM operand: ``data`` (float8, or high precision when ``scale_inv`` is None).

    ``transposed``, when present, holds the same values as ``data`` with its leading axes moved
    after its trailing ones (``[trailing..., leading...]``): the layout of a GEMM that
    contracts the leading axes, written by the quantize kernel in the same pass as ``data`` so
    that XLA need not transpose the float8 data. The GEMM stage picks whichever layout has the
    contracted axes last; the values are the same.
    """

    data: Array
    scale_inv: Array | None = None
    transposed: Array | None = None

    def keep(self, use: str) -> ScaledTensor:
        """The operand for one use only. A per-tensor operand serves every use from ``data``;
        the ``transposed`` copy is kept only for a GEMM that contracts the leading axes."""
        return self if use == LEADING else self._replace(transposed=None)


def _static(default: Any = dataclasses.MISSING) -> Any:
    return dataclasses.field(default=default, metadata={"static": True})


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockScaledTensor:
    """A block-scaled GEMM operand as a matrix whose last axis is the contraction.

    Attributes:
      data: ``[rows, K]`` float8 or float4 values.
      scale_inv: ``[rows, K // block]`` block scales (e8m0 or e4m3).
      tensor_scale_inv: float32 scalar applied to the whole tensor (NVFP4), or None.
      row_shape: the shape the ``rows`` axis unflattens to in a GEMM's output (static).
      has_rht_applied: the data is of the values after ``block_scaling.random_hadamard_transform``
        along K (static): a GEMM must multiply it with an operand transformed the same way.
    """

    data: Array
    scale_inv: Array
    tensor_scale_inv: Array | None
    row_shape: tuple[int, ...] = _static()
    has_rht_applied: bool = _static(False)

    def dequantize(self, dtype: DTypeLike = jnp.float32) -> Array:
        """The ``[rows, K]`` values the operand stands for (the Hadamard transform undone)."""
        values = block_scaling.dequantize_blocks(
            self.data, self.scale_inv, self.tensor_scale_inv, jnp.float32
        )
        if self.has_rht_applied:
            values = block_scaling.random_hadamard_transform(values, inverse=True)
        return values.astype(dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockOperand:
    """One tensor ``[leading..., trailing...]`` quantized for each way a GEMM contracts it.

    Attributes:
      trailing: the tensor as ``[prod(leading), prod(trailing)]``, for a GEMM that contracts its
        trailing axes (None when not prepared).
      leading: the tensor as ``[prod(trailing), prod(leading)]``, for a GEMM that contracts its
        leading axes (None when not prepared).
      shape: the tensor's shape (static).
      split: how many leading axes it has (static).
    """

    trailing: BlockScaledTensor | None
    leading: BlockScaledTensor | None
    shape: tuple[int, ...] = _static()
    split: int = _static()

    def keep(self, use: str) -> BlockOperand:
        """The operand with only ``use`` (``TRAILING`` or ``LEADING``) prepared."""
        return dataclasses.replace(
            self,
            trailing=self.trailing if use == TRAILING else None,
            leading=self.leading if use == LEADING else None,
        )

    def for_contraction(self, axes: tuple[int, ...]) -> BlockScaledTensor:
        """The prepared quantization of a GEMM that contracts ``axes`` of the tensor."""
        ndim = len(self.shape)
        if tuple(axes) == tuple(range(self.split, ndim)):
            use, operand = TRAILING, self.trailing
        elif tuple(axes) == tuple(range(self.split)):
            use, operand = LEADING, self.leading
        else:
            raise AssertionError(f"contraction {axes} of a block operand split at {self.split}")
        assert operand is not None, f"the {use} quantization was not prepared"
        return operand


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
    """

    block_scaled = False  # quantizes per block along a contraction

    scale_inv: Array
    amax_history: Array
    q_dtype: Any = _static(jnp.float8_e4m3fn)  # noqa: RUF009
    margin: float = _static(0)
    amax_compute_algo: str | Callable[[Array], Array] = _static("max")  # noqa: RUF009
    recipe: DelayedScaling | None = _static(None)  # noqa: RUF009

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
        scale_inv = self.scale_inv.reshape(())
        quantized = ScaledTensor(scaling.quantize(x, self.q_dtype, scale_inv), scale_inv)
        return quantized, self.update(scaling.amax(x))

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

    q_dtype: Any = _static(jnp.float8_e4m3fn)  # noqa: RUF009
    power_2_scale: bool = _static(False)

    def scale_inv_for(self, amax_value: Array) -> Array:
        """The scalar ``scale_inv`` of a tensor whose amax is ``amax_value``: ``amax / fp8_max``
        (a power of two at or above it with ``power_2_scale``), 1 for a zero or non-finite amax.
        """
        one = jnp.ones((), jnp.float32)
        return scaling.compute_scale_inv(amax_value, self.q_dtype, 0, one, self.power_2_scale)

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
) -> BlockOperand:
    """``x`` quantized for each of ``uses`` by ``quantize_matrix(matrix, use)``, in blocks of
    ``block`` along each use's contraction (refused where that is not a multiple of it, and
    along the contraction of each of ``blocked_uses`` too: square tiles).

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
                f"{recipe} quantizes kernels in {block}x{block} tiles (TransformerEngine's 2D "
                f"quantization), but the {use} axes {axes} of the kernel of shape "
                f"{tuple(x.shape)} hold {math.prod(axes)} elements, not a multiple of {block}; "
                f"pad the features to a multiple of {block} or use 1x{block} blocks with "
                f"{recipe}(disable_2d_quantization=True)"
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
        tensor_scale_inv = block_scaling.nvfp4_tensor_scale_inv(scaling.amax(x))
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
            if self.use_2d:
                return (*quantize_tiles(matrix, use), tensor_scale_inv)
            key = None if self.key is None else jax.random.fold_in(self.key, int(use == LEADING))
            matrix_scale_inv = tensor_scale_inv
            if use in transformed:
                matrix = block_scaling.random_hadamard_transform(matrix)
                matrix_scale_inv = block_scaling.nvfp4_tensor_scale_inv(scaling.amax(matrix))
            data, scale_inv = block_scaling.quantize_nvfp4(
                matrix, matrix_scale_inv, key, self.block_size
            )
            return data, scale_inv, matrix_scale_inv

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


Quantizer = DelayedScaleQuantizer | CurrentScaleQuantizer | BlockScaleQuantizer | NVFP4Quantizer
_QUANTIZER_TYPES = (
    DelayedScaleQuantizer,
    CurrentScaleQuantizer,
    BlockScaleQuantizer,
    NVFP4Quantizer,
)
_FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
_DTYPES = {
    DelayedScaleQuantizer: _FP8_DTYPES,
    CurrentScaleQuantizer: _FP8_DTYPES,
    BlockScaleQuantizer: _FP8_DTYPES,
    NVFP4Quantizer: (jnp.dtype(jnp.float4_e2m1fn),),
}


@dataclasses.dataclass(frozen=True)
class GemmPrecision:
    """The ``lax.dot_general`` precision of each per-tensor FP8 GEMM of a layer.

    ``lax.Precision.DEFAULT`` lets cuBLASLt accumulate FP8 products with fast accumulation (on
    Hopper and Ada), ``lax.Precision.HIGHEST`` with split (full float32) accumulation: a recipe's
    ``MMParams(use_split_accumulator=...)`` False and True. The defaults are
    ``Float8CurrentScaling``'s and what ``DelayedScaling`` uses: fast accumulation for the forward
    GEMM, whose error stays far below e4m3's rounding, and split accumulation for the backward
    GEMMs, which sum gradients over many tokens. Block-scaled GEMMs take no precision.
    """

    fprop: jax.lax.Precision = lax.Precision.DEFAULT
    dgrad: jax.lax.Precision = lax.Precision.HIGHEST
    wgrad: jax.lax.Precision = lax.Precision.HIGHEST


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizerSet:
    """The quantizers of one GEMM: its input ``x``, its ``kernel`` and its output gradient.

    ``dgrad`` quantizes the gradient of this GEMM's own output, which both backward GEMMs
    (dgrad and wgrad) consume. All three are None for no quantization. ``precision`` (static)
    is the precision of the forward, dgrad and wgrad GEMMs under per-tensor FP8.
    ``checkpoint_name`` (static, None by default) names the quantized operands the GEMM saves
    for its backward, for ``jax.checkpoint`` policies (TE's quantization checkpoint name).
    """

    x: Quantizer | None = None
    kernel: Quantizer | None = None
    dgrad: Quantizer | None = None
    precision: GemmPrecision = _static(GemmPrecision())  # noqa: RUF009
    checkpoint_name: str | None = _static(None)

    @property
    def is_noop(self) -> bool:
        """True when this set quantizes nothing."""
        return self.x is None and self.kernel is None and self.dgrad is None

    def check(self, argument: str = "quantizer_set") -> None:
        """Raises a clear error for a set that cannot drive FP8 GEMMs."""
        members = {"x": self.x, "kernel": self.kernel, "dgrad": self.dgrad}
        present = [name for name, quantizer in members.items() if quantizer is not None]
        if present and len(present) != 3:
            raise ValueError(
                f"{argument} quantizes {present} but not the rest: a GEMM is either fully FP8 or "
                "not at all; build sets with QuantizerFactory.create_set(fp8_recipe=...)"
            )
        for name, quantizer in members.items():
            if quantizer is not None:
                check_quantizer(quantizer, f"{argument}.{name}")
        if self.checkpoint_name is not None and not isinstance(self.checkpoint_name, str):
            raise TypeError(
                f"{argument}.checkpoint_name must be a str (a jax.checkpoint name) or None, got "
                f"{self.checkpoint_name!r}"
            )
        quantizers = {n: quantizer for n, quantizer in members.items() if quantizer is not None}
        if not quantizers:
            return
        if len({quantizer.block_scaled for quantizer in quantizers.values()}) > 1:
            raise ValueError(
                f"{argument} mixes block-scaled and per-tensor quantizers "
                f"({type(self.x).__name__}, {type(self.kernel).__name__}, "
                f"{type(self.dgrad).__name__}); build sets with "
                "QuantizerFactory.create_set(fp8_recipe=...)"
            )
        e5m2 = jnp.dtype(jnp.float8_e5m2)
        for a, b in (("x", "kernel"), ("dgrad", "kernel"), ("x", "dgrad")):
            if jnp.dtype(quantizers[a].q_dtype) == e5m2 == jnp.dtype(quantizers[b].q_dtype):
                raise ValueError(
                    f"{argument}: {a} and {b} are both float8_e5m2, and cuBLASLt cannot multiply "
                    "two e5m2 operands; use Format.HYBRID or Format.E4M3"
                )


noop_quantizer_set = QuantizerSet()


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


class QuantizerFactory:
    """Builds quantizer sets with fresh state from a recipe."""

    @overload
    @staticmethod
    def create_set(
        n_quantizer_sets: Literal[1] = 1,
        *,
        fp8_recipe: Recipe | None = None,
        sr_key: Array | None = None,
        checkpoint_name: str | None = None,
    ) -> QuantizerSet: ...

    @overload
    @staticmethod
    def create_set(
        n_quantizer_sets: Literal[2],
        *,
        fp8_recipe: Recipe | None = None,
        sr_key: Array | None = None,
        checkpoint_name: str | None = None,
    ) -> tuple[QuantizerSet, QuantizerSet]: ...

    @overload
    @staticmethod
    def create_set(
        n_quantizer_sets: int,
        *,
        fp8_recipe: Recipe | None = None,
        sr_key: Array | None = None,
        checkpoint_name: str | None = None,
    ) -> QuantizerSet | tuple[QuantizerSet, ...]: ...

    @staticmethod
    def create_set(
        n_quantizer_sets: int = 1,
        *,
        fp8_recipe: Recipe | None = None,
        sr_key: Array | None = None,
        checkpoint_name: str | None = None,
    ) -> QuantizerSet | tuple[QuantizerSet, ...]:
        """Fresh quantizer sets for ``n_quantizer_sets`` GEMMs.

        Args:
          n_quantizer_sets: how many sets to create (default 1; ``layernorm_mlp`` takes 2).
          fp8_recipe: the recipe; None means the recipe of the active ``te_flax.autocast``,
            or no quantization outside of one.
          sr_key: the RNG key of stochastic rounding, required by ``NVFP4BlockScaling()``
            unless ``disable_stochastic_rounding=True`` (each set gets its own key split from
            it) and unused by the other recipes.
          checkpoint_name: TransformerEngine's quantization checkpoint name (default None): the
            quantized operands each GEMM saves for its backward are named so with
            ``jax.ad_checkpoint.checkpoint_name``, so that a ``jax.checkpoint`` policy such as
            ``save_only_these_names(checkpoint_name)`` keeps them rather than quantizing again.

        Returns:
          One ``QuantizerSet`` when ``n_quantizer_sets == 1``, else a tuple of them.

        Example usage::

          >>> import jax
          >>> from te_flax.quantize import DelayedScaling, MXFP8BlockScaling, QuantizerFactory
          >>> qs = QuantizerFactory.create_set(fp8_recipe=DelayedScaling(amax_history_len=16))
          >>> qs.x.scale_inv.shape, qs.x.amax_history.shape, qs.x.q_dtype.__name__
          ((1,), (16,), 'float8_e4m3fn')
          >>> qs.dgrad.q_dtype.__name__
          'float8_e5m2'
          >>> type(QuantizerFactory.create_set(fp8_recipe=MXFP8BlockScaling()).x).__name__
          'BlockScaleQuantizer'
        """
        if not isinstance(n_quantizer_sets, int) or n_quantizer_sets < 1:
            raise ValueError(f"n_quantizer_sets must be an int >= 1, got {n_quantizer_sets!r}")
        recipe = get_autocast_recipe() if fp8_recipe is None else fp8_recipe
        keys: list[Array | None] = [None] * n_quantizer_sets
        if isinstance(recipe, NVFP4BlockScaling) and recipe.stochastic_rounding:
            if sr_key is None:
                raise ValueError(
                    "NVFP4BlockScaling() rounds gradients stochastically (TransformerEngine's "
                    "default), which needs an RNG key: pass sr_key=jax.random.key(...) (a new "
                    "one each step; modules draw it from the 'sr_rng' stream), or round to "
                    "nearest with NVFP4BlockScaling(disable_stochastic_rounding=True)"
                )
            keys = list(jax.random.split(sr_key, n_quantizer_sets))
        if checkpoint_name is not None and not isinstance(checkpoint_name, str):
            raise TypeError(
                f"checkpoint_name must be a str (a jax.checkpoint name) or None, got "
                f"{checkpoint_name!r}"
            )
        sets = tuple(_set_from_recipe(recipe, key) for key in keys)
        if checkpoint_name is not None:
            sets = tuple(
                qs if qs.is_noop else dataclasses.replace(qs, checkpoint_name=checkpoint_name)
                for qs in sets
            )
        return sets[0] if n_quantizer_sets == 1 else sets


def _set_from_recipe(recipe: Recipe | None, sr_key: Array | None) -> QuantizerSet:
    if recipe is None:
        return noop_quantizer_set
    check_recipe(recipe)
    if isinstance(recipe, NVFP4BlockScaling):
        # As TransformerEngine: the Hadamard transform for the inputs' and gradients' wgrad
        # layouts, 16x16 tiles for the kernel, stochastic rounding for the gradient only.
        rht = not recipe.disable_rht
        return QuantizerSet(
            NVFP4Quantizer(use_rht=rht),
            NVFP4Quantizer(use_2d=not recipe.disable_2d_quantization),
            NVFP4Quantizer(key=sr_key, use_rht=rht),
        )
    forward, backward = recipe.fp8_format.forward_dtype, recipe.fp8_format.backward_dtype
    if isinstance(recipe, MXFP8BlockScaling):
        return QuantizerSet(
            BlockScaleQuantizer(forward),
            BlockScaleQuantizer(forward),
            BlockScaleQuantizer(backward),
        )
    if isinstance(recipe, Float8CurrentScaling):
        power_2 = recipe.use_power_2_scales
        return QuantizerSet(
            CurrentScaleQuantizer(forward, power_2),
            CurrentScaleQuantizer(forward, power_2),
            CurrentScaleQuantizer(backward, power_2),
            GemmPrecision(
                fprop=recipe.fp8_gemm_fprop.precision,
                dgrad=recipe.fp8_gemm_dgrad.precision,
                wgrad=recipe.fp8_gemm_wgrad.precision,
            ),
        )
    return QuantizerSet(
        DelayedScaleQuantizer.fresh(forward, recipe),
        DelayedScaleQuantizer.fresh(forward, recipe),
        DelayedScaleQuantizer.fresh(backward, recipe),
    )


GemmOperand = ScaledTensor | BlockOperand


def quantize_operand(
    x: Array,
    quantizer: Quantizer | None,
    compute_dtype: DTypeLike,
    split: int | None = None,
    uses: tuple[str, ...] = (TRAILING,),
) -> tuple[GemmOperand, Quantizer | None]:
    """A GEMM operand from ``x``: quantized by ``quantizer``, or cast to ``compute_dtype``.

    ``split`` and ``uses`` say how the GEMMs contract ``x`` (see the module docstring); only
    block-scaled quantizers need them.
    """
    if quantizer is None:
        return ScaledTensor(x.astype(compute_dtype)), None
    if isinstance(quantizer, BlockScaleQuantizer | NVFP4Quantizer):
        if split is None:
            raise AssertionError("a block-scaled quantization needs the contraction split")
        return quantizer.quantize(x, split, uses)
    return quantizer.quantize(x, split, uses)


def as_cotangent(state: T) -> T:
    """Quantizer state as the ops return it from a backward pass: the new state as is, and a
    ``float0`` zero (no gradient) for every integer or RNG-key leaf (stochastic rounding keys).
    """

    def leaf(value: Array) -> Array | np.ndarray:
        if jnp.issubdtype(value.dtype, jnp.floating):
            return value
        return np.zeros(value.shape, jax.dtypes.float0)

    return jax.tree.map(leaf, state)
