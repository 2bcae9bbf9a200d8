"""The transformer layer's description: ``TransformerLayer`` (TransformerEngine's attributes).

Its sublayers are named by their description types (``MultiHeadAttentionDescription``,
``LayerNormMLPDescription``, ``RelativePositionBiasesDescription``, ``LayerNormDescription``,
``DropoutDescription``), and the attributes it hands them are copied by the tables below
(``ATTENTION_FROM_LAYER``, ``MLP_FROM_LAYER``, ``NORM_FROM_LAYER``). ``te_flax._layers.host``
says how a layer runs; the attention descriptions are ``te_flax._layers.attention``, the
decoding cache ``te_flax._layers.kv_cache`` (both re-exported here).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import Array

from te_flax import attention as attn
from te_flax._layers.attention import (
    DotProductAttentionDescription,
    MultiHeadAttentionDescription,
    RelativePositionBiasesDescription,
)
from te_flax._layers.composite import (
    Axes,
    DropoutDescription,
    SharedAttributes,
    lora_scope,
    positive_int,
    rate,
)
from te_flax._layers.host import Child, Host, Layer
from te_flax._layers.kv_cache import CacheSlots
from te_flax._layers.linear import LayerNormDescription, LayerNormMLPDescription
from te_flax._layers.moe import MoEBlockDescription
from te_flax.quantize import Recipe
from te_flax.sharding import with_logical_constraint

__all__ = [
    "ATTENTION_FROM_LAYER",
    "MLP_FROM_LAYER",
    "NORM_FROM_LAYER",
    "CacheSlots",
    "Child",
    "DotProductAttentionDescription",
    "DropoutDescription",
    "Host",
    "MultiHeadAttentionDescription",
    "RelativePositionBiasesDescription",
    "TransformerLayerDescription",
    "TransformerLayerType",
]

Initializer = Callable[..., Array]


class TransformerLayerType(enum.Enum):
    """The kind of ``TransformerLayer``: ENCODER (self-attention, MLP) or DECODER (+ cross)."""

    ENCODER = "encoder"
    DECODER = "decoder"


# ---------------------------------------------------------------------------- TransformerLayer


@dataclasses.dataclass
class TransformerLayerDescription(Layer):
    """Attention block (+ cross-attention for decoders) and MLP, with residuals and dropout."""

    # TransformerEngine's fields, in its order.

    hidden_size: int = 512
    mlp_hidden_size: int = 2048
    num_attention_heads: int = 8
    num_gqa_groups: int | None = None
    layernorm_type: str = "layernorm"
    layernorm_epsilon: float = 1e-6
    zero_centered_gamma: bool = False
    hidden_dropout: float = 0.1
    hidden_dropout_dims: Sequence[int] = ()
    attention_dropout: float = 0.1
    intermediate_dropout: float = 0.0
    intermediate_dropout_dims: Sequence[int] = ()
    dropout_rng_name: str = "dropout"
    mha_kernel_init: Initializer | None = None
    mlp_kernel_init: Initializer | None = None
    mlp_activations: Sequence[str] = ("gelu",)
    mlp_activation_params: dict[str, Any] | None = None
    use_bias: bool = False
    bias_init: Initializer = jax.nn.initializers.zeros
    apply_residual_connection_post_layernorm: bool = False
    output_layernorm: bool = False
    float32_attention_logits: bool = False
    layer_type: TransformerLayerType = TransformerLayerType.ENCODER
    self_attn_mask_type: str = "causal"
    self_attn_bias_type: str | None = None
    enable_relative_embedding: bool = True
    relative_embedding: Any = None
    enable_rotary_pos_emb: bool = False
    rotary_pos_emb_windows: tuple[int, int] = (1, 10000)
    rotary_pos_emb_group_method: str = "consecutive"
    low_rank_adaptation_scope: str = "none"
    low_rank_adaptation_dim: int = 32
    low_rank_adaptation_alpha: float | None = None
    dtype: Any = None
    drop_path: float = 0.0
    fuse_qkv_params: bool = True
    transpose_batch_sequence: bool = False
    enable_sequence_parallel: bool = False
    scale_attn_logits: bool = False
    scaled_query_init: bool = True
    window_size: tuple[int, int] | None = None
    softmax_type: str = "vanilla"
    score_mod: attn.ScoreMod | None = None
    score_mod_bprop: attn.ScoreMod | None = None
    # te_flax's.
    param_dtype: Any = jnp.float32
    recipe: Recipe | None = None
    implementation: str | None = None
    # MoEBlock attributes (num_experts, num_experts_per_tok, capacity_factor, ...): a MoEBlock
    # replaces the MLP; set it on every n-th layer for a MoE every n layers. None: the MLP.
    moe: dict[str, Any] | None = None

    def check(self) -> None:
        if not isinstance(self.layer_type, TransformerLayerType):
            raise ValueError(
                f"layer_type must be TransformerLayerType.ENCODER or .DECODER, got "
                f"{self.layer_type!r}"
            )
        positive_int(self.hidden_size, "hidden_size")
        positive_int(self.mlp_hidden_size, "mlp_hidden_size")
        heads = positive_int(self.num_attention_heads, "num_attention_heads")
        if self.hidden_size % heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} must be a multiple of num_attention_heads="
                f"{heads} (head_dim = hidden_size / num_attention_heads)"
            )
        for name in ("hidden_dropout", "attention_dropout", "intermediate_dropout", "drop_path"):
            rate(getattr(self, name), name)

    @property
    def decoder(self) -> bool:
        return self.layer_type == TransformerLayerType.DECODER

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def self_attention_name(self) -> str:
        return "self_attention" if self.decoder else "attention"

    def children(
        self, in_features: int | None = None, encoded_features: int | None = None
    ) -> dict[str, Child]:
        """The sublayers for an input of ``in_features`` (None: ``hidden_size``) and, in a
        DECODER, an encoder output of ``encoded_features`` (None: ``in_features``)."""
        self.check()
        width = self.hidden_size if in_features is None else in_features
        encoded_width = width if encoded_features is None else encoded_features
        children = {}
        if self.enable_relative_embedding and self.relative_embedding is None:
            children["relpos_bias"] = Child(RelativePositionBiasesDescription, dict(
                num_buckets=32,
                max_distance=128,
                num_attention_heads=self.num_attention_heads,
                embedding_init=jax.nn.initializers.variance_scaling(1.0, "fan_avg", "uniform"),
                dtype=self.dtype,
                param_dtype=self.param_dtype,
            ))  # fmt: skip
        self_attention = ATTENTION_FROM_LAYER.copy(
            self,
            head_dim=self.head_dim,
            input_layernorm=not self.output_layernorm,
            attn_mask_type=self.self_attn_mask_type,
            attn_bias_type=self.self_attn_bias_type,
            # As in TE, the score modification is the self-attention's only.
            score_mod=self.score_mod,
            score_mod_bprop=self.score_mod_bprop,
        )
        children[self.self_attention_name] = Child(
            MultiHeadAttentionDescription, self_attention, width
        )
        dropout = dict(rng_collection=self.dropout_rng_name)
        children["dropout"] = Child(DropoutDescription, dict(
            rate=self.hidden_dropout, broadcast_dims=tuple(self.hidden_dropout_dims), **dropout
        ))  # fmt: skip
        if self.drop_path > 0:
            # Stochastic depth: one draw per sample, broadcast over all but the batch axis.
            batch_axis = 1 if self.transpose_batch_sequence else 0
            others = tuple(a for a in range(3) if a != batch_axis)
            children["stochastic_depth"] = Child(
                DropoutDescription, dict(rate=self.drop_path, broadcast_dims=others, **dropout)
            )
        if self.decoder:
            children["encoder_decoder_attention"] = Child(
                MultiHeadAttentionDescription,
                ATTENTION_FROM_LAYER.copy(
                    self,
                    head_dim=self.head_dim,
                    input_layernorm=True,
                    attn_mask_type="padding",
                    attn_bias_type="no_bias",
                    # Rotary positions measure distances within one sequence; TE also turns the
                    # decoder's queries against the encoder's keys, which has no meaning and
                    # makes cached decoding (one query, seen as position 0) disagree with the
                    # full forward. The cross-attention here is position-free.
                    enable_rotary_pos_emb=False,
                ),
                (width, encoded_width),
            )
        children["mlp"] = self.mlp_child(width)
        if self.output_layernorm:
            children["output_layernorm"] = Child(
                LayerNormDescription, NORM_FROM_LAYER.copy(self), width
            )
        return children

    def mlp_child(self, in_features: int) -> Child:
        """The feed-forward block: TE's ``LayerNormMLP`` over the input width."""
        if self.moe is not None:
            # The mixture of experts with the MLP's norm, widths and activation; it sows its
            # aux loss ("aux_loss"), to be added to the training loss.
            attributes = MOE_FROM_LAYER.copy(self, enable_layernorm=True)
            return Child(MoEBlockDescription, {**attributes, **self.moe}, in_features)
        axes = Axes(bool(self.transpose_batch_sequence), self.enable_sequence_parallel)
        _, _, lora_mlp = lora_scope(self.low_rank_adaptation_scope)
        attributes = MLP_FROM_LAYER.copy(
            self,
            activations=tuple(self.mlp_activations),
            intermediate_hidden_dropout_dims=tuple(self.intermediate_dropout_dims),
            enable_low_rank_adaptation=lora_mlp,
            layernorm_input_axes=axes.residual,
            dot_1_input_axes=axes.gemm_input,
            dot_2_input_axes=axes.mlp_hidden,
        )
        return Child(LayerNormMLPDescription, attributes, in_features)

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
        """``[batch, seq, hidden]`` (``[seq, batch, ..]`` transposed) -> the same."""
        self.check()
        if inputs.ndim != 3:
            raise ValueError(
                f"inputs must be [batch, seq, hidden] ([seq, batch, hidden] with "
                f"transpose_batch_sequence), got shape {inputs.shape}; reshape it to three axes"
            )
        if decode and not self.decoder:
            raise ValueError(
                "decode=True needs layer_type=TransformerLayerType.DECODER: an encoder layer "
                "has no autoregressive cache"
            )
        if self.decoder and encoded is None:
            raise ValueError(
                "a DECODER TransformerLayer needs `encoded` (the encoder output) for its "
                "cross-attention; use layer_type=ENCODER for a decoder-only (GPT) stack"
            )
        encoded_features = None if encoded is None else encoded.shape[-1]
        host = self.host(self.children(inputs.shape[-1], encoded_features))
        axes = Axes(bool(self.transpose_batch_sequence), self.enable_sequence_parallel)
        seq = inputs.shape[0 if self.transpose_batch_sequence else 1]
        bias = None
        if self.enable_relative_embedding:
            # A user's own module (``relative_embedding``) stands in for ``relpos_bias``.
            relpos = self.relative_embedding
            if relpos is None:
                relpos = host.layer("relpos_bias")
            if self.decoder:
                length = max_decode_length if decode and max_decode_length else seq
                bias = relpos(length, length, False)
            else:
                bias = relpos(seq, seq, True)

        def residual_add(x: Array, residual: Array, ln_out: Array | None, drop_path: bool) -> Array:
            x = host.layer("dropout")(x, deterministic=deterministic)
            if drop_path and self.drop_path > 0:
                x = host.layer("stochastic_depth")(x, deterministic=deterministic)
            if self.apply_residual_connection_post_layernorm and ln_out is not None:
                residual = ln_out
            # The residual stream keeps the input's dtype; the blocks compute in ``dtype``.
            return with_logical_constraint(
                x.astype(inputs.dtype) + residual.astype(inputs.dtype), axes.residual
            )

        inputs = with_logical_constraint(inputs, axes.residual)
        x, ln_out = host.layer(self.self_attention_name)(
            inputs,
            inputs,
            attention_mask,
            bias,
            deterministic=deterministic,
            decode=decode,
            score_mod_tensors=score_mod_tensors,
            score_mod_bprop_tensors=score_mod_bprop_tensors,
        )
        x = residual_add(x, inputs, ln_out, drop_path=True)
        if self.decoder:
            y, ln_out = host.layer("encoder_decoder_attention")(
                x, encoded, encoder_decoder_mask, deterministic=deterministic
            )
            x = residual_add(y, x, ln_out, drop_path=False)
        if self.moe is not None:
            z, ln_out = host.layer("mlp")(x)[0], None  # (output, aux loss)
        else:
            z, ln_out = host.layer("mlp")(x, deterministic=deterministic)
        z = residual_add(z, x, ln_out, drop_path=True)
        if self.output_layernorm:
            z = host.layer("output_layernorm")(z)
        return z.astype(inputs.dtype)


# The attributes TransformerLayer hands its sublayers (sublayer name <- layer name).
ATTENTION_FROM_LAYER = SharedAttributes(
    MultiHeadAttentionDescription,
    names=(
        "num_attention_heads",
        "num_gqa_groups",
        "attention_dropout",
        "dropout_rng_name",
        "layernorm_type",
        "layernorm_epsilon",
        "zero_centered_gamma",
        "use_bias",
        "bias_init",
        "enable_rotary_pos_emb",
        "rotary_pos_emb_windows",
        "rotary_pos_emb_group_method",
        "low_rank_adaptation_scope",
        "low_rank_adaptation_dim",
        "low_rank_adaptation_alpha",
        "dtype",
        "param_dtype",
        "fuse_qkv_params",
        "transpose_batch_sequence",
        "enable_sequence_parallel",
        "scale_attn_logits",
        "scaled_query_init",
        "window_size",
        "softmax_type",
        "recipe",
        "implementation",
    ),
    renamed=(
        ("return_layernorm_output", "apply_residual_connection_post_layernorm"),
        ("kernel_init", "mha_kernel_init"),
        ("float32_logits", "float32_attention_logits"),
    ),
)
MLP_FROM_LAYER = SharedAttributes(
    LayerNormMLPDescription,
    names=(
        "layernorm_type",
        "zero_centered_gamma",
        "use_bias",
        "bias_init",
        "low_rank_adaptation_dim",
        "low_rank_adaptation_alpha",
        "transpose_batch_sequence",
        "dtype",
        "param_dtype",
        "recipe",
    ),
    renamed=(
        ("epsilon", "layernorm_epsilon"),
        ("return_layernorm_output", "apply_residual_connection_post_layernorm"),
        ("intermediate_dim", "mlp_hidden_size"),
        ("activations", "mlp_activations"),
        ("activation_params", "mlp_activation_params"),
        ("intermediate_dropout_rng_name", "dropout_rng_name"),
        ("intermediate_dropout_rate", "intermediate_dropout"),
        ("intermediate_hidden_dropout_dims", "intermediate_dropout_dims"),
        ("kernel_init", "mlp_kernel_init"),
    ),
)
MOE_FROM_LAYER = SharedAttributes(
    MoEBlockDescription,
    names=(
        "layernorm_type",
        "zero_centered_gamma",
        "use_bias",
        "bias_init",
        "dtype",
        "param_dtype",
        "recipe",
    ),
    renamed=(
        ("epsilon", "layernorm_epsilon"),
        ("intermediate_dim", "mlp_hidden_size"),
        ("activations", "mlp_activations"),
        ("activation_params", "mlp_activation_params"),
        ("kernel_init", "mlp_kernel_init"),
    ),
)
NORM_FROM_LAYER = SharedAttributes(
    LayerNormDescription,
    names=("layernorm_type", "zero_centered_gamma", "dtype", "param_dtype"),
    renamed=(("epsilon", "layernorm_epsilon"),),
)
