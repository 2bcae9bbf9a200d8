"""Scoped settings: the one mechanism behind every ``with`` block that changes how te_flax traces.

``autocast`` (the default recipe), ``global_shard_guard`` (the ``MeshResource``),
``pallas_kernels`` (the kernel mode), ``hold_fp8_state`` and ``distinct_over`` (the mesh axes
whose amaxes stay apart) each set a value for the code traced inside them. Each is a
``ScopedSetting``, so they all behave alike:

- Contexts nest, and leaving one restores the value that was active before it (also when the
  block raises).
- The value is part of ``jax.jit``'s cache key: a ``ScopedSetting`` is a
  ``jax.make_user_context``. A function jitted outside a block and called inside it is traced
  again for the block's value, rather than silently reusing the program traced for another one
  (a module-level stack, a ``ContextVar`` or a ``threading.local`` is invisible to the cache,
  so a jitted step would keep the recipe, the kernels or the sharding of its first call).
- Each thread sees its own value (JAX's configuration contexts are thread-local).

Values must be hashable (they are compared as part of the cache key): the recipes, the
``MeshResource`` and frozensets are.
"""

from __future__ import annotations

import contextlib
from collections.abc import Hashable, Iterator
from typing import Generic, TypeVar, cast

import jax

__all__ = ["ScopedSetting"]

T = TypeVar("T")


class ScopedSetting(Generic[T]):
    """A value set for the code traced inside ``with setting.scope(value):``, and part of
    ``jax.jit``'s cache key.

    Create one per setting at module level (JAX's contexts must not be created while other
    threads use JAX).

    Example usage::

      >>> import jax, jax.numpy as jnp
      >>> from te_flax._base.settings import ScopedSetting
      >>> scale = ScopedSetting("scale", default=1.0)
      >>> @jax.jit
      ... def f(x):
      ...     return x * scale.value
      >>> float(f(jnp.ones(())))
      1.0
      >>> with scale.scope(3.0):  # traced again: the value is part of the cache key
      ...     float(f(jnp.ones(())))
      3.0
      >>> scale.value
      1.0
    """

    def __init__(self, name: str, default: T) -> None:
        self.name = name
        self.default = default
        self._context = jax.make_user_context(default_value=default)

    @property
    def value(self) -> T:
        """The value of the innermost active ``scope``, else the default."""
        return cast(T, self._context.value)

    @contextlib.contextmanager
    def scope(self, value: T) -> Iterator[None]:
        """Makes ``value`` the setting's value inside the context."""
        if not isinstance(value, Hashable):
            raise TypeError(
                f"the {self.name} setting takes a hashable value (it is part of jax.jit's cache "
                f"key), got {value!r} of type {type(value).__name__}"
            )
        with self._context(value):
            yield

    def __repr__(self) -> str:
        return f"ScopedSetting({self.name!r}, value={self.value!r})"
