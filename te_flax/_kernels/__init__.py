"""Fused Pallas kernels for the hot element-wise stages, behind one switch (``TE_FLAX_PALLAS``).

Each entry point here takes the same operands as the XLA stage it replaces and a ``fallback``
that is that stage; ``switch.dispatch`` picks one per platform. The kernels run on CUDA GPUs
through Pallas' Triton lowering, and anywhere in interpret mode (tests).
"""

from te_flax._kernels.operands import (
    norm_backward_grads,
    norm_quantize_operand,
    tiled_quantize_operand,
)
from te_flax._kernels.switch import ENV_VAR, dispatch, mode, pallas_kernels

__all__ = [
    "ENV_VAR",
    "dispatch",
    "mode",
    "norm_backward_grads",
    "norm_quantize_operand",
    "pallas_kernels",
    "tiled_quantize_operand",
]
