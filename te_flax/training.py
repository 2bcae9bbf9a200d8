"""Applying a training step's gradients: the optimizer for parameters, overwrite for FP8 state.

The gradient of the loss with respect to the ``_overwrite_with_gradient`` collection is the new
FP8 state (the ops return it through the cotangent slot). So a step splits its gradients: the
``params`` go through the optax optimizer; the FP8 state replaces the old state and never meets
an optax transform (clipping, weight decay or averaging would corrupt it).

Inside the differentiated function, call ``merge_fp8_state(variables)`` first: it marks the
FP8 collection so that every reuse of a state in the step merges by elementwise max (a module
applied twice, state shared by the layers of an ``nn.scan`` with ``variable_broadcast``, a
loop or ``lax.scan`` over microbatches). Without it autodiff adds up the updates of the uses.
The mark has to be made where the variables enter the step, before they fan out; a module
cannot make it for the uses of its own variables.

Applying the gradients, two ways, one rule:

* Flax's ``flax.training.train_state.TrainState`` already follows it: create it with the whole
  variable dict as ``params`` and call ``apply_gradients(grads=grads)`` unchanged.
* With a plain optax transform: ``opt_state = init_optimizer(tx, variables)`` and
  ``variables, opt_state = apply_gradients(tx, variables, grads, opt_state)``. Under
  ``optax.MultiSteps`` the FP8 state stays fixed while gradients accumulate and the
  microbatches' updates are merged by elementwise max when the accumulated step is applied, so
  k accumulated microbatches give the state of one step over all of them.

Example usage::

  >>> import jax, jax.numpy as jnp, optax
  >>> import te_flax, te_flax.linen as te_nn
  >>> from te_flax.training import apply_gradients, init_optimizer, merge_fp8_state
  >>> layer = te_nn.DenseGeneral(features=4, recipe=te_flax.quantize.DelayedScaling())
  >>> x = jnp.ones((2, 8))
  >>> variables = layer.init(jax.random.key(0), x)
  >>> tx = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1e-2))
  >>> opt_state = init_optimizer(tx, variables)
  >>> def loss(variables):
  ...     return jnp.sum(layer.apply(merge_fp8_state(variables), x) ** 2)
  >>> grads = jax.jit(jax.grad(loss))(variables)
  >>> variables, opt_state = apply_gradients(tx, variables, grads, opt_state)
  >>> float(variables["_overwrite_with_gradient"]["x_amax_history"][0])
  1.0
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from te_flax._fp8_state import OVERWRITE_WITH_GRADIENT
from te_flax.quantize import merge_by_max

__all__ = [
    "OVERWRITE_WITH_GRADIENT",
    "OptimizerState",
    "apply_gradients",
    "init_optimizer",
    "merge_fp8_state",
]

# A Flax variable dict: collection name -> nested dict of arrays (a dict or a FrozenDict).
Variables = Mapping[str, Any]


class OptimizerState(NamedTuple):
    """The optax state of the parameters, and FP8 updates waiting for an accumulated step."""

    tx_state: optax.OptState
    # Under optax.MultiSteps: the elementwise max of the FP8 updates since the last applied
    # step (-inf where none yet). None otherwise.
    pending_fp8: Any


def merge_fp8_state(variables: Variables) -> Variables:
    """``variables`` with the FP8 collection marked for max-merging (see the module docstring).

    Call it first thing inside the differentiated (and jitted) loss; the gradient with respect
    to the original float32 state is then the max-merged new state.
    """
    _check_variables(variables, "variables")
    if OVERWRITE_WITH_GRADIENT not in variables:
        return variables
    merged = dict(variables)
    merged[OVERWRITE_WITH_GRADIENT] = merge_by_max(variables[OVERWRITE_WITH_GRADIENT])
    return merged


def _keep_unused(new_fp8: Any, old_fp8: Any) -> Any:
    """The old value where a state got no update in the step (it came back all zeros).

    An FP8 state that no op read in the step has a zero gradient, and a zero ``scale_inv`` can
    never be a real update (scales are never 0); a history of zeros after an update means the
    state saw only zeros, for which keeping the old history changes nothing that matters.
    """
    return jax.tree.map(lambda new, old: jnp.where(jnp.all(new == 0), old, new), new_fp8, old_fp8)


def _multi_steps_state(tx_state: optax.OptState) -> optax.MultiStepsState | None:
    def is_multi(node: Any) -> bool:
        return isinstance(node, optax.MultiStepsState)

    found = [node for node in jax.tree.leaves(tx_state, is_leaf=is_multi) if is_multi(node)]
    if len(found) > 1:
        raise ValueError("more than one optax.MultiSteps in the optimizer is not supported")
    return found[0] if found else None


def _check_variables(variables: Any, name: str) -> None:
    if not hasattr(variables, "keys") or "params" not in variables:
        raise TypeError(
            f"{name} must be a Flax variable dict with a 'params' collection (and "
            f"{OVERWRITE_WITH_GRADIENT!r} for FP8 state), got {type(variables).__name__}"
        )


def init_optimizer(tx: optax.GradientTransformation, variables: Variables) -> OptimizerState:
    """The optimizer state for ``variables``: ``tx`` sees only ``variables['params']``."""
    _check_variables(variables, "variables")
    tx_state = tx.init(variables["params"])
    pending = None
    if _multi_steps_state(tx_state) is not None and OVERWRITE_WITH_GRADIENT in variables:
        pending = jax.tree.map(
            lambda v: jnp.full_like(v, -jnp.inf), variables[OVERWRITE_WITH_GRADIENT]
        )
    return OptimizerState(tx_state, pending)


def apply_gradients(
    tx: optax.GradientTransformation,
    variables: Variables,
    grads: Variables,
    opt_state: OptimizerState,
) -> tuple[Any, OptimizerState]:
    """One optimizer step on the parameters and the FP8-state overwrite.

    Args:
      tx: the optax transform, the same one ``init_optimizer`` saw.
      variables: the model's variable dict (``params``, ``_overwrite_with_gradient``, ...).
      grads: ``jax.grad`` of the loss with respect to ``variables`` (same structure).
      opt_state: from ``init_optimizer`` or the previous step.

    Returns:
      ``(new_variables, new_opt_state)``. Collections other than ``params`` and the FP8 state
      are returned unchanged.
    """
    _check_variables(variables, "variables")
    _check_variables(grads, "grads")
    if not isinstance(opt_state, OptimizerState):
        raise TypeError(
            "opt_state must come from te_flax.training.init_optimizer, got "
            f"{type(opt_state).__name__}"
        )
    updates, tx_state = tx.update(grads["params"], opt_state.tx_state, variables["params"])
    new_variables = dict(variables)
    new_variables["params"] = optax.apply_updates(variables["params"], updates)
    pending = opt_state.pending_fp8
    if OVERWRITE_WITH_GRADIENT in grads:
        new_fp8 = _keep_unused(grads[OVERWRITE_WITH_GRADIENT], variables[OVERWRITE_WITH_GRADIENT])
        multi = _multi_steps_state(tx_state)
        if multi is not None and pending is not None:
            merged = jax.tree.map(jnp.maximum, pending, new_fp8)
            applied = multi.mini_step == 0  # MultiSteps has just applied the accumulated step
            new_fp8 = jax.tree.map(
                lambda m, old: jnp.where(applied, m, old),
                merged,
                variables[OVERWRITE_WITH_GRADIENT],
            )
            pending = jax.tree.map(lambda m: jnp.where(applied, -jnp.inf, m), merged)
        new_variables[OVERWRITE_WITH_GRADIENT] = new_fp8
    if hasattr(variables, "copy") and not isinstance(variables, dict):
        mapping_type: Any = type(variables)  # a FrozenDict in, a FrozenDict out
        return mapping_type(new_variables), OptimizerState(tx_state, pending)
    return new_variables, OptimizerState(tx_state, pending)
