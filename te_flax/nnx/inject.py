"""FP8 for NNX models written with Flax's own layers: a ``dot_general`` and an ``einsum_op``.

``nnx.Linear(..., dot_general=te_flax.nnx.DotGeneral(recipe))`` and
``nnx.Einsum(..., einsum_op=te_flax.nnx.EinsumOp(recipe))`` run the layer's product as
te_flax's ``dense`` (the quantizers, FP8 state and max-merge rule of te_flax's layers); the
FP8 state is ``Fp8Meta`` variables of the ``DotGeneral`` / ``EinsumOp`` module, a child of the
layer, so ``nnx.state``, ``nnx.split``, optimizers and checkpoints see it. Train with
``te_flax.nnx.value_and_grad(..., update_fp8_state=True)`` or ``te_flax.nnx.train_step``.
"""

from __future__ import annotations

from typing import Any

from flax import nnx
from jax import Array

from te_flax._layers.fp8_state import (
    SR_RNG,
    fresh_state,
    needs_sr_key,
    quantizer_set,
    resolve_recipe,
)
from te_flax._layers.linear import _named_sets
from te_flax._ops.products import plan_product, run_plan
from te_flax.nnx._fp8_meta import Fp8Meta
from te_flax.nnx._shell import NnxShell
from te_flax.quantize import QuantizerSet, Recipe
from te_flax.quantize.recipes import check_recipe

__all__ = ["DotGeneral", "EinsumOp", "add_fp8_state", "owner_quantizer_set"]


def add_fp8_state(module: nnx.Module, recipe: Recipe | None, postfix: str) -> None:
    """Creates one GEMM's FP8 state (``Fp8Meta`` variables) on ``module``."""
    for name, value in fresh_state(recipe, postfix).items():
        setattr(module, name, Fp8Meta(value))


def owner_quantizer_set(
    module: nnx.Module,
    recipe: Recipe | None,
    postfix: str,
    checkpoint_name: str | None = None,
) -> QuantizerSet:
    """The quantizer set of one GEMM whose FP8 state is ``Fp8Meta`` variables of ``module``.

    Stochastic rounding draws its key from the module's ``sr_rngs`` stream."""
    state = NnxShell._fp8_state(module, recipe, postfix)  # type: ignore[arg-type]
    key = NnxShell._sr_key(module, recipe)  # type: ignore[arg-type]
    (qs,) = _named_sets([quantizer_set(recipe, postfix, state, key)], checkpoint_name)
    return qs


class _Product(nnx.Module):
    """One product's FP8 state and recipe; the subclasses give the call signature."""

    def __init__(
        self,
        recipe: Recipe | None = None,
        *,
        quantization_checkpoint_name: str | None = None,
        rngs: nnx.Rngs | None = None,
    ) -> None:
        if recipe is not None:
            check_recipe(recipe, f"{type(self).__name__}(recipe=)")
        self.recipe = resolve_recipe(recipe)
        self.quantization_checkpoint_name = quantization_checkpoint_name
        add_fp8_state(self, self.recipe, "")
        # Stochastic rounding (NVFP4) draws a key per call from its own stream.
        self.sr_rngs = (rngs or nnx.Rngs(0))[SR_RNG].fork() if needs_sr_key(self.recipe) else None

    def _run(self, op: str, lhs: Array, rhs: Array, spec: Any, out_dtype: Any) -> Array:
        plan = plan_product(op, lhs, rhs, spec)
        if isinstance(plan, str):
            raise ValueError(
                f"{type(self).__name__} runs a product as te_flax's dense, but this one cannot: "
                f"{plan} (operands {lhs.shape} and {rhs.shape}, {spec!r}); use it only on "
                "layers that contract an input with a kernel without batch dimensions, or "
                "leave this layer in high precision"
            )
        qs = owner_quantizer_set(self, self.recipe, "", self.quantization_checkpoint_name)
        return run_plan(plan, lhs, rhs, qs, out_dtype)


class DotGeneral(_Product):
    """A ``dot_general`` for ``nnx.Linear`` / ``nnx.LinearGeneral`` that runs in FP8.

    Args:
      recipe: the recipe (None: the active ``te_flax.autocast`` one when built, else no FP8).
      quantization_checkpoint_name: the ``jax.checkpoint`` name of the quantized operands the
        GEMM saves for its backward (default None).
      rngs: the ``"sr_rng"`` stream for NVFP4's stochastic rounding (default ``nnx.Rngs(0)``).

    Example usage::

      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> import te_flax.nnx as te_nnx
      >>> from te_flax.quantize import DelayedScaling
      >>> layer = nnx.Linear(32, 16, dot_general=te_nnx.DotGeneral(DelayedScaling()),
      ...                    rngs=nnx.Rngs(0))
      >>> layer(jnp.ones((4, 32))).shape
      (4, 16)
      >>> sorted(nnx.state(layer, te_nnx.Fp8Meta)["dot_general"])[:2]
      ['grad_amax_history', 'grad_scale_inv']
    """

    def __call__(
        self,
        lhs: Array,
        rhs: Array,
        dimension_numbers: Any,
        precision: Any = None,
        preferred_element_type: Any = None,
        out_sharding: Any = None,
    ) -> Array:
        del precision, out_sharding  # the recipe sets the precision; the layer, the sharding
        return self._run("dot_general", lhs, rhs, dimension_numbers, preferred_element_type)


class EinsumOp(_Product):
    """An ``einsum_op`` for ``nnx.Einsum`` that runs its two-operand product in FP8.

    Takes the arguments of ``DotGeneral``; called as ``jnp.einsum(subscripts, x, kernel,
    precision=None, preferred_element_type=None)``.
    """

    def __call__(
        self,
        subscripts: str,
        lhs: Array,
        rhs: Array,
        precision: Any = None,
        preferred_element_type: Any = None,
        out_sharding: Any = None,
    ) -> Array:
        del precision, out_sharding
        return self._run("einsum", lhs, rhs, subscripts, preferred_element_type)
