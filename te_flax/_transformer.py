"""Framework-neutral descriptions of TransformerEngine's attention and transformer layers.

Each description is a dataclass of the layer's attributes (TE's names and defaults; Flax's
``dtype``/``param_dtype``) with two methods: ``children(...)`` names the sublayers it is made
of (te_flax's own ``LayerNormDenseGeneral``, ``DenseGeneral``, ``LayerNormMLP``, ``LayerNorm``,
``Dropout``, and the layers of this file) with their attributes, and ``forward(host, ...)``
runs the layer, reaching its sublayers, RNG streams and decoding cache through ``host``. The
Linen shell builds the children lazily inside its compact call; the NNX shell builds them once
at construction. Both run the same ``forward``, so the two front ends cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, NamedTuple, Protocol

import einops
import jax
import jax.numpy as jnp
from jax import Array, lax
from jax.ad_checkpoint import checkpoint_name

from te_flax import _validation as check
from te_flax import attention as attn
from te_flax._layers import ParamSpec
from te_flax.quantize import Recipe
from te_flax.sharding import with_logical_constraint

__all__ = [
    "CacheSlots",
    "Child",
    "DotProductAttentionSpec",
    "Host",
    "MultiHeadAttentionSpec",
    "RelativePositionBiasesSpec",
    "TransformerLayerSpec",
    "TransformerLayerType",
]

Initializer = Callable[..., Array]
LogicalAxes = tuple[str | None, ...]
# The default of attributes the user must give (the dataclass fields need one): checked in use.
_REQUIRED: Any = None


class TransformerLayerType(enum.Enum):
    """The kind of ``TransformerLayer``: ENCODER (self-attention, MLP) or DECODER (+ cross)."""

    ENCODER = "encoder"
    DECODER = "decoder"


class Child(NamedTuple):
    """A sublayer: its kind (a te_flax layer or ``"Dropout"``), attributes and input size.

    ``in_features`` is the NNX constructor's input size (``(query, key/value)`` sizes for a
    cross-attention); Linen reads it from the input.
    """

    kind: str
    attributes: dict[str, Any]
    in_features: int | tuple[int, int] | None = None


class CacheSlots(NamedTuple):
    """The decoding cache: keys, values and the next position, each read and set as ``.value``."""

    key: Any
    value: Any
    index: Any


class Host(Protocol):
    """What a shell gives ``forward``: its sublayers, RNG keys and decoding cache."""

    def layer(self, name: str) -> Callable[..., Any]: ...

    def rng(self, stream: str) -> Array: ...

    def cache(self, shape: tuple[int, ...], dtype: Any) -> tuple[CacheSlots, bool]:
        """The cache slots, and whether they were created by this call (nothing cached yet)."""
        ...

    def param(self, spec: ParamSpec) -> Array:
        """The module's own parameter ``spec.name`` (created from ``spec`` where needed)."""
        ...


def _float32_zeros(key: Array, shape: tuple[int, ...], dtype: Any = jnp.float32) -> Array:
    """Zeros in float32 whatever ``dtype`` (TE keeps the attention sink in float32)."""
    del key, dtype
    return jnp.zeros(shape, jnp.float32)


def _normal_fan_in() -> Initializer:
    """TE's attention kernel init: variance scaling 1.0, fan-in, normal (not truncated)."""
    return jax.nn.initializers.variance_scaling(1.0, "fan_in", "normal")


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


def _refuse(owner: str, option: str, value: object, default: object, instead: str) -> None:
    if value != default:
        raise NotImplementedError(
            f"{owner}.{option}={value!r} is not supported by te_flax; {instead}"
        )


def _positive_int(value: object, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def _rate(value: object, name: str) -> float:
    return check.check_rate(value, name)


def _compute(x: Array, dtype: Any) -> Array:
    dtype = check.check_dtype(dtype, "dtype")
    return x if dtype is None else x.astype(dtype)


class _Axes:
    """Logical axes of the activations, in te_flax's vocabulary (``configs/rules``)."""

    def __init__(self, transpose_batch_sequence: bool, sequence_parallel: bool = False):
        self.transpose = transpose_batch_sequence
        self.sequence_parallel = sequence_parallel

    def _lead(self, length: str | None) -> tuple[str | None, str | None]:
        return (length, "batch") if self.transpose else ("batch", length)

    @property
    def residual(
        self,
    ) -> LogicalAxes:  # [batch, seq, hidden]: the norm inputs, split over seq under SP
        return (*self._lead("length" if self.sequence_parallel else None), "act_embed")

    @property
    def gemm_input(self) -> LogicalAxes:  # [batch, seq, hidden], the sequence gathered
        return (*self._lead(None), "act_embed")

    @property
    def heads(self) -> LogicalAxes:  # [batch, seq, heads, head_dim]
        return (*self._lead(None), "act_heads", None)

    @property
    def context(self) -> LogicalAxes:  # [batch, seq, heads * head_dim]
        return (*self._lead(None), "act_heads")

    @property
    def mlp_hidden(self) -> LogicalAxes:  # [batch, seq, intermediate]
        return (*self._lead(None), "act_mlp")


def _lora_scope(scope: object) -> tuple[bool, bool, bool]:
    """TE's ``low_rank_adaptation_scope`` -> LoRA on (qkv projections, output, MLP)."""
    scopes = {
        "none": (False, False, False),
        "all": (True, True, True),
        "qkv_proj": (True, False, False),
        "output_proj": (False, True, False),
        "mlp": (False, False, True),
        "exclude_qkv_proj": (False, True, True),
        "exclude_output_proj": (True, False, True),
        "exclude_mlp": (True, True, False),
    }
    name = "none" if scope is None else str(scope).lower()
    if name not in scopes:
        raise ValueError(
            f"low_rank_adaptation_scope must be one of {sorted(scopes)}, got {scope!r}"
        )
    return scopes[name]


# ---------------------------------------------------------------------------- DotProductAttention

_PACKED_LAYOUTS = ("bs3hd", "bshd_bs2hd", "bshd_bshd_bshd")


@dataclasses.dataclass
class DotProductAttentionSpec:
    """Scaled dot-product attention over ``[batch, seq, heads, head_dim]`` (no parameters)."""

    head_dim: int = _REQUIRED
    num_attention_heads: int = _REQUIRED
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

    def check(self) -> None:
        owner = "DotProductAttention"
        _positive_int(self.head_dim, "head_dim")
        _positive_int(self.num_attention_heads, "num_attention_heads")
        groups = self.num_gqa_groups or self.num_attention_heads
        if _positive_int(groups, "num_gqa_groups") and self.num_attention_heads % groups:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_gqa_groups={groups}; choose num_gqa_groups among the divisors of "
                "num_attention_heads (None: one group per head)"
            )
        _rate(self.attention_dropout, "attention_dropout")
        attn.canonical_mask_type(self.attn_mask_type)
        attn.canonical_softmax_type(self.softmax_type)
        if self.qkv_layout.lower() not in _PACKED_LAYOUTS:
            raise NotImplementedError(
                f"{owner}.qkv_layout={self.qkv_layout!r} is not supported by te_flax; use one of "
                f"{_PACKED_LAYOUTS} (sequence packing, the thd layouts: pad the sequences and "
                "pass a padding mask instead)"
            )
        _refuse(
            owner,
            "max_segments_per_seq",
            self.max_segments_per_seq,
            1,
            "sequence packing is not supported: pad the sequences and use a padding mask",
        )
        cp = "context parallelism is not supported: shard the sequence with the tp_sp rule set"
        _refuse(owner, "context_parallel_axis", self.context_parallel_axis, "", cp)
        _refuse(
            owner,
            "context_parallel_causal_load_balanced",
            self.context_parallel_causal_load_balanced,
            False,
            cp,
        )
        _refuse(owner, "context_parallel_strategy", str(self.context_parallel_strategy).upper(),
                "DEFAULT", cp)  # fmt: skip

    def children(self) -> dict[str, Child]:
        return {}

    def param_specs(self) -> list[ParamSpec]:
        """The learned attention sink of ``softmax_type="learnable"``: one logit per head,
        float32 whatever the parameter dtype, zero at first (TE's ``softmax_offset``)."""
        if attn.canonical_softmax_type(self.softmax_type) != "learnable":
            return []
        shape = (1, self.num_attention_heads, 1, 1)
        return [ParamSpec("softmax_offset", shape, _float32_zeros, (None, "heads", None, None))]

    def forward(
        self,
        host: Host,
        query: Array,
        key: Array | None,
        value: Array | None,
        mask: Array | None = None,
        bias: Array | None = None,
        *,
        deterministic: bool = False,
        q_offset: Array | int = 0,
        score_mod_tensors: Mapping[str, Any] | None = None,
        score_mod_bprop_tensors: Mapping[str, Any] | None = None,
    ) -> Array | tuple[Array, Array]:
        self.check()
        layout = self.qkv_layout.lower()
        if layout == "bs3hd":  # query is [b, s, 3, h, d]
            query, key, value = (query[..., i, :, :] for i in range(3))
        elif layout == "bshd_bs2hd" and key is not None:  # key is [b, s, 2, h, d]
            key, value = key[..., 0, :, :], key[..., 1, :, :]
        if key is None or value is None:
            raise ValueError(f"qkv_layout={layout!r} needs key and value tensors")
        input_dtype = query.dtype
        query, key, value = (_compute(t, self.dtype) for t in (query, key, value))
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
        out = attn.dot_product_attention(
            query,
            key,
            value,
            mask,
            bias,
            attn_mask_type=self.attn_mask_type,
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
        )
        max_logit = None
        if isinstance(out, tuple):
            out, max_logit = out
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

    head_dim: int = _REQUIRED
    num_attention_heads: int = _REQUIRED
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
        _lora_scope(self.low_rank_adaptation_scope)

    def _attention(self) -> DotProductAttentionSpec:
        return DotProductAttentionSpec(
            head_dim=self.head_dim,
            num_attention_heads=self.num_attention_heads,
            num_gqa_groups=self.groups,
            attention_dropout=self.attention_dropout,
            attn_mask_type=self.attn_mask_type,
            attn_bias_type=self.attn_bias_type,
            dropout_rng_name=self.dropout_rng_name,
            float32_logits=self.float32_logits,
            scale_factor=1.0 / math.sqrt(self.head_dim) if self.scale_attn_logits else 1.0,
            transpose_batch_sequence=False,  # the projections are laid out here
            window_size=self.window_size,
            softmax_type=self.softmax_type,
            score_mod=self.score_mod,
            score_mod_bprop=self.score_mod_bprop,
            implementation=self.implementation,
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
        axes = _Axes(bool(self.transpose_batch_sequence), self.enable_sequence_parallel)
        lora_qkv, lora_out, _ = _lora_scope(self.low_rank_adaptation_scope)
        kernel_init = self.kernel_init or _normal_fan_in()
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
            children["qkv"] = Child("LayerNormDenseGeneral", dict(
                features=(3, heads * head_dim),
                kernel_init=_stacked_init(kernel_init, 3, query_scale),
                kernel_axes=("embed", "qkv", "heads"),
                bias_axes=("qkv", "heads"),
                return_layernorm_output=self.return_layernorm_output,
                **norm, **common,
            ), in_features)  # fmt: skip
        else:
            children["query"] = Child("LayerNormDenseGeneral", dict(
                features=heads * head_dim,
                kernel_init=_scaled_init(kernel_init, query_scale),
                kernel_axes=("embed", "heads"),
                bias_axes=("heads",),
                return_layernorm_output=True,
                **norm, **common,
            ), in_features)  # fmt: skip
            if self.fuse_qkv_params:
                children["kv"] = Child("DenseGeneral", dict(
                    features=(2, groups * head_dim),
                    kernel_init=_stacked_init(kernel_init, 2),
                    kernel_axes=("embed", "qkv", "heads"),
                    bias_axes=("qkv", "heads"),
                    **projections, **common,
                ))  # fmt: skip
            else:
                for name in ("key", "value"):
                    children[name] = Child("DenseGeneral", dict(
                        features=groups * head_dim,
                        kernel_init=kernel_init,
                        kernel_axes=("embed", "heads"),
                        bias_axes=("heads",),
                        **projections, **common,
                    ))  # fmt: skip
        children["out"] = Child("DenseGeneral", dict(
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
        mask: Array | None,
        bias: Array | None,
        *,
        self_attention: bool,
        deterministic: bool,
        decode: bool,
        score_mod_tensors: Mapping[str, Any] | None = None,
        score_mod_bprop_tensors: Mapping[str, Any] | None = None,
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
        axes = _Axes(bool(self.transpose_batch_sequence), self.enable_sequence_parallel)
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
                step = slots, self._check_step(slots, key)
                offset = step[1]
        if self.enable_rotary_pos_emb:  # positions count from the cache index when decoding
            query, key = self._rotate(query, offset), self._rotate(key, offset)
        if step is not None:
            key, value, bias = self._write_cache(step[0], key, value, bias, step[1])
        query, key, value = (
            with_logical_constraint(t, _Axes(False).heads) for t in (query, key, value)
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
        )  # [b, s, heads, head_dim]
        assert not isinstance(context, tuple), "the projections' attention returns no max logit"
        if self.transpose_batch_sequence:
            context = jnp.swapaxes(context, 0, 1)
        context = einops.rearrange(context, "x y h d -> x y (h d)")
        context = with_logical_constraint(context, axes.context)
        out = checkpoint_name(host.layer("out")(context), "out_proj")
        return out.astype(inputs_q.dtype), ln_out if self.return_layernorm_output else None

    def _rotate(self, x: Array, offset: Array | int) -> Array:
        positions = jnp.arange(x.shape[1]) + offset
        return attn.rotary_pos_emb(
            x, self.rotary_pos_emb_windows, False, self.rotary_pos_emb_group_method, positions
        )

    @staticmethod
    def _check_step(slots: CacheSlots, key: Array) -> Array:
        cached = slots.key.value.shape  # [batch, max_length, groups, head_dim]
        if key.shape != (cached[0], 1, *cached[2:]):
            raise ValueError(
                f"a decoding step takes one token per sequence: expected keys of shape "
                f"{(cached[0], 1, *cached[2:])} for the cache {cached}, got {key.shape}"
            )
        return slots.index.value.astype(jnp.int32)

    @staticmethod
    def _write_cache(
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


# ------------------------------------------------------------------------ RelativePositionBiases


# Flax's default_embed_init, TE's default for the relative position table.
_EMBED_INIT = jax.nn.initializers.variance_scaling(1.0, "fan_in", "normal", out_axis=0)


@dataclasses.dataclass
class RelativePositionBiasesSpec:
    """T5's learned relative position bias: ``rel_embedding[heads, buckets]`` looked up."""

    num_buckets: int = _REQUIRED
    max_distance: int = _REQUIRED
    num_attention_heads: int = _REQUIRED
    embedding_init: Initializer = _EMBED_INIT
    embedding_axes: tuple[str | None, ...] = ("heads", "relpos_buckets")
    dtype: Any = None
    param_dtype: Any = jnp.float32

    def shape(self) -> tuple[int, int]:
        _positive_int(self.num_buckets, "num_buckets")
        _positive_int(self.max_distance, "max_distance")
        return (_positive_int(self.num_attention_heads, "num_attention_heads"), self.num_buckets)

    def forward(
        self, embedding: Array, q_seqlen: int, k_seqlen: int, bidirectional: bool = True
    ) -> Array:
        """``[1, heads, q_seqlen, k_seqlen]`` biases."""
        buckets = attn.relative_position_buckets(
            q_seqlen, k_seqlen, self.num_buckets, self.max_distance, bidirectional
        )  # [q, k] static
        dtype = self.dtype or embedding.dtype
        return jnp.take(embedding.astype(dtype), jnp.asarray(buckets), axis=1)[None]


# ---------------------------------------------------------------------------- TransformerLayer


@dataclasses.dataclass
class TransformerLayerSpec:
    """Attention block (+ cross-attention for decoders) and MLP, with residuals and dropout."""

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
    param_dtype: Any = jnp.float32
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
    recipe: Recipe | None = None
    implementation: str | None = None

    def check(self) -> None:
        if not isinstance(self.layer_type, TransformerLayerType):
            raise ValueError(
                f"layer_type must be TransformerLayerType.ENCODER or .DECODER, got "
                f"{self.layer_type!r}"
            )
        _positive_int(self.hidden_size, "hidden_size")
        _positive_int(self.mlp_hidden_size, "mlp_hidden_size")
        heads = _positive_int(self.num_attention_heads, "num_attention_heads")
        if self.hidden_size % heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} must be a multiple of num_attention_heads="
                f"{heads} (head_dim = hidden_size / num_attention_heads)"
            )
        for name in ("hidden_dropout", "attention_dropout", "intermediate_dropout", "drop_path"):
            _rate(getattr(self, name), name)

    @property
    def decoder(self) -> bool:
        return self.layer_type == TransformerLayerType.DECODER

    def _attention_attributes(self, **overrides: Any) -> dict[str, Any]:
        attributes = dict(
            head_dim=self.hidden_size // self.num_attention_heads,
            num_attention_heads=self.num_attention_heads,
            num_gqa_groups=self.num_gqa_groups,
            attention_dropout=self.attention_dropout,
            dropout_rng_name=self.dropout_rng_name,
            layernorm_type=self.layernorm_type,
            layernorm_epsilon=self.layernorm_epsilon,
            zero_centered_gamma=self.zero_centered_gamma,
            return_layernorm_output=self.apply_residual_connection_post_layernorm,
            kernel_init=self.mha_kernel_init,
            use_bias=self.use_bias,
            bias_init=self.bias_init,
            enable_rotary_pos_emb=self.enable_rotary_pos_emb,
            rotary_pos_emb_windows=self.rotary_pos_emb_windows,
            rotary_pos_emb_group_method=self.rotary_pos_emb_group_method,
            low_rank_adaptation_scope=self.low_rank_adaptation_scope,
            low_rank_adaptation_dim=self.low_rank_adaptation_dim,
            low_rank_adaptation_alpha=self.low_rank_adaptation_alpha,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            fuse_qkv_params=self.fuse_qkv_params,
            transpose_batch_sequence=self.transpose_batch_sequence,
            enable_sequence_parallel=self.enable_sequence_parallel,
            scale_attn_logits=self.scale_attn_logits,
            scaled_query_init=self.scaled_query_init,
            float32_logits=self.float32_attention_logits,
            window_size=self.window_size,
            softmax_type=self.softmax_type,
            recipe=self.recipe,
            implementation=self.implementation,
        )
        return {**attributes, **overrides}

    def children(self) -> dict[str, Child]:
        self.check()
        hidden = self.hidden_size
        axes = _Axes(bool(self.transpose_batch_sequence), self.enable_sequence_parallel)
        _, _, lora_mlp = _lora_scope(self.low_rank_adaptation_scope)
        children = {}
        if self.enable_relative_embedding and self.relative_embedding is None:
            children["relpos_bias"] = Child("RelativePositionBiases", dict(
                num_buckets=32,
                max_distance=128,
                num_attention_heads=self.num_attention_heads,
                embedding_init=jax.nn.initializers.variance_scaling(1.0, "fan_avg", "uniform"),
                dtype=self.dtype,
                param_dtype=self.param_dtype,
            ))  # fmt: skip
        self_name = "self_attention" if self.decoder else "attention"
        children[self_name] = Child("MultiHeadAttention", self._attention_attributes(
            input_layernorm=not self.output_layernorm,
            attn_mask_type=self.self_attn_mask_type,
            attn_bias_type=self.self_attn_bias_type,
            # As in TE, the score modification is the self-attention's only.
            score_mod=self.score_mod,
            score_mod_bprop=self.score_mod_bprop,
        ), hidden)  # fmt: skip
        dropout = dict(rng_collection=self.dropout_rng_name)
        children["dropout"] = Child("Dropout", dict(
            rate=self.hidden_dropout, broadcast_dims=tuple(self.hidden_dropout_dims), **dropout
        ))  # fmt: skip
        if self.drop_path > 0:
            # Stochastic depth: one draw per sample, broadcast over all but the batch axis.
            batch_axis = 1 if self.transpose_batch_sequence else 0
            others = tuple(a for a in range(3) if a != batch_axis)
            children["stochastic_depth"] = Child(
                "Dropout", dict(rate=self.drop_path, broadcast_dims=others, **dropout)
            )
        if self.decoder:
            children["encoder_decoder_attention"] = Child(
                "MultiHeadAttention",
                self._attention_attributes(
                    input_layernorm=True,
                    attn_mask_type="padding",
                    attn_bias_type="no_bias",
                    # Rotary positions measure distances within one sequence; TE also turns the
                    # decoder's queries against the encoder's keys, which has no meaning and
                    # makes cached decoding (one query, seen as position 0) disagree with the
                    # full forward. The cross-attention here is position-free.
                    enable_rotary_pos_emb=False,
                ),
                hidden,
            )
        children["mlp"] = Child("LayerNormMLP", dict(
            layernorm_type=self.layernorm_type,
            zero_centered_gamma=self.zero_centered_gamma,
            epsilon=self.layernorm_epsilon,
            return_layernorm_output=self.apply_residual_connection_post_layernorm,
            intermediate_dim=self.mlp_hidden_size,
            activations=tuple(self.mlp_activations),
            activation_params=self.mlp_activation_params,
            intermediate_dropout_rng_name=self.dropout_rng_name,
            intermediate_dropout_rate=self.intermediate_dropout,
            intermediate_hidden_dropout_dims=tuple(self.intermediate_dropout_dims),
            kernel_init=self.mlp_kernel_init,
            use_bias=self.use_bias,
            bias_init=self.bias_init,
            enable_low_rank_adaptation=lora_mlp,
            low_rank_adaptation_dim=self.low_rank_adaptation_dim,
            low_rank_adaptation_alpha=self.low_rank_adaptation_alpha,
            layernorm_input_axes=axes.residual,
            dot_1_input_axes=axes.gemm_input,
            dot_2_input_axes=axes.mlp_hidden,
            transpose_batch_sequence=self.transpose_batch_sequence,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            recipe=self.recipe,
        ), hidden)  # fmt: skip
        if self.output_layernorm:
            children["output_layernorm"] = Child("LayerNorm", dict(
                layernorm_type=self.layernorm_type,
                zero_centered_gamma=self.zero_centered_gamma,
                epsilon=self.layernorm_epsilon,
                dtype=self.dtype,
                param_dtype=self.param_dtype,
            ), hidden)  # fmt: skip
        return children

    def forward(
        self,
        host: Host,
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
        self.check()
        if inputs.ndim != 3 or inputs.shape[-1] != self.hidden_size:
            raise ValueError(
                f"inputs must be [batch, seq, hidden_size={self.hidden_size}] ([seq, batch, "
                f"hidden_size] with transpose_batch_sequence), got shape {inputs.shape}; set "
                "hidden_size to the input's last axis"
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
        axes = _Axes(bool(self.transpose_batch_sequence), self.enable_sequence_parallel)
        seq = inputs.shape[0 if self.transpose_batch_sequence else 1]
        bias = None
        if self.enable_relative_embedding:
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
        self_name = "self_attention" if self.decoder else "attention"
        x, ln_out = host.layer(self_name)(
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
        z, ln_out = host.layer("mlp")(x, deterministic=deterministic)
        z = residual_add(z, x, ln_out, drop_path=True)
        if self.output_layernorm:
            z = host.layer("output_layernorm")(z)
        return z.astype(inputs.dtype)
