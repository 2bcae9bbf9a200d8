"""Sharding constraints from logical axis names, through Flax's logical axis rules.

Logical names (``"batch"``, ``"embed"``, ``"mlp"``, ...) are mapped to mesh axes by the rules of
the active ``flax.linen.logical_axis_rules`` context and applied on the mesh set with
``jax.set_mesh`` (the deprecated ``with mesh:`` context is not seen). Without rules, without a
mesh, or for empty axes the helper does nothing, so the same code runs on one device and on many.

Both of JAX's sharding styles work. On ``AxisType.Auto`` axes (``make_mesh`` here) a
constraint is ``with_sharding_constraint`` and XLA's partitioner places the rest. On
``AxisType.Explicit`` axes (the default of ``jax.make_mesh``) every array's sharding is part of
its type: a constraint is a ``jax.sharding.reshard``, and the ops give each GEMM whose sharding
JAX cannot infer (a product summed over a sharded axis) the sharding of the tensor it stands
for (``gemm_out_sharding``), so that every gradient has its parameter's sharding.

TransformerEngine names mesh axes by role instead: ``MeshResource(dp_resource="data",
tp_resource="tensor", ...)`` under ``global_shard_guard`` (or ``te_flax.autocast(...,
mesh_resource=...)``). Such a resource stands for logical axis rules (``mesh_resource_rules``):
for te_flax's names, the rules of the shipped rule sets (``dp_fsdp_tp``, ``tp_sp``, ``ep``), and
for TE's own names (``BATCH_AXES``, ``W_TP_AXES``, ...) TE's table. Where no Flax rules are
active, the constraints use the active resource's rules, as TE falls back to its table.

Inside ``jax.shard_map`` (with its default ``check_vma=True``) the ops take the amax over all
devices (``pmax``) and mark replicated parameters as varying, so FP8 state and gradients are
those of the single-device program. Take the gradient inside the ``shard_map`` body, or keep
``check_vma=True``: with ``check_vma=False`` and the gradient outside, JAX adds up the
replicated FP8 state's updates over the devices.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import yaml
from flax.linen.spmd import logical_to_mesh_axes
from jax import Array
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from te_flax._base.checks import check_positive_int
from te_flax._base.explicit_sharding import (
    SpecEntry,
    drop_axes,
    entry_axes,
    explicit_axes,
    explicit_specs,
    gemm_out_sharding,
    on_auto_axes,
    sharded_along,
    spec_of,
    vary_like,
    whole_last_axis,
    with_explicit_specs,
)
from te_flax._base.explicit_sharding import Specs as Specs  # the ops' type of their specs
from te_flax._base.settings import ScopedSetting

__all__ = [
    "BATCH_AXES",
    "HEAD_AXES",
    "HIDDEN_AXES",
    "HIDDEN_TP_AXES",
    "JOINED_AXES",
    "RULES_DIR",
    "SEQLEN_AXES",
    "SEQLEN_CP_AXES",
    "SEQLEN_TP_AXES",
    "W_FSDP_AXES",
    "W_JOINED_AXES",
    "W_NO_SHARD_AXES",
    "W_TP_AXES",
    "LogicalAxes",
    "MeshResource",
    "explicit_axes",
    "explicit_specs",
    "gemm_out_sharding",
    "global_mesh_resource",
    "global_shard_guard",
    "load_axis_rules",
    "make_mesh",
    "mesh_resource_rules",
    "on_auto_axes",
    "sharded_along",
    "spec_of",
    "use_sharding",
    "vary_like",
    "whole_last_axis",
    "with_explicit_specs",
    "with_logical_constraint",
]

# The rule sets shipped with the repository: dp, fsdp, tp, tp_sp, dp_fsdp_tp, ep, cp.
RULES_DIR = Path(__file__).resolve().parent.parent / "configs" / "rules"
MESH_AXES = ("data", "fsdp", "tensor")
# Axes a mesh has only when asked for: "context" shards the sequence for context parallelism.
OPTIONAL_MESH_AXES = ("context",)
# The logical axis names of te_flax's default axes and of the examples' activations.
LOGICAL_AXES = (
    "batch", "length", "embed", "mlp", "act", "heads", "kv", "qkv", "vocab", "layers",
    "act_embed", "act_mlp", "act_heads", "relpos_buckets", "exp",
)  # fmt: skip

LogicalAxes = Sequence[str | None] | None


def _drop_manual(entry: SpecEntry, manual: frozenset[str]) -> SpecEntry:
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
    if mesh.empty:
        return x
    if not rules and _ACTIVE_RESOURCE.value is not None:
        rules = mesh_resource_rules()
    if not rules:
        return x
    _check_known_names(logical_axes, rules)
    spec = logical_to_mesh_axes(logical_axes, rules)
    assert spec is not None  # logical_axes is not empty
    _check_mesh_axes(logical_axes, spec, mesh)
    manual = frozenset(mesh.manual_axes)
    if manual:
        # Inside shard_map the manual axes are already split by hand; constrain only the others.
        spec = PartitionSpec(*(_drop_manual(entry, manual) for entry in spec))
        if all(entry is None for entry in spec):
            return x
    if not isinstance(x, jax.core.Tracer):
        concrete_mesh: jax.sharding.Mesh | None
        try:
            concrete_mesh = jax.sharding.get_mesh()
        except ValueError:
            # Under jit (get_mesh refuses to run inside a trace) an input closed over by the
            # traced function is a concrete array: it is constrained like a traced one.
            concrete_mesh = None
        if concrete_mesh is not None:
            # Outside jit: place the concrete array as the constraint would have.
            return jax.device_put(x, NamedSharding(concrete_mesh, spec))
    explicit = explicit_axes()
    if not explicit:
        return jax.lax.with_sharding_constraint(x, spec)
    # Explicit axes are part of the array's type: the constraint is a ``reshard`` to them (on
    # such axes ``with_sharding_constraint`` only asserts the sharding the type already has).
    # Auto axes of the same mesh are constrained as on an Auto mesh.
    auto = frozenset(mesh.axis_names) - explicit - manual
    x = jax.sharding.reshard(x, PartitionSpec(*(drop_axes(e, auto) for e in spec)))
    auto_spec = PartitionSpec(*(drop_axes(e, explicit) for e in spec))
    if any(entry is not None for entry in auto_spec):
        x = jax.lax.with_sharding_constraint(x, auto_spec)
    return x


def _check_known_names(logical_axes: tuple[Any, ...], rules: Sequence[tuple[str, Any]]) -> None:
    # A name that no rule and no te_flax layer uses is a typo: Flax would silently replicate it.
    known = {rule[0] for rule in rules} | set(LOGICAL_AXES)
    unknown = [a for a in logical_axes if isinstance(a, str) and a not in known]
    if unknown:
        raise ValueError(
            f"logical axis names {unknown} in {logical_axes} appear in no rule of the active "
            f"logical_axis_rules and are not te_flax's names {LOGICAL_AXES}; fix the spelling, "
            f"or add a rule such as ({unknown[0]!r}, None) to replicate that axis"
        )


def _check_mesh_axes(
    logical_axes: tuple[Any, ...], spec: PartitionSpec, mesh: jax.sharding.AbstractMesh
) -> None:
    for logical, entry in zip(logical_axes, spec, strict=False):
        for name in entry_axes(entry):
            if name not in mesh.axis_names:
                raise ValueError(
                    f"the logical_axis_rules map {logical!r} to mesh axis {name!r}, but the mesh "
                    f"has axes {tuple(mesh.axis_names)}; fix the rule, or build the mesh with "
                    "that axis"
                )


def load_axis_rules(rule_set: str | Path) -> tuple[tuple[str, str | tuple[str, ...] | None], ...]:
    """Logical-axis rules from a YAML rule set: a name in ``configs/rules`` or a file path.

    A rule set is ``rules: [[logical_name, mesh_axis or [mesh_axes...] or null], ...]``, the
    format of ``flax.linen.logical_axis_rules``. Logical names a rule set does not mention are
    replicated.
    """
    path = Path(rule_set)
    if not path.suffix:
        path = RULES_DIR / f"{rule_set}.yaml"
    if not path.exists():
        known = sorted(p.stem for p in RULES_DIR.glob("*.yaml"))
        raise FileNotFoundError(f"no rule set {rule_set!r}; the shipped ones are {known}")
    try:
        document = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as error:
        raise ValueError(f"{path}: not valid YAML: {error}") from error
    entries = document.get("rules") if isinstance(document, dict) else None
    if not isinstance(entries, list) or not all(
        isinstance(e, list) and len(e) == 2 and isinstance(e[0], str) for e in entries
    ):
        raise ValueError(f"{path}: expected 'rules: [[logical_name, mesh_axes], ...]'")
    rules = [(name, tuple(axes) if isinstance(axes, list) else axes) for name, axes in entries]
    for name, axes in rules:
        named = axes if isinstance(axes, tuple) else (axes,)
        wrong = [a for a in named if a not in MESH_AXES + OPTIONAL_MESH_AXES]
        if axes is not None and wrong:
            raise ValueError(
                f"{path}: the rule [{name!r}, {axes!r}] names mesh axes {wrong}, but te_flax "
                f"meshes have the axes {MESH_AXES}; map {name!r} to one of those (or null)"
            )
    # Every logical name the layers use and the rule set leaves out is replicated explicitly:
    # Linen treats unknown names so, but NNX's partition specs would keep the name itself.
    mentioned = {name for name, _ in rules}
    rules += [(name, None) for name in LOGICAL_AXES if name not in mentioned]
    return tuple(rules)


def make_mesh(
    shape: Mapping[str, int], devices: Sequence[jax.Device] | None = None
) -> jax.sharding.Mesh:
    """A mesh with ``AxisType.Auto`` axes, e.g. ``make_mesh({"data": 2, "fsdp": 2, "tensor": 2})``.

    Axes of ``data``, ``fsdp`` and ``tensor`` that ``shape`` leaves out get size 1, so every
    shipped rule set applies to every mesh; a ``context`` axis (context parallelism, the ``cp``
    rule set) is added when ``shape`` names it. The product must equal the number of devices used
    (all of ``jax.devices()`` by default).
    """
    unknown = sorted(set(shape) - set(MESH_AXES + OPTIONAL_MESH_AXES))
    if unknown:
        raise ValueError(
            f"unknown mesh axes {unknown}; the axes are {MESH_AXES + OPTIONAL_MESH_AXES}: use "
            "only those in mesh_shape"
        )
    names = MESH_AXES + tuple(axis for axis in OPTIONAL_MESH_AXES if axis in shape)
    sizes = tuple(
        check_positive_int(
            shape.get(axis, 1), f"mesh_shape[{axis!r}]", "e.g. make_mesh({'data': 2, 'fsdp': 4})"
        )
        for axis in names
    )
    devices = list(jax.devices() if devices is None else devices)
    total = 1
    for size in sizes:
        total *= size
    if total != len(devices):
        raise ValueError(
            f"mesh {dict(zip(names, sizes, strict=True))} has {total} devices, "
            f"not {len(devices)}; choose mesh_shape sizes whose product is {len(devices)}, or "
            "pass those devices"
        )
    return jax.make_mesh(sizes, names, axis_types=(AxisType.Auto,) * len(names), devices=devices)


@contextlib.contextmanager
def use_sharding(
    rule_set: str | Path, mesh_shape: Mapping[str, int]
) -> Iterator[jax.sharding.Mesh]:
    """Loads a rule set, builds the mesh, and makes both active: the one call to shard a model.

    Example usage::

      >>> import jax
      >>> from te_flax.sharding import use_sharding
      >>> with use_sharding("dp_fsdp_tp", {"data": 2, "fsdp": 2, "tensor": 2}) as mesh:
      ...     print(dict(mesh.shape))
      {'data': 2, 'fsdp': 2, 'tensor': 2}
    """
    mesh = make_mesh(mesh_shape)
    with jax.set_mesh(mesh), nn.logical_axis_rules(load_axis_rules(rule_set)):
        yield mesh


# ----------------------------------------------------------------------------- MeshResource

# TransformerEngine's logical axis names (its layers' default axes), with its values.
BATCH_AXES = "nvte_batch"
SEQLEN_AXES = "nvte_seqlen"
SEQLEN_TP_AXES = "nvte_seqlen_tp"
SEQLEN_CP_AXES = "nvte_seqlen_cp"
HEAD_AXES = "nvte_head"
HIDDEN_AXES = "nvte_hidden"
HIDDEN_TP_AXES = "nvte_hidden_tp"
JOINED_AXES = "nvte_joined"
W_NO_SHARD_AXES = "nvte_w_no_shard"
W_FSDP_AXES = "nvte_w_fsdp"
W_TP_AXES = "nvte_w_tp"
W_JOINED_AXES = "nvte_w_joined"


@dataclasses.dataclass(frozen=True)
class MeshResource:
    """TransformerEngine's names of the mesh axes of each kind of parallelism.

    Each field is a mesh axis name or None (that parallelism is off). Under
    ``global_shard_guard(resource)`` it stands for the logical axis rules of
    ``mesh_resource_rules``.

    Attributes:
      dp_resource: data parallelism: the batch.
      tp_resource: tensor parallelism: the MLP and attention-head axes.
      tpsp_resource: tensor and sequence parallelism: as ``tp_resource``, and the sequence of
        the norm inputs (te_flax's ``tp_sp`` rule set).
      fsdp_resource: fully sharded data parallelism: the batch, and each kernel's embed axis.
      pp_resource: pipeline parallelism: accepted; te_flax has no pipeline schedule, so it
        maps no axis.
      cp_resource: context parallelism: TE's ``SEQLEN_CP_AXES`` only (the attention takes its
        axis as ``DotProductAttention(context_parallel_axis=...)``).
      ep_resource: expert parallelism: the experts axis (te_flax's ``exp``).
    """

    dp_resource: str | None = None
    tp_resource: str | None = None
    tpsp_resource: str | None = None
    fsdp_resource: str | None = None
    pp_resource: str | None = None
    cp_resource: str | None = None
    ep_resource: str | None = None

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is not None and not isinstance(value, str):
                raise TypeError(
                    f"MeshResource({field.name}={value!r}): each resource is one mesh axis name "
                    "(a str) or None"
                )


# Part of jax.jit's cache key, as the autocast recipe: the rules a trace sees are in its key.
_ACTIVE_RESOURCE: ScopedSetting[MeshResource | None] = ScopedSetting("mesh resource", None)


@contextlib.contextmanager
def global_shard_guard(resource: MeshResource | None) -> Iterator[None]:
    """Makes ``resource`` the active ``MeshResource`` inside the context (contexts nest); None
    makes none active, as in TransformerEngine.

    Example usage::

      >>> from te_flax.sharding import MeshResource, global_mesh_resource, global_shard_guard
      >>> with global_shard_guard(MeshResource(dp_resource="data")):
      ...     print(global_mesh_resource().dp_resource)
      data
    """
    if resource is not None and not isinstance(resource, MeshResource):
        raise TypeError(
            f"global_shard_guard takes a MeshResource, got {resource!r}; e.g. "
            "global_shard_guard(MeshResource(dp_resource='data', tp_resource='tensor'))"
        )
    with _ACTIVE_RESOURCE.scope(resource):
        yield


def global_mesh_resource() -> MeshResource:
    """The active ``MeshResource``; outside ``global_shard_guard`` an error says how to set one."""
    resource = _ACTIVE_RESOURCE.value
    if resource is None:
        raise ValueError(
            "no MeshResource is active: wrap the code in "
            "te_flax.sharding.global_shard_guard(MeshResource(...)) or "
            "te_flax.autocast(..., mesh_resource=MeshResource(...)); on one device "
            "MeshResource() (no parallelism) will do"
        )
    return resource


def _axis_size(mesh: Any, axis: str | None) -> int:
    if axis is None or mesh.empty:
        return 1
    if axis not in mesh.axis_names:
        raise ValueError(
            f"the MeshResource names mesh axis {axis!r}, but the mesh has axes "
            f"{tuple(mesh.axis_names)}; name one of those, or build the mesh with that axis"
        )
    return int(mesh.shape[axis])


def mesh_resource_rules(
    resource: MeshResource | None = None,
) -> tuple[tuple[str, str | tuple[str, ...] | None], ...]:
    """The logical axis rules ``resource`` (default: the active one) stands for on the mesh.

    te_flax's names follow the shipped rule sets: ``batch`` over the data-parallel axes
    (``dp_resource`` then ``fsdp_resource``), ``embed`` over ``fsdp_resource``, ``mlp``,
    ``heads``, ``act_mlp`` and ``act_heads`` over the tensor axis (``tpsp_resource`` when it
    has more than one device, else ``tp_resource``), ``length`` over ``tpsp_resource``, ``exp``
    over ``ep_resource``. TransformerEngine's names (``BATCH_AXES``, ...) follow TE's table.
    Every other te_flax name is replicated.

    Example usage::

      >>> from te_flax.sharding import MeshResource, mesh_resource_rules
      >>> dict(mesh_resource_rules(MeshResource("data", "tensor", fsdp_resource="fsdp")))["batch"]
      ('data', 'fsdp')
    """
    resource = global_mesh_resource() if resource is None else resource
    mesh = jax.sharding.get_abstract_mesh()
    tp_on = _axis_size(mesh, resource.tp_resource) > 1
    tpsp_on = _axis_size(mesh, resource.tpsp_resource) > 1
    if tp_on and tpsp_on:
        raise ValueError(
            f"MeshResource(tp_resource={resource.tp_resource!r}, "
            f"tpsp_resource={resource.tpsp_resource!r}): tensor parallelism and tensor sequence "
            "parallelism cannot both be on (as in TransformerEngine); set one of them"
        )
    fsdp_on = _axis_size(mesh, resource.fsdp_resource) > 1
    tensor = resource.tpsp_resource if tpsp_on else resource.tp_resource
    data = tuple(a for a in (resource.dp_resource, resource.fsdp_resource) if a is not None)
    ours: dict[str, str | tuple[str, ...] | None] = {
        "batch": data[0] if len(data) == 1 else (data or None),
        "embed": resource.fsdp_resource,
        "mlp": tensor,
        "heads": tensor,
        "act_mlp": tensor,
        "act_heads": tensor,
        "length": resource.tpsp_resource if tpsp_on else None,
        "exp": resource.ep_resource,
    }
    # TransformerEngine's table (transformer_engine.jax.sharding), value for value.
    theirs = {
        BATCH_AXES: resource.fsdp_resource if fsdp_on else resource.dp_resource,
        SEQLEN_AXES: None,
        SEQLEN_TP_AXES: resource.tpsp_resource,
        SEQLEN_CP_AXES: resource.cp_resource,
        HEAD_AXES: tensor,
        HIDDEN_AXES: None,
        HIDDEN_TP_AXES: tensor,
        JOINED_AXES: None,
        W_NO_SHARD_AXES: None,
        W_FSDP_AXES: resource.fsdp_resource,
        W_TP_AXES: tensor,
        W_JOINED_AXES: None,
    }
    rules = {**ours, **{name: None for name in LOGICAL_AXES if name not in ours}, **theirs}
    return tuple(rules.items())
