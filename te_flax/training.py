"""Applying a training step's gradients: the optimizer for parameters, overwrite for FP8 state.

The gradient of the loss with respect to the ``_overwrite_with_gradient`` collection is the new
FP8 state (the ops return it through the cotangent slot). So a step splits its gradients: the
``params`` go through the optax optimizer; the FP8 state replaces the old state and never meets
an optax transform (clipping, weight decay or averaging would corrupt it).

Differentiate with ``value_and_grad(loss_fn)`` (this module's, a drop-in for
``jax.value_and_grad`` over the variable dict): it marks the FP8 collection so that every reuse
of a state in the step merges by elementwise max (a module applied twice, state shared by the
layers of an ``nn.scan`` with ``variable_broadcast``, a loop or ``lax.scan`` over
microbatches). Without the mark autodiff adds up the updates of the uses. Every layer marks
its own reads, and reads of the very same arrays share one mark, so weight tying, shared
blocks and one variable dict in several ``apply`` calls merge under any loop, with or without
``jit``; the uses a loop of JAX's own makes (a ``lax.scan`` over microbatches, a state
broadcast over ``nn.scan``) read the loop body's one input and need the mark where the
variables enter the step: with ``jax.grad`` directly, call ``merge_fp8_state(variables)``
first thing in the loss. Gradients of several calls combined by hand take
``combine_gradients`` (``te_flax.accumulate``), which merges their FP8 state by max.
``apply_gradients`` checks every new state (``te_flax.quantize.check_merged``): a summed one
raises, under ``jit`` too (there as a runtime error from the check's host callback). A
gradient of ``variables["params"]`` alone, the FP8 collection passed through as a constant,
would drop the new state: a fresh state then scales just in time and the layers warn once
(``UncalibratedFp8StateWarning``), unless it runs inside ``hold_fp8_state()``.

Applying the gradients, two ways, one rule:

* Flax's ``flax.training.train_state.TrainState`` already follows it: create it with the whole
  variable dict as ``params`` and call ``apply_gradients(grads=grads)`` unchanged.
* With a plain optax transform: ``opt_state = init_optimizer(tx, variables)`` and
  ``variables, opt_state = apply_gradients(tx, variables, grads, opt_state)``. Under
  ``optax.MultiSteps`` the FP8 state stays fixed while gradients accumulate and the
  microbatches' updates are merged by elementwise max when the accumulated step is applied, so
  k accumulated microbatches give the state of one step over all of them. With
  ``skip_nonfinite=True`` a step whose gradients or new FP8 state hold a NaN or an infinity
  changes nothing but the count ``opt_state.skipped_steps``.
* Microbatches inside one jitted step: ``accumulate_gradients(loss_fn, variables,
  microbatches)`` (``te_flax.accumulate``) gives the same gradients and FP8 state as k
  ``MultiSteps`` mini-steps, and quantizes the kernels once per step instead of once per
  microbatch; apply them with a plain optimizer.

The optax update runs under standard dtype promotion (optax mixes its int32 step count with
Python floats), so the rest of a step can run under ``jax_numpy_dtype_promotion="strict"``.

FP8 statistics (``te_flax.inspect_fp8()``): a variable dict with an ``"fp8_stats"`` collection
(``fp8_stats_slots`` makes one) gets, as that collection's gradient, the step's statistics of
every GEMM operand, the output gradients' included. ``merge_fp8_state`` marks it for
max-merging too, ``apply_gradients`` writes it into the returned variables (a statistic the
step did not measure keeps its value) and no optax transform sees it. With Flax's
``TrainState``, whose ``apply_gradients`` would hand it to the optimizer, keep the collection
out of the state: add it to the variables inside the step and read ``grads["fp8_stats"]``.

Example usage::

  >>> import jax, jax.numpy as jnp, optax
  >>> import te_flax, te_flax.linen as te_nn
  >>> from te_flax.training import apply_gradients, init_optimizer, value_and_grad
  >>> layer = te_nn.DenseGeneral(features=4, recipe=te_flax.quantize.DelayedScaling())
  >>> x = jnp.ones((2, 8))
  >>> variables = layer.init(jax.random.key(0), x)
  >>> tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
  >>> opt_state = init_optimizer(tx, variables)
  >>> def loss(variables, x):
  ...     return jnp.sum(layer.apply(variables, x) ** 2)
  >>> loss_value, grads = jax.jit(value_and_grad(loss))(variables, x)
  >>> variables, opt_state = apply_gradients(tx, variables, grads, opt_state)
  >>> float(variables["_overwrite_with_gradient"]["x_amax_history"][0])
  1.0
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import Array, lax

from te_flax._base.checks import check_bool
from te_flax._layers.fp8_state import hold_fp8_state
from te_flax._layers.fp8_stats import fp8_stats_slots, kept_statistics
from te_flax.accumulate import accumulate_gradients, combine_gradients, split_microbatches
from te_flax.quantize import (
    DelayedScaling,
    check_calibrated,
    check_merged,
    merge_by_max,
    scaling,
)
from te_flax.quantize.inspection import STATS_COLLECTION
from te_flax.quantize.state import OVERWRITE_WITH_GRADIENT

__all__ = [
    "OVERWRITE_WITH_GRADIENT",
    "OptimizerState",
    "accumulate_gradients",
    "all_finite",
    "apply_gradients",
    "combine_gradients",
    "drop_amax_spikes",
    "drop_step_amax_spikes",
    "fp8_stats_slots",
    "hold_fp8_state",
    "init_optimizer",
    "kept_statistics",
    "merge_fp8_state",
    "split_microbatches",
    "value_and_grad",
]

# A Flax variable dict: collection name -> nested dict of arrays (a dict or a FrozenDict).
Variables = Mapping[str, Any]


class OptimizerState(NamedTuple):
    """The optax state of the parameters, FP8 updates waiting for an accumulated step, and the
    number of steps ``apply_gradients(..., skip_nonfinite=True)`` skipped."""

    tx_state: optax.OptState
    # Under optax.MultiSteps: the elementwise max of the FP8 updates since the last applied
    # step (-inf where none yet). None otherwise.
    pending_fp8: Any
    skipped_steps: Any  # int32 scalar


def merge_fp8_state(variables: Variables) -> Variables:
    """``variables`` with the FP8 collection marked for max-merging (see the module docstring).

    Call it first thing inside the differentiated loss; the gradient with respect to the
    original float32 state is then the max-merged new state.
    """
    _check_variables(variables, "variables")
    marked = [name for name in (OVERWRITE_WITH_GRADIENT, STATS_COLLECTION) if name in variables]
    if not marked:
        return variables
    merged = dict(variables)
    for name in marked:  # the FP8 state, and the statistics of te_flax.inspect_fp8()
        merged[name] = merge_by_max(variables[name])
    return merged


def value_and_grad(
    loss_fn: Callable[..., Any], *, has_aux: bool = False
) -> Callable[..., tuple[Any, Variables]]:
    """``jax.value_and_grad`` of ``loss_fn(variables, *args)``, the FP8 state max-merged.

    The returned function takes the variable dict first, marks its FP8 collection with
    ``merge_fp8_state`` before ``loss_fn`` sees it, and differentiates with respect to the
    whole dict: the ``params`` gradients and, for the FP8 state, its new value. With
    ``has_aux`` the loss returns ``(value, aux)`` and the result is ``((value, aux), grads)``.
    """

    def wrapped(variables: Variables, *args: Any, **kwargs: Any) -> tuple[Any, Variables]:
        def merged_loss(variables: Variables) -> Any:
            return loss_fn(merge_fp8_state(variables), *args, **kwargs)

        result: tuple[Any, Variables] = jax.value_and_grad(merged_loss, has_aux=has_aux)(variables)
        return result

    return wrapped


def drop_amax_spikes(
    state: Mapping[str, Any], recipe: DelayedScaling, factor: float = 1e3
) -> dict[str, Any]:
    """The FP8 state with amax-history entries far above the rest forgotten, and the scales
    recomputed from what is left: the guard against a finite loss or activation spike.

    Delayed scaling takes each tensor's scale from the largest amax of its history (the
    default ``amax_compute_algo="max"``). One step whose gradients are 1e12 times too large
    (a loss spike that gradient clipping keeps finite) puts that amax in the history, and for
    the next ``amax_history_len`` steps the gradient scale is 1e12 times too coarse: every
    gradient quantizes to 0, the kernel gradients are exactly 0 and the model stops training
    without a sign. After such a step, apply the new state through this function (or every
    step: where no entry stands out it returns the state unchanged).

    An entry is a spike when it exceeds ``factor`` times the median of the history's positive
    entries; it is set to 0 (an empty entry, as the start of a history), and that tensor's
    ``scale_inv`` is computed again from the rest with the recipe's rule.

    Args:
      state: the FP8 state, a nested mapping in which a GEMM's variables sit side by side
        (``*_amax_history`` ``[..., L]`` with ``*_scale_inv`` ``[..., 1]``): Linen's
        ``variables["_overwrite_with_gradient"]`` or the whole variable dict, NNX's
        ``nnx.to_pure_dict(nnx.state(model, te_flax.nnx.Fp8Meta))``. Grouped states (a
        leading expert axis) are handled per group.
      recipe: the ``DelayedScaling`` recipe the state belongs to (format, margin, rule).
      factor: how far above the median an entry must be to count as a spike (default 1e3;
        > 1).

    Returns:
      The same structure as plain dicts, spikes dropped.

    Example usage::

      >>> import jax.numpy as jnp
      >>> from te_flax.quantize import DelayedScaling
      >>> from te_flax.training import drop_amax_spikes
      >>> recipe = DelayedScaling(amax_history_len=4)
      >>> state = {"grad_amax_history": jnp.array([1e9, 1.0, 2.0, 1.5]),
      ...          "grad_scale_inv": jnp.array([1e9 / 57344.0])}
      >>> fixed = drop_amax_spikes(state, recipe)
      >>> fixed["grad_amax_history"], fixed["grad_scale_inv"] * 57344.0
      (Array([0. , 1. , 2. , 1.5], dtype=float32), Array([2.], dtype=float32))
    """
    if not isinstance(recipe, DelayedScaling):
        raise TypeError(
            "drop_amax_spikes(recipe=...) takes the DelayedScaling recipe the state belongs to "
            f"(only delayed scaling keeps amax histories), got {type(recipe).__name__}"
        )
    if isinstance(factor, bool) or not isinstance(factor, int | float) or not 1 < factor < math.inf:
        raise ValueError(
            f"drop_amax_spikes(factor=...) must be a finite number above 1, got {factor!r}; "
            "an entry more than factor times the history's median counts as a spike"
        )
    if not isinstance(state, Mapping):
        raise TypeError(
            "drop_amax_spikes(state=...) takes the FP8 state as a nested mapping (Linen's "
            "variables['_overwrite_with_gradient'], NNX's nnx.to_pure_dict(nnx.state(model, "
            f"Fp8Meta))), got {type(state).__name__}"
        )
    fixed: dict[str, Any] = {}
    for name, value in state.items():
        if isinstance(value, Mapping):
            fixed[name] = drop_amax_spikes(value, recipe, factor)
        elif name.endswith(_HISTORY) and name[: -len(_HISTORY)] + _SCALE in state:
            stem = name[: -len(_HISTORY)]
            dtype = recipe.fp8_format.value[1 if stem.startswith("grad") else 0]
            fixed[name], fixed[stem + _SCALE] = _without_spikes(
                jnp.asarray(value), jnp.asarray(state[stem + _SCALE]), dtype, recipe, factor
            )
        elif name not in fixed:
            fixed[name] = value
    return fixed


_HISTORY, _SCALE = "_amax_history", "_scale_inv"


def _without_spikes(
    history: Array, scale_inv: Array, dtype: Any, recipe: DelayedScaling, factor: float
) -> tuple[Array, Array]:
    def one(history: Array, scale_inv: Array) -> tuple[Array, Array]:
        positive = history > 0
        median = jnp.nanmedian(jnp.where(positive, history, jnp.nan))
        spikes = positive & (history > factor * median)  # none where nothing is positive
        cleaned = jnp.where(spikes, 0.0, history)
        recomputed = _scale_inv_of_history(cleaned, scale_inv, dtype, recipe)
        new = jnp.where(jnp.any(spikes), recomputed.reshape(()), scale_inv.reshape(()))
        return cleaned, new.reshape(scale_inv.shape)

    length = history.shape[-1]
    rows = jax.vmap(one)(history.reshape(-1, length), scale_inv.reshape(-1, 1))
    return rows[0].reshape(history.shape), rows[1].reshape(scale_inv.shape)


def _scale_inv_of_history(
    history: Array, saved_scale_inv: Array, dtype: Any, recipe: DelayedScaling
) -> Array:
    """One state's ``scale_inv`` (``[1]``) as ``recipe``'s update rule computes it from
    ``history`` (``[L]``, newest first); see ``scale_inv_from_history``."""
    amax = scaling.reduce_history(history, recipe.amax_compute_algo)
    if recipe.amax_compute_algo == "most_recent":
        # A newest entry of 0 (a step that recorded no amax) kept the scale of the step before:
        # the one of the newest positive entry.
        newest_positive = history[jnp.argmax(history > 0)]
        amax = scaling.where(amax > 0, amax, newest_positive)
    previous = saved_scale_inv.reshape(())
    custom = recipe.scaling_factor_compute_algo
    if custom is None:
        new = scaling.compute_scale_inv(amax, dtype, recipe.margin, previous)
    else:
        new = scaling.scale_inv_from_scaling_factor(custom, amax, dtype, previous, recipe)
    return new.reshape(saved_scale_inv.shape)


def scale_inv_from_history(
    name: str, history: Array, saved_scale_inv: Array, recipe: DelayedScaling
) -> Array:
    """The ``scale_inv`` that ``recipe`` keeps after the steps that wrote ``history``.

    Delayed scaling's scale is a function of the amax history: ``amax * 2**margin / fp8_max``
    (or the recipe's ``scaling_factor_compute_algo``) with amax the history's maximum or its
    newest entry, where ``fp8_max`` is that of the format the tensor ``name`` (a
    ``*_amax_history`` or ``*_scale_inv`` variable's name) is quantized to: the gradient
    format for ``grad*``, the forward format otherwise. Under ``"most_recent"`` a newest entry
    of 0 kept the scale of the newest positive entry, and that is the one returned. Where the
    history holds no amax the rule kept a scale older than the history, which it cannot tell:
    ``saved_scale_inv`` is returned there.

    Args:
      name: the variable's name (its role, ``x``, ``kernel`` or ``grad``, picks the format).
      history: ``[..., L]``, newest entry first; leading axes (scanned layers, groups) are
        separate states.
      saved_scale_inv: ``[..., 1]``, the scale kept where the history holds no amax.
      recipe: the ``DelayedScaling`` recipe whose scale to compute.

    Returns:
      ``[..., 1]`` float32 scales.
    """
    dtype = recipe.fp8_format.value[1 if name.startswith("grad") else 0]
    length = history.shape[-1]
    rows = jax.vmap(lambda h, s: _scale_inv_of_history(h, s, dtype, recipe))(
        jnp.asarray(history, jnp.float32).reshape(-1, length),
        jnp.asarray(saved_scale_inv, jnp.float32).reshape(-1, 1),
    )
    return rows.reshape(jnp.shape(saved_scale_inv))


def all_finite(tree: Any) -> Array:
    """Whether every floating-point leaf of ``tree`` is free of NaN and infinity (a bool)."""
    checks = [
        jnp.all(jnp.isfinite(leaf))
        for leaf in jax.tree.leaves(tree)
        if jnp.issubdtype(jnp.result_type(leaf), jnp.inexact)
    ]
    return jnp.all(jnp.stack(checks)) if checks else jnp.asarray(True)


def select_tree(keep_new: Array, new: Any, old: Any) -> Any:
    """``new`` where ``keep_new`` (a bool scalar) is True, else ``old``, leaf by leaf."""
    return jax.tree.map(lambda n, o: scaling.where(keep_new, n, o), new, old)


def keep_unused(new_fp8: Any, old_fp8: Any) -> Any:
    """The old value where a state got no update in the step (it came back all zeros).

    An FP8 state that no op read in the step can have a zero gradient (``merge_by_max``), and a
    zero ``scale_inv`` can never be a real update (scales are never 0): a quantizer whose new
    ``scale_inv`` is all zeros keeps its old ``scale_inv`` and its old amax history (the
    ``..._amax_history`` beside it), decided from its ``[1]`` scale instead of a reduction of
    its history. A leaf without a ``_scale_inv`` sibling is decided alone: kept when all zeros.
    With ``check_merged`` reading the kept state, this cut the fusions of the example's unrolled
    delayed step (``bench/RESULTS_compile_time.md``, "Unused state kept per variable, one
    conversion per tree").

    Decided per quantizer, not for the whole model at once: stacking a model's states into one
    array makes fewer operations but one concatenation of every state, which XLA compiled
    slowly (the same section).
    """
    leaves, tree = jax.tree_util.tree_flatten_with_path(new_fp8)
    names = [jax.tree_util.keystr(path) for path, _ in leaves]
    position = {name: i for i, name in enumerate(names)}
    stale: list[Array | None] = [None] * len(leaves)
    for i, name in enumerate(names):
        if "_scale_inv'" in name:  # a key ending in _scale_inv (Linen: the leaf; NNX: .value)
            stale[i] = jnp.all(leaves[i][1] == 0)
            history = position.get(name.replace("_scale_inv'", "_amax_history'"))
            if history is not None:
                stale[history] = stale[i]
    kept = [
        scaling.where(jnp.all(new == 0) if unused is None else unused, old, new)
        for (_, new), old, unused in zip(leaves, jax.tree.leaves(old_fp8), stale, strict=True)
    ]
    return jax.tree.unflatten(tree, kept)


# How far above the largest amax of its history a step's amax must be to count as a spike.
SPIKE_FACTOR = 1e3


def drop_step_amax_spikes(new_fp8: Any, old_fp8: Any, factor: float = SPIKE_FACTOR) -> Any:
    """The new FP8 state with this step's amax left out where it is a spike: the training
    helpers' guard (``apply_gradients`` and ``te_flax.nnx.train_step``, on by default).

    A state whose newest amax is more than ``factor`` times the largest amax of the history
    before it (a finite loss or activation spike that would make the scale that many times
    coarser for ``amax_history_len`` steps) records 0 in its place, as a step with a
    non-finite amax does, and keeps the previous step's ``scale_inv``; the next step computes
    the scale from the history again. A state with no amax before this step (the first step,
    ``amax_history_len=1``) has nothing to compare with and is kept as it came. Needs no recipe:
    it reads only the states, newest entry first along the last axis (``[..., L]``, leading
    axes of scanned layers or groups checked row by row), paired by name as in
    ``keep_unused``. Cost: one maximum over each history per step
    (``bench/RESULTS_fp8_state_guards.md``).
    """
    leaves, tree = jax.tree_util.tree_flatten_with_path(new_fp8)
    old_leaves = jax.tree.leaves(old_fp8)
    names = [jax.tree_util.keystr(path) for path, _ in leaves]
    position = {name: i for i, name in enumerate(names)}
    guarded = [leaf for _, leaf in leaves]
    for i, name in enumerate(names):
        if "_amax_history'" not in name:
            continue
        scale = position.get(name.replace("_amax_history'", "_scale_inv'"))
        history = jnp.asarray(guarded[i])
        if scale is None or history.shape[-1] < 2:
            continue
        newest = lax.index_in_dim(history, 0, axis=history.ndim - 1)  # [..., 1]
        before = lax.slice_in_dim(history, 1, history.shape[-1], axis=history.ndim - 1)
        largest = lax.reduce_max(before, (history.ndim - 1,)).reshape(newest.shape)
        spike = lax.bitwise_and(largest > 0, newest > factor * largest)  # [..., 1]
        # A select over the history, not a concatenation of a new first entry with the rest:
        # XLA fuses the select, and the concatenation cost twice the bytes (a 4-layer model:
        # +0.9% of a step's bytes accessed against +0.5%).
        first = lax.broadcasted_iota(jnp.int32, history.shape, history.ndim - 1) == 0
        guarded[i] = scaling.where(jnp.logical_and(first, spike), 0.0, history)
        old_scale = jnp.asarray(old_leaves[scale])
        guarded[scale] = scaling.where(spike.reshape(old_scale.shape), old_scale, guarded[scale])
    return jax.tree.unflatten(tree, guarded)


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
    with jax.numpy_dtype_promotion("standard"):  # see the module docstring
        tx_state = tx.init(variables["params"])
    pending = None
    if _multi_steps_state(tx_state) is not None and OVERWRITE_WITH_GRADIENT in variables:
        pending = jax.tree.map(
            lambda v: jnp.full_like(v, -jnp.inf), variables[OVERWRITE_WITH_GRADIENT]
        )
    return OptimizerState(tx_state, pending, jnp.zeros((), jnp.int32))


def apply_gradients(
    tx: optax.GradientTransformation,
    variables: Variables,
    grads: Variables,
    opt_state: OptimizerState,
    *,
    skip_nonfinite: bool = False,
    drop_amax_spikes: bool = True,
) -> tuple[Any, OptimizerState]:
    """One optimizer step on the parameters and the FP8-state overwrite.

    The new FP8 state is checked with ``te_flax.quantize.check_merged`` first: a state that
    came back summed over its uses (the loss was differentiated without ``merge_fp8_state``)
    raises, under ``jit`` too; a state no step has updated yet warns once
    (``te_flax.quantize.check_calibrated``). By default a step's amax more than 1e3 times the
    largest amax of its history (a finite loss spike) is left out of the history, so that one
    spike does not zero the kernel gradients for ``amax_history_len`` steps
    (``drop_step_amax_spikes``; its cost is in ``bench/RESULTS_fp8_state_guards.md``).

    Args:
      tx: the optax transform, the same one ``init_optimizer`` saw.
      variables: the model's variable dict (``params``, ``_overwrite_with_gradient``, ...).
      grads: ``jax.grad`` of the loss with respect to ``variables`` (same structure).
      opt_state: from ``init_optimizer`` or the previous step.
      skip_nonfinite: when the parameter gradients or the new FP8 state hold a NaN or an
        infinity (a bad batch, an overflowing loss), return the variables and the optimizer
        state unchanged except ``opt_state.skipped_steps``, which counts such steps; under
        ``optax.MultiSteps`` the microbatch is left out of the accumulation. Default False: the
        update is applied as it is, so non-finite gradients reach the parameters through the
        optimizer, while the FP8 state stays finite (a non-finite amax is recorded as 0 and the
        scale is kept).
      drop_amax_spikes: leave a spike of this step out of the FP8 state: a state whose new
        amax exceeds 1e3 times the largest amax of its history records 0 instead and keeps
        the previous ``scale_inv`` (what a step with a non-finite amax does). Default True.
        False records every amax as it is: one finite spike then makes that tensor's scale
        as many times too coarse for ``amax_history_len`` steps (the behaviour before this
        guard). A real jump of more than 1e3 in one step is treated as a spike too, and
        saturates until the older entries leave the history: turn the guard off where such
        jumps are expected.

    Returns:
      ``(new_variables, new_opt_state)``. Collections other than ``params``, the FP8 state and
      the FP8 statistics (``"fp8_stats"``, written with ``kept_statistics``) are returned
      unchanged.
    """
    _check_variables(variables, "variables")
    _check_variables(grads, "grads")
    check_bool(drop_amax_spikes, "drop_amax_spikes")
    if not isinstance(opt_state, OptimizerState):
        raise TypeError(
            "opt_state must come from te_flax.training.init_optimizer, got "
            f"{type(opt_state).__name__}"
        )
    with jax.numpy_dtype_promotion("standard"):  # see the module docstring
        updates, tx_state = tx.update(grads["params"], opt_state.tx_state, variables["params"])
        new_params = optax.apply_updates(variables["params"], updates)
    new_variables = dict(variables)
    new_variables["params"] = new_params
    pending = opt_state.pending_fp8
    if OVERWRITE_WITH_GRADIENT in grads:
        new_fp8 = keep_unused(grads[OVERWRITE_WITH_GRADIENT], variables[OVERWRITE_WITH_GRADIENT])
        if drop_amax_spikes:
            new_fp8 = drop_step_amax_spikes(new_fp8, variables[OVERWRITE_WITH_GRADIENT])
        # Checked after keep-unused and the guard: the kept history is the program's output,
        # and the check reading it (not the gradient) lets XLA write it in one fusion.
        check_merged(variables[OVERWRITE_WITH_GRADIENT], new_fp8)
        check_calibrated(new_fp8)
        multi = _multi_steps_state(tx_state)
        if multi is not None and pending is not None:
            merged = jax.tree.map(jnp.maximum, pending, new_fp8)
            applied = multi.mini_step == 0  # MultiSteps has just applied the accumulated step
            new_fp8 = jax.tree.map(
                lambda m, old: scaling.where(applied, m, old),
                merged,
                variables[OVERWRITE_WITH_GRADIENT],
            )
            pending = jax.tree.map(lambda m: scaling.where(applied, -jnp.inf, m), merged)
        new_variables[OVERWRITE_WITH_GRADIENT] = new_fp8
    if STATS_COLLECTION in grads and STATS_COLLECTION in variables:
        # te_flax.inspect_fp8(): the step's statistics, kept even by a skipped step.
        stats = kept_statistics(grads[STATS_COLLECTION], variables[STATS_COLLECTION])
        new_variables[STATS_COLLECTION] = stats
    skipped = opt_state.skipped_steps
    if skip_nonfinite:
        finite = all_finite((grads["params"], grads.get(OVERWRITE_WITH_GRADIENT)))
        for name in ("params", OVERWRITE_WITH_GRADIENT):
            if name in new_variables:
                new_variables[name] = select_tree(finite, new_variables[name], variables[name])
        tx_state = select_tree(finite, tx_state, opt_state.tx_state)
        pending = select_tree(finite, pending, opt_state.pending_fp8)
        skipped = skipped + jnp.where(finite, 0, 1).astype(skipped.dtype)
    new_opt_state = OptimizerState(tx_state, pending, skipped)
    if hasattr(variables, "copy") and not isinstance(variables, dict):
        mapping_type: Any = type(variables)  # a FrozenDict in, a FrozenDict out
        return mapping_type(new_variables), new_opt_state
    return new_variables, new_opt_state
