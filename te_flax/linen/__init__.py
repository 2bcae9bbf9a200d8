"""te_flax's Flax Linen modules, a drop-in for ``transformer_engine.jax.flax``.

Public API::

  LayerNorm, DenseGeneral, LayerNormDenseGeneral, LayerNormMLP      the FP8 building blocks
  DotProductAttention, MultiHeadAttention, RelativePositionBiases,
  TransformerLayer, TransformerLayerType                            TE's higher layers
  TransformerEngineBase                                             generate_quantizer_set for
                                                                    a module's own GEMMs
"""

from te_flax.linen._base import TransformerEngineBase
from te_flax.linen.modules import DenseGeneral, LayerNorm, LayerNormDenseGeneral, LayerNormMLP
from te_flax.linen.transformer import (
    DotProductAttention,
    MultiHeadAttention,
    RelativePositionBiases,
    TransformerLayer,
    TransformerLayerType,
)

__all__ = [
    "DenseGeneral",
    "DotProductAttention",
    "LayerNorm",
    "LayerNormDenseGeneral",
    "LayerNormMLP",
    "MultiHeadAttention",
    "RelativePositionBiases",
    "TransformerEngineBase",
    "TransformerLayer",
    "TransformerLayerType",
]
