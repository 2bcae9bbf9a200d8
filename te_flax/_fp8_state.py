"""FP8 state as module variables: names, fresh values, and the quantizer sets built from them.

One GEMM's delayed-scaling state is six float32 variables in the ``_overwrite_with_gradient``
collection: ``{x,kernel,grad}{postfix}_amax_history`` (``[L]``) and ``..._scale_inv`` (``[1]``).
Current scaling, the block-scaled recipes and no quantization keep none; NVFP4 with stochastic
rounding takes an RNG key per call from the ``"sr_rng"`` stream instead. Both the Linen and the
NNX shells go through here.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, TypeVar

import jax
from flax.linen.fp8_ops import OVERWRITE_WITH_GRADIENT
from jax import Array
from jax.custom_derivatives import SymbolicZero

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
    "StaleFp8StateWarning",
    "check_state_matches",
    "fresh_state",
    "needs_sr_key",
    "quantizer_set",
    "resolve_recipe",
    "state_names",
    "watch_fp8_state",
]

P = TypeVar("P")
S = TypeVar("S")

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
    return dataclasses.replace(qs, x=members["x"], kernel=members["kernel"], dgrad=members["dgrad"])


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


class StaleFp8StateWarning(UserWarning):
    """A step differentiates a layer's parameters but not its FP8 state (under ``jit``).

    The state's update leaves the step as its gradient, so a gradient taken over the parameters
    only drops it: the amax history and the scales keep their initial values for good.
    """


# The fix, per front end, named in the message.
_STALE_FIX = {
    "linen": (
        "differentiate the whole variable dict, FP8 collection included: "
        "te_flax.training.value_and_grad(loss_fn)(variables, ...), then "
        "te_flax.training.apply_gradients (or Flax's TrainState created with params=variables "
        "and its apply_gradients); in an NNX model through nnx.bridge.ToNNX, use "
        "te_flax.nnx.value_and_grad(loss_fn, update_fp8_state=True); see docs/training_loops.md"
    ),
    "nnx": (
        "use te_flax.nnx.value_and_grad(loss_fn, update_fp8_state=True) in place of "
        "nnx.value_and_grad: it writes the new FP8 state into the model and returns the "
        "parameter gradients for nnx.Optimizer(model, tx, wrt=nnx.Param).update(model, grads); "
        "or run the whole step with te_flax.nnx.train_step; in a Linen model through "
        "nnx.bridge.ToLinen, differentiate the whole variable dict with "
        "te_flax.training.value_and_grad; see docs/training_loops.md"
    ),
}
# Front ends already warned about under jit: one warning per process says it for all layers.
_REPORTED: set[str] = set()


def _stale_message(module: str, front_end: str) -> str:
    collection = "Fp8Meta variables" if front_end == "nnx" else f"{OVERWRITE_WITH_GRADIENT!r}"
    return (
        f"{module}'s parameters are differentiated but its FP8 state ({collection}) is not: "
        "the new FP8 state leaves a step as the gradient of that state, so this step drops it "
        "and the amax history and scales never change. To fix it, "
        f"{_STALE_FIX[front_end]}. (Evaluation and gradients of the inputs only are fine.)"
    )


def _report_stale(module: str, front_end: str, concrete: bool) -> None:
    message = _stale_message(module, front_end)
    if concrete:
        raise ValueError(message)
    if front_end not in _REPORTED:
        _REPORTED.add(front_end)
        warnings.warn(message, StaleFp8StateWarning, stacklevel=2)


def watch_fp8_state(module: str, front_end: str, params: P, state: S) -> tuple[P, S]:
    """``(params, state)`` unchanged, refusing a gradient that drops the FP8 state's update.

    An identity with a custom VJP: JAX tells its forward rule which inputs are differentiated
    (``symbolic_zeros``), also inside ``scan``, ``remat`` and ``vmap``, and only when the step
    is differentiated at all. When some parameter is and no FP8 state is, the update would be
    lost: that raises with concrete values, or warns once (``StaleFp8StateWarning``) under a
    trace. It runs while tracing and leaves nothing in the compiled program.

    ``front_end`` is ``"linen"`` or ``"nnx"``: which fix the message names.
    """
    if not jax.tree.leaves(state):  # the recipe keeps no state
        return params, state

    @jax.custom_vjp
    def identity(params: Any, state: Any) -> tuple[Any, Any]:
        return params, state

    def forward(params: Any, state: Any) -> tuple[tuple[Any, Any], None]:
        # With symbolic_zeros each leaf is a CustomVJPPrimal(value, perturbed).
        params_perturbed = any(leaf.perturbed for leaf in jax.tree.leaves(params))
        state_perturbed = any(leaf.perturbed for leaf in jax.tree.leaves(state))
        if params_perturbed and not state_perturbed:
            values = [leaf.value for leaf in jax.tree.leaves(params)]
            concrete = not any(isinstance(value, jax.core.Tracer) for value in values)
            _report_stale(module, front_end, concrete)
        unwrap = lambda leaf: leaf.value  # noqa: E731
        return (jax.tree.map(unwrap, params), jax.tree.map(unwrap, state)), None

    def backward(_: None, cotangents: Any) -> Any:
        # A cotangent that is a symbolic zero goes back as None (a zero).
        return jax.tree.map(
            lambda c: None if isinstance(c, SymbolicZero) else c,
            cotangents,
            is_leaf=lambda c: isinstance(c, SymbolicZero),
        )

    identity.defvjp(forward, backward, symbolic_zeros=True)
    watched: tuple[P, S] = identity(params, state)
    return watched
