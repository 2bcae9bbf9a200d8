"""Sharding constraints from logical axis names, through Flax's logical axis rules.

Logical names (``"batch"``, ``"embed"``, ``"mlp"``, ...) are mapped to mesh axes by the rules of
the active ``flax.linen.logical_axis_rules`` context and applied on the mesh set with
``jax.set_mesh``, whose axes must be ``AxisType.Auto`` (the deprecated ``with mesh:`` context is
not seen). Without rules, without a mesh, or for empty axes the helper does nothing, so the same
code runs on one device and on many.
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax
from jax import Array
from jax.sharding import AxisType, NamedSharding, PartitionSpec

__all__ = ["LogicalAxes", "with_logical_constraint"]

LogicalAxes = Sequence[str | None] | None


def _drop_manual(entry, manual: frozenset[str]):
    """A PartitionSpec entry without mesh axes that are manual (inside ``shard_map``)."""
    if entry is None or entry is PartitionSpec.UNCONSTRAINED:
        return entry
    names = (entry,) if isinstance(entry, str) else tuple(entry)
    kept = tuple(name for name in names if name not in manual)
    if not kept:
        return None
    return kept[0] if len(kept) == 1 else kept


def with_logical_constraint(x: Array, logical_axes: LogicalAxes) -> Array:
    """Constrains ``x``'s sharding to the mesh axes its logical axis names map to.

    Args:
      x: the array to constrain.
      logical_axes: one logical axis name (or None) per dimension of ``x``; None or ``()`` means
        no constraint.

    Returns:
      ``x``, with a sharding constraint when logical axis rules and a mesh are active.

    Example usage::

      >>> import jax.numpy as jnp
      >>> from te_flax.sharding import with_logical_constraint
      >>> with_logical_constraint(jnp.ones((2, 4)), ("batch", "embed")).shape  # no rules: no-op
      (2, 4)
    """
    if x is None or not logical_axes:
        return x
    logical_axes = tuple(logical_axes)
    if len(logical_axes) != x.ndim:
        raise ValueError(
            f"logical axes {logical_axes} name {len(logical_axes)} dimensions but the array has "
            f"{x.ndim} (shape {x.shape}); give one name (or None) per dimension"
        )
    rules = nn.get_logical_axis_rules()
    mesh = jax.sharding.get_abstract_mesh()
    if not rules or mesh.empty:
        return x
    spec = nn.logical_to_mesh_axes(logical_axes, rules)
    _check_auto_axes(spec, mesh)
    manual = frozenset(mesh.manual_axes)
    if manual:
        # Inside shard_map the manual axes are already split by hand; constrain only the others.
        spec = PartitionSpec(*(_drop_manual(entry, manual) for entry in spec))
        if all(entry is None for entry in spec):
            return x
    if not isinstance(x, jax.core.Tracer):
        # Outside jit: place the concrete array as the constraint would have.
        return jax.device_put(x, NamedSharding(jax.sharding.get_mesh(), spec))
    return jax.lax.with_sharding_constraint(x, spec)


def _check_auto_axes(spec: PartitionSpec, mesh) -> None:
    for entry in spec:
        if entry is None or entry is PartitionSpec.UNCONSTRAINED:
            continue
        for name in (entry,) if isinstance(entry, str) else entry:
            if mesh._name_to_type[name] == AxisType.Explicit:
                raise ValueError(
                    f"mesh axis {name!r} is AxisType.Explicit, but te_flax shards through "
                    "logical-axis constraints, which need AxisType.Auto axes; build the mesh "
                    "with jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names))"
                )
