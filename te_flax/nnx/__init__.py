"""te_flax's Flax NNX modules: the Linen modules' layers, NNX style.

Public API::

  LayerNorm, DenseGeneral, LayerNormDenseGeneral, LayerNormMLP   the modules
  MoEBlock                                                       a mixture of experts
  DotProductAttention, MultiHeadAttention, RelativePositionBiases,
  TransformerLayer, TransformerLayerType                         TE's higher layers
  Fp8Meta                                                        the FP8 state variable type
  Fp8Stats                                                       FP8 statistics (inspect_fp8)
  DotGeneral, EinsumOp                                           FP8 products for nnx.Linear's
                                                                 dot_general, nnx.Einsum's einsum_op
  value_and_grad, train_step, update_fp8_state                   the train step
  linen_variables, load_linen_variables                          Linen <-> NNX variables
"""

from te_flax.nnx._fp8_meta import Fp8Meta, Fp8Stats
from te_flax.nnx.convert import linen_variables, load_linen_variables
from te_flax.nnx.modules import DenseGeneral, LayerNorm, LayerNormDenseGeneral, LayerNormMLP
from te_flax.nnx.moe import MoEBlock
from te_flax.nnx.quantized import DotGeneral, EinsumOp
from te_flax.nnx.training import train_step, update_fp8_state, value_and_grad
from te_flax.nnx.transformer import (
    DotProductAttention,
    MultiHeadAttention,
    RelativePositionBiases,
    TransformerLayer,
    TransformerLayerType,
)

__all__ = [
    "DenseGeneral",
    "DotGeneral",
    "DotProductAttention",
    "EinsumOp",
    "Fp8Meta",
    "Fp8Stats",
    "LayerNorm",
    "LayerNormDenseGeneral",
    "LayerNormMLP",
    "MoEBlock",
    "MultiHeadAttention",
    "RelativePositionBiases",
    "TransformerLayer",
    "TransformerLayerType",
    "linen_variables",
    "load_linen_variables",
    "train_step",
    "update_fp8_state",
    "value_and_grad",
]
