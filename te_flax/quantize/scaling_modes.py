"""TransformerEngine's names for how tensors are scaled and laid out: ``ScalingMode``,
``QuantizeLayout``, and the metadata ``QuantizeMeta`` / ``QuantizeMetaSet`` a quantizer set can
be created from.

Each te_flax quantizer has one scaling mode (``quantizer.scaling_mode``), and a recipe gives
each tensor role of a GEMM its mode (``recipe_scaling_modes``). te_flax's ops choose the
layouts each GEMM needs themselves, so a ``QuantizeLayout`` is accepted where TransformerEngine
takes one and changes nothing.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp

from te_flax.quantize.recipes import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    Recipe,
)

__all__ = [
    "QuantizeLayout",
    "QuantizeMeta",
    "QuantizeMetaSet",
    "ScalingMode",
    "recipe_scaling_modes",
]


class QuantizeLayout(enum.Enum):
    """Which layouts of a tensor a quantizer writes (TransformerEngine's ``QuantizeLayout``):
    row-wise (the tensor as it is), column-wise (for a GEMM that contracts its other axes), or
    both."""

    ROWWISE = 0
    COLWISE = 1
    ROWWISE_COLWISE = 2

    @property
    def has_rowwise(self) -> bool:
        """If the layout has the rowwise component."""
        return self in (QuantizeLayout.ROWWISE, QuantizeLayout.ROWWISE_COLWISE)

    @property
    def has_colwise(self) -> bool:
        """If the layout has the colwise component."""
        return self in (QuantizeLayout.COLWISE, QuantizeLayout.ROWWISE_COLWISE)

    @property
    def is_rowwise_colwise(self) -> bool:
        """If the layout is both rowwise and colwise."""
        return self is QuantizeLayout.ROWWISE_COLWISE

    @property
    def is_rowwise_only(self) -> bool:
        """If the layout is rowwise only."""
        return self is QuantizeLayout.ROWWISE

    @property
    def is_colwise_only(self) -> bool:
        """If the layout is colwise only."""
        return self is QuantizeLayout.COLWISE


class ScalingMode(enum.Enum):
    """How a tensor is scaled (TransformerEngine's ``ScalingMode``, with its members and
    predicates), plus blockwise FP8's two modes, which TransformerEngine's JAX code lacks:

    - ``NO_SCALING``: high precision, no quantization.
    - ``DELAYED_TENSOR_SCALING``, ``CURRENT_TENSOR_SCALING``: one float32 scale per tensor.
    - ``MXFP8_1D_SCALING``: an e8m0 scale per 32 elements along the contraction.
    - ``NVFP4_1D_SCALING``, ``NVFP4_2D_SCALING``: e2m1 data, an e4m3 scale per 16 elements
      (per 16x16 tile for 2D) and a float32 tensor scale.
    - ``FP8_1D_BLOCK_SCALING``, ``FP8_2D_BLOCK_SCALING``: ``Float8BlockScaling``'s float32
      scale per 1x128 tile or 128x128 block.
    """

    NO_SCALING = 0
    DELAYED_TENSOR_SCALING = 1
    MXFP8_1D_SCALING = 2
    CURRENT_TENSOR_SCALING = 3
    NVFP4_1D_SCALING = 4
    NVFP4_2D_SCALING = 5
    FP8_1D_BLOCK_SCALING = 100
    FP8_2D_BLOCK_SCALING = 101

    def get_scale_dtype(self) -> Any:
        """The dtype of this mode's scales."""
        if self is ScalingMode.MXFP8_1D_SCALING:
            return jnp.float8_e8m0fnu
        if self.is_nvfp4_scaling:
            return jnp.float8_e4m3fn
        return jnp.float32

    def is_tensor_scaling(self) -> bool:
        """Whether the mode is per-tensor scaling (delayed or current)."""
        return self in (ScalingMode.DELAYED_TENSOR_SCALING, ScalingMode.CURRENT_TENSOR_SCALING)

    def is_1d_block_scaling(self) -> bool:
        """Whether the mode scales blocks along one axis; NVFP4's 2D tiles count, as in
        TransformerEngine (their scales are broadcast to 1D blocks for the GEMM)."""
        return self in (ScalingMode.MXFP8_1D_SCALING, ScalingMode.FP8_1D_BLOCK_SCALING) or (
            self.is_nvfp4_scaling
        )

    @property
    def is_block_scaling(self) -> bool:
        """Whether the mode scales blocks of a tensor (any block mode)."""
        return self.is_1d_block_scaling() or self is ScalingMode.FP8_2D_BLOCK_SCALING

    @property
    def is_nvfp4_scaling(self) -> bool:
        """Whether the mode is NVFP4 (1D or 2D)."""
        return self in (ScalingMode.NVFP4_1D_SCALING, ScalingMode.NVFP4_2D_SCALING)

    @property
    def is_mxfp8_scaling(self) -> bool:
        """Whether the mode is MXFP8."""
        return self is ScalingMode.MXFP8_1D_SCALING

    @property
    def is_fp8_block_scaling(self) -> bool:
        """Whether the mode is blockwise FP8 (``Float8BlockScaling``'s tiles or blocks)."""
        return self in (ScalingMode.FP8_1D_BLOCK_SCALING, ScalingMode.FP8_2D_BLOCK_SCALING)

    def get_compatible_q_dtypes(self) -> set[Any]:
        """The data dtypes a quantizer of this mode can produce."""
        if self.is_nvfp4_scaling:
            return {jnp.float4_e2m1fn}
        if self is ScalingMode.NO_SCALING:
            return {jnp.float16, jnp.bfloat16, jnp.float32}
        return {jnp.float8_e5m2, jnp.float8_e4m3fn}


def recipe_scaling_modes(
    recipe: Recipe | None,
) -> tuple[ScalingMode, ScalingMode, ScalingMode]:
    """The scaling modes a recipe gives a GEMM's ``x``, ``kernel`` and output gradient."""
    if recipe is None:
        return (ScalingMode.NO_SCALING,) * 3
    if isinstance(recipe, DelayedScaling):
        return (ScalingMode.DELAYED_TENSOR_SCALING,) * 3
    if isinstance(recipe, Float8CurrentScaling):
        return (ScalingMode.CURRENT_TENSOR_SCALING,) * 3
    if isinstance(recipe, MXFP8BlockScaling):
        return (ScalingMode.MXFP8_1D_SCALING,) * 3
    if isinstance(recipe, Float8BlockScaling):
        dims = (
            recipe.x_block_scaling_dim,
            recipe.w_block_scaling_dim,
            recipe.grad_block_scaling_dim,
        )
        by_dim = {1: ScalingMode.FP8_1D_BLOCK_SCALING, 2: ScalingMode.FP8_2D_BLOCK_SCALING}
        x, kernel, grad = (by_dim[dim] for dim in dims)
        return x, kernel, grad
    assert isinstance(recipe, NVFP4BlockScaling), f"unknown recipe {recipe!r}"
    kernel = ScalingMode.NVFP4_1D_SCALING
    if not recipe.disable_2d_quantization:
        kernel = ScalingMode.NVFP4_2D_SCALING
    return ScalingMode.NVFP4_1D_SCALING, kernel, ScalingMode.NVFP4_1D_SCALING


class QuantizeMeta:
    """Keyword arguments of one quantizer (TransformerEngine's ``QuantizeMeta``): for delayed
    scaling ``scale`` (the quantization scale, ``1 / scale_inv``) and ``amax_history``."""

    def __init__(self, **kwargs: Any) -> None:
        self._kwargs = kwargs

    @staticmethod
    def merge(a: QuantizeMeta, b: QuantizeMeta) -> QuantizeMeta:
        """The keyword arguments of both; a key in both must have the same value."""
        if not isinstance(a, QuantizeMeta) or not isinstance(b, QuantizeMeta):
            raise TypeError(f"QuantizeMeta.merge takes two QuantizeMeta, got {a!r} and {b!r}")
        for key, value in b.get_kwargs_dictionary().items():
            mine = a.get_kwargs_dictionary().get(key, value)
            if mine is not value and not bool(jnp.all(jnp.asarray(mine == value))):
                raise ValueError(
                    f"QuantizeMeta.merge: {key} has different values in the two metadata "
                    f"({mine!r} and {value!r}); merge metadata of the same quantizer only"
                )
        return QuantizeMeta(**{**a.get_kwargs_dictionary(), **b.get_kwargs_dictionary()})

    def get_kwargs_dictionary(self) -> dict[str, Any]:
        """The metadata as a dictionary."""
        return self._kwargs

    def __repr__(self) -> str:
        return f"QuantizeMeta({', '.join(sorted(self._kwargs))})"


@dataclass
class QuantizeMetaSet:
    """The ``QuantizeMeta`` of a GEMM's ``x``, ``kernel`` and output gradient (``grad``)."""

    x: QuantizeMeta
    kernel: QuantizeMeta
    grad: QuantizeMeta
