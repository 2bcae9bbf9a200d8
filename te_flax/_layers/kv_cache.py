"""The autoregressive decoding cache of ``MultiHeadAttention``: keys, values, next position.

The shells own the variables (Linen's ``"cache"`` collection, NNX ``nnx.Cache``: ``cached_key``,
``cached_value``, ``cache_index``) and hand them to the attention as ``CacheSlots``; this module
checks a decoding step against them and writes the step's key and value in.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax.numpy as jnp
from jax import Array, lax

__all__ = ["CacheSlots", "check_step", "write_step"]


class CacheSlots(NamedTuple):
    """The decoding cache: keys, values and the next position, each read and set as ``.value``."""

    key: Any
    value: Any
    index: Any


def check_step(slots: CacheSlots, key: Array) -> Array:
    """The position of this decoding step (one token per sequence), checked against the cache."""
    cached = slots.key.value.shape  # [batch, max_length, groups, head_dim]
    if key.shape != (cached[0], 1, *cached[2:]):
        raise ValueError(
            f"a decoding step takes one token per sequence: expected keys of shape "
            f"{(cached[0], 1, *cached[2:])} for the cache {cached}, got {key.shape}"
        )
    return slots.index.value.astype(jnp.int32)


def write_step(
    slots: CacheSlots, key: Array, value: Array, bias: Array | None, index: Array
) -> tuple[Array, Array, Array | None]:
    """Writes this token's key and value at ``index``; returns everything cached so far."""
    zero = jnp.zeros((), jnp.int32)
    start = (zero, index, zero, zero)
    slots.key.value = lax.dynamic_update_slice(slots.key.value, key, start)
    slots.value.value = lax.dynamic_update_slice(slots.value.value, value, start)
    slots.index.value = slots.index.value + 1
    length = slots.key.value.shape[1]
    if bias is not None and bias.shape[-2] == length:
        # A [..., length, length] bias (relative positions): this query's row.
        bias = lax.dynamic_slice_in_dim(bias, index, 1, axis=-2)
    return slots.key.value, slots.value.value, bias
