"""FP8 on the expert-parallel wire: the dispatch ``all_to_all`` moves float8 rows.

Under an FP8 recipe ``MoEBlock``'s expert parallelism sends each token copy to its expert's
device as float8 data plus, for each block of a row (128 elements, the whole row where 128
does not divide the hidden size; the recipe's own blocks for MXFP8 and blockwise FP8), the
block's amax in the compute dtype: 1 byte per element and 2 bytes (bfloat16) per block of 128,
0.51 of a BF16 row. The rows come back (the combine) in the compute dtype, as DeepSeek-V3
dispatches in FP8 and combines in BF16 (technical report, section 3.3).

Each row is quantized as the first expert GEMM quantizes it, wherever that is known before the
wire, so that the GEMM's quantization of what arrives gives back the wire's float8 values bit
for bit (same values, same scales): no second rounding, and the GEMM's operand is one device's.

* **Per-tensor recipes** (delayed and current scaling): each row on its expert's scale, that
  expert's ``scale_inv`` in delayed scaling's state, or current scaling's from the expert's
  amax over every device's rows (a ``pmax`` of ``[experts]`` floats before the wire). Every
  device knows every expert's scale, so none travels.
* **MXFP8 and blockwise FP8** (1x128 tiles): each row block on the recipe's own scale (e8m0,
  or float32 / power-of-two from the block's amax), recomputed from the amax after the wire.
* **NVFP4** (whose tensor scale spans every row): DeepSeek-V3's format, e4m3 on each 1x128
  block's ``amax / 448``; the GEMM rounds the received values a second time, to e2m1.

The block amax travels so that the GEMM's amaxes are exact: after the wire each block's
largest elements are set back to its amax, which quantizes as they did (to the same float8
value, or to the format's largest where one device clips too). Without it a value past the
delayed scale would arrive clipped, the amax history would record the clipped value, and the
scale could never grow again. The one exception to "bit for bit": delayed scaling that scales
just in time (a fresh state in a step that does not update it, ``te_flax._ops.custom_op``)
quantizes with its amax's scale, not the stored one the wire used, and rounds a second time.

The backward is the dispatch's transpose in the compute dtype: the tokens' gradient returns
through a compute-dtype ``all_to_all``, straight through the wire's rounding as through every
FP8 quantization.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax import Array, lax

from te_flax.quantize import (
    BlockScaleQuantizer,
    CurrentScaleQuantizer,
    DelayedScaleQuantizer,
    Float8BlockQuantizer,
    Quantizer,
    scaling,
)
from te_flax.quantize.block_scaling import FP8_BLOCK, e8m0_round_up

__all__ = ["WireFormat", "expert_scales", "fp8_all_to_all", "wire_format"]


@dataclasses.dataclass(frozen=True)
class WireFormat:
    """How rows cross the wire: float8 ``dtype``, one amax per ``block`` elements of a row (the
    whole row where ``block`` does not divide it), each block quantized with ``scale``:
    ``"expert"``, its row's expert scale; ``"amax"``, ``amax / fp8_max``; ``"power_2"``, that
    rounded up to a power of two (Float8BlockScaling's); ``"e8m0"``, MXFP8's."""

    dtype: Any = jnp.float8_e4m3fn
    block: int = FP8_BLOCK
    scale: str = "amax"

    def blocks(self, rows: Array) -> Array:
        """``[..., H]`` -> ``[..., H // block, block]``."""
        hidden = rows.shape[-1]
        block = self.block if hidden % self.block == 0 else hidden
        return rows.reshape(*rows.shape[:-1], hidden // block, block)

    def scales(self, amax: Array, row_scale: Array | None) -> Array:
        """float32 ``[..., blocks]``: each block's scale from its amax, or its row's
        ``row_scale`` (``"expert"``)."""
        if self.scale == "expert":
            assert row_scale is not None, "expert scales come with the rows"
            return jnp.broadcast_to(row_scale.astype(jnp.float32)[..., None], amax.shape)
        amax = amax.astype(jnp.float32)
        if self.scale == "e8m0":
            scale = e8m0_round_up(amax / scaling.fp8_max(self.dtype)).astype(jnp.float32)
            return jnp.maximum(scale, jnp.finfo(jnp.float32).tiny)
        one = jnp.ones((), jnp.float32)
        return scaling.compute_scale_inv(amax, self.dtype, 0, one, self.scale == "power_2")


def wire_format(quantizer: Quantizer | None) -> WireFormat:
    """The wire's format for rows that the first expert GEMM quantizes with ``quantizer``: its
    own scales where they can be known before the wire, so that its quantization of what
    arrives gives back the wire's values; else DeepSeek-V3's (e4m3, 1x128, ``amax / 448``)."""
    if isinstance(quantizer, (DelayedScaleQuantizer, CurrentScaleQuantizer)):
        return WireFormat(quantizer.q_dtype, FP8_BLOCK, "expert")
    if isinstance(quantizer, BlockScaleQuantizer):  # MXFP8: blocks of 32 along each row
        return WireFormat(quantizer.q_dtype, quantizer.block_size, "e8m0")
    if isinstance(quantizer, Float8BlockQuantizer) and quantizer.block_dims == 1:
        scale = "power_2" if quantizer.power_2_scale else "amax"
        return WireFormat(quantizer.q_dtype, quantizer.block_size, scale)
    return WireFormat()


def expert_scales(
    quantizer: Quantizer | None,
    rows: Array,
    row_expert: Array,
    experts: int,
    expert_axis: str,
    token_axes: tuple[str, ...],
) -> Array | None:
    """Each expert's ``scale_inv`` (float32 ``[experts]``) as its grouped GEMM will quantize
    its input with, known on every device before the wire; None for recipes without one
    per expert (block scaling: each block then scales by its own amax).

    Args:
      quantizer: the first expert GEMM's ``x`` quantizer, holding this device's experts.
      rows: ``[R, H]`` this device's token copies; ``row_expert``: int32 ``[R]`` their experts
        (``experts`` for a dropped one).
      experts: all experts; expert_axis / token_axes: the manual mesh axes of the experts and of
        the tokens.
    """
    if isinstance(quantizer, DelayedScaleQuantizer):
        local = lax.stop_gradient(quantizer.scale_inv[:, 0])  # [E / ep]
        return lax.all_gather(local, expert_axis, tiled=True)  # [E]
    if isinstance(quantizer, CurrentScaleQuantizer):
        # As the GEMM's amax: each expert's rows on every device (te_flax._ops.grouped).
        row_amax = jnp.max(jnp.abs(lax.stop_gradient(rows)), axis=1).astype(jnp.float32)  # [R]
        amax = jax.ops.segment_max(row_amax, row_expert, num_segments=experts)  # [E]
        amax = lax.pmax(jnp.maximum(amax, 0.0), token_axes)
        return quantizer.scale_inv_for(amax)
    return None


def _bytes(x: Array) -> Array:
    """``x`` as unsigned integers of its width: XLA:CPU widens a float8 collective to float16
    and a 16-bit float one to float32; an integer one crosses as it is on every backend."""
    return lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))


@partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def fp8_all_to_all(
    rows: Array,
    send_scale: Array | None,
    receive_scale: Array | None,
    axis: str,
    form: WireFormat,
) -> Array:
    """``lax.all_to_all(rows, axis, 0, 0)`` with ``rows`` crossing as float8 in ``form``.

    Args:
      rows: ``[devices, width, H]`` in the compute dtype; ``rows[d]`` goes to device ``d``.
      send_scale: float32 ``[devices, width]``, each row's expert scale (``expert_scales``) for
        the ``"expert"`` format; None for the others.
      receive_scale: float32 ``[devices, width]``, the expert scale of each row this device
        receives; None for the other formats.
      axis: the manual mesh axis of the ``all_to_all``.
      form: the wire's format (``wire_format``).

    Returns:
      ``[devices, width, H]`` in ``rows.dtype``: ``[d]`` what device ``d`` sent, as float8 on
      its scale, each block's largest elements at the block's exact amax.
    """
    blocks = form.blocks(rows)  # [devices, width, blocks, block]
    amax = jnp.max(jnp.abs(blocks), axis=-1)  # [devices, width, blocks], exact in rows.dtype
    data = scaling.quantize(blocks, form.dtype, form.scales(amax, send_scale)[..., None])
    data = lax.all_to_all(_bytes(data), axis, 0, 0)
    amax = lax.bitcast_convert_type(lax.all_to_all(_bytes(amax), axis, 0, 0), rows.dtype)
    values = lax.bitcast_convert_type(data, form.dtype).astype(jnp.float32)
    values = values * form.scales(amax, receive_scale)[..., None]
    # The largest elements of each block back at its exact amax, which quantizes as they did
    # (to the same float8 value, or clipped): the expert GEMM's amax is one device's.
    peak = jnp.max(jnp.abs(values), axis=-1, keepdims=True)
    exact = amax.astype(jnp.float32)[..., None]
    values = jnp.where(jnp.abs(values) == peak, jnp.where(values < 0, -exact, exact), values)
    return values.astype(rows.dtype).reshape(rows.shape)


def _forward(
    rows: Array,
    send_scale: Array | None,
    receive_scale: Array | None,
    axis: str,
    form: WireFormat,
) -> tuple[Array, tuple[Array | None, Array | None]]:
    out = fp8_all_to_all(rows, send_scale, receive_scale, axis, form)
    return out, (send_scale, receive_scale)


def _backward(
    axis: str, form: WireFormat, scales: tuple[Array | None, Array | None], grad: Array
) -> tuple[Array, Array | None, Array | None]:
    # An all_to_all over the leading axis is its own transpose; the gradient goes straight
    # through the rounding, in the compute dtype. The scales get none.
    zeros = jax.tree.map(jnp.zeros_like, scales)
    return (lax.all_to_all(grad, axis, 0, 0), *zeros)


fp8_all_to_all.defvjp(_forward, _backward)
