"""TransformerEngine's ``transformer_engine.jax.flax.module`` path: the base module, the FP8
building blocks and the injection of FP8 products into Flax's own layers.

``transformer_engine.jax.flax`` is ``te_flax.linen``, so TE code that names the base class by
its module path (``transformer_engine.jax.flax.module.TransformerEngineBase``) reads
``te_flax.linen.module.TransformerEngineBase``.
"""

from te_flax.linen._base import TransformerEngineBase
from te_flax.linen.modules import DenseGeneral, LayerNorm, LayerNormDenseGeneral, LayerNormMLP
from te_flax.linen.quantized import (
    make_dot_general_cls,
    make_grouped_dense_cls,
    wrap_function_in_te_state_module,
)

__all__ = [
    "DenseGeneral",
    "LayerNorm",
    "LayerNormDenseGeneral",
    "LayerNormMLP",
    "TransformerEngineBase",
    "make_dot_general_cls",
    "make_grouped_dense_cls",
    "wrap_function_in_te_state_module",
]
