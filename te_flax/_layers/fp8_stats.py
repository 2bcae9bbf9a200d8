"""FP8 statistics in modules (``te_flax.inspect_fp8()``): both shells give each GEMM's
quantizer set a statistics slot read from the module's statistics variables, and keep the
forward statistics the ops hand back. What a front end does is only how it reads, creates and
writes a variable (``StatsVariables``); the slot and the statistics are
``te_flax.quantize.inspection``'s.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from flax.core.tracers import current_trace
from jax import Array

from te_flax._layers.fp8_state import merge_reuse
from te_flax.quantize import QuantizerSet, scaling
from te_flax.quantize.inspection import (
    STATS_COLLECTION,
    collecting,
    inspect_fp8,
    inspecting,
    slot_values,
    stats_name,
    with_slot,
)

__all__ = ["StatsVariables", "fp8_stats_slots", "inspected", "kept_statistics"]

Statistics = dict[str, Array]


class StatsVariables(Protocol):
    """How a front end keeps a module's statistics variables (``{role}{postfix}_stats``)."""

    def read(self, name: str, fresh: Statistics) -> Statistics | None:
        """The variable's value; created as ``fresh`` where the front end can (Linen: a mutable
        ``fp8_stats`` collection; NNX: always), else None. A stored value of another structure
        (the recipe changed) is replaced by ``fresh`` where it can be, refused where not."""

    def write(self, name: str, value: Statistics) -> None:
        """Keeps ``value`` as the variable's value, where the front end can (else nothing)."""


# ids of statistics a module wrote in a trace -> (the trace, weak references to them, the value
# the slot was read as): a second call in the same trace reads the slot, not the write.
_WRITTEN: dict[tuple[int, ...], tuple[Any, list[weakref.ref[Any]], Statistics]] = {}


def _as_read(stored: Statistics) -> Statistics:
    """The slot's value for ``stored``: the value first read in this trace where ``stored`` is
    forward statistics a call of the module wrote (the slot stays an argument of the step)."""
    leaves = jax.tree.leaves(stored)
    entry = _WRITTEN.get(tuple(id(leaf) for leaf in leaves))
    if entry is None:
        return stored
    trace, refs, original = entry
    if trace == current_trace() and all(
        ref() is leaf for ref, leaf in zip(refs, leaves, strict=True)
    ):
        return original
    return stored


def _remember(written: Statistics, read_as: Statistics) -> None:
    leaves = jax.tree.leaves(written)
    if not leaves:
        return
    key = tuple(id(leaf) for leaf in leaves)

    def forget(_: object, table: dict[Any, Any] = _WRITTEN) -> None:
        table.pop(key, None)

    refs = [weakref.ref(leaves[0], forget)] + [weakref.ref(leaf) for leaf in leaves[1:]]
    _WRITTEN[key] = (current_trace(), refs, read_as)


def _slotted(
    sets: Sequence[QuantizerSet],
    postfixes: Sequence[str],
    n_groups: int | None,
    variables: StatsVariables,
) -> tuple[tuple[QuantizerSet, ...], dict[str, Statistics]]:
    """The sets with their slots, and the value each statistics variable was read as."""
    read: dict[str, dict[str, Statistics]] = {}
    for quantizer_set, postfix in zip(sets, postfixes, strict=True):
        for role, fresh in slot_values(quantizer_set, n_groups).items():
            stored = variables.read(stats_name(role, postfix), fresh)
            if stored is not None:
                read.setdefault(postfix, {})[role] = _as_read(stored)
    # A module applied twice in one step: its statistics merge by max, as its FP8 state does.
    marked = merge_reuse(read)
    slotted = tuple(
        with_slot(quantizer_set, marked.get(postfix, {}), postfix)
        for quantizer_set, postfix in zip(sets, postfixes, strict=True)
    )
    flat = {
        stats_name(role, postfix): value
        for postfix, roles in read.items()
        for role, value in roles.items()
    }
    return slotted, flat


@contextlib.contextmanager
def inspected(
    sets: Sequence[QuantizerSet],
    postfixes: Sequence[str],
    n_groups: int | None,
    variables: StatsVariables,
) -> Iterator[tuple[QuantizerSet, ...]]:
    """The sets a layer's forward takes: inside ``te_flax.inspect_fp8()`` with statistics
    slots, and the forward statistics the ops report in the block written to the module's
    variables when it ends; elsewhere the sets themselves."""
    if not inspecting():
        yield tuple(sets)
        return
    slotted, read = _slotted(sets, postfixes, n_groups, variables)
    with collecting() as found:
        yield slotted
    kept: dict[str, Statistics] = {}
    for postfix, roles in found:
        for role, stats in roles.items():
            name = stats_name(role, postfix)
            # A GEMM the layer ran twice in this call: the elementwise max of both.
            kept[name] = stats if name not in kept else jax.tree.map(jnp.maximum, kept[name], stats)
    for name, stats in kept.items():
        if name in read:
            variables.write(name, stats)
            _remember(stats, read[name])


def fp8_stats_slots(
    apply_fn: Callable[..., Any], variables: Mapping[str, Any], *args: Any, **kwargs: Any
) -> dict[str, Any]:
    """Zeros for the ``"fp8_stats"`` collection of a Linen model: the statistics variables
    whose gradient, in a step inside ``te_flax.inspect_fp8()``, is the step's FP8 statistics.

    ``apply_fn(variables, *args, mutable=["fp8_stats"], **kwargs)`` is traced (not run) inside
    the setting to learn which statistics the model keeps, as ``jax.eval_shape`` does.

    Args:
      apply_fn: the model's ``apply`` (``model.apply``).
      variables: its variable dict (arrays or ``jax.ShapeDtypeStruct`` values).
      *args: the inputs of a call, arrays or ``jax.ShapeDtypeStruct`` values.
      **kwargs: keyword arguments of ``apply_fn`` (``rngs``, ...).

    Returns:
      The collection, ``{module path...: {"{x,kernel,grad}{postfix}_stats": {statistic:
      float32 zeros}}}``: put it in the variable dict as ``"fp8_stats"`` before the step.

    Example usage::

      >>> import jax, jax.numpy as jnp
      >>> import te_flax, te_flax.linen as te_nn
      >>> from te_flax.quantize import DelayedScaling
      >>> from te_flax.training import fp8_stats_slots, value_and_grad
      >>> layer = te_nn.DenseGeneral(features=4, recipe=DelayedScaling())
      >>> x = jnp.full((2, 8), 3.0)
      >>> variables = layer.init(jax.random.key(0), x)
      >>> slots = fp8_stats_slots(layer.apply, variables, x)
      >>> sorted(slots)
      ['grad_stats', 'kernel_stats', 'x_stats']
      >>> def loss(variables, x):
      ...     return jnp.sum(layer.apply(variables, x))
      >>> with te_flax.inspect_fp8():
      ...     _, grads = value_and_grad(loss)({**variables, "fp8_stats": slots}, x)
      >>> stats = grads["fp8_stats"]
      >>> float(stats["x_stats"]["amax"]), float(stats["grad_stats"]["amax"])
      (3.0, 1.0)
    """
    if not hasattr(variables, "items"):
        raise TypeError(
            "fp8_stats_slots(variables=...) takes the model's Flax variable dict, got "
            f"{type(variables).__name__}"
        )
    collections = {name: value for name, value in variables.items() if name != STATS_COLLECTION}
    with inspect_fp8():
        shapes = jax.eval_shape(
            lambda v, *a: apply_fn(v, *a, mutable=[STATS_COLLECTION], **kwargs),
            collections,
            *args,
        )
    _, state = shapes
    found = dict(state.get(STATS_COLLECTION, {}))
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), found)


def kept_statistics(new: Any, old: Any) -> Any:
    """The new FP8 statistics, the old value of each tensor's where the step measured none.

    A statistics variable that no op read in the step comes back as zeros (or unchanged), and
    a measured ``scale_inv`` is never 0: a tensor's statistics whose new ``scale_inv`` is all
    zeros keep their old values (read as pairs of sibling leaves, as ``keep_unused`` does).
    """
    leaves, tree = jax.tree_util.tree_flatten_with_path(new)
    old_leaves = jax.tree.leaves(old)
    prefixes = [jax.tree_util.keystr(path[:-1]) for path, _ in leaves]
    unmeasured = {
        prefix: jnp.all(leaf == 0)
        for (path, leaf), prefix in zip(leaves, prefixes, strict=True)
        if getattr(path[-1], "key", None) == "scale_inv"
    }
    kept = [
        leaf if prefix not in unmeasured else scaling.where(unmeasured[prefix], before, leaf)
        for (_, leaf), before, prefix in zip(leaves, old_leaves, prefixes, strict=True)
    ]
    return jax.tree.unflatten(tree, kept)
