"""Kernel (2) for LayerNormMLP's forward: activation, quantize and amax in one pass.

The second GEMM's input is the activation of the first GEMM's output. XLA fuses the
activation with the amax reduction, but a reduction and the transposes of the quantization do
not share a fusion: it writes the activation in high precision and reads it back to quantize it
(and write the transposed layout that the weight gradient's GEMM reads). This kernel reads each
tile of the pre-activation slices once and writes the float8 activation in the layouts asked for
and the tile's amax; the activation in high precision exists only in registers.

The arithmetic is the XLA stage's: the activation of the slices computed in float32 and rounded
once to the pre-activation's dtype (as TransformerEngine's activation kernels compute it), then
``clip(activation / scale_inv)`` and the cast.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax.numpy as jnp
from jax import Array
from jax.experimental.pallas import triton as plgpu
from jax.typing import DTypeLike

from te_flax._ops.activations import activation_of_slices
from te_flax._ops.kernels.common import lowered_once
from te_flax._ops.kernels.quantize import Tiles, layouts_call, store_quantized

__all__ = ["activation_quantize_tiles"]


def _kernel(
    pre_ref: Any,
    scale_inv_ref: Any,
    *out_refs: Any,
    tiles: Tiles,
    activation_type: tuple[str, ...],
    q_dtype: DTypeLike | None,
    layouts: tuple[bool, bool],
) -> None:
    row, column, mask = tiles.indices()
    slices = [
        plgpu.load(
            pre_ref.at[row[:, None], index * tiles.columns + column[None, :]], mask=mask, other=0.0
        )
        for index in range(len(activation_type))
    ]
    # In float32, rounded once to the pre-activation's dtype (the XLA stage's arithmetic).
    activated = activation_of_slices([part.astype(jnp.float32) for part in slices], activation_type)
    activated = jnp.where(mask, activated.astype(slices[0].dtype).astype(jnp.float32), 0.0)
    store_quantized(activated, scale_inv_ref, out_refs, tiles, q_dtype, layouts)


@lowered_once("activation_type", "q_dtype", "layouts", "interpret")
def activation_quantize_tiles(
    pre_activation: Array,
    scale_inv: Array,
    activation_type: tuple[str, ...],
    q_dtype: DTypeLike | None,
    layouts: tuple[bool, bool],
    *,
    interpret: bool,
) -> tuple[Array | None, Array | None, Array]:
    """The activation quantized with ``scale_inv``, as is and transposed, and the tile maxima.

    Args:
      pre_activation: ``[rows, n_act * intermediate]``, the slices side by side.
      scale_inv: f32 ``[1]``, the dequantization scale.
      activation_type: the canonical activation names (see ``te_flax._ops.activations``).
      q_dtype: the float8 dtype, or None to compute the amax partials only.
      layouts: which float8 results to write: ``[rows, intermediate]``, ``[intermediate,
        rows]``.
      interpret: run in Pallas interpret mode (off GPUs).

    Returns:
      The float8 activation ``[rows, intermediate]`` and ``[intermediate, rows]`` (None where
      not asked for or without ``q_dtype``) and f32 ``[programs]``, the tiles' amax.
    """
    rows, width = pre_activation.shape
    tiles = Tiles(rows, width // len(activation_type))
    return layouts_call(
        partial(_kernel, tiles=tiles, activation_type=activation_type, q_dtype=q_dtype),
        (pre_activation, scale_inv),
        tiles,
        q_dtype,
        layouts,
        "te_flax_activation_quantize",
        interpret=interpret,
    )
