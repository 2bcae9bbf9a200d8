"""TransformerEngine's ``score_mod`` callbacks on the XLA attention's float32 scores.

``score_mod(score, tensors)`` modifies the scaled scores ``[batch, heads, q_len, kv_len]``
before the bias and the masks; ``score_mod_bprop(grad, tensors)``, if given, is its backward
(else autodiff differentiates ``score_mod``). TE's callbacks build a cuDNN graph
(``score_mod(graph, score, tensors)``); these are the same functions on ``jax.Array`` s.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array, lax

__all__ = ["ScoreMod", "score_modifier"]

# score_mod(score, tensors) -> modified score; score_mod_bprop(grad, tensors) -> grad of score.
ScoreMod = Callable[[Array, dict[str, Any]], Array]


def score_modifier(
    score_mod: object,
    score_mod_bprop: object,
    score_mod_tensors: Mapping[str, Any] | None,
    score_mod_bprop_tensors: Mapping[str, Any] | None,
) -> Callable[[Array], Array] | None:
    """The float32 scores -> modified scores, with ``score_mod_bprop`` as its backward.

    Args:
      score_mod: ``score_mod(score, tensors)`` or None (no modification; then the other three
        must be None too).
      score_mod_bprop: ``score_mod_bprop(grad, tensors)`` or None (autodiff of ``score_mod``).
      score_mod_tensors, score_mod_bprop_tensors: dicts of arrays or numbers handed to the two
        callbacks (default empty); no gradient flows into them (as in TE).

    Returns:
      A function of the scores, or None without ``score_mod``.
    """
    if score_mod is None:
        given = [
            name
            for name, value in (
                ("score_mod_bprop", score_mod_bprop),
                ("score_mod_tensors", score_mod_tensors),
                ("score_mod_bprop_tensors", score_mod_bprop_tensors),
            )
            if value is not None
        ]
        if given:
            raise ValueError(f"{', '.join(given)} given without score_mod; pass score_mod too")
        return None
    _check_callback(score_mod, "score_mod", "score, tensors")
    tensors = _tensors(score_mod_tensors, "score_mod_tensors")
    forward = cast(ScoreMod, score_mod)
    if score_mod_bprop is None:
        return lambda score: _modified(forward, score, tensors)
    _check_callback(score_mod_bprop, "score_mod_bprop", "grad, tensors")
    callbacks = _Callbacks(forward, cast(ScoreMod, score_mod_bprop))
    bprop_tensors = _tensors(score_mod_bprop_tensors, "score_mod_bprop_tensors")
    return lambda score: _modified_with_bprop(
        callbacks, _ScoreInputs(score, tensors, bprop_tensors)
    )


def _check_callback(callback: object, name: str, arguments: str) -> None:
    """Raises a clear error unless ``callback`` can be called as ``name(<arguments>)``."""
    if not callable(callback):
        raise TypeError(f"{name} must be a function {name}({arguments}) or None, got {callback!r}")
    try:
        signature = inspect.signature(callback)
    except (TypeError, ValueError):  # a builtin without a signature: trust it
        return
    try:
        signature.bind(*arguments.split(", "))
    except TypeError:
        raise TypeError(
            f"{name} must take two arguments, {name}({arguments}), and return the float32 "
            f"scores' {'gradient' if 'grad' in arguments else 'modification'}, but its "
            f"signature is {name}{signature}. TransformerEngine's callbacks build a cuDNN graph "
            f"({name}(graph, ...)); in te_flax write the same function on jax.Arrays, without "
            "the graph (e.g. graph.mul(score, t['s']) becomes score * t['s'])"
        ) from None


def _tensors(tensors: Mapping[str, Any] | None, name: str) -> dict[str, Any]:
    if tensors is None:
        return {}
    if not isinstance(tensors, Mapping):
        raise TypeError(f"{name} must be a dict of arrays or numbers, or None, got {tensors!r}")
    # As in TE, the tensors are auxiliary inputs: no gradient flows into them.
    return {k: lax.stop_gradient(jnp.asarray(v)) for k, v in tensors.items()}


def _modified(score_mod: ScoreMod, score: Array, tensors: dict[str, Any]) -> Array:
    modified = jnp.asarray(score_mod(score, tensors))
    if modified.shape != score.shape:
        raise ValueError(
            f"score_mod must return scores of the shape it was given, {score.shape} ([batch, "
            f"heads, q_len, kv_len]), got {modified.shape}"
        )
    return modified.astype(jnp.float32)


class _Callbacks(NamedTuple):
    """The custom VJP's static argument: the forward and backward callbacks."""

    score_mod: ScoreMod
    score_mod_bprop: ScoreMod


class _ScoreInputs(NamedTuple):
    """The custom VJP's differentiated argument: the scores and both callbacks' tensors."""

    score: Array
    tensors: dict[str, Any]
    bprop_tensors: dict[str, Any]


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _modified_with_bprop(callbacks: _Callbacks, inputs: _ScoreInputs) -> Array:
    return _modified(callbacks.score_mod, inputs.score, inputs.tensors)


def _modified_forward(callbacks: _Callbacks, inputs: _ScoreInputs) -> tuple[Array, _ScoreInputs]:
    return _modified_with_bprop(callbacks, inputs), inputs


def _modified_backward(
    callbacks: _Callbacks, inputs: _ScoreInputs, grad: Array
) -> tuple[_ScoreInputs]:
    score, tensors, bprop_tensors = inputs
    # cuDNN builds the forward modification again before the backward one: a callable object
    # may keep what its backward needs (XLA drops the recomputation when nothing reads it).
    _modified(callbacks.score_mod, score, tensors)
    d_score = jnp.asarray(callbacks.score_mod_bprop(grad, bprop_tensors))
    if d_score.shape != score.shape:
        raise ValueError(
            f"score_mod_bprop must return the scores' gradient, of shape {score.shape}, got "
            f"{d_score.shape}"
        )
    d_score = d_score.astype(jnp.float32)
    return (_ScoreInputs(d_score, _no_gradient(tensors), _no_gradient(bprop_tensors)),)


def _no_gradient(tree: dict[str, Any]) -> dict[str, Any]:
    def zero(value: Array) -> Array | np.ndarray:
        if jnp.issubdtype(value.dtype, jnp.inexact):
            return jnp.zeros_like(value)
        return np.zeros(value.shape, jax.dtypes.float0)

    return {name: zero(value) for name, value in tree.items()}


_modified_with_bprop.defvjp(_modified_forward, _modified_backward)
