"""``te_flax.inspect_fp8()``: the FP8 statistics of every GEMM operand, forward and backward.

Inside the setting the layers give each GEMM's quantizer set a *statistics slot*
(``StatsSlot``): zeros of the shape of the statistics of its tensors (``x``, ``kernel`` and
``grad``, the gradient of the GEMM's output). The slot is a differentiable argument of the op,
like the FP8 state, and its "gradient" is the step's statistics: the forward's of ``x`` and
``kernel``, and the backward's of ``grad``, which exist only there. A fused op that receives a
slot records every quantization it makes (``te_flax.quantize.statistics``), matches each to the
set and role of the quantizer that made it, returns the forward statistics beside its output
(``deliver`` hands them to the layer that called it) and puts all three into the slot's
cotangent. A set without a slot runs the op as it always did: outside the setting the
compiled program is unchanged.

A slot read by several uses of one GEMM in a step (a layer applied twice) is marked like the
FP8 state (``merge_by_max``): its statistics are the elementwise max over the uses.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
from flax.core.tracers import current_trace
from jax import Array

from te_flax._base.settings import ScopedSetting
from te_flax.quantize.factory import QuantizerFactory
from te_flax.quantize.quantizer_set import QuantizerSet
from te_flax.quantize.statistics import Recorded, statistic_names
from te_flax.quantize.tensors import static_field

__all__ = [
    "ROLES",
    "STATS_COLLECTION",
    "Delivered",
    "InspectedQuantizerSet",
    "StatsSlot",
    "collecting",
    "deliver",
    "forward_statistics",
    "fresh_statistics",
    "inspect_fp8",
    "inspecting",
    "positioned",
    "slot_values",
    "slotted_sets",
    "stats_name",
    "with_slot",
    "with_statistics",
    "without_slots",
]

T = TypeVar("T")

# The Flax collection of the statistics (NNX: the ``te_flax.nnx.Fp8Stats`` variable type).
STATS_COLLECTION = "fp8_stats"
# Tensor role -> QuantizerSet field; "grad" is the gradient of the GEMM's output.
ROLES = {"x": "x", "kernel": "kernel", "grad": "dgrad"}
_FORWARD_ROLES = ("x", "kernel")

Statistics = dict[str, Array]

_INSPECT: ScopedSetting[bool] = ScopedSetting("inspect_fp8", False)


@contextlib.contextmanager
def inspect_fp8() -> Iterator[None]:
    """Within the context, te_flax's layers record the FP8 statistics of every GEMM operand.

    For each GEMM of a ``DenseGeneral``, ``LayerNormDenseGeneral``, ``LayerNormMLP`` or
    ``MoEBlock`` (Linen and NNX, and the layers built of them), under every recipe, and for each
    tensor it quantizes, ``x``, ``kernel`` and ``grad`` (the gradient of the GEMM's output):
    ``amax``, ``scale_inv``, ``saturation`` (the fraction of entries clipped at the format's
    largest value), ``underflow`` (the fraction of nonzero entries quantized to zero) and, for
    block-scaled recipes, the spread of the block scales (``block_scale_min``,
    ``block_scale_max``, ``block_scale_log2_range``); see ``te_flax.quantize.statistics``.

    They are kept in the ``"fp8_stats"`` collection (NNX: ``te_flax.nnx.Fp8Stats``
    variables), one variable per tensor named ``{x,kernel,grad}{postfix}_stats``:

    - an ``apply(..., mutable=["fp8_stats"])`` (or ``init``, or any NNX call) writes the forward
      statistics (``x``, ``kernel``) of that call;
    - in a differentiated step the gradient of each statistics variable is that tensor's
      statistics in the step, the gradient's included: ``grads["fp8_stats"]``. The training
      helpers (``te_flax.training.apply_gradients``, ``te_flax.nnx.value_and_grad`` and
      ``train_step``) write them into the variables and never give them to the optimizer.

    The variables must exist before a differentiated step (JAX returns gradients of its
    arguments only): ``te_flax.training.fp8_stats_slots`` makes them for Linen, and an NNX
    model gets them on its first call inside the setting. The setting is part of ``jax.jit``'s
    cache key (a step jitted outside it is traced again inside it); outside it the layers read
    no statistics variable and the compiled program is the one without it. Inside it the
    quantizations run on XLA's stages rather than fused Pallas kernels, and each quantized
    tensor is read once more (``bench/RESULTS_inspect_fp8.md``).

    Example usage::

      >>> import jax, jax.numpy as jnp
      >>> import te_flax, te_flax.linen as te_nn
      >>> from te_flax.quantize import DelayedScaling
      >>> layer = te_nn.DenseGeneral(features=4, recipe=DelayedScaling())
      >>> x = jnp.full((2, 8), 3.0)
      >>> variables = layer.init(jax.random.key(0), x)
      >>> with te_flax.inspect_fp8():
      ...     _, state = layer.apply(variables, x, mutable=["fp8_stats"])
      >>> {name: round(float(value), 4) for name, value in state["fp8_stats"]["x_stats"].items()}
      {'amax': 3.0, 'scale_inv': 0.0067, 'saturation': 0.0, 'underflow': 0.0}
    """
    with _INSPECT.scope(True):
        yield


def inspecting() -> bool:
    """Whether code traced now runs inside ``inspect_fp8()``."""
    return _INSPECT.value


# ----------------------------------------------------------------------------- the slot


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StatsSlot:
    """One GEMM's statistics slot: ``values[role][statistic]``, float32 scalars (``[G]`` for a
    grouped GEMM), zeros where it enters an op and the statistics in its cotangent.

    Attributes:
      values: ``{"x" | "kernel" | "grad": {statistic: array}}``, the roles the set quantizes.
      name: the GEMM's postfix in its layer (static), as its FP8 state's names use it.
      position: the set's position among an op's slotted sets (static; set by the op).
    """

    values: dict[str, Statistics]
    name: str = static_field("")
    position: int = static_field(-1)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class InspectedQuantizerSet(QuantizerSet):
    """A ``QuantizerSet`` with a statistics slot: an op given it also reports the statistics of
    what it quantizes (the module docstring)."""

    stats: StatsSlot | None = None


def stats_name(role: str, postfix: str) -> str:
    """The statistics variable of tensor ``role`` of the GEMM ``postfix``:
    ``{role}{postfix}_stats``, beside its FP8 state's ``{role}{postfix}_amax_history``."""
    return f"{role}{postfix}_stats"


def slot_values(quantizer_set: QuantizerSet, n_groups: int | None = None) -> dict[str, Statistics]:
    """Zeros for the statistics of each tensor ``quantizer_set`` quantizes (none for a set
    that quantizes nothing); ``[n_groups]`` arrays for a grouped GEMM."""
    shape = () if n_groups is None else (n_groups,)
    return {
        role: {
            name: jnp.zeros(shape, jnp.float32)
            for name in statistic_names(getattr(quantizer_set, field).block_scaled)
        }
        for role, field in ROLES.items()
        if getattr(quantizer_set, field) is not None
    }


def fresh_statistics(recipe: Any, n_groups: int | None = None) -> dict[str, Statistics]:
    """Zeros for the statistics of one GEMM under ``recipe`` (None: no FP8, none), as
    ``slot_values`` gives them for its quantizer set."""
    if recipe is None:
        return {}
    return slot_values(QuantizerFactory.create_set(fp8_recipe=recipe), n_groups)


def with_slot(
    quantizer_set: QuantizerSet, values: dict[str, Statistics], name: str = ""
) -> QuantizerSet:
    """``quantizer_set`` with a statistics slot holding ``values`` (see ``slot_values``); the
    set itself when ``values`` is empty."""
    if not values:
        return quantizer_set
    fields = {f.name: getattr(quantizer_set, f.name) for f in dataclasses.fields(QuantizerSet)}
    return InspectedQuantizerSet(**fields, stats=StatsSlot(values, name))


def without_slots(tree: Any) -> Any:
    """``tree`` with every statistics slot taken out of its quantizer sets."""

    def strip(node: Any) -> Any:
        if isinstance(node, InspectedQuantizerSet):
            return dataclasses.replace(node, stats=None)
        return node

    return jax.tree.map(strip, tree, is_leaf=_is_set)


def _is_set(node: object) -> bool:
    return isinstance(node, QuantizerSet)


def slotted_sets(tree: Any) -> list[InspectedQuantizerSet]:
    """The quantizer sets of ``tree`` that carry a statistics slot, in tree order."""
    return [
        node
        for node in jax.tree.leaves(tree, is_leaf=_is_set)
        if isinstance(node, InspectedQuantizerSet) and node.stats is not None
    ]


def positioned(operands: T) -> T:
    """``operands`` (a pytree) with each slot's ``position`` its set's index among the slotted
    sets."""
    count = iter(range(len(jax.tree.leaves(operands, is_leaf=_is_set))))

    def place(node: Any) -> Any:
        if isinstance(node, InspectedQuantizerSet) and node.stats is not None:
            slot = dataclasses.replace(node.stats, position=next(count))
            return dataclasses.replace(node, stats=slot)
        return node

    placed: T = jax.tree.map(place, operands, is_leaf=_is_set)
    return placed


# ----------------------------------------------------------------------------- matching


def _measured(records: list[Recorded], quantizer: Any, like: Statistics) -> Statistics:
    """The statistics of the quantizations ``quantizer`` made (elementwise max over several),
    zeros shaped as ``like`` when it made none."""
    found = [record.statistics() for record in records if record.quantizer is quantizer]
    if quantizer is None or not found:
        return jax.tree.map(jnp.zeros_like, like)
    merged = found[0]
    for more in found[1:]:
        merged = jax.tree.map(jnp.maximum, merged, more)
    shapes = jax.tree.map(jnp.shape, like)
    assert jax.tree.map(jnp.shape, merged) == shapes, (jax.tree.map(jnp.shape, merged), shapes)
    return merged


def forward_statistics(records: list[Recorded], operands: Any) -> tuple[dict[str, Statistics], ...]:
    """Per slotted set of ``operands`` (tree order): the statistics of its ``x`` and ``kernel``
    quantizations among ``records`` (a forward rule's), keyed by role."""
    return tuple(
        {
            role: _measured(records, getattr(node, ROLES[role]), values)
            for role, values in node.stats.values.items()  # type: ignore[union-attr]
            if role in _FORWARD_ROLES
        }
        for node in slotted_sets(operands)
    )


def with_statistics(
    cotangents: Any,
    residuals: Any,
    records: list[Recorded],
    forward: tuple[dict[str, Statistics], ...],
) -> Any:
    """A backward rule's ``cotangents`` with each slot's cotangent the statistics: ``forward``
    (the forward rule's, by slot position) and the ``grad`` quantizations among ``records``
    (the backward rule's), matched through the sets the backward read from ``residuals``."""
    grads: dict[int, Statistics] = {}  # slot position -> the gradient's statistics
    for node in slotted_sets(residuals):
        slot = node.stats
        assert slot is not None
        if "grad" in slot.values:
            grads[slot.position] = _measured(records, node.dgrad, slot.values["grad"])

    def fill(node: Any) -> Any:
        if not isinstance(node, InspectedQuantizerSet) or node.stats is None:
            return node
        slot = node.stats
        measured: dict[str, Statistics] = {**forward[slot.position]}
        if slot.position in grads:
            measured["grad"] = grads[slot.position]
        values = {
            role: measured.get(role, jax.tree.map(jnp.zeros_like, stats))
            for role, stats in slot.values.items()
        }
        return dataclasses.replace(node, stats=dataclasses.replace(slot, values=values))

    return jax.tree.map(fill, cotangents, is_leaf=_is_set)


# ----------------------------------------------------------------------------- delivery


# What an op delivers per slotted set: its postfix and {role: statistics}.
Delivered = tuple[str, dict[str, Statistics]]


class _Collectors(threading.local):
    def __init__(self) -> None:
        self.stack: list[tuple[Any, list[Delivered]]] = []


_COLLECTORS = _Collectors()


@contextlib.contextmanager
def collecting() -> Iterator[list[Delivered]]:
    """Collects the forward statistics the ops inside deliver: ``(postfix, {role: stats})``
    per slotted set, for the layer that opened it to keep."""
    found: list[Delivered] = []
    _COLLECTORS.stack.append((current_trace(), found))
    try:
        yield found
    finally:
        _COLLECTORS.stack.pop()


def deliver(operands: Any, statistics: tuple[Any, ...]) -> None:
    """Hands an op's forward statistics (``forward_statistics``'s order) to the innermost
    ``collecting`` context. Statistics traced inside a transform of their own (a ``vmap`` or
    ``shard_map`` within the layer) cannot leave it that way and are not delivered; their
    slot's cotangent still carries them."""
    if not _COLLECTORS.stack:
        return
    trace, found = _COLLECTORS.stack[-1]
    if current_trace() != trace:
        return
    for node, stats in zip(slotted_sets(operands), statistics, strict=True):
        assert node.stats is not None
        found.append((node.stats.name, stats))
