"""What every te_flax Linen module does: create its parameters and FP8 state, call the layer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import flax.linen as nn
import jax.numpy as jnp
from jax import Array

from te_flax._fp8_state import (
    OVERWRITE_WITH_GRADIENT,
    SR_RNG,
    check_state_matches,
    fresh_state,
    needs_sr_key,
    quantizer_set,
    resolve_recipe,
    state_names,
)
from te_flax._layers import ParamSpec
from te_flax._validation import check_dtype
from te_flax.quantize import QuantizerSet

__all__ = ["LinenShell"]


class LinenShell(nn.Module):
    """Base of the Linen modules; the layer description supplies attributes and ``forward``."""

    def _run(self, inputs: Array, dropout: Callable[[Array], Array] | None = None) -> Any:
        specs = self.param_specs(self.in_features(inputs))
        params = {spec.name: self._param(spec) for spec in specs}
        sets = tuple(self._quantizer_set(postfix) for postfix in self.fp8_postfixes)
        return self.forward(params, inputs, sets, dropout)

    def _param(self, spec: ParamSpec) -> Array:
        if self.has_variable("params", spec.name):
            existing = jnp.shape(nn.meta.unbox(self.get_variable("params", spec.name)))
            if existing != spec.shape:
                raise ValueError(
                    f"{type(self).__name__} parameter {spec.name!r} has shape {existing}, but this "
                    f"input needs {spec.shape}: the input's feature size differs from the one "
                    "the module was initialised with; initialise it again with an input of this "
                    "shape, or reshape the input"
                )
        check_dtype(self.param_dtype, "param_dtype")
        init = nn.with_logical_partitioning(spec.init, spec.axes)
        # Linen unboxes the LogicallyPartitioned value when the module reads it.
        return cast(Array, self.param(spec.name, init, spec.shape, self.param_dtype))

    def _quantizer_set(self, postfix: str) -> QuantizerSet:
        recipe = resolve_recipe(self.recipe)
        fresh = fresh_state(recipe, postfix)
        if not self.is_initializing():
            present = {
                n for n in state_names(postfix) if self.has_variable(OVERWRITE_WITH_GRADIENT, n)
            }
            check_state_matches(type(self).__name__, recipe, set(fresh), present)
        state = {}
        for name, value in fresh.items():
            variable = self.variable(OVERWRITE_WITH_GRADIENT, name, lambda value=value: value)
            if variable.value.shape != value.shape:
                raise ValueError(
                    f"{type(self).__name__} FP8 variable {name!r} has shape "
                    f"{variable.value.shape} but the recipe {recipe} needs {value.shape}; "
                    "re-initialise the FP8 state (amax_history_len changed)"
                )
            state[name] = variable.value
        sr_key = self.make_rng(SR_RNG) if needs_sr_key(recipe) else None
        return quantizer_set(recipe, postfix, state, sr_key)
