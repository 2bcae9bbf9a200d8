"""``te_flax.autocast`` and ``fp8_autocast`` with TransformerEngine's ``mesh_resource``.

``te_flax.quantize.autocast`` sets the recipe; these also make a ``MeshResource`` active for the
context (``te_flax.sharding.global_shard_guard``), as TransformerEngine's top-level ones do.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

from te_flax import quantize
from te_flax.quantize import Recipe
from te_flax.sharding import MeshResource, global_shard_guard

__all__ = ["autocast", "fp8_autocast"]


@contextlib.contextmanager
def autocast(
    enabled: bool = False, recipe: Recipe | None = None, mesh_resource: MeshResource | None = None
) -> Iterator[None]:
    """Sets the recipe that ops and modules without an explicit recipe use, and the mesh axes.

    Args:
      enabled: whether FP8 is on inside the context (default False, as in TransformerEngine).
      recipe: the recipe to use when enabled; None means ``DelayedScaling()``.
      mesh_resource: TransformerEngine's names of the mesh axes (``te_flax.sharding``), active
        inside the context as under ``global_shard_guard``; None keeps the active one.

    Example usage::

      >>> import te_flax
      >>> from te_flax.sharding import MeshResource, global_mesh_resource
      >>> with te_flax.autocast(enabled=True, mesh_resource=MeshResource(dp_resource="data")):
      ...     print(global_mesh_resource().dp_resource)
      data
    """
    guard = contextlib.nullcontext() if mesh_resource is None else global_shard_guard(mesh_resource)
    with guard, quantize.autocast(enabled=enabled, recipe=recipe):
        yield


@contextlib.contextmanager
def fp8_autocast(
    enabled: bool = False,
    fp8_recipe: Recipe | None = None,
    mesh_resource: MeshResource | None = None,
) -> Iterator[None]:
    """TransformerEngine's deprecated spelling of ``autocast`` (``fp8_recipe`` is ``recipe``);
    it warns with a ``DeprecationWarning``, as TE's does."""
    warnings.warn(
        "fp8_autocast is deprecated (as in TransformerEngine); use "
        "te_flax.autocast(enabled=..., recipe=..., mesh_resource=...) instead",
        DeprecationWarning,
        stacklevel=3,
    )
    with autocast(enabled=enabled, recipe=fp8_recipe, mesh_resource=mesh_resource):
        yield
