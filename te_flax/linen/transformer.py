"""TransformerEngine's attention and transformer layers as Linen modules.

``DotProductAttention``, ``MultiHeadAttention``, ``RelativePositionBiases`` and
``TransformerLayer`` with TE's attribute names, defaults, call signatures and parameter tree
(``attention/qkv/kernel``, ``attention/out/kernel``, ``mlp/wi_kernel``, ``relpos_bias/
rel_embedding``, ...). They are built from te_flax's FP8 layers: the QKV projection is one
``LayerNormDenseGeneral``, the output projection a ``DenseGeneral``, the MLP a
``LayerNormMLP``, each with its own FP8 state under the recipe of ``recipe=`` or the active
``te_flax.autocast``. The attention itself (``te_flax.attention``) is quantized only under a
recipe with ``fp8_dpa=True`` (its two GEMMs' FP8 state then lives beside the projections', in
the attention module: ``{x,kernel,grad}_qk_*`` and ``{x,kernel,grad}_pv_*``).

As everywhere in te_flax, ``dtype`` is the compute dtype (None: the input's) and
``param_dtype`` the storage dtype (TE's ``dtype``). Masks are TE's: ``True`` masks a position
out. Autoregressive decoding keeps keys and values in the ``"cache"`` collection
(``cached_key``, ``cached_value``, ``cache_index``): initialise with ``decode=True`` on a
full-length input to size it, then apply one token at a time with ``mutable=["cache"]``.
"""

from __future__ import annotations

import flax.linen as nn  # noqa: F401  (the examples use it)

# The sublayers' modules, registered with the shell as they are defined.
import te_flax.linen.modules
import te_flax.linen.moe  # noqa: F401
from te_flax._layers.attention import (
    DotProductAttentionDescription,
    MultiHeadAttentionDescription,
    RelativePositionBiasesDescription,
)
from te_flax._layers.transformer import TransformerLayerDescription, TransformerLayerType
from te_flax.linen._shell import LinenShell

__all__ = [
    "DotProductAttention",
    "MultiHeadAttention",
    "RelativePositionBiases",
    "TransformerLayer",
    "TransformerLayerType",
]


class DotProductAttention(LinenShell, DotProductAttentionDescription):
    """Scaled dot-product attention: ``softmax(q.k * scale + bias, masked) . v`` per head.

    No parameters. cuDNN's flash attention (``jax.nn.dot_product_attention``) computes it on
    GPUs where it applies (16-bit inputs, no attention dropout), XLA ops elsewhere.

    Attributes:
      head_dim, num_attention_heads: the query's head size and count (required).
      num_gqa_groups: key/value heads (None: ``num_attention_heads``; 1 is multi-query).
      attention_dropout, dropout_rng_name: dropout of the probabilities, from that RNG stream.
      attn_mask_type: ``"no_mask"``, ``"padding"``, ``"causal"`` (default),
        ``"padding_causal"``, ``"causal_bottom_right"``, ``"padding_causal_bottom_right"``.
      attn_bias_type: None (follow ``bias``), ``"no_bias"``, ``"pre_scale_bias"``,
        ``"post_scale_bias"``.
      qkv_layout: ``"bshd_bshd_bshd"`` (default), ``"bshd_bs2hd"`` (key is ``[.., 2, h, d]``)
        or ``"bs3hd"`` (query is ``[.., 3, h, d]``).
      scale_factor: logits scale (None: ``1 / sqrt(head_dim)``).
      transpose_batch_sequence: inputs are ``[seq, batch, ...]`` (default None, as in TE: taken
        as False, ``[batch, seq, ...]``).
      window_size: sliding window ``(left, right)``; -1 is unbounded.
      float32_logits: accepted for TE compatibility; logits are always float32.
      implementation: None (automatic), ``"xla"`` or ``"cudnn"``.
      score_mod, score_mod_bprop: TE's score modification, as JAX functions
        ``score_mod(score, tensors)`` of the float32 scores ``[batch, heads, q, kv]`` (scaled,
        before bias and masks) and its optional backward ``score_mod_bprop(grad, tensors)``;
        ``tensors`` are the call's ``score_mod_tensors`` / ``score_mod_bprop_tensors``. They run
        on the XLA attention (see ``te_flax.attention``).
      return_max_logit: return ``(output, max_logit)``, the per-head maximum score ``[heads]``
        (over batch, queries and attended keys; no gradient), as read by QK-clip.
      softmax_type: ``"vanilla"`` (default), ``"off_by_one"`` (an attention sink of logit 0:
        the softmax denominator gets + 1) or ``"learnable"`` (a learned sink logit per head,
        the float32 parameter ``softmax_offset`` ``[1, heads, 1, 1]``, zero at first); see
        ``te_flax.attention``. A masked position, and every position of a fully masked row
        (a padding query), gets probability 0, as in TE.
      dtype: the compute dtype (None: the inputs').
      recipe: the FP8 recipe (None: the active ``te_flax.autocast`` one). The attention is
        FP8 only when its ``fp8_dpa`` is True (``DelayedScaling`` or ``Float8CurrentScaling``):
        queries, keys, values and probabilities in e4m3, the gradients of the output and the
        scores in e5m2 (``Format.HYBRID``); delayed scaling keeps the state
        ``{x,kernel,grad}_qk_*`` and ``{x,kernel,grad}_pv_*`` (see docs/attention.md).

    Packed documents: pass a ``te_flax.attention.SequenceDescriptor`` as the mask (or as
    ``sequence_descriptor=``, TE's name) with a ``thd`` layout (same shapes as ``bshd``); a
    query then attends only keys of its own document (causality and windows within it). The
    ``MultiHeadAttention`` and ``TransformerLayer`` masks accept one too, and their rotary
    positions restart at each document. Context parallelism: with ``context_parallel_axis``
    naming a mesh axis of two or more devices the sequence is split over it (TE's
    ``"all_gather"`` or ``"ring"`` strategy, inputs in DualChunkSwap order with
    ``context_parallel_causal_load_balanced``); see docs/attention.md.

    Example usage::

      >>> import jax, jax.numpy as jnp
      >>> import te_flax.linen as te_nn
      >>> q = jnp.ones((2, 8, 4, 16))  # [batch, seq, heads, head_dim]
      >>> kv = jnp.ones((2, 8, 2, 16))  # two GQA groups
      >>> dpa = te_nn.DotProductAttention(head_dim=16, num_attention_heads=4, num_gqa_groups=2,
      ...                                 transpose_batch_sequence=False)
      >>> dpa.apply({}, q, kv, kv).shape
      (2, 8, 4, 16)
    """


class MultiHeadAttention(LinenShell, MultiHeadAttentionDescription):
    """Norm, Q/K/V projections, rotary embeddings, attention, output projection.

    Returns ``(out, ln_output or None)`` as TE's does. Self-attention (``inputs_q is
    inputs_kv``) without GQA uses one fused ``qkv`` kernel ``[hidden, 3, heads * head_dim]``
    (``fuse_qkv_params``); otherwise ``query`` (with the norm) and ``kv`` ``[hidden, 2,
    groups * head_dim]``, or ``query``, ``key`` and ``value`` when not fused. The output
    projection is ``out`` ``[heads * head_dim, hidden]``.

    Attributes:
      head_dim, num_attention_heads, num_gqa_groups: head size, query heads, key/value heads.
      attention_dropout, dropout_rng_name, attn_mask_type, attn_bias_type, window_size,
        float32_logits, implementation, score_mod, score_mod_bprop, softmax_type: the
        attention, as in ``DotProductAttention`` (the learned sink is ``softmax_offset`` here).
      input_layernorm, layernorm_type, layernorm_epsilon, zero_centered_gamma: the norm before
        the projections (default on, layernorm, 1e-6).
      return_layernorm_output: also return the norm output.
      kernel_init (None: variance scaling 1.0, fan-in, normal), use_bias (default False),
        bias_init: the projections.
      enable_rotary_pos_emb, rotary_pos_emb_windows (default ``(1, 10000)``),
        rotary_pos_emb_group_method (``"consecutive"`` or ``"alternate"``): rotary embeddings
        of the queries and keys.
      low_rank_adaptation_scope (``"none"``, ``"all"``, ``"qkv_proj"``, ``"output_proj"``,
        ``"exclude_qkv_proj"``, ``"exclude_output_proj"``), low_rank_adaptation_dim,
        low_rank_adaptation_alpha: LoRA on the projections.
      fuse_qkv_params: fused projection kernels (default True).
      transpose_batch_sequence: inputs are ``[seq, batch, hidden]`` (default None, as in TE:
        taken as False, ``[batch, seq, hidden]``).
      enable_sequence_parallel: the norm input's sequence axis has the logical name
        ``"length"`` (split under the ``tp_sp`` rules).
      scale_attn_logits: scale the logits by ``1 / sqrt(head_dim)`` (default False: TE scales
        the query kernel at init instead, ``scaled_query_init=True``).
      dtype, param_dtype, recipe: as in the other te_flax modules.

    Example usage::

      >>> import jax, jax.numpy as jnp
      >>> import te_flax.linen as te_nn
      >>> mha = te_nn.MultiHeadAttention(head_dim=8, num_attention_heads=4,
      ...                                transpose_batch_sequence=False)
      >>> x = jnp.ones((2, 6, 32))
      >>> (out, _), variables = mha.init_with_output(jax.random.key(0), x, x)
      >>> out.shape
      (2, 6, 32)
      >>> jax.tree.map(jnp.shape, nn.meta.unbox(variables))["params"]["qkv"]
      {'kernel': (32, 3, 32), 'ln_bias': (32,), 'scale': (32,)}
    """


class RelativePositionBiases(LinenShell, RelativePositionBiasesDescription):
    """T5-style relative position biases: ``rel_embedding[heads, buckets]`` looked up by bucket.

    Attributes:
      num_buckets, max_distance, num_attention_heads: the table and its bucketing (required).
      embedding_init: initializer of ``rel_embedding`` (default Flax's embedding init).
      embedding_axes: its logical axes (default ``("heads", "relpos_buckets")``).
      dtype, param_dtype: compute and storage dtypes.

    Example usage::

      >>> import jax
      >>> import te_flax.linen as te_nn
      >>> rpb = te_nn.RelativePositionBiases(num_buckets=32, max_distance=128,
      ...                                    num_attention_heads=4)
      >>> bias, variables = rpb.init_with_output(jax.random.key(0), 6, 6)
      >>> bias.shape, variables["params"]["rel_embedding"].value.shape
      ((1, 4, 6, 6), (4, 32))
    """


class TransformerLayer(LinenShell, TransformerLayerDescription):
    """TE's transformer layer: attention, (cross-attention,) MLP, residuals and dropout.

    Pre-norm by default: ``x + attention(norm(x))``, then ``+ mlp(norm(.))``; with
    ``output_layernorm`` the attention's input norm moves to the output. An ENCODER has
    ``attention``; a DECODER ``self_attention``, ``encoder_decoder_attention`` over
    ``encoded`` and a KV cache for ``decode=True``. Relative position biases (``relpos_bias``,
    on by default as in TE) or rotary embeddings give the positions.

    Attributes:
      hidden_size (512), mlp_hidden_size (2048), num_attention_heads (8), num_gqa_groups.
        As in TE, ``hidden_size`` sets the attention width (``head_dim = hidden_size /
        num_attention_heads``); the input may be wider or narrower, and the output projection
        and the MLP return the input's width.
      layernorm_type, layernorm_epsilon, zero_centered_gamma: every norm of the layer.
      hidden_dropout (0.1), hidden_dropout_dims: dropout of each block's output.
      attention_dropout (0.1), intermediate_dropout (0.0), intermediate_dropout_dims,
        dropout_rng_name: the other dropouts and their RNG stream.
      mha_kernel_init, mlp_kernel_init, mlp_activations (default ``("gelu",)``), use_bias,
        bias_init: the projections and the MLP.
      apply_residual_connection_post_layernorm: residuals from the norm outputs.
      output_layernorm: normalize the layer's output rather than the attention's input.
      float32_attention_logits: accepted (logits are float32).
      layer_type: ``TransformerLayerType.ENCODER`` (default) or ``DECODER``.
      self_attn_mask_type (default ``"causal"``), self_attn_bias_type: the self-attention.
      enable_relative_embedding (default True), relative_embedding (a module to use instead
        of the default ``RelativePositionBiases(32 buckets, max_distance 128)``).
      enable_rotary_pos_emb, rotary_pos_emb_windows, rotary_pos_emb_group_method: RoPE.
      low_rank_adaptation_scope (also ``"mlp"``, ``"exclude_mlp"``), low_rank_adaptation_dim,
        low_rank_adaptation_alpha: LoRA.
      drop_path: stochastic depth of the residual branches (default 0).
      fuse_qkv_params, scale_attn_logits, scaled_query_init, window_size,
        enable_sequence_parallel, implementation: as in ``MultiHeadAttention``.
      score_mod, score_mod_bprop: the self-attention's score modification (as in TE, not the
        cross-attention's), with the call's ``score_mod_tensors`` / ``score_mod_bprop_tensors``.
      softmax_type: both attentions' softmax (``"vanilla"``, ``"off_by_one"``, ``"learnable"``),
        as in ``DotProductAttention``.
      transpose_batch_sequence: inputs are ``[seq, batch, hidden]`` (default False).
      dtype, param_dtype, recipe: as in the other te_flax modules.
      moe: None (default: the MLP) or ``MoEBlock`` attributes, e.g. ``{"num_experts": 8,
        "num_experts_per_tok": 2}``: a ``MoEBlock`` (named ``mlp``, with the MLP's norm,
        ``mlp_hidden_size`` per expert and ``mlp_activations``) replaces the MLP; give it to
        every n-th layer for a mixture of experts every n layers. Its aux loss is sown
        (``"intermediates"``, ``aux_loss``): add it to the training loss.

    Example usage::

      >>> import jax, jax.numpy as jnp
      >>> import te_flax.linen as te_nn
      >>> layer = te_nn.TransformerLayer(hidden_size=32, mlp_hidden_size=64,
      ...                                num_attention_heads=4)
      >>> x = jnp.ones((2, 6, 32))
      >>> y, variables = layer.init_with_output(jax.random.key(0), x, deterministic=True)
      >>> y.shape
      (2, 6, 32)
      >>> sorted(variables["params"])
      ['attention', 'mlp', 'relpos_bias']
    """
