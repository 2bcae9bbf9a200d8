"""te_flax's Flax Linen modules, a drop-in for ``transformer_engine.jax.flax``.

Public API::

  LayerNorm, DenseGeneral, LayerNormDenseGeneral, LayerNormMLP
"""

from te_flax.linen.modules import DenseGeneral, LayerNorm, LayerNormDenseGeneral, LayerNormMLP

__all__ = ["DenseGeneral", "LayerNorm", "LayerNormDenseGeneral", "LayerNormMLP"]
