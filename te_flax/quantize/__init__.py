"""FP8 recipes, quantizer state, and the scale math behind them.

Public API::

  Format, DelayedScaling, Float8CurrentScaling        per-tensor recipes
  Float8BlockScaling, MXFP8BlockScaling,              block-scaled recipes
  NVFP4BlockScaling
  MMParams, QParams                                   a recipe's GEMM and quantization options
  QuantizerSet, QuantizerFactory, noop_quantizer_set  per-GEMM quantizer state (pytrees)
  GemmPrecision                                       the precision of a set's FP8 GEMMs
  ScalingMode, QuantizeLayout                         TransformerEngine's names for scaling rules
  QuantizeMeta, QuantizeMetaSet                       state a quantizer set can start from
  DelayedScaleQuantizer, CurrentScaleQuantizer,       the quantizers a set holds
  Float8BlockQuantizer, BlockScaleQuantizer,
  NVFP4Quantizer
  GroupedQuantizer                                    one quantizer per group of a grouped GEMM
  merge_by_max                                        max-merge the updates of a reused state
  check_merged                                        catch a reused state whose updates were summed
  check_calibrated, UncalibratedFp8StateWarning       catch layers whose state never updates
  autocast, get_autocast_recipe                       the default recipe of a code region
"""

from te_flax.quantize.autocast import autocast, get_autocast_recipe
from te_flax.quantize.max_merge import (
    UncalibratedFp8StateWarning,
    check_calibrated,
    check_merged,
    float32_state,
    merge_by_max,
)
from te_flax.quantize.quantizer import (
    LEADING,
    TRAILING,
    BlockOperand,
    BlockScaledTensor,
    BlockScaleQuantizer,
    CurrentScaleQuantizer,
    DelayedScaleQuantizer,
    Float8BlockQuantizer,
    GemmOperand,
    GemmPrecision,
    GroupedQuantizer,
    NVFP4Quantizer,
    Quantizer,
    QuantizerFactory,
    QuantizerSet,
    ScaledTensor,
    as_cotangent,
    check_quantizer,
    noop_quantizer_set,
    quantize_operand,
)
from te_flax.quantize.recipes import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    MMParams,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    QParams,
    Recipe,
)
from te_flax.quantize.scaling_modes import (
    QuantizeLayout,
    QuantizeMeta,
    QuantizeMetaSet,
    ScalingMode,
)

__all__ = [
    "LEADING",
    "TRAILING",
    "BlockOperand",
    "BlockScaleQuantizer",
    "BlockScaledTensor",
    "CurrentScaleQuantizer",
    "DelayedScaleQuantizer",
    "DelayedScaling",
    "Float8BlockQuantizer",
    "Float8BlockScaling",
    "Float8CurrentScaling",
    "Format",
    "GemmOperand",
    "GemmPrecision",
    "GroupedQuantizer",
    "MMParams",
    "MXFP8BlockScaling",
    "NVFP4BlockScaling",
    "NVFP4Quantizer",
    "QParams",
    "QuantizeLayout",
    "QuantizeMeta",
    "QuantizeMetaSet",
    "Quantizer",
    "QuantizerFactory",
    "QuantizerSet",
    "Recipe",
    "ScaledTensor",
    "ScalingMode",
    "UncalibratedFp8StateWarning",
    "as_cotangent",
    "autocast",
    "check_calibrated",
    "check_merged",
    "check_quantizer",
    "float32_state",
    "get_autocast_recipe",
    "merge_by_max",
    "noop_quantizer_set",
    "quantize_operand",
]
