"""LayerNormMLP's activation combinations beyond one activation and a gated pair, against
TransformerEngine 2.20.2: TE computes them on its unfused path (each slice through the named
``flax.linen`` activation, the results multiplied); te_flax on its fused op. Same outputs,
parameter gradients and FP8 state over two steps, with TE's unfused gradient-state names
exchanged as in ``test_layers`` (te_flax keeps the fused path's meaning)."""

from __future__ import annotations

import pytest

pytest.importorskip(
    "transformer_engine.jax.flax", reason="needs TransformerEngine (scripts/parity)"
)

from tests.parity.test_layers import compare_with_te_unfused_mlp


@pytest.mark.parametrize("recipe_name", ["none", "delayed"])
@pytest.mark.parametrize(
    "activations", [("relu", "relu"), ("linear", "gelu", "tanh")], ids="*".join
)
def test_activation_combinations_match_te(activations, recipe_name):
    compare_with_te_unfused_mlp(dict(intermediate_dim=64, activations=activations), recipe_name)
