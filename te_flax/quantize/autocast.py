"""``autocast``: a context that sets the default FP8 recipe for code traced inside it, and
``fp8_autocast``, TransformerEngine's deprecated spelling of it."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

from te_flax._base.settings import ScopedSetting
from te_flax.quantize.recipes import DelayedScaling, Recipe, check_recipe
from te_flax.sharding import MeshResource, global_shard_guard

__all__ = ["autocast", "fp8_autocast", "get_autocast_recipe"]

# Part of jax.jit's cache key (recipes are frozen, hashable dataclasses): a function jitted
# outside ``autocast`` and called inside it is traced again, so it cannot silently reuse the
# unquantized program (or one of another recipe).
_ACTIVE_RECIPE: ScopedSetting[Recipe | None] = ScopedSetting("autocast recipe", None)


@contextlib.contextmanager
def autocast(
    enabled: bool = False, recipe: Recipe | None = None, mesh_resource: MeshResource | None = None
) -> Iterator[None]:
    """Sets the recipe that ops and modules without an explicit recipe use, and the mesh axes.

    The recipe is read while a function is traced, and it is part of ``jax.jit``'s cache key:
    a jitted function called inside the context is traced for its recipe, even if it was
    compiled outside the context before. Contexts nest; leaving one restores the recipe that was
    active before. ``te_flax.autocast`` is this function.

    Args:
      enabled: whether FP8 is on inside the context (default False, as in TransformerEngine).
      recipe: the recipe to use when enabled; None means ``DelayedScaling()``. A recipe with
        ``enabled=False`` is ignored, with a ``UserWarning`` that says so.
      mesh_resource: TransformerEngine's names of the mesh axes (``te_flax.sharding``), active
        inside the context as under ``global_shard_guard``; None keeps the active one.

    Example usage::

      >>> import te_flax
      >>> from te_flax.quantize import Float8CurrentScaling, get_autocast_recipe
      >>> with te_flax.autocast(enabled=True, recipe=Float8CurrentScaling()):
      ...     print(type(get_autocast_recipe()).__name__)
      Float8CurrentScaling
      >>> print(get_autocast_recipe())
      None
      >>> from te_flax.sharding import MeshResource, global_mesh_resource
      >>> with te_flax.autocast(enabled=True, mesh_resource=MeshResource(dp_resource="data")):
      ...     print(global_mesh_resource().dp_resource)
      data
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"autocast(enabled=...) must be a bool, got {enabled!r}")
    if not enabled and recipe is not None:
        # TE ignores the recipe too; here that is said, since nothing else would show it.
        warnings.warn(
            f"te_flax.autocast(recipe={type(recipe).__name__}(...)) with enabled=False quantizes "
            "nothing: enabled defaults to False, as in TransformerEngine, and the recipe is "
            "ignored. Pass enabled=True to use the recipe, or leave the recipe out to run in "
            "high precision",
            UserWarning,
            stacklevel=3,
        )
    if enabled:
        recipe = DelayedScaling() if recipe is None else recipe
        check_recipe(recipe, "autocast(recipe=...)")
    guard = contextlib.nullcontext() if mesh_resource is None else global_shard_guard(mesh_resource)
    with guard, _ACTIVE_RECIPE.scope(recipe if enabled else None):
        yield


def get_autocast_recipe() -> Recipe | None:
    """The recipe of the innermost enabled ``autocast`` context, or None outside of one."""
    return _ACTIVE_RECIPE.value


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
