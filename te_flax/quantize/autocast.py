"""``autocast``: a context that sets the default FP8 recipe for code traced inside it."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

from te_flax.quantize.recipes import DelayedScaling, Recipe, check_recipe

__all__ = ["autocast", "get_autocast_recipe"]

_ACTIVE_RECIPE: contextvars.ContextVar[Recipe | None] = contextvars.ContextVar(
    "te_flax_autocast_recipe", default=None
)


@contextlib.contextmanager
def autocast(enabled: bool = False, recipe: Recipe | None = None) -> Iterator[None]:
    """Sets the recipe that ops and modules without an explicit recipe use.

    The recipe is read while a function is traced, so the context must be active around
    ``init``/``apply`` (or the traced step), not merely around a call of an already compiled
    function. Contexts nest; leaving one restores the recipe that was active before.

    Args:
      enabled: whether FP8 is on inside the context (default False, as in TransformerEngine).
      recipe: the recipe to use when enabled; None means ``DelayedScaling()``.

    Example usage::

      >>> import te_flax
      >>> from te_flax.quantize import Float8CurrentScaling, get_autocast_recipe
      >>> with te_flax.autocast(enabled=True, recipe=Float8CurrentScaling()):
      ...     print(type(get_autocast_recipe()).__name__)
      Float8CurrentScaling
      >>> print(get_autocast_recipe())
      None
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"autocast(enabled=...) must be a bool, got {enabled!r}")
    if enabled:
        recipe = DelayedScaling() if recipe is None else recipe
        check_recipe(recipe, "autocast(recipe=...)")
    token = _ACTIVE_RECIPE.set(recipe if enabled else None)
    try:
        yield
    finally:
        _ACTIVE_RECIPE.reset(token)


def get_autocast_recipe() -> Recipe | None:
    """The recipe of the innermost enabled ``autocast`` context, or None outside of one."""
    return _ACTIVE_RECIPE.get()
