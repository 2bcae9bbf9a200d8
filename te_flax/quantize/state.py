"""FP8 state as variables: their names, fresh values, and the quantizer sets built from them.

One GEMM's delayed-scaling state is six float32 variables in the ``_overwrite_with_gradient``
collection (``OVERWRITE_WITH_GRADIENT``): ``{x,kernel,grad}{postfix}_amax_history`` (``[L]``) and
``..._scale_inv`` (``[1]``). Current scaling, the block-scaled recipes and no quantization keep
none; NVFP4 with stochastic rounding takes an RNG key per call from the ``"sr_rng"`` stream
instead. The module shells, the FP8 attention and ``quantize_model`` all name and read the state
through here; what modules do with it (reuse merged by max, stale state refused) is in
``te_flax._layers.fp8_state``.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax.linen.fp8_ops import OVERWRITE_WITH_GRADIENT
from jax import Array

from te_flax._base.checks import check_positive_int
from te_flax.quantize._block_recipes import NVFP4BlockScaling
from te_flax.quantize.autocast import get_autocast_recipe
from te_flax.quantize.factory import QuantizerFactory
from te_flax.quantize.quantizer_set import QuantizerSet, noop_quantizer_set
from te_flax.quantize.recipes import DelayedScaling, Recipe
from te_flax.quantize.tensor_quantizers import DelayedScaleQuantizer

__all__ = [
    "OVERWRITE_WITH_GRADIENT",
    "SR_RNG",
    "fresh_state",
    "needs_sr_key",
    "quantizer_set",
    "resolve_recipe",
    "state_names",
]

# Variable role -> QuantizerSet field. "grad" quantizes the gradient of the GEMM's output.
_ROLES = {"x": "x", "kernel": "kernel", "grad": "dgrad"}

# The RNG stream stochastic rounding draws from (TransformerEngine's name).
SR_RNG = "sr_rng"


def needs_sr_key(recipe: Recipe | None) -> bool:
    """Whether a module applied with ``recipe`` must draw a stochastic-rounding key."""
    return isinstance(recipe, NVFP4BlockScaling) and recipe.stochastic_rounding


def resolve_recipe(recipe: Recipe | None) -> Recipe | None:
    """A module's recipe: its own, else the active ``te_flax.autocast`` one, else None."""
    return recipe if recipe is not None else get_autocast_recipe()


def state_names(postfix: str) -> tuple[str, ...]:
    """All variable names one GEMM's delayed-scaling state may have."""
    return tuple(
        f"{role}{postfix}_{kind}" for role in _ROLES for kind in ("amax_history", "scale_inv")
    )


def fresh_state(
    recipe: Recipe | None, postfix: str, n_groups: int | None = None
) -> dict[str, Array]:
    """Initial variable values for one GEMM (empty unless the recipe keeps state).

    With ``n_groups`` each value has a leading group axis (``[n_groups, L]`` amax histories,
    ``[n_groups, 1]`` scales): one state per group of a grouped GEMM.
    """
    if n_groups is not None:
        check_positive_int(n_groups, "n_groups", "the number of groups of a grouped GEMM, or None")
    if not isinstance(recipe, DelayedScaling):
        return {}
    qs = QuantizerFactory.create_set(fp8_recipe=recipe)
    values = {}
    for role, field in _ROLES.items():
        quantizer = getattr(qs, field)
        values[f"{role}{postfix}_amax_history"] = quantizer.amax_history
        values[f"{role}{postfix}_scale_inv"] = quantizer.scale_inv
    if n_groups is None:
        return values
    return {
        name: jnp.broadcast_to(value, (n_groups, *value.shape)) for name, value in values.items()
    }


def quantizer_set(
    recipe: Recipe | None, postfix: str, state: dict[str, Array], sr_key: Array | None = None
) -> QuantizerSet:
    """The quantizer set of one GEMM, its state leaves read from ``state`` (variable values).

    ``sr_key`` is the stochastic-rounding key when ``needs_sr_key(recipe)``.

    The gradient of the loss with respect to these variables is their new value. Reuses of
    the variables merge by max when the step marked them (``te_flax.training.merge_fp8_state``)
    before they fanned out; marking here, after the fan-out, would be too late.
    """
    if recipe is None:
        return noop_quantizer_set
    qs = QuantizerFactory.create_set(fp8_recipe=recipe, sr_key=sr_key)
    if not isinstance(recipe, DelayedScaling):
        return qs
    members = {}
    for role, field in _ROLES.items():
        quantizer: DelayedScaleQuantizer = getattr(qs, field)
        members[field] = dataclasses.replace(
            quantizer,
            amax_history=state[f"{role}{postfix}_amax_history"],
            scale_inv=state[f"{role}{postfix}_scale_inv"],
        )
    return dataclasses.replace(qs, x=members["x"], kernel=members["kernel"], dgrad=members["dgrad"])
