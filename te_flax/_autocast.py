"""``fp8_autocast``: TransformerEngine's deprecated spelling of ``te_flax.autocast``
(``te_flax.quantize.autocast``, which takes TE's ``mesh_resource`` too)."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

from te_flax.quantize import Recipe, autocast
from te_flax.sharding import MeshResource

__all__ = ["autocast", "fp8_autocast"]


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
