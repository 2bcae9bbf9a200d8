"""Memory figures: XLA's compiled temporary memory and the residuals saved for the backward.

Residuals are read from ``jax.vjp`` of the (jitted) layer forward: the arrays its pullback
closes over are exactly what the forward keeps alive for the backward. They are classified by
identity against the inputs: the parameters and FP8 state are alive during a step whatever the
layer saves, so the headline figure counts the other residuals (``activations``: the layer
input and everything computed from it); the total is reported beside it.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np
from flax.linen.fp8_ops import OVERWRITE_WITH_GRADIENT

__all__ = ["compiled_memory", "saved_residuals"]


def _nbytes(leaf) -> int:
    return int(np.prod(leaf.shape)) * leaf.dtype.itemsize


def saved_residuals(apply: Callable, variables: dict, x: jax.Array) -> tuple[jax.Array, dict]:
    """The output of ``apply(variables, x)`` and the bytes its forward saves for the backward.

    The byte counts, by kind: ``activations`` (the residuals that are not parameters or FP8
    state), ``params``, ``fp8_state``, ``total`` (each array counted once), and ``count``
    (number of arrays).
    """
    out, pullback = jax.vjp(jax.jit(apply), variables, x)
    kinds = {}
    for leaf in jax.tree.leaves(variables.get("params", {})):
        kinds[id(leaf)] = "params"
    for leaf in jax.tree.leaves(variables.get(OVERWRITE_WITH_GRADIENT, {})):
        kinds[id(leaf)] = "fp8_state"
    totals = {"activations": 0, "params": 0, "fp8_state": 0}
    seen = set()
    for leaf in jax.tree.leaves(pullback):
        if not hasattr(leaf, "dtype") or id(leaf) in seen:
            continue
        seen.add(id(leaf))
        totals[kinds.get(id(leaf), "activations")] += _nbytes(leaf)
    totals["total"] = sum(totals.values())
    totals["count"] = len(seen)
    return out, totals


def compiled_memory(compiled) -> dict[str, int]:
    """``compiled.memory_analysis()`` as a dict of byte counts (temp, arguments, outputs...)."""
    analysis = compiled.memory_analysis()
    return {
        "temp": int(analysis.temp_size_in_bytes),
        "argument": int(analysis.argument_size_in_bytes),
        "output": int(analysis.output_size_in_bytes),
        "alias": int(analysis.alias_size_in_bytes),
    }
