"""FP8 state in modules: a state read twice in one step merges by max, a state that does not fit
the recipe is refused, and a step that can never update a fresh state says so. Both the Linen
and the NNX shells go through here; the state's names, fresh values and quantizer sets are
``te_flax.quantize.state``'s.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Iterator
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
from flax.core.tracers import current_trace
from jax import Array
from jax.custom_derivatives import SymbolicZero

from te_flax._base.settings import ScopedSetting
from te_flax.quantize import (
    Recipe,
    float32_state,
    merge_by_max,
)
from te_flax.quantize.max_merge import UncalibratedFp8StateWarning, on_host
from te_flax.quantize.state import OVERWRITE_WITH_GRADIENT

__all__ = [
    "check_state_matches",
    "hold_fp8_state",
    "merge_reuse",
    "watch_fp8_state",
]

P = TypeVar("P")
S = TypeVar("S")

# ids of the state leaves a module read -> (the trace they were read in, weak references to
# those leaves, the leaves marked to merge by max).
_READS: dict[tuple[int, ...], tuple[Any, list[weakref.ref[Any]], Any]] = {}


def merge_reuse(states: S) -> S:
    """``states`` (the FP8 state a module just read) marked to merge by max: the same marked
    values for every read of the very same arrays in the same trace.

    One state read twice in one differentiated step (a layer applied twice, weight tying, a
    shared block, one variable dict in two ``apply`` calls of a two-view loss) would get the sum
    of the two reads' cotangents, and a summed history is no history. Marking each read makes
    the uses merge by elementwise max, whatever loop differentiates the step (``jax.grad``,
    Flax's ``TrainState``, ``nnx.grad``), with or without ``jit``. Reads are matched by
    identity and by trace: within one trace the same variable gives the same array, whichever
    module or ``apply`` reads it, and an array of another trace is another object (a concrete
    array closed over by two traces is marked once per trace).
    """
    leaves = jax.tree.leaves(states)
    if not leaves:
        return states
    key = tuple(id(leaf) for leaf in leaves)
    trace = current_trace()
    cached = _READS.get(key)
    if cached is not None:
        read_in, leaf_refs, marked = cached
        if read_in == trace and all(
            ref() is leaf for ref, leaf in zip(leaf_refs, leaves, strict=True)
        ):
            return marked
    marked = merge_by_max(states)

    def forget(_: object, reads: dict[Any, Any] = _READS) -> None:
        reads.pop(key, None)  # the dict bound here: at interpreter exit the global is gone

    refs = [weakref.ref(leaves[0], forget)] + [weakref.ref(leaf) for leaf in leaves[1:]]
    _READS[key] = (trace, refs, marked)
    return marked


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
        "apply it inside the te_flax.autocast (or with the recipe=) it was initialised with; "
        "or, to run trained variables without that FP8 state (BF16 evaluation, another "
        f"recipe), pass only the other collections ({{'params': variables['params']}}, "
        f"leaving out {OVERWRITE_WITH_GRADIENT!r}), or fit the state to the new model with "
        "te_flax.convert.migrate_fp8_state(variables, target, drop_extra=True). The trained "
        "parameters are kept either way"
    )


# Set by ``hold_fp8_state()``: gradients of parameters alone are allowed, the state held.
_HOLD: ScopedSetting[bool] = ScopedSetting("hold_fp8_state", False)


@contextlib.contextmanager
def hold_fp8_state() -> Iterator[None]:
    """Allows gradients of a layer's parameters alone, quietly, while JAX traces them: the FP8
    state is held as it is, for steps that update it another way (TransformerEngine's layer
    tests update it in a separate call) or not at all (LoRA adapters over a frozen layer, a
    deliberately held scale).

    Outside it such a gradient warns once (``UncalibratedFp8StateWarning``), with and without
    ``jit``, while the state has never been updated: the state's update leaves a step as its
    gradient, so a loop that differentiates the parameters only never moves it, and the layer
    scales each tensor just in time (as ``Float8CurrentScaling``, one more pass over it) in
    place of delayed scaling's stored scales. The numbers are right either way; a state updated
    before, or a scale set by hand, is kept as it is. The context is read when the step is
    traced and is part of ``jax.jit``'s cache key: enter it around the calls of a jitted step,
    or around ``jax.grad`` itself.

    Example usage::

      >>> import jax, jax.numpy as jnp
      >>> import te_flax.linen as te_nn
      >>> from te_flax.quantize import DelayedScaling
      >>> from te_flax.training import hold_fp8_state
      >>> layer = te_nn.DenseGeneral(features=4, recipe=DelayedScaling(amax_history_len=4))
      >>> variables = layer.init(jax.random.key(0), jnp.ones((2, 8)))
      >>> def loss(params):
      ...     return jnp.sum(layer.apply({**variables, "params": params}, jnp.ones((2, 8))))
      >>> with hold_fp8_state():
      ...     grads = jax.grad(loss)(variables["params"])
      >>> sorted(grads)
      ['bias', 'kernel']
    """
    with _HOLD.scope(True):
        yield


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


def _stale_message(module: str, front_end: str) -> str:
    collection = "Fp8Meta variables" if front_end == "nnx" else f"{OVERWRITE_WITH_GRADIENT!r}"
    return (
        f"{module}'s parameters are differentiated but its FP8 state ({collection}) is not, "
        "and that state has never been updated: the new FP8 state leaves a step as the "
        "gradient of that state, so this step drops it and the state never moves. The layer "
        "computes right (it scales each tensor just in time, as Float8CurrentScaling does, "
        "one more pass over each tensor) but never uses delayed scaling's stored scales. To "
        f"train it with delayed scaling, {_STALE_FIX[front_end]}. (A deliberate gradient of "
        "the parameters alone, LoRA adapters over a frozen layer, runs quiet inside "
        "te_flax.training.hold_fp8_state().)"
    )


def _never_updated(state: Any) -> Array:
    """Whether every amax history of ``state`` is still all zeros (a bool scalar)."""
    histories = [
        jnp.all(float32_state(leaf) == 0)
        for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]
        if jax.tree_util.keystr(path).endswith("_amax_history']")
    ]
    return jnp.all(jnp.stack(histories)) if histories else jnp.asarray(False)


def _warn_if_never_updated(module: str, front_end: str, state: Any) -> None:
    """Warns once per module type when a gradient of the parameters alone meets an FP8 state
    that has never been updated (a loop that drops the update keeps it so for good, scaled just
    in time); a state updated before is kept as it is and says nothing. Concrete values are
    checked here; traced ones by the step itself (a host callback), so ``jit`` changes
    nothing."""
    message = _stale_message(module, front_end)

    def warn(fresh: Any) -> None:
        if bool(fresh) and message not in _STALE_WARNED:
            _STALE_WARNED.add(message)
            warnings.warn(message, UncalibratedFp8StateWarning, stacklevel=2)

    on_host(warn, _never_updated(state))


# Messages already given: each is said once per process.
_STALE_WARNED: set[str] = set()


def watch_fp8_state(module: str, front_end: str, params: P, state: S) -> tuple[P, S]:
    """``(params, state)`` unchanged, saying once when a gradient drops the FP8 state's update.

    The parameters pass through an identity with a custom VJP that also reads the state: JAX
    tells its forward rule which inputs are differentiated (``symbolic_zeros``), also inside
    ``scan``, ``remat`` and ``vmap``, and only when the step is differentiated at all. When
    some parameter is and no FP8 state is, the update is lost for good while the state has
    never been updated (all its amax histories are zero): that warns once
    (``UncalibratedFp8StateWarning``), under ``jit`` as outside it (there from the step,
    through a host callback); ``hold_fp8_state`` keeps it quiet. The state itself is returned
    as it came, not through the identity, so that the ops see whether it is differentiated and
    scale a never-updated state just in time where it is not.

    ``front_end`` is ``"linen"`` or ``"nnx"``: which fix the message names.
    """
    if not jax.tree.leaves(state):  # the recipe keeps no state
        return params, state

    @jax.custom_vjp
    def identity(params: Any, state: Any) -> Any:
        return params

    def forward(params: Any, state: Any) -> tuple[Any, None]:
        # With symbolic_zeros each leaf is a CustomVJPPrimal(value, perturbed).
        params_perturbed = any(leaf.perturbed for leaf in jax.tree.leaves(params))
        state_perturbed = any(leaf.perturbed for leaf in jax.tree.leaves(state))
        unwrap = lambda leaf: leaf.value  # noqa: E731
        if params_perturbed and not state_perturbed and not _HOLD.value:
            _warn_if_never_updated(module, front_end, jax.tree.map(unwrap, state))
        return jax.tree.map(unwrap, params), None

    def backward(_: None, cotangents: Any) -> tuple[Any, None]:
        # A cotangent that is a symbolic zero goes back as None (a zero); the state reaches
        # the ops directly, and its update comes back that way.
        params_cotangents = jax.tree.map(
            lambda c: None if isinstance(c, SymbolicZero) else c,
            cotangents,
            is_leaf=lambda c: isinstance(c, SymbolicZero),
        )
        return params_cotangents, None

    identity.defvjp(forward, backward, symbolic_zeros=True)
    watched: P = identity(params, state)
    return watched, state
