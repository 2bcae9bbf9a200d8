"""``GroupedQuantizer``: the quantizers of one tensor role of a grouped GEMM, one per group
(TransformerEngine's ``GroupedQuantizer``), as ``grouped_dense`` takes them.

TransformerEngine keeps a tuple of ``n_groups`` quantizers. te_flax keeps one quantizer of the
same kind whose state leaves have a leading group axis (delayed scaling: ``scale_inv [G, 1]``
and ``amax_history [G, L]``), so that the groups' states update in one vectorised step and
shard over an expert mesh axis like any ``[G, ...]`` array; the stateless quantizers (current
scaling, MXFP8, NVFP4, blockwise FP8) scale each group from its own rows or blocks, so one
quantizer serves every group. ``quantizers`` gives TransformerEngine's tuple.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from te_flax._base.checks import check_positive_int
from te_flax.quantize.max_merge import float32_state
from te_flax.quantize.scaling_modes import QuantizeLayout, ScalingMode
from te_flax.quantize.tensor_quantizers import (
    BlockScaleQuantizer,
    DelayedScaleQuantizer,
    Quantizer,
    check_quantizer,
)
from te_flax.quantize.tensors import static_field as _static

__all__ = ["GroupedQuantizer", "group_quantizer"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GroupedQuantizer:
    """One quantizer per group of a grouped GEMM (TransformerEngine's ``GroupedQuantizer``).

    Made by ``QuantizerFactory.create(n_groups=G)``, ``QuantizerFactory.create_set(n_groups=G)``,
    a module's ``generate_quantizer_set(n_groups=G)`` and ``te_flax.dense.grouped_quantizer_set``
    (one implementation); only ``te_flax.dense.grouped_dense`` takes it.

    Attributes:
      quantizer: the groups' quantizer: delayed scaling with its state stacked along a leading
        group axis (``scale_inv [G, 1]``, ``amax_history [G, L]``), or a stateless quantizer
        that scales each group on its own.
      n_groups: the number of groups (static).
      q_layout: TransformerEngine's ``QuantizeLayout``, recorded as TE sets it (static);
        te_flax's ops quantize each tensor in the layouts their GEMMs contract.
      checkpoint_name: TransformerEngine's quantization checkpoint name (static, default None).
    """

    quantizer: Quantizer
    n_groups: int = _static(1)
    q_layout: QuantizeLayout = _static(QuantizeLayout.ROWWISE_COLWISE)  # noqa: RUF009
    checkpoint_name: str | None = _static(None)

    @property
    def block_scaled(self) -> bool:
        """True when the groups are quantized per block (MXFP8, NVFP4, blockwise FP8)."""
        return self.quantizer.block_scaled

    @property
    def q_dtype(self) -> jnp.dtype:
        """The low-precision dtype of every group."""
        return jnp.dtype(self.quantizer.q_dtype)

    @property
    def scaling_mode(self) -> ScalingMode:
        """TransformerEngine's ``ScalingMode`` of every group."""
        return self.quantizer.scaling_mode

    @property
    def data_layout(self) -> str:
        """The data layout string TransformerEngine gives (``"NN"`` for MXFP8, else ``"NT"``)."""
        return "NN" if isinstance(self.quantizer, BlockScaleQuantizer) else "NT"

    @property
    def quantizers(self) -> tuple[Quantizer, ...]:
        """TransformerEngine's tuple of ``n_groups`` quantizers: group ``g``'s state is
        ``quantizer``'s leaves at index ``g`` (delayed scaling); a stateless quantizer is the
        same for every group. Views in float32 (a max-merged state's cotangents still merge
        by max)."""
        if not isinstance(self.quantizer, DelayedScaleQuantizer):
            return (self.quantizer,) * self.n_groups
        stacked = float32_state(self.quantizer)
        return tuple(jax.tree.map(lambda leaf, g=g: leaf[g], stacked) for g in range(self.n_groups))


def group_quantizer(
    quantizer: Quantizer | GroupedQuantizer,
    n_groups: int,
    q_layout: QuantizeLayout | None = None,
    checkpoint_name: str | None = None,
) -> GroupedQuantizer:
    """``quantizer`` as the quantizers of ``n_groups`` groups.

    A delayed-scaling state is repeated along a new leading group axis, unless it already has
    one of ``n_groups`` entries (a module's per-group variables); a ``GroupedQuantizer`` of
    ``n_groups`` groups is returned as it is.

    Args:
      quantizer: a quantizer, or a ``GroupedQuantizer``.
      n_groups: the number of groups, an int >= 1.
      q_layout: TransformerEngine's layout to record (None: ``ROWWISE_COLWISE``).
      checkpoint_name: TransformerEngine's quantization checkpoint name (default None).

    Returns:
      A ``GroupedQuantizer``.
    """
    check_positive_int(n_groups, "n_groups", "the number of groups of a grouped GEMM, or None")
    if isinstance(quantizer, GroupedQuantizer):
        if quantizer.n_groups != n_groups:
            raise ValueError(
                f"the quantizer is already grouped for {quantizer.n_groups} groups, not "
                f"n_groups={n_groups}; make a fresh set with "
                f"QuantizerFactory.create_set(..., n_groups={n_groups})"
            )
        return quantizer
    check_quantizer(quantizer, "quantizer")
    if isinstance(quantizer, DelayedScaleQuantizer):
        quantizer = _stacked(quantizer, n_groups)
    layout = QuantizeLayout.ROWWISE_COLWISE if q_layout is None else q_layout
    return GroupedQuantizer(quantizer, n_groups, layout, checkpoint_name)


def _stacked(quantizer: DelayedScaleQuantizer, n_groups: int) -> DelayedScaleQuantizer:
    """The delayed state with a leading group axis of ``n_groups`` entries."""
    if quantizer.scale_inv.ndim == 1:
        return jax.tree.map(lambda leaf: jnp.broadcast_to(leaf, (n_groups, *leaf.shape)), quantizer)
    if quantizer.scale_inv.shape != (n_groups, 1) or quantizer.amax_history.ndim != 2:
        raise ValueError(
            f"a delayed-scaling state of shape {tuple(quantizer.scale_inv.shape)} (scale_inv) "
            f"and {tuple(quantizer.amax_history.shape)} (amax_history) is not one state per "
            f"group of {n_groups} groups: ({n_groups}, 1) and ({n_groups}, amax_history_len); "
            "start from an ungrouped set (QuantizerFactory.create_set(...))"
        )
    return quantizer
