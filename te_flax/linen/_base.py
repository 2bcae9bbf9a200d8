"""``TransformerEngineBase``: TransformerEngine's base module, whose ``generate_quantizer_set``
creates one GEMM's FP8 state as module variables and returns the quantizer set built from it.

te_flax's own Linen layers create their state through the same function (``fp8_variables``),
so a module written on this base keeps the same collection, variable names and shapes.
"""

from __future__ import annotations

import flax.linen as nn
from jax import Array

from te_flax._base.checks import check_positive_int
from te_flax._layers.base import named_sets
from te_flax._layers.fp8_state import check_state_matches, merge_reuse
from te_flax.quantize import QuantizerSet, Recipe
from te_flax.quantize.quantizer_set import grouped_quantizer_set
from te_flax.quantize.state import (
    OVERWRITE_WITH_GRADIENT,
    SR_RNG,
    fresh_state,
    needs_sr_key,
    quantizer_set,
    resolve_recipe,
    state_names,
)

__all__ = ["TransformerEngineBase", "fp8_variables"]


def fp8_variables(
    module: nn.Module,
    recipe: Recipe | None,
    postfix: str,
    collection: str = OVERWRITE_WITH_GRADIENT,
    n_groups: int | None = None,
) -> dict[str, Array]:
    """One GEMM's FP8 state: the variables of ``module`` in ``collection`` (created on first
    use), read as arrays; empty when the recipe keeps no state.

    With ``n_groups`` each variable has a leading group axis (``[n_groups, L]`` amax histories,
    ``[n_groups, 1]`` scales), one state per group of a grouped GEMM. Applying a module whose
    variables do not fit the recipe (initialised without FP8, or with another history length)
    is refused with the fix.
    """
    name = type(module).__name__
    if n_groups is not None:
        check_positive_int(
            n_groups, f"{name}: n_groups", "the number of groups of a grouped GEMM, or None"
        )
    fresh = fresh_state(recipe, postfix, n_groups)
    if not module.is_initializing():
        present = {n for n in state_names(postfix) if module.has_variable(collection, n)}
        check_state_matches(name, recipe, set(fresh), present)
    state = {}
    for key, value in fresh.items():
        variable = module.variable(collection, key, lambda value=value: value)
        if variable.value.shape != value.shape:
            raise ValueError(
                f"{name} FP8 variable {key!r} has shape {variable.value.shape} but the recipe "
                f"{recipe} needs {value.shape}; re-initialise the FP8 state (amax_history_len "
                "changed, or the number of groups)"
            )
        state[key] = variable.value
    return state


class TransformerEngineBase(nn.Module):
    """TransformerEngine's base of the Flax modules: ``generate_quantizer_set`` for its GEMMs.

    A Linen module that calls ``dense`` (or ``layernorm_dense``, ``layernorm_mlp``) itself
    subclasses this and asks for one quantizer set per GEMM; te_flax's own layers are built on it.

    Example usage::

      >>> import flax.linen as nn, jax, jax.numpy as jnp, te_flax
      >>> from te_flax.dense import dense
      >>> from te_flax.linen import TransformerEngineBase
      >>> class Projection(TransformerEngineBase):
      ...     @nn.compact
      ...     def __call__(self, x):
      ...         kernel = self.param("kernel", nn.initializers.ones, (x.shape[-1], 4))
      ...         return dense(x, kernel, quantizer_set=self.generate_quantizer_set())
      >>> with te_flax.autocast(enabled=True):
      ...     variables = Projection().init(jax.random.key(0), jnp.ones((2, 8)))
      >>> sorted(variables["_overwrite_with_gradient"])[:2]
      ['grad_amax_history', 'grad_scale_inv']
    """

    def generate_quantizer_set(
        self,
        postfix: str = "",
        variable_collection: str | None = None,
        quantization_checkpoint_name: str | None = None,
        fp8_recipe: Recipe | None = None,
        n_groups: int | None = None,
    ) -> QuantizerSet:
        """The quantizer set of one GEMM, its FP8 state kept as variables of this module.

        Args:
          postfix: appended to the variable names, ``{x,kernel,grad}{postfix}_amax_history``
            and ``..._scale_inv`` (default ``""``; one postfix per GEMM of the module).
          variable_collection: the collection of the variables (None: ``_overwrite_with_gradient``,
            the collection te_flax's training helpers and Flax's ``TrainState`` overwrite with
            its gradient, which is the new state).
          quantization_checkpoint_name: the ``jax.checkpoint`` name of the quantized operands
            the GEMM saves for its backward (default None).
          fp8_recipe: the recipe (None: the active ``te_flax.autocast`` one; outside of one,
            the no-op set and no variables).
          n_groups: for a grouped GEMM, the number of groups: ``x``, ``kernel`` and
            ``dgrad`` are then ``GroupedQuantizer``s (one quantizer per group, as
            TransformerEngine's) for ``te_flax.dense.grouped_dense``, and under
            ``DelayedScaling`` each variable holds one state per group (``[G, L]``
            histories, ``[G, 1]`` scales; TransformerEngine's own module cannot keep
            delayed state per group).

        Returns:
          A ``QuantizerSet`` for the ops' ``quantizer_set`` argument. Under
          ``NVFP4BlockScaling`` with stochastic rounding a key is drawn from the ``"sr_rng"``
          stream.
        """
        if not isinstance(postfix, str):
            raise TypeError(f"postfix must be a str, got {postfix!r}")
        recipe = resolve_recipe(fp8_recipe)
        collection = OVERWRITE_WITH_GRADIENT if variable_collection is None else variable_collection
        # A module applied twice in one step reads the same arrays: their updates merge by max.
        state = merge_reuse(fp8_variables(self, recipe, postfix, collection, n_groups))
        sr_key = self.make_rng(SR_RNG) if needs_sr_key(recipe) else None
        (qs,) = named_sets(
            [quantizer_set(recipe, postfix, state, sr_key)], quantization_checkpoint_name
        )
        return qs if n_groups is None else grouped_quantizer_set(qs, n_groups)
