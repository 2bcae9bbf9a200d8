"""Fused Pallas kernels for the hot element-wise stages, behind one switch (``TE_FLAX_PALLAS``).

Each entry point here takes the same operands as the XLA stage it replaces and a ``fallback``
that is that stage; ``switch.dispatch`` picks one per platform. The kernels run on CUDA GPUs
through Pallas' Triton lowering, and anywhere in interpret mode (tests).

- ``norm_quantize``: normalize with the saved statistics, quantize, amax (kernel 1);
- ``quantize``: a GEMM kernel's float8 data in both layouts and its amax (kernel 2);
- ``activation_quantize``: LayerNormMLP's activation quantized in its GEMM layouts, with its
  amax (kernel 2 with its producer);
- ``activation_grad``: LayerNormMLP's activation backward quantized in both layouts, with its
  amax and bias gradient (kernel 2 with its producer);
- ``norm_backward``: dx, dgamma and dbeta of the norm (kernel 3);
- ``activation_grad_rows``: MoEBlock's expert activation backward quantized with each expert's
  scale, with each expert's amax (``activation_grad_rows_mosaic``, through
  ``te_flax._ops.grouped_activation``).

On a GPU each kernel configuration is checked against its XLA stage on its first use in a
process (``first_use``; ``TE_FLAX_KERNEL_CHECK=0`` or ``kernel_checks("0")`` turn it off).
"""

from te_flax._ops.kernels.first_use import KernelCheckWarning, kernel_checks
from te_flax._ops.kernels.operands import (
    GradOperand,
    activation_grad_operand,
    activation_quantize_operand,
    norm_backward_grads,
    norm_quantize_operand,
    tiled_quantize_operand,
)
from te_flax._ops.kernels.switch import ENV_VAR, dispatch, mode, pallas_kernels, traced_in_scan

__all__ = [
    "ENV_VAR",
    "GradOperand",
    "KernelCheckWarning",
    "activation_grad_operand",
    "activation_quantize_operand",
    "dispatch",
    "kernel_checks",
    "mode",
    "norm_backward_grads",
    "norm_quantize_operand",
    "pallas_kernels",
    "tiled_quantize_operand",
    "traced_in_scan",
]
