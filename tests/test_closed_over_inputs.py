"""Inputs closed over by a jitted function, under sharding rules, for every Linen layer.

``jax.jit(lambda: layer.init(key, x))()`` and ``jax.jit(lambda v: layer.apply(v, x))(v)`` make
``x`` a concrete array inside a trace: each layer's logical constraints must treat it as a
traced one (asking for the mesh outside ``jit`` raised there). The results equal those of the
same calls with ``x`` passed in.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_flax.linen as te_nn
from te_flax.quantize import DelayedScaling
from te_flax.sharding import use_sharding

BATCH, SEQ, HIDDEN, HEADS = 4, 8, 32, 2
LAYERS = {
    "DenseGeneral": lambda: te_nn.DenseGeneral(
        features=HIDDEN, kernel_axes=("embed", "mlp"), input_axes=("batch", None, "embed")
    ),
    "LayerNormDenseGeneral": lambda: te_nn.LayerNormDenseGeneral(
        features=HIDDEN, kernel_axes=("embed", "mlp"), layernorm_input_axes=("batch", None, None)
    ),
    "LayerNormMLP": lambda: te_nn.LayerNormMLP(
        intermediate_dim=2 * HIDDEN, layernorm_input_axes=("batch", None, None)
    ),
    "TransformerLayer": lambda: te_nn.TransformerLayer(
        hidden_size=HIDDEN,
        mlp_hidden_size=2 * HIDDEN,
        num_attention_heads=HEADS,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    ),
}


def _output(result):
    return result[0] if isinstance(result, tuple) else result


@pytest.mark.parametrize("name", list(LAYERS))
def test_closed_over_input_under_jit_equals_passed_input(name):
    layer = LAYERS[name]()
    if name != "TransformerLayer":
        layer = layer.clone(recipe=DelayedScaling())
    x = jax.random.normal(jax.random.key(0), (BATCH, SEQ, HIDDEN), jnp.float32)
    key = jax.random.key(1)
    kwargs = {"deterministic": True} if name == "TransformerLayer" else {}
    with use_sharding("dp_fsdp_tp", {"data": 2, "fsdp": 2, "tensor": 2}):
        variables = jax.jit(lambda key, x: layer.init(key, x, **kwargs))(key, x)
        closed_variables = jax.jit(lambda: layer.init(key, x, **kwargs))()
        passed = jax.jit(lambda v, x: _output(layer.apply(v, x, **kwargs)))(variables, x)
        closed = jax.jit(lambda v: _output(layer.apply(v, x, **kwargs)))(variables)
    for got, want in zip(
        jax.tree.leaves(closed_variables), jax.tree.leaves(variables), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(closed), np.asarray(passed))
