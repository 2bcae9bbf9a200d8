"""The quantizer set: the quantizers of one GEMM, as the ops take them, and its factory.

The ops take a ``QuantizerSet(x, kernel, dgrad)`` per GEMM as a differentiable argument; the
"gradient" they return for it is the set with its new state (``as_cotangent``).
"""

from __future__ import annotations

import dataclasses
from typing import Literal, TypeVar, overload

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array, lax

from te_flax.quantize.autocast import get_autocast_recipe
from te_flax.quantize.quantizers import (
    BlockScaleQuantizer,
    CurrentScaleQuantizer,
    DelayedScaleQuantizer,
    Float8BlockQuantizer,
    NVFP4Quantizer,
    Quantizer,
    check_quantizer,
)
from te_flax.quantize.recipes import (
    Float8BlockScaling,
    Float8CurrentScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    Recipe,
    check_recipe,
)
from te_flax.quantize.tensors import static_field as _static

__all__ = [
    "GemmPrecision",
    "QuantizerFactory",
    "QuantizerSet",
    "as_cotangent",
    "noop_quantizer_set",
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

    x: Quantizer | None = None
    kernel: Quantizer | None = None
    dgrad: Quantizer | None = None
    precision: GemmPrecision = _static(GemmPrecision())  # noqa: RUF009
    checkpoint_name: str | None = _static(None)

    @property
    def is_noop(self) -> bool:
        """True when this set quantizes nothing."""
        return self.x is None and self.kernel is None and self.dgrad is None

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


class QuantizerFactory:
    """Builds quantizer sets with fresh state from a recipe."""

    @overload
    @staticmethod
    def create_set(
        n_quantizer_sets: Literal[1] = 1,
        *,
        fp8_recipe: Recipe | None = None,
        sr_key: Array | None = None,
        checkpoint_name: str | None = None,
    ) -> QuantizerSet: ...

    @overload
    @staticmethod
    def create_set(
        n_quantizer_sets: Literal[2],
        *,
        fp8_recipe: Recipe | None = None,
        sr_key: Array | None = None,
        checkpoint_name: str | None = None,
    ) -> tuple[QuantizerSet, QuantizerSet]: ...

    @overload
    @staticmethod
    def create_set(
        n_quantizer_sets: int,
        *,
        fp8_recipe: Recipe | None = None,
        sr_key: Array | None = None,
        checkpoint_name: str | None = None,
    ) -> QuantizerSet | tuple[QuantizerSet, ...]: ...

    @staticmethod
    def create_set(
        n_quantizer_sets: int = 1,
        *,
        fp8_recipe: Recipe | None = None,
        sr_key: Array | None = None,
        checkpoint_name: str | None = None,
    ) -> QuantizerSet | tuple[QuantizerSet, ...]:
        """Fresh quantizer sets for ``n_quantizer_sets`` GEMMs.

        Args:
          n_quantizer_sets: how many sets to create (default 1; ``layernorm_mlp`` takes 2).
          fp8_recipe: the recipe; None means the recipe of the active ``te_flax.autocast``,
            or no quantization outside of one.
          sr_key: the RNG key of stochastic rounding, required by ``NVFP4BlockScaling()``
            unless ``disable_stochastic_rounding=True`` (each set gets its own key split from
            it) and unused by the other recipes.
          checkpoint_name: TransformerEngine's quantization checkpoint name (default None): the
            quantized operands each GEMM saves for its backward are named so with
            ``jax.ad_checkpoint.checkpoint_name``, so that a ``jax.checkpoint`` policy such as
            ``save_only_these_names(checkpoint_name)`` keeps them rather than quantizing again.

        Returns:
          One ``QuantizerSet`` when ``n_quantizer_sets == 1``, else a tuple of them.

        Example usage::

          >>> import jax
          >>> from te_flax.quantize import DelayedScaling, MXFP8BlockScaling, QuantizerFactory
          >>> qs = QuantizerFactory.create_set(fp8_recipe=DelayedScaling(amax_history_len=16))
          >>> qs.x.scale_inv.shape, qs.x.amax_history.shape, qs.x.q_dtype.__name__
          ((1,), (16,), 'float8_e4m3fn')
          >>> qs.dgrad.q_dtype.__name__
          'float8_e5m2'
          >>> type(QuantizerFactory.create_set(fp8_recipe=MXFP8BlockScaling()).x).__name__
          'BlockScaleQuantizer'
        """
        if not isinstance(n_quantizer_sets, int) or n_quantizer_sets < 1:
            raise ValueError(f"n_quantizer_sets must be an int >= 1, got {n_quantizer_sets!r}")
        recipe = get_autocast_recipe() if fp8_recipe is None else fp8_recipe
        keys: list[Array | None] = [None] * n_quantizer_sets
        if isinstance(recipe, NVFP4BlockScaling) and recipe.stochastic_rounding:
            if sr_key is None:
                raise ValueError(
                    "NVFP4BlockScaling() rounds gradients stochastically (TransformerEngine's "
                    "default), which needs an RNG key: pass sr_key=jax.random.key(...) (a new "
                    "one each step; modules draw it from the 'sr_rng' stream), or round to "
                    "nearest with NVFP4BlockScaling(disable_stochastic_rounding=True)"
                )
            keys = list(jax.random.split(sr_key, n_quantizer_sets))
        if checkpoint_name is not None and not isinstance(checkpoint_name, str):
            raise TypeError(
                f"checkpoint_name must be a str (a jax.checkpoint name) or None, got "
                f"{checkpoint_name!r}"
            )
        sets = tuple(_set_from_recipe(recipe, key) for key in keys)
        if checkpoint_name is not None:
            sets = tuple(
                qs if qs.is_noop else dataclasses.replace(qs, checkpoint_name=checkpoint_name)
                for qs in sets
            )
        return sets[0] if n_quantizer_sets == 1 else sets


def _set_from_recipe(recipe: Recipe | None, sr_key: Array | None) -> QuantizerSet:
    if recipe is None:
        return noop_quantizer_set
    check_recipe(recipe)
    if isinstance(recipe, NVFP4BlockScaling):
        # As TransformerEngine: the Hadamard transform for the inputs' and gradients' wgrad
        # layouts, 16x16 tiles for the kernel, stochastic rounding for the gradient only.
        rht = not recipe.disable_rht
        return QuantizerSet(
            NVFP4Quantizer(use_rht=rht),
            NVFP4Quantizer(use_2d=not recipe.disable_2d_quantization),
            NVFP4Quantizer(key=sr_key, use_rht=rht),
        )
    forward, backward = recipe.fp8_format.forward_dtype, recipe.fp8_format.backward_dtype
    if isinstance(recipe, Float8BlockScaling):
        power_2 = not recipe.use_f32_scales
        return QuantizerSet(
            Float8BlockQuantizer(forward, recipe.x_block_scaling_dim, power_2),
            Float8BlockQuantizer(forward, recipe.w_block_scaling_dim, power_2),
            Float8BlockQuantizer(backward, recipe.grad_block_scaling_dim, power_2),
        )
    if isinstance(recipe, MXFP8BlockScaling):
        return QuantizerSet(
            BlockScaleQuantizer(forward),
            BlockScaleQuantizer(forward),
            BlockScaleQuantizer(backward),
        )
    if isinstance(recipe, Float8CurrentScaling):
        power_2 = recipe.use_power_2_scales
        return QuantizerSet(
            CurrentScaleQuantizer(forward, power_2),
            CurrentScaleQuantizer(forward, power_2),
            CurrentScaleQuantizer(backward, power_2),
            GemmPrecision(
                fprop=recipe.fp8_gemm_fprop.precision,
                dgrad=recipe.fp8_gemm_dgrad.precision,
                wgrad=recipe.fp8_gemm_wgrad.precision,
            ),
        )
    return QuantizerSet(
        DelayedScaleQuantizer.fresh(forward, recipe),
        DelayedScaleQuantizer.fresh(forward, recipe),
        DelayedScaleQuantizer.fresh(backward, recipe),
    )


def as_cotangent(state: T) -> T:
    """Quantizer state as the ops return it from a backward pass: the new state as is, and a
    ``float0`` zero (no gradient) for every integer or RNG-key leaf (stochastic rounding keys).
    """

    def leaf(value: Array) -> Array | np.ndarray:
        if jnp.issubdtype(value.dtype, jnp.floating):
            return value
        return np.zeros(value.shape, jax.dtypes.float0)

    return jax.tree.map(leaf, state)
