"""The ``custom_vjp`` of every fused op, and where its delayed-scaling state scales just in time.

A delayed-scaling quantizer quantizes with the scale of the steps before; its state's update
leaves the step as the "gradient" of its quantizer set. Where that update cannot leave the
step, a fresh (never-updated) state would quantize with scale 1 for good: inputs far from 1
clip or underflow. Only inside the op's ``custom_vjp`` does JAX tell which case a call is,
also inside ``lax.scan``, ``jax.checkpoint`` and ``vmap`` (whose rules trace the op's rules
lazily, after the module's code ran):

1. the primal rule (the op is not differentiated: evaluation, a frozen backbone under a
   gradient of the head) -> just in time;
2. the forward rule with the quantizer's state perturbed (its new value is differentiated:
   ``te_flax.training.value_and_grad``, Flax's ``TrainState`` over the whole variable dict,
   ``te_flax.nnx.value_and_grad``) -> the stored scale, the program as it always was;
3. the forward rule with the state not perturbed (a gradient of LoRA adapters, of the inputs
   or of the parameters alone) -> just in time, the backward's gradient quantizer too.

"Just in time" is ``DelayedScaleQuantizer.just_in_time``: while the state is fresh the tensor
is quantized with its own amax's scale, which costs a second read of it (see
docs/fp8_state.md, "Never-updated state"); a calibrated state keeps its scale. Current and
block scaling keep no state and are untouched.

An op whose quantizer sets carry a statistics slot (``te_flax.inspect_fp8()``) runs a second
``custom_vjp`` of the same rules that also returns the statistics of what they quantize
(``te_flax.quantize.inspection``); without a slot, the op is the one above, unchanged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial
from typing import Any, Generic, TypeVar

import jax
from jax.ad_checkpoint import checkpoint_name
from jax.custom_derivatives import SymbolicZero, zero_from_primal

from te_flax.quantize import DelayedScaleQuantizer, QuantizerSet, inspection
from te_flax.quantize.statistics import recording
from te_flax.quantize.tensors import static_field
from te_flax.sharding import on_auto_axes

__all__ = ["FusedOp", "fused_op"]

ConfigT = TypeVar("ConfigT")
OperandsT = TypeVar("OperandsT")


def _is_delayed(node: object) -> bool:
    return isinstance(node, DelayedScaleQuantizer)


def _in_mode(quantizer: DelayedScaleQuantizer, just_in_time: bool) -> DelayedScaleQuantizer:
    if quantizer.just_in_time == just_in_time:
        return quantizer
    return dataclasses.replace(quantizer, just_in_time=just_in_time)


def _just_in_time(operands: Any) -> Any:
    """``operands`` with every delayed-scaling quantizer just in time (case 1)."""
    return jax.tree.map(
        lambda node: _in_mode(node, True) if _is_delayed(node) else node,
        operands,
        is_leaf=_is_delayed,
    )


def _decided(primals: Any) -> tuple[Any, tuple[bool, ...]]:
    """The forward rule's ``CustomVJPPrimal`` leaves as values, each delayed-scaling quantizer
    whose state is not perturbed just in time (case 3); and the quantizers' own modes, in
    tree order, for the cotangents (``_restored``)."""
    modes: list[bool] = []

    def decide(node: Any) -> Any:
        if not _is_delayed(node):
            return node.value  # a CustomVJPPrimal
        values = jax.tree.map(lambda leaf: leaf.value, node)
        modes.append(values.just_in_time)
        perturbed = any(leaf.perturbed for leaf in jax.tree.leaves(node))
        return values if perturbed else _in_mode(values, True)

    operands = jax.tree.map(decide, primals, is_leaf=_is_delayed)
    return operands, tuple(modes)


def _restored(cotangents: Any, modes: tuple[bool, ...]) -> Any:
    """The backward rule's cotangents with each quantizer in the mode its primal came in
    (a cotangent's tree must be its primal's)."""
    remaining = iter(modes)
    restored = jax.tree.map(
        lambda node: _in_mode(node, next(remaining)) if _is_delayed(node) else node,
        cotangents,
        is_leaf=_is_delayed,
    )
    assert next(remaining, None) is None, "one cotangent per quantizer"
    return restored


def _instantiated(cotangent: Any) -> Any:
    """A symbolic zero as zeros of its type (sharding and varying axes included), as JAX
    passes it to a backward rule without ``symbolic_zeros``; anything else as it is."""
    if not isinstance(cotangent, SymbolicZero):
        return cotangent
    aval: Any = cotangent.aval  # a ShapedArray
    zeros = jax.ShapeDtypeStruct(
        aval.shape,
        aval.dtype,
        sharding=aval.sharding,
        weak_type=aval.weak_type,
        manual_axis_type=aval.mat,
    )
    return zero_from_primal(zeros)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _Saved:
    """The op's residuals, and its quantizers' modes as they came in (static)."""

    residuals: Any
    modes: tuple[bool, ...] = static_field(())


# An op's rules: forward(config, operands, for_backward) -> (out, residuals), where
# for_backward=False (the op is not differentiated) may skip what only the backward reads, and
# backward(config, residuals, cotangent) -> the operands' cotangents, a record of their type.
Forward = Callable[[Any, Any, bool], tuple[Any, Any]]
Backward = Callable[[Any, Any, Any], Any]


def _plain_op(forward: Forward, backward: Backward) -> Callable[[Any, Any], Any]:
    """The op's ``custom_vjp``: ``op(config, operands) -> out``."""

    @partial(jax.custom_vjp, nondiff_argnums=(0,))
    def op(config: Any, operands: Any) -> Any:
        return forward(config, _just_in_time(operands), False)[0]

    def op_forward(config: Any, primals: Any) -> tuple[Any, _Saved]:
        operands, modes = _decided(primals)
        out, residuals = forward(config, operands, True)
        return out, _Saved(residuals, modes)

    def op_backward(config: Any, saved: _Saved, cotangent: Any) -> tuple[Any]:
        cotangent = jax.tree.map(
            _instantiated, cotangent, is_leaf=lambda c: isinstance(c, SymbolicZero)
        )
        return (_restored(backward(config, saved.residuals, cotangent), saved.modes),)

    op.defvjp(op_forward, op_backward, symbolic_zeros=True)
    return op


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _InspectedSaved:
    """``_Saved`` and the forward rule's statistics (per slotted set)."""

    residuals: Any
    statistics: tuple[Any, ...]
    modes: tuple[bool, ...] = static_field(())


def _inspected_op(forward: Forward, backward: Backward) -> Callable[[Any, Any], Any]:
    """The same rules as ``_plain_op``, recording what they quantize:
    ``op(config, operands) -> (out, forward statistics)``, the statistics of every slot
    (forward's and gradient's) as its cotangent (``te_flax.quantize.inspection``)."""

    @partial(jax.custom_vjp, nondiff_argnums=(0,))
    def op(config: Any, operands: Any) -> Any:
        operands = _just_in_time(operands)
        with recording() as records:
            out = forward(config, operands, False)[0]
        return out, inspection.forward_statistics(records, operands)

    def op_forward(config: Any, primals: Any) -> tuple[Any, _InspectedSaved]:
        operands, modes = _decided(primals)
        with recording() as records:
            out, residuals = forward(config, operands, True)
        statistics = inspection.forward_statistics(records, operands)
        return (out, statistics), _InspectedSaved(residuals, statistics, modes)

    def op_backward(config: Any, saved: _InspectedSaved, cotangent: Any) -> tuple[Any]:
        out_cotangent = jax.tree.map(
            _instantiated, cotangent[0], is_leaf=lambda c: isinstance(c, SymbolicZero)
        )
        with recording() as records:
            cotangents = backward(config, saved.residuals, out_cotangent)
        cotangents = _restored(cotangents, saved.modes)
        stats = inspection.with_statistics(cotangents, saved.residuals, records, saved.statistics)
        return (stats,)

    op.defvjp(op_forward, op_backward, symbolic_zeros=True)
    return op


def _is_set(node: object) -> bool:
    return isinstance(node, QuantizerSet)


def _block_scaled(operands: Any) -> bool:
    """Whether a quantizer set among ``operands`` scales per block (MXFP8, NVFP4)."""
    sets = jax.tree.leaves(operands, is_leaf=_is_set)
    return any(isinstance(node, QuantizerSet) and node.block_scaled for node in sets)


class FusedOp(Generic[ConfigT, OperandsT]):
    """A fused op ``op(config, operands) -> out`` (see ``fused_op``)."""

    def __init__(
        self,
        forward: Forward,
        backward: Backward,
        out_specs: Callable[[ConfigT, OperandsT], Any] | None = None,
        output_name: Callable[[ConfigT], str | None] | None = None,
    ) -> None:
        self._plain = _plain_op(forward, backward)
        self._inspected = _inspected_op(forward, backward)
        self._out_specs = out_specs
        self._output_name = output_name

    def __call__(self, config: ConfigT, operands: OperandsT) -> Any:
        """The op's output, named for ``jax.checkpoint`` policies; the forward statistics of
        sets with a slot go to the layer that called it (``inspection.deliver``)."""
        op = self._plain if not inspection.slotted_sets(operands) else self._delivered
        if (
            self._out_specs is None
            or config.grad_specs is None  # type: ignore[attr-defined]
            or not _block_scaled(operands)
        ):
            out = op(config, operands)
        else:
            # On Explicit mesh axes a block-scaled op runs with the axes as Auto inside: its
            # quantization reshapes sharded axes into blocks, which JAX cannot type axis by
            # axis. Its outputs then take the shardings ``out_specs`` gives.
            inside = dataclasses.replace(config, grad_specs=None)  # type: ignore[type-var]
            out = on_auto_axes(partial(op, inside), self._out_specs(config, operands), operands)
        name = None if self._output_name is None else self._output_name(config)
        if name is None:
            return out
        # Named outside the custom_vjp, where remat policies see the output as a value.
        if isinstance(out, tuple):
            return (checkpoint_name(out[0], name), *out[1:])
        return checkpoint_name(out, name)

    def _delivered(self, config: ConfigT, operands: OperandsT) -> Any:
        out, statistics = self.with_statistics(config, operands)
        inspection.deliver(operands, statistics)
        return out

    def with_statistics(self, config: ConfigT, operands: OperandsT) -> tuple[Any, tuple[Any, ...]]:
        """``(out, forward statistics per slotted set)``, for a caller that transforms the op
        (a ``vmap`` over groups) and delivers them itself; the output is not named."""
        if not inspection.slotted_sets(operands):
            return self._plain(config, operands), ()
        result: tuple[Any, tuple[Any, ...]] = self._inspected(
            config, inspection.positioned(operands)
        )
        return result


def fused_op(
    forward: Forward,
    backward: Backward,
    out_specs: Callable[[ConfigT, OperandsT], Any] | None = None,
    output_name: Callable[[ConfigT], str | None] | None = None,
) -> FusedOp[ConfigT, OperandsT]:
    """The one wrapper of every fused op: ``op(config, operands)``, a ``jax.custom_vjp`` of
    the static ``config`` (a frozen dataclass) and the typed
    ``operands`` record (a ``NamedTuple``) that the op's one check returns.

    ``forward(config, operands, for_backward) -> (out, residuals)`` and ``backward(config,
    residuals, cotangent) -> the operands' cotangents`` are the op's rules. The wrapper sets
    the delayed-scaling quantizers of the operands just in time where their update cannot
    leave the step (the module docstring's cases), runs the inspected twin for operands whose
    quantizer sets carry a statistics slot, runs a block-scaled op on ``Explicit`` mesh axes
    (``config.grad_specs`` is set there) as ``Auto`` with its outputs resharded to
    ``out_specs(config, operands)`` (None: an op that never runs so), and names the (first)
    output ``output_name(config)`` with ``jax.ad_checkpoint.checkpoint_name``.
    """
    return FusedOp(forward, backward, out_specs, output_name)
