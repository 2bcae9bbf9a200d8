"""Moving variables between a te_flax Linen variable tree and an NNX module's state.

The two front ends name everything the same, so the conversion is a copy: ``params`` <->
``nnx.Param`` and ``_overwrite_with_gradient`` <-> ``Fp8Meta``, nested by submodule name.

Example usage::

  >>> import jax, jax.numpy as jnp
  >>> from flax import nnx
  >>> import te_flax.linen as te_nn, te_flax.nnx as te_nnx
  >>> x = jnp.ones((2, 8))
  >>> variables = te_nn.DenseGeneral(features=4).init(jax.random.key(0), x)
  >>> layer = te_nnx.DenseGeneral(8, 4, rngs=nnx.Rngs(1))
  >>> te_nnx.load_linen_variables(layer, variables)
  >>> bool(jnp.all(layer(x) == te_nn.DenseGeneral(features=4).apply(variables, x)))
  True
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
from flax import nnx

from te_flax.nnx._fp8_meta import Fp8Meta
from te_flax.quantize.state import OVERWRITE_WITH_GRADIENT

__all__ = ["linen_variables", "load_linen_variables"]

_COLLECTIONS = (("params", nnx.Param), (OVERWRITE_WITH_GRADIENT, Fp8Meta))


def linen_variables(module: nnx.Module) -> dict[str, Any]:
    """The module's parameters and FP8 state as a Linen variable dict (plain arrays)."""
    out: dict[str, Any] = {}
    for collection, variable_type in _COLLECTIONS:
        tree = nnx.to_pure_dict(nnx.state(module, variable_type))
        if tree:
            out[collection] = tree
    return out


def _paths(tree: Any) -> set[str]:
    return {jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(tree)}


def load_linen_variables(module: nnx.Module, variables: Mapping[str, Any]) -> None:
    """Sets the module's parameters and FP8 state from a Linen variable dict, in place.

    The dict must hold exactly the module's variables (same names and shapes); boxed
    (logically partitioned) Linen parameters are unboxed.
    """
    variables = nn.meta.unbox(variables)
    # Everything is checked before anything is written: a refused load changes nothing.
    states = []
    for collection, variable_type in _COLLECTIONS:
        state = nnx.state(module, variable_type)
        tree = variables.get(collection, {})
        current = nnx.to_pure_dict(state)
        expected, given = _paths(current), _paths(tree)
        if expected != given:
            raise ValueError(
                f"the {collection!r} collection does not fit {type(module).__name__}: missing "
                f"{sorted(expected - given)}, unexpected {sorted(given - expected)}; pass the "
                "variables of the Linen module with the same attributes and input features"
            )
        for (path, new), (_, old) in zip(
            jax.tree_util.tree_leaves_with_path(tree),
            jax.tree_util.tree_leaves_with_path(current),
            strict=True,
        ):
            if new.shape != old.shape:
                raise ValueError(
                    f"{collection}{jax.tree_util.keystr(path)} has shape {new.shape} but the "
                    f"module's has {old.shape}"
                )
        states.append((state, tree))
    for state, tree in states:
        nnx.replace_by_pure_dict(state, tree)
        nnx.update(module, state)
