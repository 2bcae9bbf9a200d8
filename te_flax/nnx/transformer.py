"""TransformerEngine's attention and transformer layers, NNX style.

The same layers as ``te_flax.linen``'s (which documents the attributes), built once at
construction from the same descriptions, with the same submodule and variable names, so that
``te_flax.nnx.load_linen_variables`` moves a Linen variable tree in and the outputs agree bit
for bit. Sizes the Linen modules read from their inputs are given at construction:
``MultiHeadAttention(in_features, head_dim, num_attention_heads, in_kv_features=None)``
(``in_kv_features=None`` builds self-attention, with the fused ``qkv`` kernel), while
``TransformerLayer`` reads ``hidden_size``. Dropout draws from ``rngs``' ``dropout_rng_name``
stream (default ``"dropout"``). For autoregressive decoding, call ``init_cache(batch_size,
max_length)`` first; the cache is ``nnx.Cache`` variables (``cached_key``, ``cached_value``,
``cache_index``), as in Linen's ``"cache"`` collection.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from flax import nnx
from jax import Array

# The sublayers' modules, registered with the shell as they are defined.
import te_flax.nnx.modules
import te_flax.nnx.moe  # noqa: F401
from te_flax._layers.attention import (
    DotProductAttentionDescription,
    MultiHeadAttentionDescription,
    RelativePositionBiasesDescription,
)
from te_flax._layers.base import ParamRecord
from te_flax._layers.transformer import TransformerLayerDescription, TransformerLayerType
from te_flax._ops.fp8_attention import FP8_ATTENTION_POSTFIXES
from te_flax.nnx._fp8_meta import create_fp8_variables
from te_flax.nnx._shell import NnxShell, build_children, create_param, set_attributes

__all__ = [
    "DotProductAttention",
    "MultiHeadAttention",
    "RelativePositionBiases",
    "TransformerLayer",
    "TransformerLayerType",
]


def _own_params(module: nnx.Module, records: list[ParamRecord], rngs: nnx.Rngs) -> None:
    """The attention's own parameters (the learned sink, float32), as the Linen host's."""
    for record in records:
        setattr(module, record.name, create_param(record, rngs, jnp.float32))


def _own_fp8_attention_state(
    module: nnx.Module, description: DotProductAttentionDescription
) -> None:
    """FP8 attention's delayed-scaling state (``Fp8Meta``), as the Linen host's variables."""
    for postfix in FP8_ATTENTION_POSTFIXES:
        create_fp8_variables(module, description.fp8_recipe(), postfix)


def _dropout_rngs(rate: float, stream: str, rngs: nnx.Rngs) -> nnx.RngStream | None:
    """A fork of the dropout stream when attention dropout is on (else None)."""
    return rngs[stream].fork() if rate > 0 else None


class DotProductAttention(NnxShell, DotProductAttentionDescription):
    """Scaled dot-product attention (``te_flax.linen.DotProductAttention``, NNX style).

    Example usage::

      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> import te_flax.nnx as te_nnx
      >>> dpa = te_nnx.DotProductAttention(16, 4, transpose_batch_sequence=False,
      ...                                  rngs=nnx.Rngs(0))
      >>> x = jnp.ones((2, 8, 4, 16))
      >>> dpa(x, x, x).shape
      (2, 8, 4, 16)
    """

    def __init__(
        self, head_dim: int, num_attention_heads: int, *, rngs: nnx.Rngs, **attributes: Any
    ):
        attributes = dict(attributes, head_dim=head_dim, num_attention_heads=num_attention_heads)
        set_attributes(self, DotProductAttentionDescription, attributes, rngs)
        self.check()
        _own_params(self, self.param_records(), rngs)
        _own_fp8_attention_state(self, self)
        self.dropout_rngs = _dropout_rngs(self.attention_dropout, self.dropout_rng_name, rngs)


class MultiHeadAttention(NnxShell, MultiHeadAttentionDescription):
    """Norm, projections, attention, output (``te_flax.linen.MultiHeadAttention``, NNX style).

    ``in_features`` is the hidden size of ``inputs_q``; ``in_kv_features`` that of
    ``inputs_kv`` for cross-attention (None: self-attention, called with ``inputs_kv`` the
    same array as ``inputs_q``). Returns ``(out, ln_output or None)``.

    Example usage::

      >>> import jax, jax.numpy as jnp
      >>> from flax import nnx
      >>> import te_flax.nnx as te_nnx
      >>> mha = te_nnx.MultiHeadAttention(32, 8, 4, transpose_batch_sequence=False,
      ...                                 rngs=nnx.Rngs(0))
      >>> x = jnp.ones((2, 6, 32))
      >>> mha(x, x)[0].shape
      (2, 6, 32)
      >>> jax.tree.map(jnp.shape, nnx.to_pure_dict(nnx.state(mha, nnx.Param)))["qkv"]
      {'kernel': (32, 3, 32), 'ln_bias': (32,), 'scale': (32,)}
    """

    def __init__(
        self,
        in_features: int,
        head_dim: int,
        num_attention_heads: int,
        *,
        in_kv_features: int | None = None,
        rngs: nnx.Rngs,
        **attributes: Any,
    ):
        attributes = dict(attributes, head_dim=head_dim, num_attention_heads=num_attention_heads)
        set_attributes(self, MultiHeadAttentionDescription, attributes, rngs)
        self.in_kv_features = in_kv_features
        children = self.children(in_features, in_kv_features is None)
        for name in ("kv", "key", "value"):
            if name in children:
                children[name] = children[name]._replace(in_features=in_kv_features or in_features)
        build_children(self, children, rngs)
        _own_params(self, self.param_records(), rngs)
        _own_fp8_attention_state(self, self._attention())
        self.dropout_rngs = _dropout_rngs(self.attention_dropout, self.dropout_rng_name, rngs)

    def is_self_attention(self, inputs_q: Array, inputs_kv: Array) -> bool:
        """What the module was built for (``in_kv_features=None``: self-attention, called with
        ``inputs_kv`` the same array as ``inputs_q``)."""
        if self.in_kv_features is None and inputs_kv is not inputs_q:
            raise ValueError(
                "this MultiHeadAttention was built for self-attention (in_kv_features=None): "
                "call it with inputs_kv the same array as inputs_q, or build it with "
                "in_kv_features=<hidden size of inputs_kv> for cross-attention"
            )
        return self.in_kv_features is None

    def init_cache(self, batch_size: int, max_length: int, dtype: Any = jnp.float32) -> None:
        """Zeroed keys and values ``[batch_size, max_length, groups, head_dim]`` for decoding.

        ``dtype`` is the compute dtype of the keys (the module's ``dtype``, else the input's).
        """
        shape = (batch_size, max_length, self.groups, self.head_dim)
        self.cached_key = nnx.Cache(jnp.zeros(shape, dtype))
        self.cached_value = nnx.Cache(jnp.zeros(shape, dtype))
        self.cache_index = nnx.Cache(jnp.zeros((), jnp.int32))


class RelativePositionBiases(NnxShell, RelativePositionBiasesDescription):
    """T5 relative position biases (``te_flax.linen.RelativePositionBiases``, NNX style).

    Example usage::

      >>> from flax import nnx
      >>> import te_flax.nnx as te_nnx
      >>> rpb = te_nnx.RelativePositionBiases(32, 128, 4, rngs=nnx.Rngs(0))
      >>> rpb(6, 6).shape, rpb.rel_embedding[...].shape
      ((1, 4, 6, 6), (4, 32))
    """

    def __init__(
        self,
        num_buckets: int,
        max_distance: int,
        num_attention_heads: int,
        *,
        rngs: nnx.Rngs,
        **attributes: Any,
    ):
        attributes = dict(
            attributes,
            num_buckets=num_buckets,
            max_distance=max_distance,
            num_attention_heads=num_attention_heads,
        )
        set_attributes(self, RelativePositionBiasesDescription, attributes, rngs)
        (table,) = self.param_records()
        self.rel_embedding = create_param(table, rngs, self.param_dtype)


class TransformerLayer(NnxShell, TransformerLayerDescription):
    """TE's transformer layer (``te_flax.linen.TransformerLayer``, NNX style).

    Built from its attributes and the input sizes: ``in_features`` (None: ``hidden_size``)
    and, for a DECODER's cross-attention, ``encoded_features`` (None: ``in_features``). As in
    TE, ``hidden_size`` sets the attention width (``head_dim = hidden_size /
    num_attention_heads``) while the output projection and the MLP return ``in_features``.

    Example usage::

      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> import te_flax.nnx as te_nnx
      >>> layer = te_nnx.TransformerLayer(hidden_size=32, mlp_hidden_size=64,
      ...                                 num_attention_heads=4, rngs=nnx.Rngs(0))
      >>> layer(jnp.ones((2, 6, 32)), deterministic=True).shape
      (2, 6, 32)
    """

    def __init__(
        self,
        *,
        in_features: int | None = None,
        encoded_features: int | None = None,
        rngs: nnx.Rngs,
        **attributes: Any,
    ):
        set_attributes(self, TransformerLayerDescription, attributes, rngs)
        self.in_features = self.hidden_size if in_features is None else in_features
        self.encoded_features = encoded_features
        # TE names the output norm after its switch: the module takes the attribute's place
        # (and keeps its truth value), so that its variables sit where Linen puts them.
        build_children(self, self.children(self.in_features, encoded_features), rngs)

    def init_cache(self, batch_size: int, max_length: int, dtype: Any = jnp.float32) -> None:
        """Sizes the self-attention's decoding cache (DECODER layers only)."""
        if not self.decoder:
            raise ValueError("only a DECODER TransformerLayer decodes autoregressively")
        attention: Any = self.host().layer("self_attention")
        attention.init_cache(batch_size, max_length, dtype)
