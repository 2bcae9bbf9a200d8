"""FP8 state as module variables: names, fresh values, and the quantizer sets built from them.

One GEMM's delayed-scaling state is six float32 variables in the ``_overwrite_with_gradient``
collection: ``{x,kernel,grad}{postfix}_amax_history`` (``[L]``) and ``..._scale_inv`` (``[1]``).
Current scaling, the block-scaled recipes and no quantization keep none; NVFP4 with stochastic
rounding takes an RNG key per call from the ``"sr_rng"`` stream instead. Both the Linen and the
NNX shells go through here.
"""

from __future__ import annotations

import dataclasses

from flax.linen.fp8_ops import OVERWRITE_WITH_GRADIENT
from jax import Array

from te_flax.quantize import (
    DelayedScaleQuantizer,
    DelayedScaling,
    NVFP4BlockScaling,
    QuantizerFactory,
    QuantizerSet,
    Recipe,
    get_autocast_recipe,
    noop_quantizer_set,
)

__all__ = [
    "OVERWRITE_WITH_GRADIENT",
    "SR_RNG",
    "check_state_matches",
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


def fresh_state(recipe: Recipe | None, postfix: str) -> dict[str, Array]:
    """Initial variable values for one GEMM (empty unless the recipe keeps state)."""
    if not isinstance(recipe, DelayedScaling):
        return {}
    qs = QuantizerFactory.create_set(fp8_recipe=recipe)
    values = {}
    for role, field in _ROLES.items():
        quantizer = getattr(qs, field)
        values[f"{role}{postfix}_amax_history"] = quantizer.amax_history
        values[f"{role}{postfix}_scale_inv"] = quantizer.scale_inv
    return values


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
    return QuantizerSet(**members)


def check_state_matches(
    module: str, recipe: Recipe | None, expected: set[str], present: set[str]
) -> None:
    """Refuses FP8 variables that do not fit the recipe a module is applied with."""
    if expected == present:
        return
    if expected - present:
        raise ValueError(
            f"{module} is applied with the FP8 recipe {recipe}, which needs the variables "
            f"{sorted(expected - present)} in the {OVERWRITE_WITH_GRADIENT!r} collection, but "
            "they are missing: the model was initialised without FP8 (or the collection was "
            "not passed to apply). Initialise inside te_flax.autocast(enabled=True, recipe=...) "
            "or with the module's recipe= set, and pass every variable collection to apply"
        )
    raise ValueError(
        f"{module} holds the FP8 variables {sorted(present - expected)} but is applied "
        f"{'without FP8' if recipe is None else f'with the recipe {recipe}, which keeps none'}: "
        "apply it inside the te_flax.autocast (or with the recipe=) it was initialised with, "
        "or initialise it again without FP8"
    )
