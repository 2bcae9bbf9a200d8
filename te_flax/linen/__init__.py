"""te_flax's Flax Linen modules, a drop-in for ``transformer_engine.jax.flax``.

Public API::

  LayerNorm, DenseGeneral, LayerNormDenseGeneral, LayerNormMLP      the FP8 building blocks
  MoEBlock                                                          a mixture of experts
  DotProductAttention, MultiHeadAttention, RelativePositionBiases,
  TransformerLayer, TransformerLayerType                            TE's higher layers
  make_dot_general_cls, make_grouped_dense_cls,                     FP8 for Flax's own layers
  wrap_function_in_te_state_module, extend_logical_axis_rules
  TransformerEngineBase                                             generate_quantizer_set for
                                                                    a module's own GEMMs
"""

from te_flax.linen._base import TransformerEngineBase
from te_flax.linen.modules import DenseGeneral, LayerNorm, LayerNormDenseGeneral, LayerNormMLP
from te_flax.linen.moe import MoEBlock
from te_flax.linen.quantized import (
    extend_logical_axis_rules,
    make_dot_general_cls,
    make_grouped_dense_cls,
    wrap_function_in_te_state_module,
)
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
    "MoEBlock",
    "MultiHeadAttention",
    "RelativePositionBiases",
    "TransformerEngineBase",
    "TransformerLayer",
    "TransformerLayerType",
    "extend_logical_axis_rules",
    "make_dot_general_cls",
    "make_grouped_dense_cls",
    "wrap_function_in_te_state_module",
]
