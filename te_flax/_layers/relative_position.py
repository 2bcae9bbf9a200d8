"""``RelativePositionBiases``' description: T5's learned relative position bias (TE's attributes).

The bucketing is ``te_flax.attention.relative_position_buckets``; the table is the one parameter
``rel_embedding [heads, buckets]``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import Array

from te_flax import attention as attn
from te_flax._layers.base import Initializer, ParamRecord, param
from te_flax._layers.composite import REQUIRED, positive_int
from te_flax._layers.host import Layer

__all__ = ["EMBED_INIT", "RelativePositionBiasesDescription"]

# Flax's default_embed_init, TE's default for the relative position table.
EMBED_INIT = jax.nn.initializers.variance_scaling(1.0, "fan_in", "normal", out_axis=0)


@dataclasses.dataclass
class RelativePositionBiasesDescription(Layer):
    """T5's learned relative position bias: ``rel_embedding[heads, buckets]`` looked up."""

    num_buckets: int = REQUIRED
    max_distance: int = REQUIRED
    num_attention_heads: int = REQUIRED
    embedding_init: Initializer = EMBED_INIT
    embedding_axes: tuple[str | None, ...] = ("heads", "relpos_buckets")
    dtype: Any = None
    param_dtype: Any = jnp.float32

    def shape(self) -> tuple[int, int]:
        positive_int(self.num_buckets, "num_buckets")
        positive_int(self.max_distance, "max_distance")
        return (positive_int(self.num_attention_heads, "num_attention_heads"), self.num_buckets)

    def param_records(self) -> list[ParamRecord]:
        """The table ``rel_embedding [heads, buckets]``."""
        return [param("rel_embedding", self.shape(), self.embedding_init, self.embedding_axes)]

    def __call__(self, q_seqlen: int, k_seqlen: int, bidirectional: bool = True) -> Array:
        """``[1, num_attention_heads, q_seqlen, k_seqlen]`` biases."""
        (table,) = self.param_records()
        return self.forward(self.host().param(table), q_seqlen, k_seqlen, bidirectional)

    def forward(
        self, embedding: Array, q_seqlen: int, k_seqlen: int, bidirectional: bool = True
    ) -> Array:
        """``[1, heads, q_seqlen, k_seqlen]`` biases from the table ``embedding``."""
        buckets = attn.relative_position_buckets(
            q_seqlen, k_seqlen, self.num_buckets, self.max_distance, bidirectional
        )  # [q, k] static
        dtype = self.dtype or embedding.dtype
        return jnp.take(embedding.astype(dtype), jnp.asarray(buckets), axis=1)[None]
