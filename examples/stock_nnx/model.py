"""A small Llama-style decoder written with Flax NNX's own layers only: nothing of te_flax.

RMSNorm, causal attention with ``nnx.Linear`` projections, a SwiGLU MLP (``gate_proj``,
``up_proj``, ``down_proj``), a tied-free output head, bytes as tokens.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 256
    dim: int = 128
    heads: int = 4
    mlp_dim: int = 384
    layers: int = 2
    dtype: jnp.dtype = jnp.bfloat16  # compute dtype; parameters stay float32


class Attention(nnx.Module):
    def __init__(self, config: Config, rngs: nnx.Rngs) -> None:
        linear = dict(use_bias=False, dtype=config.dtype, rngs=rngs)
        self.heads = config.heads
        self.q_proj = nnx.Linear(config.dim, config.dim, **linear)
        self.k_proj = nnx.Linear(config.dim, config.dim, **linear)
        self.v_proj = nnx.Linear(config.dim, config.dim, **linear)
        self.o_proj = nnx.Linear(config.dim, config.dim, **linear)

    def __call__(self, x: jax.Array) -> jax.Array:
        batch, length, dim = x.shape
        split = lambda t: t.reshape(batch, length, self.heads, dim // self.heads)  # noqa: E731
        q, k, v = split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x))
        # [batch, length, heads, head_dim] -> [batch, heads, length, length]
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / jnp.sqrt(
            dim // self.heads
        )
        causal = jnp.tril(jnp.ones((length, length), bool))
        probs = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1).astype(x.dtype)
        out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(batch, length, dim)
        return self.o_proj(out)


class MLP(nnx.Module):
    def __init__(self, config: Config, rngs: nnx.Rngs) -> None:
        linear = dict(use_bias=False, dtype=config.dtype, rngs=rngs)
        self.gate_proj = nnx.Linear(config.dim, config.mlp_dim, **linear)
        self.up_proj = nnx.Linear(config.dim, config.mlp_dim, **linear)
        self.down_proj = nnx.Linear(config.mlp_dim, config.dim, **linear)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nnx.Module):
    def __init__(self, config: Config, rngs: nnx.Rngs) -> None:
        self.attn_norm = nnx.RMSNorm(config.dim, dtype=config.dtype, rngs=rngs)
        self.attn = Attention(config, rngs)
        self.mlp_norm = nnx.RMSNorm(config.dim, dtype=config.dtype, rngs=rngs)
        self.mlp = MLP(config, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Decoder(nnx.Module):
    def __init__(self, config: Config, rngs: nnx.Rngs) -> None:
        self.embed = nnx.Embed(config.vocab, config.dim, dtype=config.dtype, rngs=rngs)
        self.layers = nnx.List([Block(config, rngs) for _ in range(config.layers)])
        self.norm = nnx.RMSNorm(config.dim, dtype=config.dtype, rngs=rngs)
        self.lm_head = nnx.Linear(config.dim, config.vocab, use_bias=False, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x).astype(jnp.float32))  # [batch, length, vocab]
