"""The NNX variable types of FP8 state and FP8 statistics, and the one way NNX modules create
and read them."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax import Array

from te_flax._layers.fp8_state import check_state_matches
from te_flax._layers.fp8_stats import Statistics
from te_flax.quantize import Recipe
from te_flax.quantize.inspection import (
    STATS_COLLECTION,
    fresh_statistics,
    inspecting,
    stats_name,
)
from te_flax.quantize.state import OVERWRITE_WITH_GRADIENT, fresh_state, needs_sr_key, state_names

__all__ = ["Fp8Meta", "Fp8Stats", "NnxStats", "create_fp8_variables", "fp8_variables", "sr_key"]


@nnx.register_variable_name(OVERWRITE_WITH_GRADIENT)
class Fp8Meta(nnx.Variable[Any]):
    """FP8 state (amax history, ``scale_inv``): a variable whose gradient is its new value.

    Registered under the Linen collection name ``_overwrite_with_gradient``, so ``nnx.bridge``
    maps it to and from Linen modules' FP8 state. Keep it out of the optimizer
    (``nnx.Optimizer(model, tx, wrt=nnx.Param)``) and overwrite it with its gradient instead,
    as ``te_flax.nnx.train_step`` does.
    """


@nnx.register_variable_name(STATS_COLLECTION)
class Fp8Stats(nnx.Variable[Any]):
    """The FP8 statistics of one tensor of a GEMM (``te_flax.inspect_fp8()``): a dict of float32
    ``amax``, ``scale_inv``, ``saturation``, ``underflow`` (and the block-scale spread for
    block-scaled recipes), named ``{x,kernel,grad}{postfix}_stats``.

    A module gets them on its first call inside ``te_flax.inspect_fp8()``; every call inside it
    writes the forward statistics (``x``, ``kernel``), and ``te_flax.nnx.value_and_grad`` and
    ``train_step`` write all three, the gradient's included, after a step. Read them with
    ``nnx.state(model, Fp8Stats)``. Registered under the Linen collection name
    ``"fp8_stats"``; the optimizer never sees them (``wrt=nnx.Param``).
    """


class NnxStats:
    """An NNX module's ``Fp8Stats`` attributes: created on first use, written by every call."""

    def __init__(self, module: nnx.Module) -> None:
        self.module = module

    def read(self, name: str, fresh: Statistics) -> Statistics:
        variable = getattr(self.module, name, None)
        if isinstance(variable, Fp8Stats):
            stored = variable.get_value()
            if jax.tree.map(jnp.shape, stored) == jax.tree.map(jnp.shape, fresh):
                return stored
        setattr(self.module, name, Fp8Stats(fresh))
        return fresh

    def write(self, name: str, value: Statistics) -> None:
        getattr(self.module, name).set_value(value)


def create_fp8_variables(
    module: nnx.Module, recipe: Recipe | None, postfix: str, n_groups: int | None = None
) -> None:
    """Creates one GEMM's FP8 state on ``module``: ``Fp8Meta`` attributes named as in Linen
    (none when the recipe keeps no state; with ``n_groups``, one state per group). Inside
    ``te_flax.inspect_fp8()`` its ``Fp8Stats`` variables too (a model built inside the setting
    has them before any transform runs it, ``nnx.scan`` included)."""
    for name, value in fresh_state(recipe, postfix, n_groups).items():
        setattr(module, name, Fp8Meta(value))
    if inspecting():
        for role, fresh in fresh_statistics(recipe, n_groups).items():
            setattr(module, stats_name(role, postfix), Fp8Stats(fresh))


def fp8_variables(
    module: nnx.Module, recipe: Recipe | None, postfix: str, n_groups: int | None = None
) -> dict[str, Array]:
    """One GEMM's FP8 state, the ``Fp8Meta`` attributes of ``module`` read as arrays.

    The NNX twin of ``te_flax.linen.fp8_variables``: a module built without the state the
    recipe needs (or with another history length, or number of groups) is refused with the fix.
    """
    fresh = fresh_state(recipe, postfix, n_groups)
    present = {n for n in state_names(postfix) if isinstance(getattr(module, n, None), Fp8Meta)}
    check_state_matches(type(module).__name__, recipe, set(fresh), present)
    state = {}
    for name, value in fresh.items():
        stored = getattr(module, name)[...]
        if jnp.shape(stored) != value.shape:
            raise ValueError(
                f"{type(module).__name__} FP8 variable {name!r} has shape {jnp.shape(stored)} "
                f"but the recipe {recipe} needs {value.shape}; build the module again "
                "(amax_history_len changed, or the number of groups)"
            )
        state[name] = stored
    return state


def sr_key(module: nnx.Module, recipe: Recipe | None) -> Array | None:
    """A stochastic-rounding key from ``module.sr_rngs`` when ``recipe`` needs one, else None."""
    if not needs_sr_key(recipe):
        return None
    rngs = getattr(module, "sr_rngs", None)
    if rngs is None:
        raise ValueError(
            f"{type(module).__name__} is applied with {recipe}, whose stochastic rounding "
            "needs an RNG stream, but it was built without that recipe; build it inside "
            "the same te_flax.autocast (or with recipe=), so that it keeps an 'sr_rng' "
            "stream from its rngs"
        )
    key: Array = rngs()
    return key
