"""Quantizers: the state of each quantized tensor as a pytree, and the sets the ops take.

A quantizer knows one tensor's float8 dtype and scaling rule and, for delayed scaling, carries
that tensor's state (``scale_inv`` f32[1] and ``amax_history`` f32[L]) as pytree leaves. The ops
take a ``QuantizerSet(x, kernel, dgrad)`` per GEMM as a differentiable argument; the "gradient"
they return for it is the set with its new state.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import Array

from te_flax.quantize import scaling
from te_flax.quantize.autocast import get_autocast_recipe
from te_flax.quantize.recipes import DelayedScaling, Float8CurrentScaling, Recipe, check_recipe

__all__ = [
    "CurrentScaleQuantizer",
    "DelayedScaleQuantizer",
    "Quantizer",
    "QuantizerFactory",
    "QuantizerSet",
    "ScaledTensor",
    "check_quantizer",
    "noop_quantizer_set",
]


class ScaledTensor(NamedTuple):
    """A GEMM operand: ``data`` (float8, or high precision when ``scale_inv`` is None)."""

    data: Array
    scale_inv: Array | None = None


def _static(default=dataclasses.MISSING):
    return dataclasses.field(default=default, metadata={"static": True})


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DelayedScaleQuantizer:
    """Quantizes with the scale of the previous step and records this step's amax.

    Attributes:
      scale_inv: f32[1], the dequantization scale this step uses.
      amax_history: f32[L], past amax values, newest at index 0.
      q_dtype: the float8 dtype (static).
      margin: powers of two of headroom (static).
      amax_compute_algo: ``"max"`` or ``"most_recent"`` (static).
    """

    scale_inv: Array
    amax_history: Array
    q_dtype: Any = _static(jnp.float8_e4m3fn)  # noqa: RUF009
    margin: float = _static(0)
    amax_compute_algo: str = _static("max")

    @classmethod
    def fresh(cls, q_dtype, recipe: DelayedScaling) -> DelayedScaleQuantizer:
        """A quantizer with the initial state: ``scale_inv = 1`` and an all-zero history."""
        return cls(
            scale_inv=jnp.ones((1,), jnp.float32),
            amax_history=jnp.zeros((recipe.amax_history_len,), jnp.float32),
            q_dtype=q_dtype,
            margin=recipe.margin,
            amax_compute_algo=recipe.amax_compute_algo,
        )

    def quantize(self, x: Array) -> tuple[ScaledTensor, DelayedScaleQuantizer]:
        """Returns ``x`` quantized with the stored scale, and the quantizer with the new state."""
        scale_inv = self.scale_inv.reshape(())
        quantized = ScaledTensor(scaling.quantize(x, self.q_dtype, scale_inv), scale_inv)
        return quantized, self.update(scaling.amax(x))

    def update(self, amax_value: Array) -> DelayedScaleQuantizer:
        """The state after a step whose tensor had ``amax_value``.

        The new ``scale_inv`` is computed from the history *including* this step, and is used
        by the next step: so step ``t`` always quantizes with the scale of step ``t - 1``.
        """
        history = scaling.push_amax(self.amax_history, amax_value)
        reduced = scaling.reduce_history(history, self.amax_compute_algo)
        scale_inv = scaling.compute_scale_inv(reduced, self.q_dtype, self.margin, self.scale_inv)
        return dataclasses.replace(self, scale_inv=scale_inv.reshape(1), amax_history=history)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CurrentScaleQuantizer:
    """Quantizes with a scale from the tensor's own amax; keeps no state."""

    q_dtype: Any = _static(jnp.float8_e4m3fn)  # noqa: RUF009

    def quantize(self, x: Array) -> tuple[ScaledTensor, CurrentScaleQuantizer]:
        """Returns ``x`` quantized with ``amax(x) / fp8_max``, and this (stateless) quantizer."""
        one = jnp.ones((), jnp.float32)
        scale_inv = scaling.compute_scale_inv(scaling.amax(x), self.q_dtype, 0, one)
        return ScaledTensor(scaling.quantize(x, self.q_dtype, scale_inv), scale_inv), self


Quantizer = DelayedScaleQuantizer | CurrentScaleQuantizer
_FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizerSet:
    """The quantizers of one GEMM: its input ``x``, its ``kernel`` and its output gradient.

    ``dgrad`` quantizes the gradient of this GEMM's own output, which both backward GEMMs
    (dgrad and wgrad) consume. All three are None for no quantization.
    """

    x: Quantizer | None = None
    kernel: Quantizer | None = None
    dgrad: Quantizer | None = None

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
        if not present:
            return
        e5m2 = jnp.dtype(jnp.float8_e5m2)
        for a, b in (("x", "kernel"), ("dgrad", "kernel"), ("x", "dgrad")):
            if jnp.dtype(members[a].q_dtype) == e5m2 == jnp.dtype(members[b].q_dtype):
                raise ValueError(
                    f"{argument}: {a} and {b} are both float8_e5m2, and cuBLASLt cannot multiply "
                    "two e5m2 operands; use Format.HYBRID or Format.E4M3"
                )


noop_quantizer_set = QuantizerSet()


def check_quantizer(quantizer: object, argument: str) -> None:
    """Raises a clear error unless ``quantizer`` is a quantizer to a supported float8 dtype."""
    if not isinstance(quantizer, DelayedScaleQuantizer | CurrentScaleQuantizer):
        raise TypeError(
            f"{argument} must be a DelayedScaleQuantizer or CurrentScaleQuantizer (or None), got "
            f"{quantizer!r}"
        )
    if jnp.dtype(quantizer.q_dtype) not in _FP8_DTYPES:
        raise ValueError(
            f"{argument} quantizes to {quantizer.q_dtype}, but only float8_e4m3fn and "
            "float8_e5m2 are supported"
        )


class QuantizerFactory:
    """Builds quantizer sets with fresh state from a recipe."""

    @staticmethod
    def create_set(
        n_quantizer_sets: int = 1, *, fp8_recipe: Recipe | None = None
    ) -> QuantizerSet | tuple[QuantizerSet, ...]:
        """Fresh quantizer sets for ``n_quantizer_sets`` GEMMs.

        Args:
          n_quantizer_sets: how many sets to create (default 1; ``layernorm_mlp`` takes 2).
          fp8_recipe: the recipe; None means the recipe of the active ``te_flax.autocast``,
            or no quantization outside of one.

        Returns:
          One ``QuantizerSet`` when ``n_quantizer_sets == 1``, else a tuple of them.

        Example usage::

          >>> import jax
          >>> from te_flax.quantize import DelayedScaling, QuantizerFactory
          >>> qs = QuantizerFactory.create_set(fp8_recipe=DelayedScaling(amax_history_len=16))
          >>> qs.x.scale_inv.shape, qs.x.amax_history.shape, qs.x.q_dtype.__name__
          ((1,), (16,), 'float8_e4m3fn')
          >>> qs.dgrad.q_dtype.__name__
          'float8_e5m2'
        """
        if not isinstance(n_quantizer_sets, int) or n_quantizer_sets < 1:
            raise ValueError(f"n_quantizer_sets must be an int >= 1, got {n_quantizer_sets!r}")
        recipe = get_autocast_recipe() if fp8_recipe is None else fp8_recipe
        sets = tuple(_set_from_recipe(recipe) for _ in range(n_quantizer_sets))
        return sets[0] if n_quantizer_sets == 1 else sets


def _set_from_recipe(recipe: Recipe | None) -> QuantizerSet:
    if recipe is None:
        return noop_quantizer_set
    check_recipe(recipe)
    forward, backward = recipe.fp8_format.forward_dtype, recipe.fp8_format.backward_dtype
    if isinstance(recipe, Float8CurrentScaling):
        return QuantizerSet(
            CurrentScaleQuantizer(forward),
            CurrentScaleQuantizer(forward),
            CurrentScaleQuantizer(backward),
        )
    return QuantizerSet(
        DelayedScaleQuantizer.fresh(forward, recipe),
        DelayedScaleQuantizer.fresh(forward, recipe),
        DelayedScaleQuantizer.fresh(backward, recipe),
    )


def quantize_operand(
    x: Array, quantizer: Quantizer | None, compute_dtype
) -> tuple[ScaledTensor, Quantizer | None]:
    """A GEMM operand from ``x``: quantized by ``quantizer``, or cast to ``compute_dtype``."""
    if quantizer is None:
        return ScaledTensor(x.astype(compute_dtype)), None
    return quantizer.quantize(x)
