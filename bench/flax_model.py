"""Model-level peers written with Flax's own FP8 ops, and a scanned language model shell.

``FlaxBlock`` is the pre-norm transformer block of te_flax's ``TransformerLayer`` and of the
example GPT's ``Block`` written as a Flax user writes it without te_flax: ``nn.LayerNorm``,
``nn.DenseGeneral`` projections (QKV as one ``[3, heads, head_dim]`` projection, the output
projection, the MLP of ``bench.models.FlaxLayerNormMLP``), with
``flax.linen.fp8_ops.Fp8DirectDotGeneralOp`` under FP8, and cuDNN's fused attention through
``jax.nn.dot_product_attention`` (the call te_flax's ``DotProductAttention`` makes on a GPU).

``ScannedLM`` is the example GPT's shell (tied byte embedding, learned positions, the blocks
stacked with ``nn.scan``, a final norm) around either block, optionally with ``nn.remat`` on
each block; with ``remat="off"`` and the example's ``Block`` it is the example's ``GPT``.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from bench.models import (
    ACTIVATION_DTYPE,
    EPSILON,
    PARAM_DTYPE,
    FlaxLayerNormMLP,
    _flax_dense,
    _flax_norm,
)

__all__ = ["FlaxBlock", "ScannedLM"]


class FlaxBlock(nn.Module):
    """``x + attention(norm(x))`` then ``x + mlp(norm(x))`` with Flax layers; ``(x, _) -> (x,
    None)`` as ``nn.scan`` calls a block."""

    heads: int
    head_dim: int
    mlp_dim: int
    activations: tuple[str, ...] = ("gelu",)
    fp8: bool = False
    attention: str = "cudnn"  # jax.nn.dot_product_attention's implementation

    @nn.compact
    def __call__(self, x, _=None):  # [batch, seq, hidden]
        batch, seq, hidden = x.shape
        y = _flax_norm()(x)
        qkv = _flax_dense((3, self.heads, self.head_dim), self.fp8, "qkv")(y)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]  # [batch, seq, heads, head_dim]
        attended = jax.nn.dot_product_attention(
            q, k, v, is_causal=True, implementation=self.attention
        )
        attended = attended.reshape(batch, seq, self.heads * self.head_dim)
        x = x + _flax_dense(hidden, self.fp8, "out")(attended)
        x = x + FlaxLayerNormMLP(self.mlp_dim, self.activations, self.fp8, name="mlp")(x)
        return x, None


class ScannedLM(nn.Module):
    """Embedding, ``layers`` blocks under ``nn.scan`` (each with its own parameters and FP8
    state), a final norm and the tied output projection. ``remat``: ``"on"`` (``nn.remat`` on
    each block, nothing saved), ``"dots"`` (``nn.remat`` saving the GEMM outputs,
    ``dots_with_no_batch_dims_saveable``) or ``"off"``."""

    block: Any  # a block class called as (x, _) -> (x, None)
    block_attributes: dict
    vocab_size: int
    d_model: int
    layers: int
    remat: str = "on"
    te_final_norm: bool = True  # te_flax's LayerNorm (the example's) or Flax's

    @nn.compact
    def __call__(self, tokens):  # int32[batch, seq] -> f32[batch, seq, vocab]
        from te_flax.linen import LayerNorm
        from te_flax.training import OVERWRITE_WITH_GRADIENT

        embed = nn.Embed(self.vocab_size, self.d_model, param_dtype=PARAM_DTYPE, name="embed")
        positions = self.param(
            "positions", nn.initializers.normal(0.02), (tokens.shape[1], self.d_model)
        )
        x = (embed(tokens) + positions[None]).astype(ACTIVATION_DTYPE)
        block = self.block
        if self.remat != "off":
            policy = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
            policy = policy if self.remat == "dots" else None
            block = nn.remat(block, prevent_cse=False, policy=policy)
        blocks = nn.scan(
            block,
            variable_axes={"params": 0, OVERWRITE_WITH_GRADIENT: 0, "intermediates": 0},
            split_rngs={"params": True},
            length=self.layers,
            metadata_params={nn.PARTITION_NAME: "layers"},
        )
        x, _ = blocks(**self.block_attributes, name="blocks")(x, None)
        norm = LayerNorm if self.te_final_norm else nn.LayerNorm
        x = norm(epsilon=EPSILON, dtype=jnp.float32, name="final_norm")(x)
        return embed.attend(x)
