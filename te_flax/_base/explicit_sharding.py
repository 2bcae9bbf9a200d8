"""Sharding under ``AxisType.Explicit`` mesh axes, and the ``shard_map`` varying marks: the
helpers the ops use so that every array (and every gradient) has the sharding JAX's types
require. Everything here is a no-op without a mesh of ``Explicit`` axes (or outside
``shard_map`` for ``vary_like``). Public through ``te_flax.sharding``.

On ``Explicit`` axes every array's sharding is part of its type: a GEMM whose operands are
sharded along the contraction has no sharding of its own (``gemm_out_sharding`` gives it
one), an elementwise product needs its operands' shardings to agree (``sharded_along``), and a
custom_vjp's cotangents must keep their primals' shardings (``explicit_specs``,
``with_explicit_specs``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import jax
from jax import Array
from jax.sharding import AxisType, PartitionSpec

__all__ = [
    "SpecEntry",
    "Specs",
    "drop_axes",
    "entry_axes",
    "explicit_axes",
    "explicit_specs",
    "gemm_out_sharding",
    "on_auto_axes",
    "placed_for_shard_map",
    "sharded_along",
    "spec_of",
    "vary_as_operands",
    "vary_like",
    "whole_last_axis",
    "with_explicit_specs",
]

T = TypeVar("T")
# One entry of a PartitionSpec: a mesh axis, a tuple of them, None or UNCONSTRAINED.
SpecEntry = Any


def explicit_axes() -> frozenset[str]:
    """The mesh axes of the active mesh (``jax.set_mesh``) that are ``AxisType.Explicit`` and
    not manual: the axes along which arrays carry their sharding in their type."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return frozenset()
    types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
    return frozenset(
        name
        for name, kind in types.items()
        if kind == AxisType.Explicit and name not in mesh.manual_axes
    )


def _spec_of(array: Any) -> tuple[SpecEntry, ...]:
    spec = tuple(jax.typeof(array).sharding.spec)
    return spec + (None,) * (array.ndim - len(spec))


def gemm_out_sharding(
    lhs: Array,
    rhs: Array,
    contracting: tuple[Sequence[int], Sequence[int]],
    like: Array | None = None,
) -> PartitionSpec | None:
    """The ``out_sharding`` of ``lax.dot_general(lhs, rhs, (contracting, ((), ())))`` under a
    mesh with ``Explicit`` axes, None elsewhere (the partitioner decides, as it always did).

    With ``Explicit`` axes a GEMM whose operands are sharded along the contraction (a weight
    gradient summed over a data-parallel batch, a row-parallel product) has no sharding of its
    own: JAX asks for one. ``like`` gives it: the cotangent of a primal (dgrad, wgrad) takes
    the primal's sharding, as JAX's own transpose of ``dot_general`` does. Without ``like`` the
    output keeps the free axes' shardings, ``lhs``'s first; a mesh axis both operands use on
    free axes is kept on ``lhs``'s (a product sharded twice over one axis does not exist).
    """
    if not explicit_axes():
        return None
    if like is not None:
        return PartitionSpec(*_spec_of(like))
    lhs_spec, rhs_spec = _spec_of(lhs), _spec_of(rhs)
    lhs_free = [e for d, e in enumerate(lhs_spec) if d not in contracting[0]]
    rhs_free = [e for d, e in enumerate(rhs_spec) if d not in contracting[1]]
    used = {a for entry in lhs_free for a in entry_axes(entry)}
    kept = [drop_axes(entry, used) for entry in rhs_free]
    return PartitionSpec(*lhs_free, *kept)


def sharded_along(vector: Array, x: Array) -> Array:
    """``vector`` (a parameter over ``x``'s trailing axes: a norm scale, a bias, an attention
    bias broadcast over the batch) resharded to ``x``'s sharding of those axes, under
    ``Explicit`` mesh axes; as it is elsewhere. An axis ``vector`` broadcasts (size 1 where
    ``x``'s is larger) is replicated.

    An elementwise product needs its operands' shardings to agree. A parameter stored sharded
    otherwise (over ``fsdp``) is gathered for its use, as XLA does by itself on ``Auto`` axes.
    """
    if not explicit_axes():
        return vector
    lead = x.ndim - vector.ndim
    target = PartitionSpec(
        *(
            entry if size == x.shape[lead + axis] else None
            for axis, (entry, size) in enumerate(zip(_spec_of(x)[lead:], vector.shape, strict=True))
        )
    )
    if tuple(jax.typeof(vector).sharding.spec) == tuple(target):
        return vector
    return jax.sharding.reshard(vector, target)


def whole_last_axis(x: Array) -> Array:
    """``x`` with its last axis unsharded, under ``Explicit`` mesh axes (as it is elsewhere):
    for a reduction over that axis that reads slices of it, a norm's statistics. XLA gathers
    it by itself on ``Auto`` axes."""
    if not explicit_axes():
        return x
    spec = _spec_of(x)
    if spec[-1] is None:
        return x
    return jax.sharding.reshard(x, PartitionSpec(*spec[:-1], None))


def spec_of(x: Array) -> PartitionSpec:
    """``x``'s ``PartitionSpec`` as its type holds it (``Explicit`` axes; empty elsewhere)."""
    return PartitionSpec(*_spec_of(x))


def on_auto_axes(fun: Callable[..., T], out_specs: Any, *args: Any) -> T:
    """``fun(*args)`` with the ``Explicit`` mesh axes taken as ``Auto`` inside (XLA's
    partitioner places its collectives, as on an ``Auto`` mesh), its outputs resharded to
    ``out_specs``: for a computation whose sharding JAX cannot type axis by axis (block-scaled
    quantization reshapes the sharded axes into blocks). Elsewhere ``fun(*args)``."""
    axes = explicit_axes()
    if not axes:
        return fun(*args)
    return jax.sharding.auto_axes(fun, axes=tuple(sorted(axes)), out_sharding=out_specs)(*args)


# The shardings of an op's differentiable arguments, one entry per array leaf: the static part
# of a custom_vjp's configuration under Explicit mesh axes, None elsewhere.
Specs = tuple[PartitionSpec, ...] | None


def explicit_specs(tree: Any) -> Specs:
    """The ``PartitionSpec`` of each array leaf of ``tree`` under ``Explicit`` mesh axes, else
    None. A custom_vjp op records its primals' with this, and its backward returns each
    cotangent with its primal's sharding (``with_explicit_specs``): JAX requires the types to
    match, and a parameter's gradient must keep the parameter's sharding."""
    if not explicit_axes():
        return None
    return tuple(PartitionSpec(*_spec_of(leaf)) for leaf in jax.tree.leaves(tree))


def with_explicit_specs(tree: T, specs: Specs) -> T:
    """``tree``'s array leaves resharded to ``specs`` (from ``explicit_specs`` of the primals
    ``tree`` is the cotangent of); ``tree`` as it is when ``specs`` is None."""
    if specs is None:
        return tree
    leaves, treedef = jax.tree.flatten(tree)
    assert len(leaves) == len(specs), "cotangents and primals have different leaves"
    placed = [
        leaf
        if getattr(leaf, "ndim", 0) != len(spec)
        or tuple(jax.typeof(leaf).sharding.spec) == tuple(spec)
        else jax.sharding.reshard(leaf, spec)
        for leaf, spec in zip(leaves, specs, strict=True)
    ]
    return jax.tree.unflatten(treedef, placed)


def placed_for_shard_map(
    args: T, in_specs: Any, axis_names: frozenset[str] | set[str] | None = None
) -> T:
    """``args`` resharded for ``shard_map(..., in_specs, axis_names=axis_names)`` where the mesh
    has ``Explicit`` axes: there ``shard_map`` refuses an input whose type says another sharding
    along its manual axes (on an ``Auto`` mesh it reshards at its boundary itself).

    Each array gets its ``in_specs`` entry (a tree of ``PartitionSpec`` matching ``args``'
    arrays) along the manual axes (``axis_names``, default every mesh axis) and keeps its own
    sharding along the others. A resharded parameter's gradient comes back with the parameter's
    sharding (``reshard``'s transpose). Elsewhere ``args`` as they are."""
    if not explicit_axes():
        return args
    manual = set(jax.sharding.get_abstract_mesh().axis_names if axis_names is None else axis_names)
    leaves, treedef = jax.tree.flatten(args)
    specs = jax.tree.leaves(in_specs, is_leaf=lambda spec: isinstance(spec, PartitionSpec))
    assert len(leaves) == len(specs), "one PartitionSpec per array"
    placed = []
    for leaf, spec in zip(leaves, specs, strict=True):
        entries = tuple(spec) + (None,) * (leaf.ndim - len(spec))
        own = _spec_of(leaf)
        wanted = tuple(
            entry if entry is not None else drop_axes(kept, manual)
            for entry, kept in zip(entries, own, strict=True)
        )
        if own != wanted:
            leaf = jax.sharding.reshard(leaf, PartitionSpec(*wanted))
        placed.append(leaf)
    return jax.tree.unflatten(treedef, placed)


def entry_axes(entry: SpecEntry) -> tuple[str, ...]:
    if entry is None or entry is PartitionSpec.UNCONSTRAINED:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def drop_axes(entry: SpecEntry, axes: set[str] | frozenset[str]) -> SpecEntry:
    kept = tuple(a for a in entry_axes(entry) if a not in axes)
    if not kept:
        return None
    return kept[0] if len(kept) == 1 else kept


def _varying_axes(array: Any) -> frozenset[str]:
    manual = getattr(jax.typeof(array), "mat", None)
    return frozenset(manual.varying) if manual is not None else frozenset()


def vary_like(x: Array, tree: T) -> T:
    """``tree``'s arrays marked as varying over the ``shard_map`` axes that ``x`` varies over.

    Inside ``shard_map`` a replicated parameter (a kernel, a bias, a norm scale) meets a
    per-device input. A plain ``jnp.dot`` marks it varying implicitly, so that its gradient is
    summed over the devices; a ``custom_vjp`` op has to make the same mark itself (the mark's
    transpose is that sum). Outside ``shard_map`` this does nothing.
    """
    return vary_as_operands((x,), tree)


def vary_as_operands(operands: Any, tree: T) -> T:
    """``tree``'s arrays marked as varying over every ``shard_map`` axis that an array of
    ``operands`` varies over: what JAX's own ops give their results, and what a Pallas kernel
    (whose ``out_shape`` carries no varying axes) does not. Outside ``shard_map`` (or with
    ``check_vma=False``) this does nothing."""
    varying = frozenset().union(*map(_varying_axes, jax.tree.leaves(operands)))
    if not varying:
        return tree

    def mark(array: Array) -> Array:
        missing = tuple(sorted(varying - _varying_axes(array)))
        return jax.lax.pcast(array, missing, to="varying") if missing else array

    return jax.tree.map(mark, tree)
