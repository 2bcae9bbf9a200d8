"""The kernels in programs partitioned over a mesh: one call per device block.

XLA's SPMD partitioner cannot split a Pallas kernel's custom call; left alone it would gather
the operands and run the kernel whole on every device. ``per_shard`` wraps a kernel's local
computation in ``jax.experimental.custom_partitioning`` with a Shardy sharding rule built from
the operands' dimensions, so that each device runs the kernel on its own block and the results
keep the operands' sharding. Reductions over the tensor (an amax, a bias or norm-scale
gradient) are taken on the block and combined over the mesh axes that split what they reduce,
as the XLA stages' reductions are: one all-reduce of the float32 result each.

Outside a partitioned program (one device, no mesh, or inside ``shard_map``) the local
computation is traced as it is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal, TypeVar

import jax
from jax import Array, lax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

__all__ = ["Dims", "Reduction", "mesh_partitioned", "per_shard"]

# The factor of each dimension of an array (a name shared by every array with that dimension),
# or None for an array that is replicated whole (a scale).
Dims = tuple[str, ...] | None
Reduction = Literal["max", "sum"] | None
R = TypeVar("R")


def mesh_partitioned() -> bool:
    """True in a program that Shardy partitions over a mesh of several devices set with
    ``jax.set_mesh`` (no axis manual): there ``per_shard`` splits the kernels."""
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and mesh.size > 1 and not mesh.manual_axes


def _axes(entry: object) -> tuple[str, ...]:
    if entry is None or entry is PartitionSpec.UNCONSTRAINED:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (str(entry),)


def per_shard(
    local: Callable[..., Sequence[Array]],
    operands: Sequence[Array | None],
    operand_dims: Sequence[Dims],
    result_dims: Sequence[tuple[str, ...]],
    reductions: Sequence[Reduction],
    replicated: tuple[str, ...] = (),
) -> tuple[Array, ...]:
    """``local(*operands)``, run on each device's block where the program is partitioned.

    Args:
      local: the computation on (blocks of) the operands; returns one array per result, the
        results with a reduction as the block's partial value.
      operands: the arrays (None for an absent one, passed to ``local`` as None); the first
        carries every factor of the results.
      operand_dims: each operand's factors (None: replicated whole).
      result_dims: each result's factors.
      reductions: per result, ``"max"`` or ``"sum"`` when it reduces the first operand's
        factors that it lacks (combined over the mesh axes that split them), else None.
      replicated: factors the kernel needs whole on every device (a row it reduces).
    """
    if not mesh_partitioned():
        return tuple(local(*operands))
    present = [x is not None for x in operands]
    local = _with_absent(local, present)
    operand_dims = [d for d, p in zip(operand_dims, present, strict=True) if p]
    arrays = [x for x in operands if x is not None]
    primary = operand_dims[0]
    assert primary is not None, "the first operand carries the factors"
    counter = iter(range(len(arrays)))

    def mapping(dims: Dims) -> str:
        # A replicated operand gets factors of its own, each needing replication.
        if dims is None:
            return ""
        return " ".join(dims)

    whole = [
        tuple(f"r{next(counter)}_{d}" for d in range(x.ndim)) if dims is None else None
        for x, dims in zip(arrays, operand_dims, strict=True)
    ]
    operand_rules = [
        " ".join(own) if own is not None else mapping(dims)
        for own, dims in zip(whole, operand_dims, strict=True)
    ]
    rule = f"{', '.join(operand_rules)} -> {', '.join(mapping(d) for d in result_dims)}"
    need_replication = tuple(replicated) + tuple(f for own in whole if own for f in own)

    def partition(
        mesh: jax.sharding.Mesh, arg_shapes: tuple[jax.ShapeDtypeStruct, ...], result_shape: object
    ) -> tuple[object, ...]:
        spec = tuple(arg_shapes[0].sharding.spec) + (None,) * len(primary)
        axes = {
            factor: None if factor in replicated else spec[d] for d, factor in enumerate(primary)
        }

        def sharding(dims: Dims) -> NamedSharding:
            if dims is None:
                return NamedSharding(mesh, PartitionSpec())
            return NamedSharding(mesh, PartitionSpec(*(axes.get(f) for f in dims)))

        def reduced_axes(dims: tuple[str, ...]) -> tuple[str, ...]:
            return tuple(a for f in primary if f not in dims for a in _axes(axes[f]))

        def lower(*blocks: Array) -> tuple[Array, ...]:
            results = list(local(*blocks))
            for i, (dims, how) in enumerate(zip(result_dims, reductions, strict=True)):
                over = reduced_axes(dims)
                if how == "max" and over:
                    results[i] = lax.pmax(results[i], over)
                elif how == "sum" and over:
                    results[i] = lax.psum(results[i], over)
            return tuple(results)

        arg_shardings = tuple(sharding(d) for d in operand_dims)
        result_shardings = tuple(sharding(d) for d in result_dims)
        return mesh, lower, result_shardings, arg_shardings

    @custom_partitioning
    def call(*arrays: Array) -> tuple[Array, ...]:
        return tuple(local(*arrays))

    call.def_partition(
        partition=partition, sharding_rule=rule, need_replication_factors=need_replication
    )
    return tuple(call(*arrays))


def _with_absent(local: Callable[..., R], present: Sequence[bool]) -> Callable[..., R]:
    """``local`` taking only the operands that are present (the others passed as None)."""

    def call(*arrays: Array) -> R:
        it = iter(arrays)
        return local(*(next(it) if p else None for p in present))

    return call
