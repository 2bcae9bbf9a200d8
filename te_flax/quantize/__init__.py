"""FP8 recipes, quantizer state, and the scale math behind them.

Public API::

  Format, DelayedScaling, Float8CurrentScaling        recipes
  QuantizerSet, QuantizerFactory, noop_quantizer_set  per-GEMM quantizer state (pytrees)
  DelayedScaleQuantizer, CurrentScaleQuantizer        the quantizers a set holds
  merge_by_max                                        max-merge the updates of a reused state
  autocast, get_autocast_recipe                       the default recipe of a code region
"""

from te_flax.quantize.autocast import autocast, get_autocast_recipe
from te_flax.quantize.max_merge import float32_state, merge_by_max
from te_flax.quantize.quantizer import (
    CurrentScaleQuantizer,
    DelayedScaleQuantizer,
    Quantizer,
    QuantizerFactory,
    QuantizerSet,
    ScaledTensor,
    check_quantizer,
    noop_quantizer_set,
    quantize_operand,
)
from te_flax.quantize.recipes import DelayedScaling, Float8CurrentScaling, Format, Recipe

__all__ = [
    "CurrentScaleQuantizer",
    "DelayedScaleQuantizer",
    "DelayedScaling",
    "Float8CurrentScaling",
    "Format",
    "Quantizer",
    "QuantizerFactory",
    "QuantizerSet",
    "Recipe",
    "ScaledTensor",
    "autocast",
    "check_quantizer",
    "float32_state",
    "get_autocast_recipe",
    "merge_by_max",
    "noop_quantizer_set",
    "quantize_operand",
]
