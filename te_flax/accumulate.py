"""Gradient accumulation inside one jitted step, with the kernels quantized once per step.

``accumulate_gradients(loss_fn, variables, microbatches)`` runs ``jax.value_and_grad(loss_fn)``
on each microbatch in a ``lax.scan`` and returns what one step over all of them needs: the mean
loss, the mean parameter gradients and the FP8 state of the microbatches merged by elementwise
max. That is what ``optax.MultiSteps`` with ``te_flax.training.apply_gradients`` gives after k
mini-steps, in one call: apply the result with a plain optimizer.

The FP8 state does not change between the microbatches of a step, so everything computed from
the variables alone is the same in every microbatch: the float8 kernels, their amax, the
kernels' new FP8 state (and casts of parameters to the compute dtype). With
``quantize_once=True`` (the default) that part of the microbatch computation is split off by
JAX's partial evaluation, which is how JAX itself hoists loop-invariant work out of a scan, and
runs once before the loop; the loop runs only what depends on the microbatch. The result is
the same computation, in the same order, as ``quantize_once=False``, which quantizes the kernels
in every microbatch unless the compiler moves them out of the loop (XLA:CPU does; XLA:GPU, in a
deviceless H100 compile, quantizes them in every iteration).

Example usage::

  >>> import jax, jax.numpy as jnp, optax
  >>> import te_flax.linen as te_nn
  >>> from te_flax.quantize import DelayedScaling
  >>> from te_flax.accumulate import accumulate_gradients
  >>> from te_flax.training import apply_gradients, init_optimizer, merge_fp8_state
  >>> layer = te_nn.DenseGeneral(features=4, recipe=DelayedScaling())
  >>> variables = layer.init(jax.random.key(0), jnp.ones((2, 8)))
  >>> tx = optax.sgd(1e-2)
  >>> opt_state = init_optimizer(tx, variables)
  >>> def loss_fn(variables, x):
  ...     return jnp.mean(layer.apply(merge_fp8_state(variables), x) ** 2)
  >>> microbatches = jnp.ones((4, 2, 8))  # 4 microbatches of 2 examples
  >>> loss, grads = jax.jit(accumulate_gradients, static_argnums=0)(
  ...     loss_fn, variables, microbatches)
  >>> variables, opt_state = apply_gradients(tx, variables, grads, opt_state)
  >>> grads["_overwrite_with_gradient"]["x_amax_history"][0]  # the max over the microbatches
  Array(1., dtype=float32)
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax import Array
from jax.extend.core import jaxpr_as_fun

from te_flax._base.checks import check_positive_int
from te_flax._base.jax_compat import partial_eval_jaxpr_nounits
from te_flax.quantize.inspection import STATS_COLLECTION
from te_flax.quantize.state import OVERWRITE_WITH_GRADIENT

__all__ = ["accumulate_gradients", "combine_gradients", "split_microbatches"]

# A Flax variable dict: collection name -> nested dict of arrays.
Variables = Mapping[str, Any]


def split_microbatches(batch: Any, num_microbatches: int) -> Any:
    """``batch`` with every leaf ``[B, ...]`` reshaped to ``[num_microbatches, B // k, ...]``.

    Example usage::

      >>> import jax.numpy as jnp
      >>> from te_flax.accumulate import split_microbatches
      >>> split_microbatches({"x": jnp.ones((8, 3))}, 4)["x"].shape
      (4, 2, 3)
    """
    check_positive_int(num_microbatches, "num_microbatches", "1 means no accumulation")

    def split(leaf: Array) -> Array:
        if leaf.ndim == 0 or leaf.shape[0] % num_microbatches:
            raise ValueError(
                f"a batch leaf of shape {leaf.shape} cannot be split into {num_microbatches} "
                "microbatches: its leading (batch) axis must be a multiple of num_microbatches"
            )
        return leaf.reshape(num_microbatches, leaf.shape[0] // num_microbatches, *leaf.shape[1:])

    return jax.tree.map(split, batch)


# Collections whose "gradients" are values merged by max, never averaged: the FP8 state and
# the FP8 statistics (te_flax.inspect_fp8()).
_MAX_MERGED = (OVERWRITE_WITH_GRADIENT, STATS_COLLECTION)


def _fp8_mask(grads: Variables) -> Any:
    """True at the leaves of the FP8 state and statistics (merged by max), False elsewhere
    (averaged)."""
    return {
        name: jax.tree.map(lambda _, fp8=name in _MAX_MERGED: fp8, collection)
        for name, collection in grads.items()
    }


def _combine(is_max: bool, total: Array, value: Array) -> Array:
    return jnp.maximum(total, value) if is_max else total + value


def _start(is_max: bool, like: jax.ShapeDtypeStruct) -> Array:
    fill = -jnp.inf if is_max else 0
    return jnp.full(like.shape, fill, like.dtype)


def combine_gradients(*grads: Variables, reduce: str = "mean") -> dict[str, Any]:
    """Several gradient dicts of one step (microbatches, views) as one: each parameter
    gradient averaged (or summed), the FP8 state merged by elementwise max.

    A gradient dict's FP8 collection is a new state, not a gradient: the sum of two new
    states is no state, and their mean is a state of the mean amax, which no check can tell
    from a real one (a mean of updates of one state is itself a valid update). Where a step
    differentiates each microbatch apart and combines the results by hand, combine them with
    this, not ``jax.tree.map``. (A loss that applies the model to every microbatch in one
    differentiated function needs nothing: its reads of the state merge by max.)

    Args:
      *grads: gradient dicts of the same structure (``jax.grad`` of a loss over the whole
        variable dict), one per microbatch.
      reduce: ``"mean"`` (default) or ``"sum"``, for the parameter gradients.

    Returns:
      One gradient dict of that structure, ready for ``te_flax.training.apply_gradients`` or
      Flax's ``TrainState.apply_gradients``.

    Example usage::

      >>> import jax, jax.numpy as jnp
      >>> import te_flax.linen as te_nn
      >>> from te_flax.quantize import DelayedScaling
      >>> from te_flax.accumulate import combine_gradients
      >>> layer = te_nn.DenseGeneral(features=4, recipe=DelayedScaling(amax_history_len=4))
      >>> variables = layer.init(jax.random.key(0), jnp.ones((2, 8)))
      >>> grad = jax.grad(lambda v, x: jnp.sum(layer.apply(v, x)))
      >>> grads = combine_gradients(grad(variables, jnp.ones((2, 8))),
      ...                           grad(variables, 3 * jnp.ones((2, 8))))
      >>> grads["_overwrite_with_gradient"]["x_amax_history"]  # max(1, 3), not their mean
      Array([3., 0., 0., 0.], dtype=float32)
    """
    if reduce not in ("mean", "sum"):
        raise ValueError(
            f'combine_gradients(reduce=...) must be "mean" or "sum", got {reduce!r}; "mean" '
            'averages the parameter gradients, "sum" adds them (the FP8 state is max-merged)'
        )
    if not grads:
        raise ValueError(
            "combine_gradients needs at least one gradient dict, got none; pass the gradient "
            "dicts of the microbatches, e.g. combine_gradients(grads_1, grads_2)"
        )
    trees = {jax.tree.structure(g) for g in grads}
    if len(trees) != 1:
        raise ValueError(
            "combine_gradients takes gradient dicts of one structure (the same model's "
            f"variables), got {len(trees)} different structures: {sorted(map(str, trees))}; "
            "pass the gradients of one model, each from jax.grad over its whole variable dict"
        )
    if not isinstance(grads[0], Mapping):
        raise TypeError(
            "combine_gradients takes Flax variable dicts ({'params': ..., "
            f"'{OVERWRITE_WITH_GRADIENT}': ...}}), got {type(grads[0]).__name__}"
        )

    def combine(path: tuple[Any, ...], *values: Array) -> Array:
        if getattr(path[0], "key", None) in _MAX_MERGED:
            return functools.reduce(jnp.maximum, values)
        total = functools.reduce(jnp.add, values)
        return total / len(values) if reduce == "mean" else total

    combined: dict[str, Any] = jax.tree_util.tree_map_with_path(combine, *grads)
    return combined


def accumulate_gradients(
    loss_fn: Callable[[Variables, Any], Array],
    variables: Variables,
    microbatches: Any,
    *,
    quantize_once: bool = True,
) -> tuple[Array, dict[str, Any]]:
    """The mean loss and gradients of ``loss_fn`` over microbatches, FP8 state max-merged.

    Args:
      loss_fn: ``loss_fn(variables, microbatch) -> scalar loss``; it calls
        ``te_flax.training.merge_fp8_state(variables)`` first, as any FP8 loss does.
      variables: the model's variable dict (``params``, ``_overwrite_with_gradient``, ...).
      microbatches: a pytree whose leaves have a leading microbatch axis ``[k, ...]``
        (``split_microbatches`` makes one from a batch).
      quantize_once: compute what depends only on ``variables`` (the float8 kernels, their
        amax and new FP8 state) once per call, before the microbatch loop (default True).
        False runs the whole ``value_and_grad`` in every iteration.

    Returns:
      ``(loss, grads)``: the mean of the microbatch losses, and ``grads`` with the structure of
      ``variables``: the mean of the microbatch gradients, except the FP8 collection, the
      elementwise max of the microbatches' new states. Pass ``grads`` to
      ``te_flax.training.apply_gradients`` with an optimizer that does not accumulate again.
    """
    leaves = jax.tree.leaves(microbatches)
    if not leaves or any(leaf.ndim == 0 for leaf in leaves):
        raise ValueError(
            "microbatches must be a pytree of arrays with a leading microbatch axis [k, ...]; "
            "use split_microbatches(batch, k) to make one from a batch"
        )
    count = leaves[0].shape[0]
    if any(leaf.shape[0] != count for leaf in leaves):
        shapes = [leaf.shape for leaf in leaves]
        raise ValueError(f"microbatch leaves disagree on the number of microbatches: {shapes}")
    grad_fn = jax.value_and_grad(loss_fn)
    one = jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape[1:], leaf.dtype), microbatches)
    out_leaves, out_tree = jax.tree.flatten(jax.eval_shape(grad_fn, variables, one))
    is_max = [False, *jax.tree.leaves(_fp8_mask(jax.tree.unflatten(out_tree, out_leaves)[1]))]
    constant, per_microbatch = _split(grad_fn, variables, one, quantize_once)

    def body(totals: list[Array | None], microbatch: Any) -> tuple[list[Array | None], None]:
        values = per_microbatch(microbatch)
        new = [
            None if total is None or value is None else _combine(m, total, value)
            for m, total, value in zip(is_max, totals, values, strict=True)
        ]
        return new, None

    # An output that does not depend on the microbatch (computed once, before the loop) is
    # taken as it is: its max and its mean over the microbatches are itself.
    start: list[Array | None] = [
        None if fixed is not None else _start(m, like)
        for m, like, fixed in zip(is_max, out_leaves, constant, strict=True)
    ]
    totals, _ = jax.lax.scan(body, start, microbatches)
    results = [
        fixed if fixed is not None else (total if m else total / count)
        for m, total, fixed in zip(is_max, totals, constant, strict=True)
    ]
    loss, grads = jax.tree.unflatten(out_tree, results)
    return loss, grads


PerMicrobatch = Callable[[Any], list[Array | None]]


def _split(
    grad_fn: Callable[..., Any], variables: Variables, one: Any, hoist: bool
) -> tuple[list[Array | None], PerMicrobatch]:
    """``grad_fn(variables, microbatch)`` as ``(constant, per_microbatch)``: the output leaves
    computed once (None where an output depends on the microbatch), and a function of the
    microbatch giving the others (None where ``constant`` has the value).

    With ``hoist`` JAX's partial evaluation splits the traced computation by data dependence:
    every operation whose inputs are all known without the microbatch runs here, once; what it
    passes to the rest (the float8 kernels and their scales) becomes a constant of the loop.
    """
    variable_leaves = jax.tree.leaves(variables)
    partial_eval = partial_eval_jaxpr_nounits() if hoist else None
    if partial_eval is None:
        n_outputs = len(jax.tree.leaves(jax.eval_shape(grad_fn, variables, one)))

        def whole(microbatch: Any) -> list[Array | None]:
            return list(jax.tree.leaves(grad_fn(variables, microbatch)))

        return [None] * n_outputs, whole
    closed = jax.make_jaxpr(grad_fn)(variables, one)
    unknowns = [False] * len(variable_leaves) + [True] * len(jax.tree.leaves(one))
    known, unknown, out_unknowns, _ = partial_eval(closed, unknowns, instantiate=False)
    known_outputs = jaxpr_as_fun(known)(*variable_leaves)
    n_known = out_unknowns.count(False)
    fixed, residuals = iter(known_outputs[:n_known]), known_outputs[n_known:]
    constant = [None if is_unknown else next(fixed) for is_unknown in out_unknowns]
    run_unknown = jaxpr_as_fun(unknown)

    def rest(microbatch: Any) -> list[Array | None]:
        values = iter(run_unknown(*residuals, *jax.tree.leaves(microbatch)))
        return [next(values) if is_unknown else None for is_unknown in out_unknowns]

    return constant, rest
