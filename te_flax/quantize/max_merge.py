"""Merging FP8 state updates by elementwise max when one state is used more than once.

The ops return a quantizer's new state as its cotangent. When one state feeds several uses in
one differentiated function (a layer applied twice, a ``lax.scan`` over microbatches, state
broadcast over ``nn.scan``), autodiff adds the uses' cotangents, which would sum amax histories
and scales. The right merge is the elementwise max: the merged history's newest entry is the
largest amax of any use, and the merged ``scale_inv`` the largest (most cautious) scale.

``merge_by_max`` converts float32 state to Flax's ``fp32_max_grad`` dtype, whose cotangents
autodiff accumulates with max; the ops convert it back to float32 where they read it. Inside
``jit`` the dtype's own rule adds them; outside it, the rule ``jax_compat.add_eagerly_by_max``
registers.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from flax.linen.fp8_ops import fp32_max_grad
from jax import Array, lax

from te_flax._base.jax_compat import add_eagerly_by_max
from te_flax.quantize import scaling

__all__ = [
    "UncalibratedFp8StateWarning",
    "check_calibrated",
    "check_merged",
    "float32_state",
    "merge_by_max",
]

T = TypeVar("T")

# Outside jit too, the cotangents of a marked state's uses merge by max.
add_eagerly_by_max(fp32_max_grad)


# Both conversions take a whole tuple of leaves: one custom_vjp per marked tree (a model's state,
# an op's quantizer set), not one per leaf, which a model's hundreds of leaves made a large part
# of the step's trace time. Autodiff still accumulates each leaf's cotangent by itself.
@jax.custom_vjp
def _to_max_merged(states: tuple[Array, ...]) -> tuple[Array, ...]:
    return tuple(lax.convert_element_type(state, fp32_max_grad) for state in states)


def _to_max_merged_fwd(states: tuple[Array, ...]) -> tuple[tuple[Array, ...], tuple[Array, ...]]:
    return _to_max_merged(states), states


def _to_max_merged_bwd(
    states: tuple[Array, ...], merged_updates: tuple[Array, ...]
) -> tuple[tuple[Array, ...]]:
    kept = []
    for state, merged_update in zip(states, merged_updates, strict=True):
        update = lax.convert_element_type(merged_update, jnp.float32)
        # The zero of fp32_max_grad is -inf: a state that no use updated keeps its value
        # instead of being overwritten with -inf.
        kept.append(scaling.where(update == -jnp.inf, state, update))
    return (tuple(kept),)


_to_max_merged.defvjp(_to_max_merged_fwd, _to_max_merged_bwd)


@jax.custom_vjp
def _from_max_merged(states: tuple[Array, ...]) -> tuple[Array, ...]:
    return tuple(lax.convert_element_type(state, jnp.float32) for state in states)


def _from_max_merged_fwd(states: tuple[Array, ...]) -> tuple[tuple[Array, ...], None]:
    return _from_max_merged(states), None


def _from_max_merged_bwd(_: None, updates: tuple[Array, ...]) -> tuple[tuple[Array, ...]]:
    return (tuple(lax.convert_element_type(update, fp32_max_grad) for update in updates),)


_from_max_merged.defvjp(_from_max_merged_fwd, _from_max_merged_bwd)


def _convert_where(
    state: T,
    selected: Callable[[Any], bool],
    convert: Callable[[tuple[Array, ...]], tuple[Array, ...]],
) -> T:
    """``state`` with its ``selected`` leaves passed through ``convert`` all at once."""
    leaves, tree = jax.tree.flatten(state)
    chosen = [i for i, leaf in enumerate(leaves) if selected(leaf)]
    if chosen:
        converted = convert(tuple(leaves[i] for i in chosen))
        for i, leaf in zip(chosen, converted, strict=True):
            leaves[i] = leaf
    return jax.tree.unflatten(tree, leaves)


def _is_max_merged(leaf: object) -> bool:
    return hasattr(leaf, "dtype") and leaf.dtype == fp32_max_grad


def merge_by_max(state: T) -> T:
    """Marks FP8 state so that the updates of all its uses merge by elementwise max.

    Call it where a differentiated function reads the state, before the state
    fans out to its uses (outside any ``lax.scan`` / ``nn.scan`` that reads it: inside a scan
    body the per-iteration updates would already have been added up); pass the result to the
    ops as usual. The gradient with respect to the original float32 state is then the
    max-merged new state. A state that no op reads comes back as it was when another state
    marked in the same call is read, and as zeros when nothing marked in the call is (JAX never
    calls the backward of an unused value); ``te_flax.training.apply_gradients`` keeps such
    states.

    Args:
      state: a ``QuantizerSet`` or any pytree of them (float32 leaves).

    Returns:
      The same pytree with its leaves in the ``fp32_max_grad`` dtype.

    Example usage::

      >>> import jax, jax.numpy as jnp
      >>> from te_flax.dense import dense
      >>> from te_flax.quantize import DelayedScaling, QuantizerFactory, merge_by_max
      >>> qs = QuantizerFactory.create_set(fp8_recipe=DelayedScaling(amax_history_len=4))
      >>> kernel = jnp.ones((2, 2))
      >>> def loss(qs):
      ...     qs = merge_by_max(qs)
      ...     small = dense(jnp.full((1, 2), 3.0), kernel, quantizer_set=qs)
      ...     large = dense(jnp.full((1, 2), 5.0), kernel, quantizer_set=qs)
      ...     return jnp.sum(small + large)
      >>> jax.jit(jax.grad(loss))(qs).x.amax_history
      Array([5., 0., 0., 0.], dtype=float32)

    Marking is idempotent: leaves already marked pass through, so state marked at the top of a
    step stays marked when a module marks what it reads again. Leaves that are not float32
    (the RNG key of stochastic rounding) are not state and pass through too.
    """

    for leaf in jax.tree.leaves(state):
        if not hasattr(leaf, "dtype"):
            raise TypeError(
                f"merge_by_max(state=...) takes a QuantizerSet or a pytree of float32 arrays "
                f"(FP8 state), got a leaf of type {type(leaf).__name__}; pass the FP8 "
                "collection (variables['_overwrite_with_gradient']) or the quantizer sets"
            )

    def unmarked(leaf: Array) -> bool:
        return not _is_max_merged(leaf) and jnp.dtype(leaf.dtype) == jnp.float32

    return _convert_where(state, unmarked, _to_max_merged)


def float32_state(state: T) -> T:
    """The inverse of ``merge_by_max`` for the ops: float32 leaves, max-merging cotangents.

    Leaves that are already float32 pass through unchanged.
    """

    return _convert_where(state, _is_max_merged, _from_max_merged)


_FIX = (
    "mark the state where it enters the differentiated step: merge_fp8_state(variables) first "
    "thing in the loss (te_flax.training), merge_by_max(quantizer_sets) for the functional ops, "
    "or differentiate with te_flax.training.value_and_grad / te_flax.nnx.value_and_grad, "
    "which mark it themselves"
)


def _history_pairs(previous: Any, updated: Any) -> list[tuple[str, Array, Array]]:
    """``(path, previous, updated)`` for every amax-history leaf of two same-shaped trees."""
    old_leaves, old_tree = jax.tree_util.tree_flatten_with_path(previous)
    new_leaves, new_tree = jax.tree_util.tree_flatten_with_path(updated)
    if old_tree != new_tree:  # type: ignore[operator]  # PyTreeDef compares by structure
        raise ValueError(
            "check_merged needs the previous and the updated FP8 state in the same tree "
            f"structure, got {old_tree} and {new_tree}; pass the FP8 collection of the "
            "variables and that of the gradients"
        )
    return [
        (jax.tree_util.keystr(path), jnp.asarray(old), jnp.asarray(new))
        for (path, old), (_, new) in zip(old_leaves, new_leaves, strict=True)
        if "amax_history" in jax.tree_util.keystr(path)
    ]


def _summed_rows(old: Array, new: Array) -> tuple[Array, Array]:
    """Per row of ``[rows, L]`` histories (newest first): whether ``new`` is not a single use's
    update of ``old``, and the factor it seems to be.

    A row that got no update comes back all zeros (a gradient) or as it was (a state kept by
    ``apply_gradients``), and a row whose shifted part is still all zeros (the first step)
    cannot tell a sum from a merge; none of them counts.
    """
    shifted_old = old[:, :-1].astype(jnp.float32)  # [rows, L - 1]
    shifted_new = new[:, 1:].astype(jnp.float32)
    updated = jnp.any(new != 0, axis=-1) & jnp.any(new != old, axis=-1)
    informative = jnp.any(shifted_old != 0, axis=-1)
    differs = jnp.any(shifted_new != shifted_old, axis=-1)
    unknown = shifted_old == 0
    ratio = shifted_new / jnp.where(unknown, 1.0, shifted_old)
    factor = jnp.max(jnp.where(unknown, 0.0, ratio), axis=-1, initial=-jnp.inf)
    return updated & informative & differs, factor


def _check_rows(
    pairs: list[tuple[str, Array, Array]],
) -> tuple[tuple[str, ...], Array, Array]:
    """Every history's rows (a scanned stack's histories are ``[..., L]``) checked at once: the
    leaf name of each row, and each row's flag and factor (``_summed_rows``).

    The histories are concatenated per length into one ``[rows, L]`` matrix, so a model's whole
    FP8 state costs the program a handful of operations, not a dozen per variable.
    """
    by_length: dict[int, list[tuple[str, Array, Array]]] = {}
    for name, old, new in pairs:
        by_length.setdefault(old.shape[-1] if old.ndim else 1, []).append((name, old, new))
    names: list[str] = []
    flags, factors = [], []
    for length, group in by_length.items():
        olds = [old.reshape(-1, length) for _, old, _ in group]
        news = [new.reshape(-1, length) for _, _, new in group]
        for (name, _, _), rows in zip(group, olds, strict=True):
            names += [name] * rows.shape[0]
        flag, factor = _summed_rows(jnp.concatenate(olds), jnp.concatenate(news))
        flags.append(flag)
        factors.append(factor)
    return tuple(names), jnp.concatenate(flags), jnp.concatenate(factors)


def _flagged(
    names: tuple[str, ...], flags: np.ndarray, factors: np.ndarray
) -> tuple[list[str], list[float]]:
    """The leaves with a flagged row, in order, and each leaf's factor (its rows' maximum)."""
    flagged: dict[str, float] = {}
    for name, flag in zip(names, np.asarray(flags), strict=True):
        if flag:
            flagged[name] = -np.inf
    for name, factor in zip(names, np.asarray(factors), strict=True):
        if name in flagged:
            flagged[name] = max(flagged[name], float(factor))
    return list(flagged), list(flagged.values())


def _message(names: list[str], factors: list[float]) -> str:
    listed = ", ".join(f"{name} ({factor:g}x)" for name, factor in zip(names, factors, strict=True))
    return (
        "FP8 state came back summed over its uses instead of max-merged: the shifted part of "
        f"the new amax history is not the previous history but a multiple of it, for {listed}; "
        f"the scales that follow are wrong by that factor. To fix it, {_FIX}."
    )


def _report(names: tuple[str, ...], flags: np.ndarray, factors: np.ndarray) -> None:
    flagged, leaf_factors = _flagged(names, flags, factors)
    if flagged:
        raise ValueError(_message(flagged, leaf_factors))


def _has_gpu() -> bool:
    try:
        return bool(jax.devices("cuda"))
    except RuntimeError:  # no CUDA backend in this process
        return False


def on_host(report: Callable[..., None], *arrays: Array) -> None:
    """``report(*arrays)`` on the host: now for concrete arrays, and as a host callback of the
    traced program for traced ones (on the CPU program only where the process has no GPU: a
    deviceless GPU compile cannot lower a callback). An error ``report`` raises stops the
    program, as a runtime error that carries its message."""
    if not any(isinstance(array, jax.core.Tracer) for array in arrays):
        report(*(np.asarray(array) for array in arrays))
        return
    if _has_gpu():
        jax.debug.callback(report, *arrays)
        return

    # A process without a GPU may still compile for one (a deviceless compile), where a host
    # callback cannot be lowered; the check is then left to the CPU program.
    def on_cpu(*arrays: Array) -> Array:
        jax.debug.callback(report, *arrays)
        return jnp.zeros((), jnp.int32)

    def elsewhere(*arrays: Array) -> Array:
        return jnp.zeros((), jnp.int32)

    lax.platform_dependent(*arrays, cpu=on_cpu, default=elsewhere)


class UncalibratedFp8StateWarning(UserWarning):
    """A layer's delayed-scaling state was applied after a step without ever being updated:
    the layer runs but is not differentiated (frozen), so its scales stay at 1."""


# Messages already given: each is said once per process.
_WARNED: set[str] = set()


def _warn_uncalibrated(names: tuple[str, ...], flags: np.ndarray) -> None:
    stale = [name for name, flag in zip(names, np.asarray(flags), strict=True) if flag]
    if not stale:
        return
    message = (
        f"FP8 state still uncalibrated after a training step: {', '.join(stale)} (the amax "
        "histories of each such GEMM's input and kernel are empty, its scales still 1). The "
        "step differentiated that state, but no gradient reached those layers (a frozen "
        "backbone under stop_gradient, a layer the step did not run), and delayed scaling "
        "updates its state only through the gradient: they run with the stored scale of 1 and "
        "their update is lost, every step; inputs far from 1 clip or underflow. To fix it, "
        "give the frozen layers Float8CurrentScaling() (scales from each tensor, no state), "
        "or leave their state out of the differentiated arguments (a gradient of the trained "
        "part only scales a never-updated state just in time), or let the gradient reach them "
        "and hold only their parameters (see docs/training_loops.md, 'Frozen layers')."
    )
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, UncalibratedFp8StateWarning, stacklevel=2)


def _flat(state: Any) -> list[tuple[Any, Any]]:
    return jax.tree_util.tree_flatten_with_path(state)[0]


def _named_path(path: tuple[Any, ...]) -> tuple[tuple[Any, ...], str]:
    """``(the path up to the variable's name, the name)``: the name is the path's last string
    key (a dict key of Linen's collections, of ``nnx.State`` and of pure dicts)."""
    for i in range(len(path) - 1, -1, -1):
        key = getattr(path[i], "key", None)
        if isinstance(key, str):
            return tuple(path[:i]), key
    return tuple(path), ""


def _keystr(head: tuple[Any, ...], name: str) -> str:
    return f"{jax.tree_util.keystr(head)}['{name}']"


def check_calibrated(state: Any) -> None:
    """Warns once (``UncalibratedFp8StateWarning``) when a delayed-scaling state that a
    training step applied was never updated: a GEMM whose input and kernel amax histories are
    both still all zeros.

    ``te_flax.training.apply_gradients`` and the NNX ``train_step`` / ``update_fp8_state``
    call it on the state they apply. Under ``jit`` it runs on the device and a host callback
    warns. A step whose input was not finite records an empty input amax but still its
    kernel's, so it is not mistaken for a frozen layer.
    """
    # Keyed by the path up to the variable's name and the name: NNX state paths end in
    # ``.value`` after it, Linen's at it.
    leaves = {_named_path(path): jnp.asarray(leaf) for path, leaf in _flat(state)}
    pairs = []
    for (head, name), leaf in leaves.items():
        if name.startswith("x") and name.endswith("_amax_history"):
            kernel = leaves.get((head, f"kernel{name[1:]}"))
            if kernel is not None:
                pairs.append((_keystr(head, name), leaf, kernel))
    if not pairs:
        return
    names = tuple(path for path, _, _ in pairs)
    flags = jnp.stack([jnp.all(x == 0) & jnp.all(kernel == 0) for _, x, kernel in pairs])
    on_host(partial(_warn_uncalibrated, names), flags)


def check_merged(previous: Any, updated: Any) -> None:
    """Checks that a step's new FP8 state is max-merged, not summed over the state's uses.

    The helpers in ``te_flax.training`` and ``te_flax.nnx`` call it where they apply the new
    state; call it yourself in a hand-written loop (for example one that keeps the FP8
    collection of the gradients as the next variables, as TransformerEngine's examples do).
    It needs an amax history of 2 or more entries and a history that is not all zeros, so it
    can catch a sum from the second step on; current scaling and the block-scaled recipes keep
    no state and pass.

    Args:
      previous: the FP8 state the step read (the ``_overwrite_with_gradient`` collection, an
        ``nnx.State`` of ``Fp8Meta`` variables, or quantizer sets).
      updated: the new state the step produced, in the same structure (the gradient with
        respect to ``previous``).

    Raises:
      ValueError: when a history came back summed. Under ``jit`` the check runs on the
        device and its host callback raises it, so the step fails as a runtime error
        (``jax.errors.JaxRuntimeError``) that carries the message.

    Example usage::

      >>> import jax, jax.numpy as jnp
      >>> from te_flax.dense import dense
      >>> from te_flax.quantize import DelayedScaling, QuantizerFactory, check_merged
      >>> qs = QuantizerFactory.create_set(fp8_recipe=DelayedScaling(amax_history_len=4))
      >>> qs = jax.tree.map(lambda leaf: leaf + 1.0, qs)  # a state after some steps
      >>> def loss(qs):  # the state used twice, not marked with merge_by_max
      ...     return jnp.sum(dense(jnp.ones((1, 2)), jnp.ones((2, 2)), quantizer_set=qs) * 2
      ...                    + dense(jnp.ones((1, 2)), jnp.ones((2, 2)), quantizer_set=qs))
      >>> try:
      ...     check_merged(qs, jax.jit(jax.grad(loss))(qs))
      ... except ValueError as error:
      ...     print(str(error).split(":")[0])
      FP8 state came back summed over its uses instead of max-merged
    """
    pairs = _history_pairs(previous, updated)
    if not pairs:
        return
    names, flags, factors = _check_rows(pairs)
    on_host(partial(_report, names), flags, factors)
