"""The description of ``DotProductAttention``: scaled dot-product attention over
``[batch, seq, heads, head_dim]``, TransformerEngine's attributes, no parameters but a learned
attention sink (the functional attention is ``te_flax.attention``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax import Array
from jax.ad_checkpoint import checkpoint_name

from te_flax import attention as attn
from te_flax._layers.base import ParamRecord
from te_flax._layers.composite import (
    AttentionHeads,
    compute,
    float32_zeros,
    positive_int,
    rate,
)
from te_flax._layers.host import Child, Host, Layer
from te_flax._ops.attention import check_qkv, check_window, sink_logit
from te_flax._ops.fp8_attention import (
    AttentionQuantizers,
    attention_quantizers,
    attention_recipe,
)
from te_flax._ops.packing import SequenceDescriptor, padding_mask, segment_ids_and_pos
from te_flax._parallel import context as cp
from te_flax.quantize import Recipe

__all__ = ["DotProductAttentionDescription"]

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
class DotProductAttentionDescription(Layer, AttentionHeads):
    """Scaled dot-product attention over ``[batch, seq, heads, head_dim]`` (no parameters)."""

    # TransformerEngine's fields, in its order, after AttentionHeads'.

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
    # te_flax's.
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

    def quantizers(self, host: Host) -> AttentionQuantizers | None:
        """FP8 attention's quantizer sets, their delayed-scaling state the module's
        (``host.fp8_state``), or None when the recipe has no ``fp8_dpa``."""
        recipe = self.fp8_recipe()
        if recipe is None:
            return None
        return attention_quantizers(recipe, lambda postfix: host.fp8_state(recipe, postfix))

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
        descriptor: SequenceDescriptor | None,
        dropout_rng: Array | None,
        q_offset: Array | int,
        sink: Array | None,
    ) -> Array:
        """The attention with the sequence sharded over ``context_parallel_axis``."""
        mask_type = attn.canonical_mask_type(self.attn_mask_type)
        given = {
            "a bias": bias is not None,
            "attention dropout": dropout_rng is not None,
            "a mask array (pass a SequenceDescriptor)": descriptor is None
            and "padding" in mask_type,
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
        balanced = self.context_parallel_causal_load_balanced
        segments = None
        if descriptor is not None:  # its ids and positions say where each token lies
            segments = cp.descriptor_segments(
                descriptor, query.shape[1], key.shape[1], self.context_parallel_size(), balanced
            )
        return cp.context_parallel_attention(
            query,
            key,
            value,
            axis=self.context_parallel_axis,
            strategy=cp.canonical_cp_strategy(self.context_parallel_strategy),
            load_balanced=balanced,
            segments=segments,
            causal="causal" in mask_type,
            window=check_window(self.window_size),
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

    def param_records(self) -> list[ParamRecord]:
        """The learned attention sink of ``softmax_type="learnable"``: one logit per head,
        float32 whatever the parameter dtype, zero at first (TE's ``softmax_offset``)."""
        if attn.canonical_softmax_type(self.softmax_type) != "learnable":
            return []
        shape = (1, self.num_attention_heads, 1, 1)
        return [ParamRecord("softmax_offset", shape, float32_zeros, (None, "heads", None, None))]

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
        host = self.host()
        return self.forward(
            host,
            query,
            key,
            value,
            mask,
            bias,
            deterministic=deterministic,
            score_mod_tensors=score_mod_tensors,
            score_mod_bprop_tensors=score_mod_bprop_tensors,
            sequence_descriptor=sequence_descriptor,
            quantizers=self.quantizers(host),
        )

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
        """The attention, reaching the learned sink and the dropout stream through ``host``
        (a ``MultiHeadAttention`` runs it with its own); ``quantizers``: the FP8 attention's
        quantizer sets (``quantizers(host)``; None: high precision)."""
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
        offsets = {record.name: host.param(record) for record in self.param_records()}
        mask_type = self.attn_mask_type
        descriptor = None
        if isinstance(mask, SequenceDescriptor):
            # Documents: a key of another document (or padding) is masked out, as a padding
            # mask; causality and windows then apply within each document.
            descriptor = mask
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
            check_qkv(query, key, value)
            sink = sink_logit(
                attn.canonical_softmax_type(self.softmax_type),
                offsets.get("softmax_offset"),
                query.shape[2],
            )
            result: Array | tuple[Array, Array] = self._context_parallel(
                query, key, value, mask, bias, descriptor, dropout_rng, q_offset, sink
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
