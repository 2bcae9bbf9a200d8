"""The quantizer set: the quantizers of one GEMM, as the ops take them.

``te_flax.quantize.factory.QuantizerFactory`` builds sets from a recipe or a scaling mode.

The ops take a ``QuantizerSet(x, kernel, dgrad)`` per GEMM as a differentiable argument; the
"gradient" they return for it is the set with its new state (``as_cotangent``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array, lax

from te_flax._base.checks import check_positive_int
from te_flax.quantize.grouped_quantizer import GroupedQuantizer, group_quantizer
from te_flax.quantize.scaling_modes import QuantizeLayout
from te_flax.quantize.tensor_quantizers import Quantizer, check_quantizer
from te_flax.quantize.tensors import static_field as _static

__all__ = [
    "GemmPrecision",
    "QuantizerSet",
    "as_cotangent",
    "grouped_quantizer_set",
    "noop_quantizer_set",
    "ungrouped_quantizer_set",
]


T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class GemmPrecision:
    """The ``lax.dot_general`` precision of each per-tensor FP8 GEMM of a layer.

    ``lax.Precision.DEFAULT`` lets cuBLASLt accumulate FP8 products with fast accumulation (on
    Hopper and Ada), ``lax.Precision.HIGHEST`` with split (full float32) accumulation: a recipe's
    ``MMParams(use_split_accumulator=...)`` False and True. The defaults are
    ``Float8CurrentScaling``'s and what ``DelayedScaling`` uses: fast accumulation for the forward
    GEMM, whose error stays far below e4m3's rounding, and split accumulation for the backward
    GEMMs, which sum gradients over many tokens. Block-scaled GEMMs take no precision.
    """

    fprop: jax.lax.Precision = lax.Precision.DEFAULT
    dgrad: jax.lax.Precision = lax.Precision.HIGHEST
    wgrad: jax.lax.Precision = lax.Precision.HIGHEST


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizerSet:
    """The quantizers of one GEMM: its input ``x``, its ``kernel`` and its output gradient.

    ``dgrad`` quantizes the gradient of this GEMM's own output, which both backward GEMMs
    (dgrad and wgrad) consume. All three are None for no quantization. ``precision`` (static)
    is the precision of the forward, dgrad and wgrad GEMMs under per-tensor FP8.
    ``checkpoint_name`` (static, None by default) names the quantized operands the GEMM saves
    for its backward, for ``jax.checkpoint`` policies (TE's quantization checkpoint name).
    """

    # A grouped GEMM's set holds GroupedQuantizers (QuantizerFactory.create_set(n_groups=G)),
    # which only grouped_dense takes: it unwraps them (ungrouped_quantizer_set) before its
    # check, and every other op's check refuses them, so the ops read these types.
    x: Quantizer | None = None
    kernel: Quantizer | None = None
    dgrad: Quantizer | None = None
    precision: GemmPrecision = _static(GemmPrecision())  # noqa: RUF009
    checkpoint_name: str | None = _static(None)

    @property
    def is_noop(self) -> bool:
        """True when this set quantizes nothing."""
        return self.x is None and self.kernel is None and self.dgrad is None

    @property
    def block_scaled(self) -> bool:
        """True when this set quantizes per block (MXFP8, NVFP4, blockwise FP8)."""
        return any(q is not None and q.block_scaled for q in (self.x, self.kernel, self.dgrad))

    def check(self, argument: str = "quantizer_set") -> None:
        """Raises a clear error for a set that cannot drive FP8 GEMMs."""
        members = {"x": self.x, "kernel": self.kernel, "dgrad": self.dgrad}
        present = [name for name, quantizer in members.items() if quantizer is not None]
        if present and len(present) != 3:
            raise ValueError(
                f"{argument} quantizes {present} but not the rest: a GEMM is either fully FP8 or "
                "not at all; build sets with QuantizerFactory.create_set(fp8_recipe=...)"
            )
        for name, quantizer in members.items():
            if isinstance(quantizer, GroupedQuantizer):
                raise ValueError(
                    f"{argument}.{name} is a GroupedQuantizer (one quantizer per group, from "
                    "n_groups=...), which only te_flax.dense.grouped_dense takes; build this "
                    "GEMM's set without n_groups"
                )
            if quantizer is not None:
                check_quantizer(quantizer, f"{argument}.{name}")
        if self.checkpoint_name is not None and not isinstance(self.checkpoint_name, str):
            raise TypeError(
                f"{argument}.checkpoint_name must be a str (a jax.checkpoint name) or None, got "
                f"{self.checkpoint_name!r}"
            )
        quantizers = {n: quantizer for n, quantizer in members.items() if quantizer is not None}
        if not quantizers:
            return
        if len({quantizer.block_scaled for quantizer in quantizers.values()}) > 1:
            raise ValueError(
                f"{argument} mixes block-scaled and per-tensor quantizers "
                f"({type(self.x).__name__}, {type(self.kernel).__name__}, "
                f"{type(self.dgrad).__name__}); build sets with "
                "QuantizerFactory.create_set(fp8_recipe=...)"
            )
        e5m2 = jnp.dtype(jnp.float8_e5m2)
        for a, b in (("x", "kernel"), ("dgrad", "kernel"), ("x", "dgrad")):
            if jnp.dtype(quantizers[a].q_dtype) == e5m2 == jnp.dtype(quantizers[b].q_dtype):
                raise ValueError(
                    f"{argument}: {a} and {b} are both float8_e5m2, and cuBLASLt cannot multiply "
                    "two e5m2 operands; use Format.HYBRID or Format.E4M3"
                )


noop_quantizer_set = QuantizerSet()


def grouped_quantizer_set(
    quantizer_set: QuantizerSet,
    n_groups: int,
    q_layouts: tuple[QuantizeLayout | None, ...] = (None, None, None),
) -> QuantizerSet:
    """``quantizer_set`` with one quantizer per group, for ``grouped_dense`` with ``n_groups``
    groups: each quantizer becomes a ``GroupedQuantizer`` (``group_quantizer``), as
    ``QuantizerFactory.create_set(n_groups=G)`` makes them. A noop set stays a noop set.

    Args:
      quantizer_set: the set of one group (or already grouped for ``n_groups`` groups).
      n_groups: the number of groups, an int >= 1.
      q_layouts: TransformerEngine's layout to record for ``x``, ``kernel`` and ``dgrad``
        (None: ``ROWWISE_COLWISE``).

    Returns:
      The grouped ``QuantizerSet``.

    Example usage::

      >>> from te_flax.dense import grouped_quantizer_set
      >>> from te_flax.quantize import DelayedScaling, QuantizerFactory
      >>> qs = QuantizerFactory.create_set(fp8_recipe=DelayedScaling(amax_history_len=16))
      >>> grouped = grouped_quantizer_set(qs, 8)
      >>> type(grouped.x).__name__, grouped.x.n_groups, len(grouped.x.quantizers)
      ('GroupedQuantizer', 8, 8)
      >>> grouped.x.quantizer.scale_inv.shape, grouped.x.quantizers[0].amax_history.shape
      ((8, 1), (16,))
    """
    if not isinstance(quantizer_set, QuantizerSet):
        raise TypeError(
            f"quantizer_set must be a te_flax.quantize.QuantizerSet, got {quantizer_set!r}; "
            "build one with QuantizerFactory.create_set(...)"
        )
    check_positive_int(n_groups, "n_groups", "the number of groups of a grouped GEMM")
    name = quantizer_set.checkpoint_name

    def grouped(quantizer: Quantizer | None, layout: QuantizeLayout | None) -> Any:
        return None if quantizer is None else group_quantizer(quantizer, n_groups, layout, name)

    x_layout, kernel_layout, dgrad_layout = q_layouts
    return dataclasses.replace(
        quantizer_set,
        x=grouped(quantizer_set.x, x_layout),
        kernel=grouped(quantizer_set.kernel, kernel_layout),
        dgrad=grouped(quantizer_set.dgrad, dgrad_layout),
    )


def ungrouped_quantizer_set(quantizer_set: T) -> T:
    """The set whose ``GroupedQuantizer`` members are their groups' quantizer (delayed state
    stacked ``[G, ...]``), as ``grouped_dense``'s stages take it; other members, and anything
    that is not a ``QuantizerSet`` (for the caller's check to refuse), as they are.

    A reshaping of the pytree only: the gradient with respect to the grouped set (the new
    state) flows through it unchanged.
    """
    if not isinstance(quantizer_set, QuantizerSet):
        return quantizer_set

    def inner(quantizer: Any) -> Any:
        return quantizer.quantizer if isinstance(quantizer, GroupedQuantizer) else quantizer

    ungrouped: Any = dataclasses.replace(
        quantizer_set,
        x=inner(quantizer_set.x),
        kernel=inner(quantizer_set.kernel),
        dgrad=inner(quantizer_set.dgrad),
    )
    return cast(T, ungrouped)


def as_cotangent(state: T) -> T:
    """Quantizer state as the ops return it from a backward pass: the new state as is, and a
    ``float0`` zero (no gradient) for every integer or RNG-key leaf (stochastic rounding keys).
    """

    def leaf(value: Array) -> Array | np.ndarray:
        if jnp.issubdtype(value.dtype, jnp.floating):
            return value
        return np.zeros(value.shape, jax.dtypes.float0)

    return jax.tree.map(leaf, state)
