"""What the parity suite (tests/parity, against TransformerEngine itself) found, held without TE:
LayerNormMLP's gradient-state names, its initial kernel, and TE's defaults."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import te_flax.linen as te_nn
import te_flax.nnx as te_nnx
from te_flax._layers.linear import LayerNormMLPDescription
from te_flax.quantize import DelayedScaling
from tests.helpers import normal

HIDDEN, INTERMEDIATE = 32, 64
OUTPUT_GRADIENT_SCALE = 8.0  # the layer's output gradient, far from the activation gradient's


def _new_gradient_state(**attributes):
    """The new ``grad_{0,1}_amax_history[0]`` of one step with a known output gradient."""
    layer = te_nn.LayerNormMLP(
        intermediate_dim=INTERMEDIATE, recipe=DelayedScaling(amax_history_len=2), **attributes
    )
    x = normal(jax.random.key(1), (4, 8, HIDDEN))
    variables = nn.meta.unbox(layer.init(jax.random.key(0), x, deterministic=True))
    cotangent = jnp.full((4, 8, HIDDEN), OUTPUT_GRADIENT_SCALE).at[0, 0, 0].set(-9.0)

    def loss(fp8):
        out, _ = layer.apply({**variables, "_overwrite_with_gradient": fp8}, x, deterministic=True)
        return jnp.sum(out * cotangent)

    new = jax.grad(loss)(variables["_overwrite_with_gradient"])
    return float(new["grad_0_amax_history"][0]), float(new["grad_1_amax_history"][0])


@pytest.mark.parametrize(
    "attributes",
    [{}, {"return_layernorm_output": True}, {"enable_low_rank_adaptation": True}],
    ids=["fused", "norm output returned", "LoRA"],
)
def test_grad_0_state_is_the_output_gradient_on_every_path(attributes):
    """TE's fused LayerNormMLP: ``grad_0_*`` quantizes the layer's output gradient (GEMM 2's),
    ``grad_1_*`` the activation gradient (GEMM 1's). te_flax keeps that meaning on its
    composed paths too."""
    grad_0, grad_1 = _new_gradient_state(**attributes)
    assert grad_0 == 9.0  # amax of the output gradient given
    assert grad_1 != 9.0 and grad_1 > 0


def test_stacked_kernel_is_drawn_as_transformer_engine_draws_it():
    """``wi_kernel [hidden, n_act, intermediate]``: slice i initialised as a 2-D kernel from the
    i-th key of the chain ``key, slice_key = split(key)``, as TE draws it."""
    init = jax.nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal")
    description = LayerNormMLPDescription(
        intermediate_dim=INTERMEDIATE, activations=("silu", "linear")
    )
    (wi,) = [p for p in description.param_records((HIDDEN,)) if p.name == "wi_kernel"]
    key = jax.random.key(3)
    rest, first = jax.random.split(key)
    _, second = jax.random.split(rest)
    expected = jnp.stack(
        [init(first, (HIDDEN, INTERMEDIATE)), init(second, (HIDDEN, INTERMEDIATE))], axis=-2
    )
    np.testing.assert_array_equal(wi.init(key, wi.shape), expected)


def test_transformer_layer_defaults_are_transformer_engines():
    """TE 2.20.2: no intermediate dropout, a gelu MLP."""
    assert te_nn.TransformerLayer.intermediate_dropout == 0.0
    assert tuple(te_nn.TransformerLayer.mlp_activations) == ("gelu",)
    sizes = dict(hidden_size=32, mlp_hidden_size=64, num_attention_heads=4)
    x = normal(jax.random.key(0), (2, 6, 32))
    rngs = {"params": jax.random.key(0), "dropout": jax.random.key(1)}
    default = te_nn.TransformerLayer(**sizes, hidden_dropout=0.0, attention_dropout=0.0)
    explicit = te_nn.TransformerLayer(
        **sizes,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        intermediate_dropout=0.0,
        mlp_activations=("gelu",),
    )
    # Not deterministic: with TE's 0.1 intermediate dropout the two would differ.
    variables = default.init(rngs, x, deterministic=False)
    np.testing.assert_array_equal(
        default.apply(variables, x, deterministic=False, rngs={"dropout": jax.random.key(1)}),
        explicit.apply(variables, x, deterministic=False, rngs={"dropout": jax.random.key(1)}),
    )
    nnx_layer = te_nnx.TransformerLayer(**sizes, rngs=nnx.Rngs(0))
    assert nnx_layer.intermediate_dropout == 0.0
    assert tuple(nnx_layer.mlp_activations) == ("gelu",)


@pytest.mark.parametrize("layer", ["DotProductAttention", "MultiHeadAttention"])
def test_attention_transpose_batch_sequence_defaults_to_none_taken_as_false(layer):
    """TE's default is None (since 2.10), read as False: inputs are ``[batch, seq, ...]``."""
    assert getattr(te_nn, layer).transpose_batch_sequence is None
    batch, seq, heads, head_dim = 2, 6, 4, 8
    if layer == "DotProductAttention":
        module = te_nn.DotProductAttention(head_dim=head_dim, num_attention_heads=heads)
        explicit = te_nn.DotProductAttention(
            head_dim=head_dim, num_attention_heads=heads, transpose_batch_sequence=False
        )
        args = tuple(normal(jax.random.key(i), (batch, seq, heads, head_dim)) for i in range(3))
    else:
        module = te_nn.MultiHeadAttention(head_dim=head_dim, num_attention_heads=heads)
        explicit = te_nn.MultiHeadAttention(
            head_dim=head_dim, num_attention_heads=heads, transpose_batch_sequence=False
        )
        x = normal(jax.random.key(0), (batch, seq, heads * head_dim))
        args = (x, x)
    variables = module.init(jax.random.key(0), *args, deterministic=True)
    out = module.apply(variables, *args, deterministic=True)
    out = out[0] if isinstance(out, tuple) else out
    expected = explicit.apply(variables, *args, deterministic=True)
    expected = expected[0] if isinstance(expected, tuple) else expected
    assert out.shape[:2] == (batch, seq)
    np.testing.assert_array_equal(out, expected)
