"""The NNX train step: gradients of parameters and FP8 state; optimizer, then overwrite.

``value_and_grad(loss_fn)`` differentiates ``loss_fn(model, ...)`` with respect to the model's
``nnx.Param`` and ``Fp8Meta`` variables, with the FP8 state marked so that every reuse of a
state (a module called twice, a loop over microbatches, state shared by scanned layers) merges
its updates by elementwise max. ``train_step`` adds the update: ``nnx.Optimizer(model, tx,
wrt=nnx.Param)`` for the parameters (under standard dtype promotion, which optax needs), and the
FP8 state overwritten with its gradient (its new value), never touched by optax. The new state is
checked with ``te_flax.quantize.check_merged`` where it is applied, so a gradient taken without
the merge (``nnx.grad`` directly) cannot sum a reused state unnoticed.

The training loop of Flax's guides needs one change: ``value_and_grad(loss_fn,
update_fp8_state=True)`` in place of ``nnx.value_and_grad`` writes the new FP8 state into the
model and returns the parameter gradients, for a plain ``nnx.Optimizer(model, tx,
wrt=nnx.Param).update(model, grads)``. A plain ``nnx.value_and_grad`` would differentiate the
parameters only and drop the new state: a fresh state then scales just in time and the layers
warn once (``te_flax.training.hold_fp8_state()`` keeps a deliberate one quiet).

Example usage::

  >>> import jax, jax.numpy as jnp, optax
  >>> from flax import nnx
  >>> import te_flax.nnx as te_nnx
  >>> from te_flax.quantize import DelayedScaling
  >>> layer = te_nnx.DenseGeneral(8, 4, recipe=DelayedScaling(amax_history_len=4),
  ...                             rngs=nnx.Rngs(0))
  >>> optimizer = nnx.Optimizer(layer, optax.sgd(0.1), wrt=nnx.Param)
  >>> def loss_fn(model, x):
  ...     return jnp.mean(model(x) ** 2)
  >>> step = nnx.jit(lambda m, o, x: te_nnx.train_step(m, o, loss_fn, x))
  >>> loss = step(layer, optimizer, jnp.full((2, 8), 3.0))
  >>> layer.x_amax_history[...]
  Array([3., 0., 0., 0.], dtype=float32)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from te_flax._base.checks import check_bool
from te_flax.nnx._fp8_meta import Fp8Meta, Fp8Stats
from te_flax.quantize import check_calibrated, check_merged, merge_by_max
from te_flax.quantize.inspection import inspecting
from te_flax.training import (
    all_finite,
    drop_step_amax_spikes,
    keep_unused,
    kept_statistics,
    select_tree,
)

__all__ = ["train_step", "update_fp8_state", "value_and_grad"]


def value_and_grad(
    loss_fn: Callable[..., Any],
    *,
    has_aux: bool = False,
    update_fp8_state: bool = False,
    drop_amax_spikes: bool = True,
) -> Callable[..., Any]:
    """``loss_fn(model, *args)`` -> ``(value, grads)`` over ``nnx.Param`` and ``Fp8Meta``.

    ``grads`` is an ``nnx.State`` holding the parameter gradients and the new FP8 state. Other
    state the loss changes (RNG counters of dropout, ...) is written back to the model, as
    ``nnx.value_and_grad`` would. With ``has_aux`` the loss returns ``(value, aux)`` and the
    result is ``((value, aux), grads)``.

    With ``update_fp8_state=True`` it is a drop-in for ``nnx.value_and_grad`` in a training
    loop: the new FP8 state is written into the model (checked as ``update_fp8_state`` checks
    it), the way ``nnx.value_and_grad`` writes back BatchNorm statistics, and ``grads`` holds
    the parameter gradients only, ready for ``nnx.Optimizer(model, tx,
    wrt=nnx.Param).update(model, grads)``. Leave it False to inspect the new state without
    applying it (then apply it with ``update_fp8_state`` or use ``train_step``).
    ``drop_amax_spikes`` is ``update_fp8_state``'s, for the state written into the model.

    Inside ``te_flax.inspect_fp8()`` the model's ``Fp8Stats`` variables are differentiated too,
    and their gradients, the step's FP8 statistics (the output gradients' included), are
    written into them: read them with ``nnx.state(model, te_flax.nnx.Fp8Stats)``. They are
    never part of ``grads``.
    """
    check_bool(drop_amax_spikes, "drop_amax_spikes")

    def wrapped(model: nnx.Module, *args: Any, **kwargs: Any) -> Any:
        # Outside inspect_fp8() no statistics variable is read: they stay with the rest.
        inspected = inspecting()
        if inspected:
            graphdef, *states = nnx.split(model, nnx.Param, Fp8Meta, Fp8Stats, ...)
            params, fp8, stats, rest = states
        else:
            graphdef, *states = nnx.split(model, nnx.Param, Fp8Meta, ...)
            params, fp8, rest = states
            stats = nnx.State({})

        def pure(
            params: nnx.State[Any, Any],
            fp8: nnx.State[Any, Any],
            stats: nnx.State[Any, Any],
            rest: nnx.State[Any, Any],
            *args: Any,
        ) -> tuple[Any, tuple[Any, nnx.State[Any, Any]]]:
            # Marked where the state enters the step, before it fans out to its uses. Copied:
            # the merged module must own variables of this trace (RNG counters change).
            marked = (merge_by_max(fp8), merge_by_max(stats))
            inner = nnx.merge(graphdef, params, *marked, rest, copy=True)
            out = loss_fn(inner, *args, **kwargs)
            value, aux = out if has_aux else (out, None)
            # Statistics variables made by this step's first call inside inspect_fp8 included.
            new_rest = nnx.split(inner, nnx.Param, Fp8Meta, ...)[-1]
            return value, (aux, new_rest)

        grad_fn = jax.value_and_grad(pure, argnums=(0, 1, 2), has_aux=True)
        (value, (aux, new_rest)), grads = grad_fn(params, fp8, stats, rest, *args)
        param_grads, fp8_grads, stats_grads = grads
        # The step's statistics are the statistics variables' gradient (read before the
        # update below, which writes the loss's own values into the model's variables).
        measured = kept_statistics(stats_grads, stats) if inspected else None
        nnx.update(model, new_rest)  # statistics variables made by this step included
        if measured is not None:
            nnx.update(model, measured)
        if update_fp8_state:
            _overwrite_fp8_state(model, fp8_grads, drop_amax_spikes)
            grads = param_grads
        else:
            grads = nnx.merge_state(param_grads, fp8_grads)
        return ((value, aux) if has_aux else value), grads

    return wrapped


def update_fp8_state(
    model: nnx.Module, grads: nnx.State[Any, Any], *, drop_amax_spikes: bool = True
) -> None:
    """Overwrites the model's ``Fp8Meta`` variables with their gradients (their new values).

    A state that no op read in the step has a zero gradient; it keeps its value. A state that
    came back summed over its uses raises (``te_flax.quantize.check_merged``), under ``jit``
    too; a state no step has updated yet warns once (``check_calibrated``).

    By default (``drop_amax_spikes=True``) a new amax more than 1e3 times the largest amax of
    its history (a finite loss spike) is recorded as 0 and the state keeps its previous
    ``scale_inv`` (``te_flax.training.drop_step_amax_spikes``), so one spike does not zero the
    kernel gradients for ``amax_history_len`` steps; a real jump of more than 1e3 in one step
    saturates until the older entries leave the history. ``False`` records every amax as it
    is (the behaviour before this guard). The cost is one maximum over each history per step
    (``bench/RESULTS_fp8_state_guards.md``).
    """
    check_bool(drop_amax_spikes, "drop_amax_spikes")
    new = nnx.state(grads, Fp8Meta)
    if nnx.state(model, Fp8Meta) and not new:
        raise ValueError(
            "the model holds FP8 state (Fp8Meta variables) but grads holds none, so there is "
            "no new FP8 state to apply: take grads with te_flax.nnx.value_and_grad (which "
            "differentiates the Fp8Meta variables too), or let it apply the state itself with "
            "te_flax.nnx.value_and_grad(loss_fn, update_fp8_state=True)"
        )
    _overwrite_fp8_state(model, new, drop_amax_spikes)


def _overwrite_fp8_state(
    model: nnx.Module, new: nnx.State[Any, Any], drop_amax_spikes: bool
) -> None:
    old = nnx.state(model, Fp8Meta)
    kept = keep_unused(new, old)
    if drop_amax_spikes:
        kept = drop_step_amax_spikes(kept, old)
    check_merged(old, kept)  # on the state written, as te_flax.training.apply_gradients
    check_calibrated(kept)
    nnx.update(model, kept)


def train_step(
    model: nnx.Module,
    optimizer: nnx.Optimizer[Any],
    loss_fn: Callable[..., Any],
    *args: Any,
    skip_nonfinite: bool = False,
    drop_amax_spikes: bool = True,
    **kwargs: Any,
) -> Any:
    """One step: gradients, ``optimizer.update`` on the parameters, FP8-state overwrite.

    ``optimizer`` must optimize ``nnx.Param`` only (``wrt=nnx.Param``), so that no optax
    transform touches the FP8 state. Run it under ``nnx.jit``.

    Args:
      model: the model; its parameters and FP8 state are updated in place.
      optimizer: ``nnx.Optimizer(model, tx, wrt=nnx.Param)``.
      loss_fn: ``loss_fn(model, *args, **kwargs)`` -> scalar loss.
      *args: passed to ``loss_fn``.
      skip_nonfinite: when the parameter gradients or the new FP8 state hold a NaN or an
        infinity, leave the parameters, the optimizer state (its step count included) and the
        FP8 state as they were. Default False: the update is applied as it is (non-finite
        gradients reach the parameters; the FP8 state stays finite, as a non-finite amax is
        recorded as 0 and the scale is kept).
      drop_amax_spikes: leave a finite spike of this step out of the FP8 state (default True;
        see ``update_fp8_state``). False records every amax, so one spike makes that tensor's
        scale as many times too coarse for ``amax_history_len`` steps.
      **kwargs: passed to ``loss_fn``.

    Returns:
      The loss; with ``skip_nonfinite=True``, ``(loss, skipped)`` where ``skipped`` is a bool
      array, True when the step was skipped (sum it to count skipped steps).
    """
    if not isinstance(optimizer, nnx.Optimizer) or isinstance(optimizer, nnx.ModelAndOptimizer):
        raise TypeError(
            f"optimizer must be an nnx.Optimizer(model, tx, wrt=nnx.Param), got "
            f"{type(optimizer).__name__}"
        )
    if optimizer.wrt is not nnx.Param:
        raise ValueError(
            f"the optimizer must be built with wrt=nnx.Param, got wrt={optimizer.wrt!r}: the "
            "FP8 state (Fp8Meta) is overwritten with its gradient, never optimized"
        )
    loss, grads = value_and_grad(loss_fn)(model, *args, **kwargs)
    # A copy of the values: the state of a module holds its live Variables.
    before = jax.tree.map(
        jnp.asarray, nnx.state((model, optimizer), (nnx.Param, Fp8Meta, nnx.OptState))
    )
    with jax.numpy_dtype_promotion("standard"):  # optax mixes its int32 count with floats
        optimizer.update(model, grads)
    update_fp8_state(model, grads, drop_amax_spikes=drop_amax_spikes)
    if not skip_nonfinite:
        return loss
    finite = all_finite(nnx.state(grads, nnx.Param)) & all_finite(nnx.state(grads, Fp8Meta))
    after = nnx.state((model, optimizer), (nnx.Param, Fp8Meta, nnx.OptState))
    nnx.update((model, optimizer), select_tree(finite, after, before))
    return loss, jnp.logical_not(finite)
