"""TransformerEngine's ``transformer_engine.jax.flax.module`` path: the base module and the FP8
building blocks.

``transformer_engine.jax.flax`` is ``te_flax.linen``, so TE code that names the base class by
its module path (``transformer_engine.jax.flax.module.TransformerEngineBase``) reads
``te_flax.linen.module.TransformerEngineBase``.
"""

from te_flax.linen._base import TransformerEngineBase
from te_flax.linen.modules import DenseGeneral, LayerNorm, LayerNormDenseGeneral, LayerNormMLP

__all__ = [
    "DenseGeneral",
    "LayerNorm",
    "LayerNormDenseGeneral",
    "LayerNormMLP",
    "TransformerEngineBase",
]
