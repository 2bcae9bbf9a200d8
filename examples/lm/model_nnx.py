"""The same GPT in Flax NNX: te_flax.nnx layers, blocks created with ``nnx.vmap`` and run with
``nnx.scan`` (each layer with its own parameters and FP8 state); with ``model.block=te``,
``te_flax.nnx.TransformerLayer`` blocks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

import te_flax.nnx as te_nnx
from te_flax.attention import dot_product_attention

from .config import ModelConfig
from .model_linen import (
    ACTIVATIONS,
    ATTENTION_AXES,
    COMPUTE_DTYPE,
    GEMM_INPUT_AXES,
    MLP_HIDDEN_AXES,
    RESIDUAL_AXES,
    te_layer_attributes,
)

__all__ = ["GPT"]


class ResidualMLP(te_nnx.LayerNormMLP):
    """A te_flax NNX module extended by subclassing: the MLP adds its input back."""

    def __call__(self, inputs, deterministic: bool = True):
        out, _ = super().__call__(inputs, deterministic)
        return inputs + out


class Block(nnx.Module):
    def __init__(self, c: ModelConfig, *, rngs: nnx.Rngs):
        self.qkv = te_nnx.LayerNormDenseGeneral(
            c.d_model,
            (3, c.heads, c.head_dim),
            kernel_axes=("embed", "qkv", "heads", "kv"),
            layernorm_input_axes=RESIDUAL_AXES,
            dot_input_axes=GEMM_INPUT_AXES,
            dtype=COMPUTE_DTYPE,
            rngs=rngs,
        )
        self.out = te_nnx.DenseGeneral(
            (c.heads, c.head_dim),
            c.d_model,
            axis=(-2, -1),
            use_bias=False,
            kernel_axes=("heads", "kv", "embed"),
            input_axes=ATTENTION_AXES,
            dtype=COMPUTE_DTYPE,
            rngs=rngs,
        )
        self.mlp = ResidualMLP(
            c.d_model,
            intermediate_dim=c.mlp_dim,
            activations=ACTIVATIONS[c.activation],
            layernorm_input_axes=RESIDUAL_AXES,
            dot_1_input_axes=GEMM_INPUT_AXES,
            dot_2_input_axes=MLP_HIDDEN_AXES,
            dtype=COMPUTE_DTYPE,
            rngs=rngs,
        )

    def __call__(self, x):  # [batch, seq, d_model]
        qkv, _ = self.qkv(x)  # [batch, seq, 3, heads, head_dim]
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        attended = dot_product_attention(q, k, v, attn_mask_type="causal")
        x = x + self.out(attended)
        return self.mlp(x)


class TELayer(te_nnx.TransformerLayer):
    """TE's ``TransformerLayer`` called as a block: ``x -> x``, no dropout."""

    def __call__(self, x):  # [batch, seq, d_model]
        return super().__call__(x, deterministic=True)


class GPT(nnx.Module):
    def __init__(self, c: ModelConfig, seq_len: int, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(c.vocab_size, c.d_model, rngs=rngs)
        self.positions = nnx.Param(
            jax.nn.initializers.normal(0.02)(rngs.params(), (seq_len, c.d_model))
        )

        @nnx.split_rngs(splits=c.layers)
        # The layer axis is added to each parameter's sharding metadata, unsharded.
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: None})
        def create_blocks(rngs: nnx.Rngs):
            if c.block == "te":
                return TELayer(**te_layer_attributes(c), rngs=rngs)
            return Block(c, rngs=rngs)

        self.blocks = create_blocks(rngs)
        self.final_norm = te_nnx.LayerNorm(c.d_model, dtype=jnp.float32, rngs=rngs)

    def __call__(self, tokens):  # int32[batch, seq] -> f32[batch, seq, vocab]
        x = (self.embed(tokens) + self.positions[None]).astype(COMPUTE_DTYPE)

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def run_blocks(x, block: Block):
            return block(x)

        x = run_blocks(x, self.blocks)
        return self.embed.attend(self.final_norm(x))
