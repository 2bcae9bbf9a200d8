"""The attention layers' descriptions: ``MultiHeadAttention`` here, with the two it is made of,
``DotProductAttention`` (``te_flax._layers.dot_product_attention``) and
``RelativePositionBiases`` (``te_flax._layers.relative_position``), re-exported
(TransformerEngine's attributes, Flax's ``dtype``/``param_dtype``).

See ``te_flax._layers.host`` for how a layer runs in a front end and ``te_flax._layers.composite``
for how it names its sublayers;
the functional attention is ``te_flax.attention``, the decoding cache ``te_flax._layers.kv_cache``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, ClassVar

import einops
import jax
import jax.numpy as jnp
from jax import Array
from jax.ad_checkpoint import checkpoint_name

from te_flax import attention as attn
from te_flax._layers import kv_cache
from te_flax._layers.base import Initializer, ParamRecord, scaled_init, stacked_init
from te_flax._layers.composite import (
    AttentionHeads,
    Axes,
    SharedAttributes,
    lora_scope,
    normal_fan_in,
)
from te_flax._layers.dot_product_attention import DotProductAttentionDescription
from te_flax._layers.host import Child, Host, Layer
from te_flax._layers.linear import DenseGeneralDescription, LayerNormDenseGeneralDescription
from te_flax._layers.relative_position import RelativePositionBiasesDescription
from te_flax._ops.fp8_attention import AttentionQuantizers
from te_flax._ops.packing import SequenceDescriptor, segment_ids_and_pos
from te_flax.quantize import Recipe
from te_flax.sharding import with_logical_constraint

__all__ = [
    "ATTENTION_FROM_MHA",
    "DotProductAttentionDescription",
    "MultiHeadAttentionDescription",
    "RelativePositionBiasesDescription",
]


# ---------------------------------------------------------------------------- MultiHeadAttention


@dataclasses.dataclass
class MultiHeadAttentionDescription(Layer, AttentionHeads):
    """Norm + Q/K/V projections, rotary embeddings, attention (with a KV cache), output GEMM."""

    # TransformerEngine's fields, in its order, after AttentionHeads'.

    dropout_rng_name: str = "dropout"
    input_layernorm: bool = True
    layernorm_type: str = "layernorm"
    layernorm_epsilon: float = 1e-6
    return_layernorm_output: bool = False
    zero_centered_gamma: bool = False
    kernel_init: Initializer | None = None
    use_bias: bool = False
    bias_init: Initializer = jax.nn.initializers.zeros
    attn_mask_type: str = "causal"
    attn_bias_type: str | None = None
    enable_rotary_pos_emb: bool = False
    rotary_pos_emb_windows: tuple[int, int] = (1, 10000)
    rotary_pos_emb_group_method: str = "consecutive"
    low_rank_adaptation_scope: str = "none"
    low_rank_adaptation_dim: int = 32
    low_rank_adaptation_alpha: float | None = None
    dtype: Any = None
    fuse_qkv_params: bool = True
    # TE's default: None, taken as False ([batch, seq, hidden] inputs).
    transpose_batch_sequence: bool | None = None
    enable_sequence_parallel: bool = False
    scale_attn_logits: bool = False
    scaled_query_init: bool = True
    float32_logits: bool = False
    window_size: tuple[int, int] | None = None
    softmax_type: str = "vanilla"
    score_mod: attn.ScoreMod | None = None
    score_mod_bprop: attn.ScoreMod | None = None
    # TE's deprecated spellings, refused with the name to use.
    num_heads: int | None = None
    dropout_rate: float | None = None
    output_layernorm: bool | None = None
    apply_residual_connection_post_layernorm: bool | None = None
    fuse_qkv: bool | None = None
    # te_flax's.
    param_dtype: Any = jnp.float32
    recipe: Recipe | None = None
    implementation: str | None = None

    _DEPRECATED: ClassVar[dict[str, str]] = {
        "num_heads": "num_attention_heads",
        "dropout_rate": "attention_dropout",
        "output_layernorm": "input_layernorm",
        "apply_residual_connection_post_layernorm": "return_layernorm_output",
        "fuse_qkv": "fuse_qkv_params",
    }

    @property
    def groups(self) -> int:
        return self.num_gqa_groups or self.num_attention_heads

    def check(self) -> None:
        for old, new in self._DEPRECATED.items():
            if getattr(self, old) is not None:
                raise TypeError(
                    f"MultiHeadAttention.{old} is TE's deprecated spelling; use {new} instead"
                )
        self._attention().check()
        lora_scope(self.low_rank_adaptation_scope)

    def _attention(self) -> DotProductAttentionDescription:
        return DotProductAttentionDescription(
            **ATTENTION_FROM_MHA.copy(
                self,
                num_gqa_groups=self.groups,
                scale_factor=1.0 / math.sqrt(self.head_dim) if self.scale_attn_logits else 1.0,
                transpose_batch_sequence=False,  # the projections are laid out here
            )
        )

    def param_records(self) -> list[ParamRecord]:
        """The attention's own parameters (the learned sink), besides the projections'."""
        return self._attention().param_records()

    def fused_qkv(self, self_attention: bool) -> bool:
        """One ``qkv`` kernel (self-attention, no GQA), else ``query`` + ``kv`` (or key, value)."""
        return self.fuse_qkv_params and self_attention and self.num_attention_heads == self.groups

    def children(self, in_features: int, self_attention: bool) -> dict[str, Child]:
        """The projections of an input of ``in_features``; fused QKV only for self-attention."""
        self.check()
        heads, groups, head_dim = self.num_attention_heads, self.groups, self.head_dim
        axes = Axes(bool(self.transpose_batch_sequence), self.enable_sequence_parallel)
        lora_qkv, lora_out, _ = lora_scope(self.low_rank_adaptation_scope)
        kernel_init = self.kernel_init or normal_fan_in()
        query_scale = math.sqrt(head_dim) if self.scaled_query_init else 1.0
        common = dict(
            use_bias=self.use_bias,
            bias_init=self.bias_init,
            low_rank_adaptation_dim=self.low_rank_adaptation_dim,
            low_rank_adaptation_alpha=self.low_rank_adaptation_alpha,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            transpose_batch_sequence=bool(self.transpose_batch_sequence),
            recipe=self.recipe,
        )
        norm = dict(
            enable_layernorm=self.input_layernorm,
            layernorm_type=self.layernorm_type,
            zero_centered_gamma=self.zero_centered_gamma,
            epsilon=self.layernorm_epsilon,
            layernorm_input_axes=axes.residual,
            dot_input_axes=axes.gemm_input,
            enable_low_rank_adaptation=lora_qkv,
        )
        projections = dict(enable_low_rank_adaptation=lora_qkv, input_axes=axes.gemm_input)
        children = {}
        if self.fused_qkv(self_attention):
            children["qkv"] = Child(LayerNormDenseGeneralDescription, dict(
                features=(3, heads * head_dim),
                kernel_init=stacked_init(kernel_init, 3, query_scale),
                kernel_axes=("embed", "qkv", "heads"),
                bias_axes=("qkv", "heads"),
                return_layernorm_output=self.return_layernorm_output,
                **norm, **common,
            ), in_features)  # fmt: skip
        else:
            children["query"] = Child(LayerNormDenseGeneralDescription, dict(
                features=heads * head_dim,
                kernel_init=scaled_init(kernel_init, query_scale),
                kernel_axes=("embed", "heads"),
                bias_axes=("heads",),
                return_layernorm_output=True,
                **norm, **common,
            ), in_features)  # fmt: skip
            if self.fuse_qkv_params:
                children["kv"] = Child(DenseGeneralDescription, dict(
                    features=(2, groups * head_dim),
                    kernel_init=stacked_init(kernel_init, 2),
                    kernel_axes=("embed", "qkv", "heads"),
                    bias_axes=("qkv", "heads"),
                    **projections, **common,
                ))  # fmt: skip
            else:
                for name in ("key", "value"):
                    children[name] = Child(DenseGeneralDescription, dict(
                        features=groups * head_dim,
                        kernel_init=kernel_init,
                        kernel_axes=("embed", "heads"),
                        bias_axes=("heads",),
                        **projections, **common,
                    ))  # fmt: skip
        children["out"] = Child(DenseGeneralDescription, dict(
            features=in_features,
            kernel_init=kernel_init,
            kernel_axes=("heads", "embed"),
            bias_axes=("embed",),
            enable_low_rank_adaptation=lora_out,
            input_axes=axes.context,
            **common,
        ), heads * head_dim)  # fmt: skip
        return children

    def is_self_attention(self, inputs_q: Array, inputs_kv: Array) -> bool:
        """Self-attention (the fused ``qkv`` kernel, the keys read the normalized input): a call
        with ``inputs_kv`` the same array as ``inputs_q``."""
        return inputs_q is inputs_kv

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
        self_attention = self.is_self_attention(inputs_q, inputs_kv)
        host = self.host(self.children(inputs_q.shape[-1], self_attention))
        return self.forward(
            host,
            inputs_q,
            inputs_kv,
            mask,
            bias,
            self_attention=self_attention,
            deterministic=deterministic,
            decode=decode,
            score_mod_tensors=score_mod_tensors,
            score_mod_bprop_tensors=score_mod_bprop_tensors,
            quantizers=self._attention().quantizers(host),
        )

    def forward(
        self,
        host: Host,
        inputs_q: Array,
        inputs_kv: Array,
        mask: Array | SequenceDescriptor | None,
        bias: Array | None,
        *,
        self_attention: bool,
        deterministic: bool,
        decode: bool,
        score_mod_tensors: Mapping[str, Any] | None = None,
        score_mod_bprop_tensors: Mapping[str, Any] | None = None,
        quantizers: AttentionQuantizers | None = None,
    ) -> tuple[Array, Array | None]:
        self.check()
        for name, x in (("inputs_q", inputs_q), ("inputs_kv", inputs_kv)):
            if x.ndim != 3:
                raise ValueError(
                    f"{name} must be [batch, seq, hidden] ([seq, batch, hidden] with "
                    f"transpose_batch_sequence), got shape {x.shape}; reshape it to three axes"
                )
        if inputs_q.dtype != inputs_kv.dtype:
            raise TypeError(
                f"inputs_q ({inputs_q.dtype}) and inputs_kv ({inputs_kv.dtype}) must share a dtype"
            )
        axes = Axes(bool(self.transpose_batch_sequence), self.enable_sequence_parallel)
        heads, groups = self.num_attention_heads, self.groups
        inputs_q = with_logical_constraint(inputs_q, axes.residual)
        split = (
            "b s (h d) -> b s h d" if not self.transpose_batch_sequence else "s b (h d) -> s b h d"
        )
        if self.fused_qkv(self_attention):
            qkv, ln_out = host.layer("qkv")(inputs_q)  # [b, s, 3, heads * head_dim]
            qkv = checkpoint_name(qkv, "combined_qkv_proj")
            query, key, value = (einops.rearrange(qkv[..., i, :], split, h=heads) for i in range(3))
        else:
            query, ln_out = host.layer("query")(inputs_q)  # [b, s, heads * head_dim]
            if self_attention:
                inputs_kv = ln_out  # the keys and values read the same normalized input
            if self.fuse_qkv_params:
                kv = checkpoint_name(host.layer("kv")(inputs_kv), "combined_kv_proj")
                key, value = (kv[..., i, :] for i in range(2))  # [b, s, groups * head_dim]
            else:
                key = checkpoint_name(host.layer("key")(inputs_kv), "key_proj")
                value = checkpoint_name(host.layer("value")(inputs_kv), "value_proj")
            query = einops.rearrange(checkpoint_name(query, "query_proj"), split, h=heads)
            key = einops.rearrange(key, split, h=groups)
            value = einops.rearrange(value, split, h=groups)
        dtype = inputs_q.dtype if self.dtype is None else self.dtype
        query, key, value = (t.astype(dtype) for t in (query, key, value))
        if self.transpose_batch_sequence:  # the attention runs on [b, s, h, d]
            query, key, value = (jnp.swapaxes(t, 0, 1) for t in (query, key, value))

        offset: Array | int = 0
        step = None  # a decoding step: the cache slots and this token's position
        if decode:
            slots, created = host.cache(key.shape, key.dtype)
            if not created:  # creating it sizes the cache (e.g. init): attend the input itself
                step = slots, kv_cache.check_step(slots, key)
                offset = step[1]
        if self.enable_rotary_pos_emb and isinstance(mask, SequenceDescriptor):
            # Packed documents: positions restart at each document (segment_pos).
            _, (q_pos, kv_pos) = segment_ids_and_pos(mask, query.shape[1], key.shape[1])
            query, key = self._rotate(query, q_pos), self._rotate(key, kv_pos)
        elif self.enable_rotary_pos_emb:  # positions count from the cache index when decoding
            offset_positions = jnp.arange(query.shape[1]) + offset
            query, key = self._rotate(query, offset_positions), self._rotate(key, offset_positions)
        if step is not None:
            key, value, bias = kv_cache.write_step(step[0], key, value, bias, step[1])
        query, key, value = (
            with_logical_constraint(t, Axes(False).heads) for t in (query, key, value)
        )
        context = self._attention().forward(
            host,
            query,
            key,
            value,
            mask,
            bias,
            deterministic=deterministic,
            q_offset=offset,
            score_mod_tensors=score_mod_tensors,
            score_mod_bprop_tensors=score_mod_bprop_tensors,
            quantizers=quantizers,
        )  # [b, s, heads, head_dim]
        assert not isinstance(context, tuple), "the projections' attention returns no max logit"
        if self.transpose_batch_sequence:
            context = jnp.swapaxes(context, 0, 1)
        context = einops.rearrange(context, "x y h d -> x y (h d)")
        context = with_logical_constraint(context, axes.context)
        out = checkpoint_name(host.layer("out")(context), "out_proj")
        return out.astype(inputs_q.dtype), ln_out if self.return_layernorm_output else None

    def _rotate(self, x: Array, positions: Array) -> Array:
        return attn.rotary_pos_emb(
            x, self.rotary_pos_emb_windows, False, self.rotary_pos_emb_group_method, positions
        )


# The attributes MultiHeadAttention hands its DotProductAttention unchanged.
ATTENTION_FROM_MHA = SharedAttributes(
    DotProductAttentionDescription,
    names=(
        "head_dim",
        "num_attention_heads",
        "attention_dropout",
        "attn_mask_type",
        "attn_bias_type",
        "dropout_rng_name",
        "float32_logits",
        "window_size",
        "softmax_type",
        "score_mod",
        "score_mod_bprop",
        "implementation",
        "recipe",
    ),
)
