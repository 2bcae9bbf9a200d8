"""te_flax: FP8 training layers for Flax Linen and NNX, with TransformerEngine's JAX API.

The functional ops live in ``te_flax.layernorm``, ``te_flax.dense`` and
``te_flax.layernorm_dense``; recipes and quantizer state in ``te_flax.quantize``.
"""

from te_flax.quantize import autocast

__version__ = "0.1.0"

__all__ = ["__version__", "autocast"]
