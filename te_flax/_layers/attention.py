"""The attention layers' descriptions: ``DotProductAttention``, ``MultiHeadAttention`` and
``RelativePositionBiases`` (TransformerEngine's attributes, Flax's ``dtype``/``param_dtype``).

See ``te_flax._layers.composite`` for how a description names its sublayers and runs through a host;
the functional attention is ``te_flax.attention``, the decoding cache ``te_flax._layers.kv_cache``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import einops
import jax
import jax.numpy as jnp
from jax import Array
from jax.ad_checkpoint import checkpoint_name

from te_flax import attention as attn
from te_flax._layers import kv_cache
from te_flax._layers.composite import (
    REQUIRED,
    Axes,
    Child,
    Host,
    SharedAttributes,
    compute,
    float32_zeros,
    lora_scope,
    normal_fan_in,
    positive_int,
    rate,
)
from te_flax._layers.linear import DenseGeneralSpec, LayerNormDenseGeneralSpec, ParamSpec
from te_flax._ops.fp8_attention import AttentionQuantizers, attention_recipe
from te_flax._ops.packing import SequenceDescriptor, padding_mask, segment_ids_and_pos
from te_flax._parallel import context as cp
from te_flax.quantize import Recipe
from te_flax.sharding import with_logical_constraint

__all__ = [
    "ATTENTION_FROM_MHA",
    "DotProductAttentionSpec",
    "MultiHeadAttentionSpec",
    "RelativePositionBiasesSpec",
]

Initializer = Callable[..., Array]


def _stacked_init(kernel_init: Initializer, parts: int, first_scale: float = 1.0) -> Initializer:
    """Init for a flat ``[hidden, parts * width]`` kernel: each part on its own (TE's qkv/kv).

    The first part (the query of a fused QKV kernel) is divided by ``first_scale``.
    """

    def init(key: Array, shape: tuple[int, ...], dtype: Any = jnp.float32) -> Array:
        hidden, total = shape
        keys = jax.random.split(key, parts)
        blocks = [kernel_init(k, (hidden, total // parts), dtype) for k in keys]
        blocks[0] = blocks[0] / jnp.asarray(first_scale, dtype)
        return jnp.concatenate(blocks, axis=-1)

    return init


def _scaled_init(kernel_init: Initializer, scale: float) -> Initializer:
    def init(key: Array, shape: tuple[int, ...], dtype: Any = jnp.float32) -> Array:
        return kernel_init(key, shape, dtype) / jnp.asarray(scale, dtype)

    return init


# ---------------------------------------------------------------------------- DotProductAttention

# TE's layouts -> how the tensors are laid out: thd is bshd with several documents per row.
_LAYOUTS = {
    "bs3hd": "bs3hd",
    "bshd_bs2hd": "bshd_bs2hd",
    "bshd_bshd_bshd": "bshd_bshd_bshd",
    "t3hd": "bs3hd",
    "thd_t2hd": "bshd_bs2hd",
    "thd_thd_thd": "bshd_bshd_bshd",
}
# A sequence descriptor adds its documents' mask to the mask type.
_WITH_PADDING = {
    "no_mask": "padding",
    "padding": "padding",
    "causal": "padding_causal",
    "padding_causal": "padding_causal",
    "causal_bottom_right": "padding_causal_bottom_right",
    "padding_causal_bottom_right": "padding_causal_bottom_right",
}


@dataclasses.dataclass
class DotProductAttentionSpec:
    """Scaled dot-product attention over ``[batch, seq, heads, head_dim]`` (no parameters)."""

    head_dim: int = REQUIRED
    num_attention_heads: int = REQUIRED
    num_gqa_groups: int | None = None
    attention_dropout: float = 0.0
    attn_mask_type: str = "causal"
    attn_bias_type: str | None = None
    dtype: Any = None
    dropout_rng_name: str = "dropout"
    float32_logits: bool = False
    qkv_layout: str = "bshd_bshd_bshd"
    scale_factor: float | None = None
    # TE's default: None, taken as False ([batch, seq, ...] inputs).
    transpose_batch_sequence: bool | None = None
    window_size: tuple[int, int] | None = None
    max_segments_per_seq: int | None = 1
    context_parallel_causal_load_balanced: bool = False
    context_parallel_axis: str = ""
    context_parallel_strategy: str = "DEFAULT"
    context_checkpoint_name: str = "context"
    softmax_type: str = "vanilla"
    score_mod: attn.ScoreMod | None = None
    score_mod_bprop: attn.ScoreMod | None = None
    return_max_logit: bool = False
    implementation: str | None = None
    recipe: Recipe | None = None

    def check(self) -> None:
        owner = "DotProductAttention"
        positive_int(self.head_dim, "head_dim")
        positive_int(self.num_attention_heads, "num_attention_heads")
        groups = self.num_gqa_groups or self.num_attention_heads
        if positive_int(groups, "num_gqa_groups") and self.num_attention_heads % groups:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_gqa_groups={groups}; choose num_gqa_groups among the divisors of "
                "num_attention_heads (None: one group per head)"
            )
        rate(self.attention_dropout, "attention_dropout")
        attn.canonical_mask_type(self.attn_mask_type)
        attn.canonical_softmax_type(self.softmax_type)
        if self.qkv_layout.lower() not in _LAYOUTS:
            raise ValueError(
                f"{owner}.qkv_layout={self.qkv_layout!r} is not a TransformerEngine layout; use "
                f"one of {sorted(_LAYOUTS)} (thd: packed documents, same shapes as bshd)"
            )
        if self.max_segments_per_seq is not None:
            positive_int(self.max_segments_per_seq, "max_segments_per_seq")
        cp.canonical_cp_strategy(self.context_parallel_strategy)
        if not isinstance(self.context_parallel_axis, str):
            raise TypeError(
                f"{owner}.context_parallel_axis must be a mesh axis name (str, '' for none), got "
                f"{self.context_parallel_axis!r}"
            )

    def fp8_recipe(self) -> Recipe | None:
        """The recipe of FP8 attention: ``recipe`` (else the active ``te_flax.autocast`` one)
        when its ``fp8_dpa`` is True; None: the attention runs in high precision."""
        return attention_recipe(self.recipe)

    def context_parallel_size(self) -> int:
        """The size of the context-parallel mesh axis (1 without one, or outside a mesh)."""
        axis = self.context_parallel_axis
        mesh = jax.sharding.get_abstract_mesh()
        if not axis or mesh.empty or axis not in mesh.axis_names:
            return 1
        return int(mesh.shape[axis])

    def _context_parallel(
        self,
        query: Array,
        key: Array,
        value: Array,
        mask: Array | None,
        bias: Array | None,
        ids: tuple[Array, Array] | None,
        dropout_rng: Array | None,
        q_offset: Array | int,
        sink: Array | None,
    ) -> Array:
        """The attention with the sequence sharded over ``context_parallel_axis``."""
        mask_type = attn.canonical_mask_type(self.attn_mask_type)
        given = {
            "a bias": bias is not None,
            "attention dropout": dropout_rng is not None,
            "a mask array (pass a SequenceDescriptor)": ids is None and "padding" in mask_type,
            "a bottom-right causal mask": mask_type.endswith("bottom_right"),
            "a decoding offset": not (isinstance(q_offset, int) and q_offset == 0),
            "score_mod": self.score_mod is not None,
            "return_max_logit": self.return_max_logit,
        }
        unsupported = [name for name, present in given.items() if present]
        if unsupported:
            raise ValueError(
                f"DotProductAttention with context parallelism over "
                f"{self.context_parallel_axis!r} ({self.context_parallel_size()} devices) "
                f"supports the no_mask / causal / padding masks of a SequenceDescriptor, "
                f"sliding windows and softmax sinks; got {', '.join(unsupported)}: drop "
                "them, or give the context axis size 1"
            )
        del mask
        scale = self.scale_factor
        return cp.context_parallel_attention(
            query,
            key,
            value,
            axis=self.context_parallel_axis,
            strategy=cp.canonical_cp_strategy(self.context_parallel_strategy),
            load_balanced=self.context_parallel_causal_load_balanced,
            segment_ids=ids,
            causal="causal" in mask_type,
            window=attn._check_window(self.window_size),
            scale=1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale),
            sink=sink,
        )

    def _one_device(
        self,
        query: Array,
        key: Array,
        value: Array,
        mask: Array | None,
        bias: Array | None,
        mask_type: str,
        dropout_rng: Array | None,
        q_offset: Array | int,
        offsets: dict[str, Array],
        score_mod_tensors: Mapping[str, Any] | None,
        score_mod_bprop_tensors: Mapping[str, Any] | None,
        quantizers: AttentionQuantizers | None,
    ) -> Array | tuple[Array, Array]:
        return attn.dot_product_attention(
            query,
            key,
            value,
            mask,
            bias,
            attn_mask_type=mask_type,
            attn_bias_type=self.attn_bias_type,
            scale_factor=self.scale_factor,
            window_size=self.window_size,
            dropout_rate=self.attention_dropout,
            dropout_rng=dropout_rng,
            q_offset=q_offset,
            implementation=self.implementation,
            score_mod=self.score_mod,
            score_mod_bprop=self.score_mod_bprop,
            score_mod_tensors=score_mod_tensors,
            score_mod_bprop_tensors=score_mod_bprop_tensors,
            return_max_logit=self.return_max_logit,
            softmax_type=self.softmax_type,
            softmax_offset=offsets.get("softmax_offset"),
            quantizers=quantizers,
        )

    def children(self) -> dict[str, Child]:
        return {}

    def param_specs(self) -> list[ParamSpec]:
        """The learned attention sink of ``softmax_type="learnable"``: one logit per head,
        float32 whatever the parameter dtype, zero at first (TE's ``softmax_offset``)."""
        if attn.canonical_softmax_type(self.softmax_type) != "learnable":
            return []
        shape = (1, self.num_attention_heads, 1, 1)
        return [ParamSpec("softmax_offset", shape, float32_zeros, (None, "heads", None, None))]

    def forward(
        self,
        host: Host,
        query: Array,
        key: Array | None,
        value: Array | None,
        mask: Array | SequenceDescriptor | None = None,
        bias: Array | None = None,
        *,
        deterministic: bool = False,
        q_offset: Array | int = 0,
        score_mod_tensors: Mapping[str, Any] | None = None,
        score_mod_bprop_tensors: Mapping[str, Any] | None = None,
        sequence_descriptor: Array | SequenceDescriptor | None = None,
        quantizers: AttentionQuantizers | None = None,
    ) -> Array | tuple[Array, Array]:
        """The attention; ``quantizers``: the FP8 attention's quantizer sets, made by the shell
        from its FP8 state when ``fp8_recipe()`` is not None (None: high precision)."""
        self.check()
        if sequence_descriptor is not None:
            if mask is not None:
                raise ValueError(
                    "pass the mask or the sequence_descriptor, not both (TE's call takes one)"
                )
            mask = sequence_descriptor
        layout = _LAYOUTS[self.qkv_layout.lower()]
        if layout == "bs3hd":  # query is [b, s, 3, h, d]
            query, key, value = (query[..., i, :, :] for i in range(3))
        elif layout == "bshd_bs2hd" and key is not None:  # key is [b, s, 2, h, d]
            key, value = key[..., 0, :, :], key[..., 1, :, :]
        if key is None or value is None:
            raise ValueError(f"qkv_layout={layout!r} needs key and value tensors")
        input_dtype = query.dtype
        query, key, value = (compute(t, self.dtype) for t in (query, key, value))
        if self.transpose_batch_sequence:  # [s, b, h, d] -> [b, s, h, d]
            query, key, value = (jnp.swapaxes(t, 0, 1) for t in (query, key, value))
        if query.shape[2] != self.num_attention_heads:
            raise ValueError(
                f"query has {query.shape[2]} heads (shape {query.shape}) but "
                f"num_attention_heads={self.num_attention_heads}; set num_attention_heads to "
                "the input's heads axis (axis 2 of [batch, seq, heads, head_dim])"
            )
        if query.shape[3] != self.head_dim:
            raise ValueError(
                f"query has head_dim {query.shape[3]} (shape {query.shape}) but "
                f"head_dim={self.head_dim}; set head_dim to the input's last axis"
            )
        dropout_rng = None
        if not deterministic and self.attention_dropout > 0:
            dropout_rng = host.rng(self.dropout_rng_name)
        offsets = {spec.name: host.param(spec) for spec in self.param_specs()}
        mask_type = self.attn_mask_type
        ids = None
        if isinstance(mask, SequenceDescriptor):
            # Documents: a key of another document (or padding) is masked out, as a padding
            # mask; causality and windows then apply within each document.
            ids, _ = segment_ids_and_pos(mask, query.shape[1], key.shape[1])
            mask = padding_mask(ids)
            mask_type = _WITH_PADDING[attn.canonical_mask_type(mask_type)]
        if self.context_parallel_size() > 1:
            if quantizers is not None:
                raise ValueError(
                    f"FP8 attention (recipe {self.fp8_recipe()} with fp8_dpa=True) is not built "
                    f"for context parallelism (context_parallel_axis="
                    f"{self.context_parallel_axis!r}, {self.context_parallel_size()} devices): "
                    "the ring and all-gather attention run in high precision. Use a recipe with "
                    "fp8_dpa=False (the projections stay FP8), or give the context axis size 1"
                )
            attn._check_qkv(query, key, value)
            sink = attn._sink_logit(
                attn.canonical_softmax_type(self.softmax_type),
                offsets.get("softmax_offset"),
                query.shape[2],
            )
            result: Array | tuple[Array, Array] = self._context_parallel(
                query, key, value, mask, bias, ids, dropout_rng, q_offset, sink
            )
        else:
            result = self._one_device(
                query, key, value, mask, bias, mask_type, dropout_rng, q_offset, offsets,
                score_mod_tensors, score_mod_bprop_tensors, quantizers,
            )  # fmt: skip
        out, max_logit = result if isinstance(result, tuple) else (result, None)
        out = checkpoint_name(out, self.context_checkpoint_name)
        if self.transpose_batch_sequence:
            out = jnp.swapaxes(out, 0, 1)
        if max_logit is None:
            return out.astype(input_dtype)
        return out.astype(input_dtype), max_logit.astype(input_dtype)


# ---------------------------------------------------------------------------- MultiHeadAttention


@dataclasses.dataclass
class MultiHeadAttentionSpec:
    """Norm + Q/K/V projections, rotary embeddings, attention (with a KV cache), output GEMM."""

    head_dim: int = REQUIRED
    num_attention_heads: int = REQUIRED
    num_gqa_groups: int | None = None
    attention_dropout: float = 0.0
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
    param_dtype: Any = jnp.float32
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
    recipe: Recipe | None = None
    implementation: str | None = None
    # TE's deprecated spellings, refused with the name to use.
    num_heads: int | None = None
    dropout_rate: float | None = None
    output_layernorm: bool | None = None
    apply_residual_connection_post_layernorm: bool | None = None
    fuse_qkv: bool | None = None

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

    def _attention(self) -> DotProductAttentionSpec:
        return DotProductAttentionSpec(
            **ATTENTION_FROM_MHA.copy(
                self,
                num_gqa_groups=self.groups,
                scale_factor=1.0 / math.sqrt(self.head_dim) if self.scale_attn_logits else 1.0,
                transpose_batch_sequence=False,  # the projections are laid out here
            )
        )

    def param_specs(self) -> list[ParamSpec]:
        """The attention's own parameters (the learned sink), besides the projections'."""
        return self._attention().param_specs()

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
            children["qkv"] = Child(LayerNormDenseGeneralSpec, dict(
                features=(3, heads * head_dim),
                kernel_init=_stacked_init(kernel_init, 3, query_scale),
                kernel_axes=("embed", "qkv", "heads"),
                bias_axes=("qkv", "heads"),
                return_layernorm_output=self.return_layernorm_output,
                **norm, **common,
            ), in_features)  # fmt: skip
        else:
            children["query"] = Child(LayerNormDenseGeneralSpec, dict(
                features=heads * head_dim,
                kernel_init=_scaled_init(kernel_init, query_scale),
                kernel_axes=("embed", "heads"),
                bias_axes=("heads",),
                return_layernorm_output=True,
                **norm, **common,
            ), in_features)  # fmt: skip
            if self.fuse_qkv_params:
                children["kv"] = Child(DenseGeneralSpec, dict(
                    features=(2, groups * head_dim),
                    kernel_init=_stacked_init(kernel_init, 2),
                    kernel_axes=("embed", "qkv", "heads"),
                    bias_axes=("qkv", "heads"),
                    **projections, **common,
                ))  # fmt: skip
            else:
                for name in ("key", "value"):
                    children[name] = Child(DenseGeneralSpec, dict(
                        features=groups * head_dim,
                        kernel_init=kernel_init,
                        kernel_axes=("embed", "heads"),
                        bias_axes=("heads",),
                        **projections, **common,
                    ))  # fmt: skip
        children["out"] = Child(DenseGeneralSpec, dict(
            features=in_features,
            kernel_init=kernel_init,
            kernel_axes=("heads", "embed"),
            bias_axes=("embed",),
            enable_low_rank_adaptation=lora_out,
            input_axes=axes.context,
            **common,
        ), heads * head_dim)  # fmt: skip
        return children

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
    DotProductAttentionSpec,
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


# ------------------------------------------------------------------------ RelativePositionBiases


# Flax's default_embed_init, TE's default for the relative position table.
_EMBED_INIT = jax.nn.initializers.variance_scaling(1.0, "fan_in", "normal", out_axis=0)


@dataclasses.dataclass
class RelativePositionBiasesSpec:
    """T5's learned relative position bias: ``rel_embedding[heads, buckets]`` looked up."""

    num_buckets: int = REQUIRED
    max_distance: int = REQUIRED
    num_attention_heads: int = REQUIRED
    embedding_init: Initializer = _EMBED_INIT
    embedding_axes: tuple[str | None, ...] = ("heads", "relpos_buckets")
    dtype: Any = None
    param_dtype: Any = jnp.float32

    def shape(self) -> tuple[int, int]:
        positive_int(self.num_buckets, "num_buckets")
        positive_int(self.max_distance, "max_distance")
        return (positive_int(self.num_attention_heads, "num_attention_heads"), self.num_buckets)

    def forward(
        self, embedding: Array, q_seqlen: int, k_seqlen: int, bidirectional: bool = True
    ) -> Array:
        """``[1, heads, q_seqlen, k_seqlen]`` biases."""
        buckets = attn.relative_position_buckets(
            q_seqlen, k_seqlen, self.num_buckets, self.max_distance, bidirectional
        )  # [q, k] static
        dtype = self.dtype or embedding.dtype
        return jnp.take(embedding.astype(dtype), jnp.asarray(buckets), axis=1)[None]
