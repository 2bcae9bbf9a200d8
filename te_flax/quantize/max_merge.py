"""Merging FP8 state updates by elementwise max when one state is used more than once.

The ops return a quantizer's new state as its cotangent. When one state feeds several uses in
one differentiated function (a layer applied twice, a ``lax.scan`` over microbatches, state
broadcast over ``nn.scan``), autodiff adds the uses' cotangents, which would sum amax histories
and scales. The right merge is the elementwise max: the merged history's newest entry is the
largest amax of any use, and the merged ``scale_inv`` the largest (most cautious) scale.

``merge_by_max`` converts float32 state to Flax's ``fp32_max_grad`` dtype, whose cotangents
autodiff accumulates with max; the ops convert it back to float32 where they read it. The
differentiated function must be jitted: JAX adds extended-dtype cotangents only when tracing.
"""

from __future__ import annotations

from typing import TypeVar

import jax
import jax.numpy as jnp
from flax.linen.fp8_ops import fp32_max_grad
from jax import Array, lax

__all__ = ["float32_state", "merge_by_max"]

T = TypeVar("T")


@jax.custom_vjp
def _to_max_merged(state: Array) -> Array:
    return lax.convert_element_type(state, fp32_max_grad)


def _to_max_merged_fwd(state: Array) -> tuple[Array, Array]:
    return _to_max_merged(state), state


def _to_max_merged_bwd(state: Array, merged_update: Array) -> tuple[Array]:
    update = lax.convert_element_type(merged_update, jnp.float32)
    # The zero of fp32_max_grad is -inf: a state that no use updated keeps its value instead of
    # being overwritten with -inf.
    return (jnp.where(update == -jnp.inf, state, update),)


_to_max_merged.defvjp(_to_max_merged_fwd, _to_max_merged_bwd)


@jax.custom_vjp
def _from_max_merged(state: Array) -> Array:
    return lax.convert_element_type(state, jnp.float32)


def _from_max_merged_fwd(state: Array) -> tuple[Array, None]:
    return _from_max_merged(state), None


def _from_max_merged_bwd(_: None, update: Array) -> tuple[Array]:
    return (lax.convert_element_type(update, fp32_max_grad),)


_from_max_merged.defvjp(_from_max_merged_fwd, _from_max_merged_bwd)


def _is_max_merged(leaf: object) -> bool:
    return hasattr(leaf, "dtype") and leaf.dtype == fp32_max_grad


def merge_by_max(state: T) -> T:
    """Marks FP8 state so that the updates of all its uses merge by elementwise max.

    Call it where a differentiated (and jitted) function reads the state, before the state
    fans out to its uses (outside any ``lax.scan`` / ``nn.scan`` that reads it: inside a scan
    body the per-iteration updates would already have been added up); pass the result to the
    ops as usual. The gradient with respect to the original float32 state is then the
    max-merged new state. A state that no op reads gets a zero gradient (JAX never calls the
    backward of an unused value); ``te_flax.training.apply_gradients`` keeps such states.

    Args:
      state: a ``QuantizerSet`` or any pytree of them (float32 leaves).

    Returns:
      The same pytree with its leaves in the ``fp32_max_grad`` dtype.

    Example usage::

      >>> import jax, jax.numpy as jnp
      >>> from te_flax.dense import dense
      >>> from te_flax.quantize import DelayedScaling, QuantizerFactory, merge_by_max
      >>> qs = QuantizerFactory.create_set(fp8_recipe=DelayedScaling(amax_history_len=4))
      >>> kernel = jnp.ones((2, 2))
      >>> def loss(qs):
      ...     qs = merge_by_max(qs)
      ...     small = dense(jnp.full((1, 2), 3.0), kernel, quantizer_set=qs)
      ...     large = dense(jnp.full((1, 2), 5.0), kernel, quantizer_set=qs)
      ...     return jnp.sum(small + large)
      >>> jax.jit(jax.grad(loss))(qs).x.amax_history
      Array([5., 0., 0., 0.], dtype=float32)

    Marking is idempotent: leaves already marked pass through, so state marked at the top of a
    step stays marked when a module marks what it reads again. Leaves that are not float32
    (the RNG key of stochastic rounding) are not state and pass through too.
    """

    def mark(leaf: Array) -> Array:
        if _is_max_merged(leaf) or jnp.dtype(leaf.dtype) != jnp.float32:
            return leaf
        return _to_max_merged(leaf)

    return jax.tree.map(mark, state)


def float32_state(state: T) -> T:
    """The inverse of ``merge_by_max`` for the ops: float32 leaves, max-merging cotangents.

    Leaves that are already float32 pass through unchanged.
    """

    def to_float32(leaf: Array) -> Array:
        return _from_max_merged(leaf) if _is_max_merged(leaf) else leaf

    return jax.tree.map(to_float32, state)
