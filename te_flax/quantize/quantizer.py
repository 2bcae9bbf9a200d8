"""TransformerEngine's ``quantize.quantizer`` module: the quantizers, the sets the ops take and
the factory that builds them, at TE's import path.

The code lives by concern in modules below this one, which each import the quantizer classes
(so the classes cannot live here, where the set and the factory are re-exported):
``te_flax.quantize.tensor_quantizers`` (how one tensor is scaled), ``te_flax.quantize.tensors``
(the quantized GEMM operands), ``te_flax.quantize.grouped_quantizer`` (one quantizer per group
of a grouped GEMM), ``te_flax.quantize.quantizer_set`` (the quantizers of one GEMM) and
``te_flax.quantize.factory`` (which builds them).
"""

from te_flax.quantize.factory import QuantizerFactory
from te_flax.quantize.grouped_quantizer import GroupedQuantizer
from te_flax.quantize.quantizer_set import (
    GemmPrecision,
    QuantizerSet,
    as_cotangent,
    noop_quantizer_set,
)
from te_flax.quantize.tensor_quantizers import (
    BlockScaleQuantizer,
    CurrentScaleQuantizer,
    DelayedScaleQuantizer,
    Float8BlockQuantizer,
    NVFP4Quantizer,
    Quantizer,
    check_quantizer,
    quantize_operand,
)
from te_flax.quantize.tensors import (
    LEADING,
    TRAILING,
    BlockOperand,
    BlockScaledTensor,
    GemmOperand,
    ScaledTensor,
)

__all__ = [
    "LEADING",
    "TRAILING",
    "BlockOperand",
    "BlockScaleQuantizer",
    "BlockScaledTensor",
    "CurrentScaleQuantizer",
    "DelayedScaleQuantizer",
    "Float8BlockQuantizer",
    "GemmOperand",
    "GemmPrecision",
    "GroupedQuantizer",
    "NVFP4Quantizer",
    "Quantizer",
    "QuantizerFactory",
    "QuantizerSet",
    "ScaledTensor",
    "as_cotangent",
    "check_quantizer",
    "noop_quantizer_set",
    "quantize_operand",
]
