"""Converting variable trees between TransformerEngine's Linen layout and te_flax's.

Parameters have the same names and shapes in both and are copied. FP8 state differs:

* TE keeps it in the ``fp8_metas`` collection as ``{x,kernel,grad}{postfix}_scale`` (the
  quantization multiplier, ``fp8_max / amax``) and ``..._amax_history``, stored after TE's
  update as ``[0, a(t-L+2), ..., a(t-1), a(t)]`` (oldest first, slot 0 cleared for the next step).
* te_flax keeps it in ``_overwrite_with_gradient`` as ``..._scale_inv`` (the dequantization
  scale, ``1 / scale``) and ``..._amax_history`` newest first, ``[a(t), a(t-1), ..., a(t-L+1)]``.

Both layouts give the next step the same scale and the same window of L amax values; the one
value te_flax keeps beyond TE (its oldest entry) is dropped by the next update anyway, and comes
back from TE as 0. ``scale_inv = 1 / scale`` is rounded to float32 (within one ulp).

Example usage::

  >>> import jax.numpy as jnp
  >>> from te_flax.convert import from_transformer_engine
  >>> te_tree = {"params": {"kernel": jnp.ones((2, 2))},
  ...            "fp8_metas": {"x_scale": jnp.array([4.0]),
  ...                          "x_amax_history": jnp.array([0.0, 1.0, 3.0])}}
  >>> ours = from_transformer_engine(te_tree)
  >>> fp8 = ours["_overwrite_with_gradient"]
  >>> fp8["x_amax_history"], fp8["x_scale_inv"]
  (Array([3., 1., 0.], dtype=float32), Array([0.25], dtype=float32))
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax.numpy as jnp
from jax import Array
from jax.typing import ArrayLike

from te_flax._fp8_state import OVERWRITE_WITH_GRADIENT

__all__ = ["TE_FP8_COLLECTION", "from_transformer_engine", "to_transformer_engine"]

TE_FP8_COLLECTION = "fp8_metas"
_HISTORY, _TE_SCALE, _SCALE_INV = "_amax_history", "_scale", "_scale_inv"
# A variable tree: collection -> nested mapping of arrays.
_Tree = Mapping[str, Any]
_LeafConverter = Callable[[str, Any], tuple[str, Any]]


def _history_from_te(history: ArrayLike) -> Array:
    history = jnp.asarray(history, jnp.float32)
    # TE: [0, oldest, ..., newest] -> te_flax: [newest, ..., oldest, 0]
    return jnp.concatenate([history[1:][::-1], jnp.zeros((1,), jnp.float32)])


def _history_to_te(history: ArrayLike) -> Array:
    history = jnp.asarray(history, jnp.float32)
    # te_flax: [newest, ..., oldest kept] -> TE: [0, ..., newest] (TE's slot 0 is cleared)
    return jnp.concatenate([jnp.zeros((1,), jnp.float32), history[:-1][::-1]])


def _convert_leaves(tree: _Tree, convert: _LeafConverter) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            out[key] = _convert_leaves(value, convert)
        else:
            new_key, new_value = convert(key, value)
            out[new_key] = new_value
    return out


def _check_history(name: str, value: ArrayLike) -> None:
    if jnp.ndim(value) != 1 or jnp.size(value) < 1:
        raise ValueError(
            f"FP8 variable {name!r} has shape {jnp.shape(value)}, but an amax history is 1-D "
            "[amax_history_len]; pass the variable dict as the model stores it"
        )


def _from_te_leaf(name: str, value: ArrayLike) -> tuple[str, Array]:
    if name.endswith(_HISTORY):
        _check_history(name, value)
        return name, _history_from_te(value)
    if name.endswith(_TE_SCALE):
        scale = jnp.asarray(value, jnp.float32)
        return name[: -len(_TE_SCALE)] + _SCALE_INV, 1.0 / scale
    raise ValueError(
        f"unexpected FP8 variable {name!r} in {TE_FP8_COLLECTION!r}: TE's delayed-scaling state "
        f"has only '*{_TE_SCALE}' and '*{_HISTORY}' variables"
    )


def _to_te_leaf(name: str, value: ArrayLike) -> tuple[str, Array]:
    if name.endswith(_HISTORY):
        _check_history(name, value)
        return name, _history_to_te(value)
    if name.endswith(_SCALE_INV):
        scale_inv = jnp.asarray(value, jnp.float32)
        return name[: -len(_SCALE_INV)] + _TE_SCALE, 1.0 / scale_inv
    raise ValueError(
        f"unexpected FP8 variable {name!r} in {OVERWRITE_WITH_GRADIENT!r}: te_flax's FP8 state "
        f"has only '*{_SCALE_INV}' and '*{_HISTORY}' variables"
    )


def _convert(variables: _Tree, source: str, target: str, convert: _LeafConverter) -> dict[str, Any]:
    if not isinstance(variables, Mapping):
        raise TypeError(
            f"variables must be a mapping of collections, got {type(variables)}; pass the whole "
            "variable dict, e.g. {'params': ..., 'fp8_metas': ...}"
        )
    if target in variables:
        raise ValueError(
            f"variables already hold a {target!r} collection; nothing to convert into (the tree "
            "is already converted: pass it as it is)"
        )
    if "params" not in variables and source not in variables:
        raise ValueError(
            f"variables hold neither 'params' nor {source!r} (got {sorted(variables)}); pass the "
            f"whole variable dict, e.g. {{'params': ..., {source!r}: ...}}, not one collection"
        )
    out = {name: tree for name, tree in variables.items() if name != source}
    if source in variables:
        out[target] = _convert_leaves(variables[source], convert)
    return out


def from_transformer_engine(variables: Mapping[str, Any]) -> dict[str, Any]:
    """A TE Linen variable tree (``params`` + ``fp8_metas``) as a te_flax one.

    Collections other than ``fp8_metas`` are copied unchanged.
    """
    return _convert(variables, TE_FP8_COLLECTION, OVERWRITE_WITH_GRADIENT, _from_te_leaf)


def to_transformer_engine(variables: Mapping[str, Any]) -> dict[str, Any]:
    """A te_flax variable tree (``params`` + ``_overwrite_with_gradient``) as a TE Linen one."""
    return _convert(variables, OVERWRITE_WITH_GRADIENT, TE_FP8_COLLECTION, _to_te_leaf)
