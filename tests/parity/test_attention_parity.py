"""te_flax's attention and transformer layers against TransformerEngine 2.20.2's, beyond the
layer suite: an input width other than hidden_size, packed sequences."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

pytest.importorskip(
    "transformer_engine.jax.flax", reason="needs TransformerEngine (scripts/parity)"
)

import te_flax.linen as te_nn
from tests.parity import te_reference as ref

TOLERANCE = 1e-5


def test_transformer_layer_input_width_other_than_hidden_size(parity_results):
    """hidden_size=16 sets the attention width; the input and output are 24 wide."""
    attributes = dict(hidden_size=16, mlp_hidden_size=32, num_attention_heads=4)
    theirs, ours = ref.TE.TransformerLayer(**attributes), te_nn.TransformerLayer(**attributes)
    x = jax.random.normal(jax.random.key(1), (2, 6, 24))
    cotangent = jax.random.normal(jax.random.key(2), x.shape)
    te_variables = nn.meta.unbox(theirs.init(jax.random.key(0), x, deterministic=True))
    our_variables = nn.meta.unbox(ours.init(jax.random.key(0), x, deterministic=True))
    assert jax.tree.map(jnp.shape, te_variables) == jax.tree.map(jnp.shape, our_variables)

    def loss(module, variables):
        def value_of(variables, x):
            return jnp.sum(module.apply(variables, x, deterministic=True) * cotangent)

        return jax.value_and_grad(value_of, argnums=(0, 1))(variables, x)

    (_, te_grads), (_, our_grads) = (
        loss(theirs, te_variables),
        loss(ours, te_variables),
    )
    errors = {
        "output": ref.relative_error(
            ours.apply(te_variables, x, deterministic=True),
            theirs.apply(te_variables, x, deterministic=True),
        ),
        "parameter gradients": max(
            ref.relative_error(a, b)
            for a, b in zip(jax.tree.leaves(our_grads), jax.tree.leaves(te_grads), strict=True)
        ),
    }
    parity_results[("TransformerLayer input width 24, hidden_size 16", "none")] = {
        **errors,
        "FP8 state": 0.0,
    }
    for what, error in errors.items():
        assert error <= TOLERANCE, f"{what}: {error:.2e}"
