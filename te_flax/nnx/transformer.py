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

from collections.abc import Mapping
from typing import Any, cast

import jax.numpy as jnp
from flax import nnx
from jax import Array

from te_flax._layers.attention import (
    DotProductAttentionDescription,
    MultiHeadAttentionDescription,
    RelativePositionBiasesDescription,
)
from te_flax._layers.composite import Child, DropoutDescription
from te_flax._layers.kv_cache import CacheSlots
from te_flax._layers.linear import (
    DenseGeneralDescription,
    LayerNormDenseGeneralDescription,
    LayerNormDescription,
    LayerNormMLPDescription,
    ParamRecord,
)
from te_flax._layers.moe import MoEBlockDescription
from te_flax._layers.transformer import TransformerLayerDescription, TransformerLayerType
from te_flax._ops.fp8_attention import (
    FP8_ATTENTION_POSTFIXES,
    AttentionQuantizers,
    attention_quantizers,
)
from te_flax._ops.packing import SequenceDescriptor
from te_flax.nnx import modules
from te_flax.nnx._fp8_meta import create_fp8_variables, fp8_variables
from te_flax.nnx._shell import create_param, described_by, logical_param, set_attributes
from te_flax.nnx.moe import MoEBlock

__all__ = [
    "DotProductAttention",
    "MultiHeadAttention",
    "RelativePositionBiases",
    "TransformerLayer",
    "TransformerLayerType",
]


class _Slot:
    """An ``nnx.Cache`` seen through ``.value``, as a Linen variable is."""

    def __init__(self, variable: nnx.Cache[Array]):
        self.variable = variable

    @property
    def value(self) -> Array:
        return self.variable.get_value()

    @value.setter
    def value(self, new: Array) -> None:
        self.variable.set_value(new)


class _NnxHost:
    """The children built at construction, the module's dropout stream and its cache."""

    def __init__(self, module: Any):  # a module of this file: its attributes vary by kind
        self.module = module

    def layer(self, name: str) -> Any:
        return getattr(self.module, name)

    def rng(self, stream: str) -> Array:
        return self.module.dropout_rngs()

    def param(self, record: ParamRecord) -> Array:
        return cast(Array, getattr(self.module, record.name)[...])

    def cache(self, shape: tuple[int, ...], dtype: Any) -> tuple[CacheSlots, bool]:
        module = self.module
        if getattr(module, "cached_key", None) is None:
            raise ValueError(
                f"{type(module).__name__} has no decoding cache: call "
                "init_cache(batch_size, max_length) before applying it with decode=True"
            )
        cached = module.cached_key.get_value()
        if cached.dtype != dtype:
            raise TypeError(
                f"the decoding cache holds {cached.dtype} but the keys are {jnp.dtype(dtype)}; "
                "call init_cache with dtype= the compute dtype"
            )
        slots = (module.cached_key, module.cached_value, module.cache_index)
        return CacheSlots(*(_Slot(variable) for variable in slots)), False


def _build(child: Child, rngs: nnx.Rngs) -> nnx.Module:
    kind, attributes, in_features = child
    if kind is DropoutDescription:  # a stream only where it draws: rate 0 needs no "dropout" stream
        return nnx.Dropout(**attributes, rngs=rngs if attributes["rate"] > 0 else None)
    if kind is RelativePositionBiasesDescription:
        return RelativePositionBiases(**attributes, rngs=rngs)
    if kind is MultiHeadAttentionDescription and isinstance(in_features, tuple):
        query_features, kv_features = in_features
        return MultiHeadAttention(
            query_features, in_kv_features=kv_features, **attributes, rngs=rngs
        )
    return _KINDS[kind](in_features, **attributes, rngs=rngs)  # type: ignore[call-arg]


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


def _fp8_attention(
    module: nnx.Module, description: DotProductAttentionDescription
) -> AttentionQuantizers | None:
    """FP8 attention's quantizer sets from ``module``'s state, or None without ``fp8_dpa``."""
    recipe = description.fp8_recipe()
    if recipe is None:
        return None
    # The layers' own reading of their FP8 variables (names, shapes and recipe checked).
    return attention_quantizers(recipe, lambda postfix: fp8_variables(module, recipe, postfix))


def _dropout_rngs(rate: float, stream: str, rngs: nnx.Rngs) -> nnx.RngStream | None:
    """A fork of the dropout stream when attention dropout is on (else None)."""
    return rngs[stream].fork() if rate > 0 else None


@described_by(DotProductAttentionDescription)
class DotProductAttention(nnx.Module, DotProductAttentionDescription):
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

    def __call__(
        self,
        query: Array,
        key: Array | None = None,
        value: Array | None = None,
        sequence_descriptor: Array | SequenceDescriptor | None = None,
        bias: Array | None = None,
        *,
        deterministic: bool = False,
        mask: Array | SequenceDescriptor | None = None,
        score_mod_tensors: Mapping[str, Any] | None = None,
        score_mod_bprop_tensors: Mapping[str, Any] | None = None,
    ) -> Array | tuple[Array, Array]:
        """``[batch, seq, heads, head_dim]`` (per ``qkv_layout``) -> the query's shape, and
        the per-head max logit ``[heads]`` with ``return_max_logit``.

        TransformerEngine's order: the fourth argument is the ``sequence_descriptor``, a
        ``SequenceDescriptor`` or a mask array ``[batch, 1, q_len, kv_len]`` (True = masked
        out); ``mask=`` (keyword) is its other name. Pass one of the two."""
        return self.forward(
            _NnxHost(self),
            query,
            key,
            value,
            mask,
            bias,
            deterministic=deterministic,
            score_mod_tensors=score_mod_tensors,
            score_mod_bprop_tensors=score_mod_bprop_tensors,
            sequence_descriptor=sequence_descriptor,
            quantizers=_fp8_attention(self, self),
        )


@described_by(MultiHeadAttentionDescription)
class MultiHeadAttention(nnx.Module, MultiHeadAttentionDescription):
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
        self_attention = in_kv_features is None
        for name, child in self.children(in_features, self_attention).items():
            if name == "kv" or name in ("key", "value"):
                child = child._replace(in_features=in_kv_features or in_features)
            setattr(self, name, _build(child, rngs))
        _own_params(self, self.param_records(), rngs)
        _own_fp8_attention_state(self, self._attention())
        self.dropout_rngs = _dropout_rngs(self.attention_dropout, self.dropout_rng_name, rngs)

    def init_cache(self, batch_size: int, max_length: int, dtype: Any = jnp.float32) -> None:
        """Zeroed keys and values ``[batch_size, max_length, groups, head_dim]`` for decoding.

        ``dtype`` is the compute dtype of the keys (the module's ``dtype``, else the input's).
        """
        shape = (batch_size, max_length, self.groups, self.head_dim)
        self.cached_key = nnx.Cache(jnp.zeros(shape, dtype))
        self.cached_value = nnx.Cache(jnp.zeros(shape, dtype))
        self.cache_index = nnx.Cache(jnp.zeros((), jnp.int32))

    def __call__(
        self,
        inputs_q: Array,
        inputs_kv: Array,
        mask: Array | None = None,
        bias: Array | None = None,
        *,
        decode: bool = False,
        deterministic: bool = False,
        score_mod_tensors: Mapping[str, Any] | None = None,
        score_mod_bprop_tensors: Mapping[str, Any] | None = None,
    ) -> tuple[Array, Array | None]:
        """``[batch, seq, hidden]`` (``[seq, batch, hidden]`` transposed) -> ``(out, ln)``."""
        self_attention = self.in_kv_features is None
        if self_attention and inputs_kv is not inputs_q:
            raise ValueError(
                "this MultiHeadAttention was built for self-attention (in_kv_features=None): "
                "call it with inputs_kv the same array as inputs_q, or build it with "
                "in_kv_features=<hidden size of inputs_kv> for cross-attention"
            )
        return self.forward(
            _NnxHost(self),
            inputs_q,
            inputs_kv,
            mask,
            bias,
            self_attention=self_attention,
            deterministic=deterministic,
            decode=decode,
            score_mod_tensors=score_mod_tensors,
            score_mod_bprop_tensors=score_mod_bprop_tensors,
            quantizers=_fp8_attention(self, self._attention()),
        )


@described_by(RelativePositionBiasesDescription)
class RelativePositionBiases(nnx.Module, RelativePositionBiasesDescription):
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
        value = self.embedding_init(rngs.params(), self.shape(), self.param_dtype)
        self.rel_embedding = logical_param(value, self.embedding_axes)

    def __call__(self, q_seqlen: int, k_seqlen: int, bidirectional: bool = True) -> Array:
        """``[1, num_attention_heads, q_seqlen, k_seqlen]`` biases."""
        return self.forward(self.rel_embedding[...], q_seqlen, k_seqlen, bidirectional)


@described_by(TransformerLayerDescription)
class TransformerLayer(nnx.Module, TransformerLayerDescription):
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
        for name, child in self.children(self.in_features, encoded_features).items():
            # TE names the output norm after its switch: the module takes the attribute's place
            # (and keeps its truth value), so that its variables sit where Linen puts them.
            setattr(self, name, nnx.data(_build(child, rngs)))

    def init_cache(self, batch_size: int, max_length: int, dtype: Any = jnp.float32) -> None:
        """Sizes the self-attention's decoding cache (DECODER layers only)."""
        if not self.decoder:
            raise ValueError("only a DECODER TransformerLayer decodes autoregressively")
        _NnxHost(self).layer("self_attention").init_cache(batch_size, max_length, dtype)

    def __call__(
        self,
        inputs: Array,
        encoded: Array | None = None,
        attention_mask: Array | None = None,
        encoder_decoder_mask: Array | None = None,
        deterministic: bool = False,
        decode: bool = False,
        max_decode_length: int | None = None,
        score_mod_tensors: Mapping[str, Any] | None = None,
        score_mod_bprop_tensors: Mapping[str, Any] | None = None,
    ) -> Array:
        """``[batch, seq, in_features]`` (``[seq, batch, ..]`` transposed) -> the same."""
        if inputs.shape[-1:] != (self.in_features,):
            raise ValueError(
                f"inputs must be [batch, seq, {self.in_features}] (the in_features this "
                f"TransformerLayer was built with; default hidden_size={self.hidden_size}), got "
                f"shape {inputs.shape}; build it with in_features=<the input's last axis>"
            )
        host = _NnxHost(self)
        if self.relative_embedding is not None:
            host = _WithRelativeEmbedding(self)
        return self.forward(
            host,
            inputs,
            encoded,
            attention_mask,
            encoder_decoder_mask,
            deterministic,
            decode,
            max_decode_length,
            score_mod_tensors,
            score_mod_bprop_tensors,
        )


class _WithRelativeEmbedding(_NnxHost):
    """A user's own relative embedding module stands in for ``relpos_bias``."""

    def layer(self, name: str) -> Any:
        if name == "relpos_bias":
            return self.module.relative_embedding
        return super().layer(name)


# The NNX module of each sublayer description built from its input size.
_KINDS: dict[type, type[nnx.Module]] = {
    DenseGeneralDescription: modules.DenseGeneral,
    LayerNormDescription: modules.LayerNorm,
    LayerNormDenseGeneralDescription: modules.LayerNormDenseGeneral,
    LayerNormMLPDescription: modules.LayerNormMLP,
    MoEBlockDescription: MoEBlock,
    MultiHeadAttentionDescription: MultiHeadAttention,
}
