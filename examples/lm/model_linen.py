"""The example GPT in Flax Linen, written with te_flax layers the way a user would.

Pre-norm decoder blocks: attention whose QKV projection is one ``LayerNormDenseGeneral`` with
``features=(3, heads, head_dim)``, ``DotProductAttention`` (across the ``context`` mesh axis
with ``mesh.context`` and ``rules=cp``: context parallelism), an output
``DenseGeneral``, then a ``LayerNormMLP`` subclass that adds its own residual. The blocks are
stacked with ``nn.scan``, each layer with its own parameters and FP8 state
(``model.scan=false`` unrolls them, as the kernel path in interpret mode on a CPU needs). With
``model.moe.experts`` each block's MLP is a ``MoEBlock`` (with its pre-norm), whose aux loss
and dropped tokens are sown into ``"intermediates"``. Kernels and activations carry logical
axis names for the rule sets of ``configs/rules``; the (small) embeddings are replicated.

With ``model.block=te`` each block is TransformerEngine's ``TransformerLayer`` instead (the
same pre-norm block, TE's parameter tree), stacked the same way.
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

import te_flax.linen as te_nn
from te_flax.training import OVERWRITE_WITH_GRADIENT

from .config import ModelConfig

__all__ = ["GPT"]

COMPUTE_DTYPE = jnp.bfloat16
ACTIVATIONS = {"gelu": ("gelu",), "swiglu": ("silu", "linear")}
# Logical axes of the activations (configs/rules maps them to the mesh): the residual stream
# and norm inputs, and the inputs of the GEMMs, whose sequence axis is gathered (None).
RESIDUAL_AXES = ("batch", "length", "act_embed")
GEMM_INPUT_AXES = ("batch", None, "act_embed")
ATTENTION_AXES = ("batch", None, "act_heads", None)
MLP_HIDDEN_AXES = ("batch", None, "act_mlp")


class ResidualMLP(te_nn.LayerNormMLP):
    """A te_flax module extended by subclassing: the MLP adds its input back."""

    @nn.compact
    def __call__(self, inputs, deterministic: bool = True):
        out, _ = super().__call__(inputs, deterministic)
        return inputs + out


class ResidualMoE(te_nn.MoEBlock):
    """The mixture of experts with its own residual; it sows its aux loss for the train step."""

    @nn.compact
    def __call__(self, inputs):
        out, _ = super().__call__(inputs)
        return inputs + out


class Attention(nn.Module):
    config: ModelConfig

    @nn.compact
    def __call__(self, x):  # [batch, seq, d_model]
        c = self.config
        qkv, _ = te_nn.LayerNormDenseGeneral(
            features=(3, c.heads, c.head_dim),
            kernel_axes=("embed", "qkv", "heads", "kv"),
            layernorm_input_axes=RESIDUAL_AXES,
            dot_input_axes=GEMM_INPUT_AXES,
            dtype=COMPUTE_DTYPE,
            name="qkv",
        )(x)  # [batch, seq, 3, heads, head_dim]
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]  # [batch, seq, heads, head_dim]
        # Across the "context" mesh axis when the mesh has one (mesh.context), else one device.
        attended = te_nn.DotProductAttention(
            head_dim=c.head_dim,
            num_attention_heads=c.heads,
            attn_mask_type="causal",
            context_parallel_axis="context",
            context_parallel_strategy=c.context_parallel,
            name="core",
        )(q, k, v)
        return te_nn.DenseGeneral(
            features=c.d_model,
            axis=(-2, -1),
            use_bias=False,
            kernel_axes=("heads", "kv", "embed"),
            input_axes=ATTENTION_AXES,
            dtype=COMPUTE_DTYPE,
            name="out",
        )(attended)  # [batch, seq, heads, head_dim] -> [batch, seq, d_model]


class Block(nn.Module):
    config: ModelConfig

    @nn.compact
    def __call__(self, x, _):
        x = x + Attention(self.config, name="attention")(x)
        moe = self.config.moe
        if moe.experts:
            x = ResidualMoE(
                num_experts=moe.experts,
                num_experts_per_tok=moe.top_k,
                capacity_factor=moe.capacity_factor,
                aux_loss_coeff=moe.aux_loss_coeff,
                intermediate_dim=self.config.mlp_dim,
                activations=ACTIVATIONS[self.config.activation],
                enable_layernorm=True,
                dtype=COMPUTE_DTYPE,
                name="moe",
            )(x)
            return x, None
        x = ResidualMLP(
            intermediate_dim=self.config.mlp_dim,
            activations=ACTIVATIONS[self.config.activation],
            layernorm_input_axes=RESIDUAL_AXES,
            dot_1_input_axes=GEMM_INPUT_AXES,
            dot_2_input_axes=MLP_HIDDEN_AXES,
            dtype=COMPUTE_DTYPE,
            name="mlp",
        )(x)
        return x, None


class TELayer(te_nn.TransformerLayer):
    """TE's ``TransformerLayer`` called as ``nn.scan`` calls a layer: ``(x, _) -> (x, None)``."""

    @nn.compact
    def __call__(self, x, _):
        return super().__call__(x, deterministic=True), None


def te_layer_attributes(c: ModelConfig) -> dict:
    """TE's ``TransformerLayer`` as a GPT block: causal self-attention, no dropout."""
    return dict(
        hidden_size=c.d_model,
        mlp_hidden_size=c.mlp_dim,
        num_attention_heads=c.heads,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        intermediate_dropout=0.0,
        mlp_activations=ACTIVATIONS[c.activation],
        # A decoder-only stack: TE's DECODER adds cross-attention to an encoder.
        layer_type=te_nn.TransformerLayerType.ENCODER,
        self_attn_mask_type="causal",
        enable_relative_embedding=False,  # the model's learned positions
        # TE's query scaling is kept: the query kernel starts 1/sqrt(head_dim) smaller and the
        # logits are not scaled (Block scales the logits; scale_attn_logits=True and
        # scaled_query_init=False give Block's model).
        # The residual stream's sequence axis is "length", as in Block (split by tp_sp).
        enable_sequence_parallel=True,
        dtype=COMPUTE_DTYPE,
    )


class GPT(nn.Module):
    config: ModelConfig

    @nn.compact
    def __call__(self, tokens):  # int32[batch, seq] -> f32[batch, seq, vocab]
        c = self.config
        embed = nn.Embed(c.vocab_size, c.d_model, name="embed")
        positions = self.param(
            "positions", nn.initializers.normal(0.02), (tokens.shape[1], c.d_model)
        )
        x = (embed(tokens) + positions[None]).astype(COMPUTE_DTYPE)  # [batch, seq, d_model]
        block = TELayer if c.block == "te" else Block
        attributes = te_layer_attributes(c) if c.block == "te" else {"config": c}
        if c.scan:
            blocks = nn.scan(
                block,
                # Each layer its own FP8 state and FP8 statistics (te_flax.inspect_fp8()).
                variable_axes={
                    "params": 0,
                    OVERWRITE_WITH_GRADIENT: 0,
                    "intermediates": 0,
                    "fp8_stats": 0,
                },
                split_rngs={"params": True},
                length=c.layers,
                metadata_params={nn.PARTITION_NAME: "layers"},
            )
            x, _ = blocks(**attributes, name="blocks")(x, None)
        else:  # unrolled: each layer traced apart, named blocks_0, blocks_1, ...
            for layer in range(c.layers):
                x, _ = block(**attributes, name=f"blocks_{layer}")(x, None)
        x = te_nn.LayerNorm(dtype=jnp.float32, name="final_norm")(x)
        return embed.attend(x)  # tied embedding
