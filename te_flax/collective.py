"""Collective-GEMM settings with TransformerEngine's names: ``CollectiveOp``, ``CollectiveOpSet``,
``noop_collective_op_set``.

TransformerEngine can overlap a tensor-parallel GEMM with its communication inside one kernel:
the forward all-gathers the sequence-sharded input while multiplying (``ALL_GATHER``) or
reduce-scatters the output (``REDUCE_SCATTER``), and the backward does the reverse. te_flax has
no such kernel. Its GEMMs are ``lax.dot_general`` calls that XLA partitions: with the sequence
axis sharded by logical axis rules (e.g. ``("length", "tensor")``, as ``configs/rules/tp_sp``),
XLA inserts the same all-gather and reduce-scatter around the GEMMs. The ops therefore take
``collective_op_set`` for TE's signatures, accept the no-op set, and refuse the others with that
alternative.
"""

from __future__ import annotations

import dataclasses
import enum

__all__ = ["CollectiveOp", "CollectiveOpSet", "check_collective_op_set", "noop_collective_op_set"]


class CollectiveOp(enum.Enum):
    """The collective a GEMM overlaps with its computation (TransformerEngine's enum)."""

    NONE = 0
    ALL_GATHER = 1
    REDUCE_SCATTER = 2

    @property
    def is_all_gather(self) -> bool:
        """Whether this is ``ALL_GATHER``."""
        return self is CollectiveOp.ALL_GATHER

    @property
    def is_reduce_scatter(self) -> bool:
        """Whether this is ``REDUCE_SCATTER``."""
        return self is CollectiveOp.REDUCE_SCATTER

    @property
    def is_none(self) -> bool:
        """Whether this is ``NONE``."""
        return self is CollectiveOp.NONE


@dataclasses.dataclass(frozen=True)
class CollectiveOpSet:
    """The collectives of a dense layer's forward and backward GEMMs.

    Example usage::

      >>> from te_flax.collective import CollectiveOp, CollectiveOpSet
      >>> CollectiveOpSet.create(CollectiveOp.ALL_GATHER).backward
      <CollectiveOp.REDUCE_SCATTER: 2>
    """

    forward: CollectiveOp
    backward: CollectiveOp

    @staticmethod
    def create(forward_collective_op: CollectiveOp) -> CollectiveOpSet:
        """The set whose backward is the forward's complement: an all-gather's is a
        reduce-scatter and the reverse; ``NONE``'s is ``NONE``."""
        if forward_collective_op.is_all_gather:
            backward = CollectiveOp.REDUCE_SCATTER
        elif forward_collective_op.is_reduce_scatter:
            backward = CollectiveOp.ALL_GATHER
        else:
            backward = CollectiveOp.NONE
        return CollectiveOpSet(forward=forward_collective_op, backward=backward)


noop_collective_op_set = CollectiveOpSet.create(forward_collective_op=CollectiveOp.NONE)


def check_collective_op_set(collective_op_set: object, argument: str = "collective_op_set") -> None:
    """Accepts the no-op set; refuses a collective GEMM, naming the alternative."""
    if not isinstance(collective_op_set, CollectiveOpSet):
        raise TypeError(
            f"{argument} must be a CollectiveOpSet, got {collective_op_set!r}; pass "
            "te_flax.collective.noop_collective_op_set (the default)"
        )
    if collective_op_set == noop_collective_op_set:
        return
    raise ValueError(
        f"{argument}={collective_op_set} asks for a collective GEMM (communication overlapped "
        "inside the GEMM kernel), which te_flax does not have; pass noop_collective_op_set (the "
        "default) and shard the sequence axis with logical axis rules instead (e.g. "
        "('length', 'tensor') as in the tp_sp rule set, or a MeshResource with "
        "tpsp_resource): XLA then inserts the all-gather and reduce-scatter around the GEMM"
    )
