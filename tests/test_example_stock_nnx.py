"""The stock NNX decoder example: one quantize_model call selects its seven projections per
layer (not the embedding or the head), and a few FP8 steps train and move the FP8 state."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

import te_flax
import te_flax.nnx as te_nnx
from examples.stock_nnx.model import Config, Decoder
from examples.stock_nnx.train import train
from te_flax.quantize import DelayedScaling


def test_quantize_model_selects_the_projections_of_every_layer():
    tokens = jax.numpy.zeros((2, 16), jax.numpy.int32)
    with jax.numpy_dtype_promotion("standard"), pytest.warns(te_flax.QuantizeModelNote) as notes:
        model = te_flax.quantize_model(Decoder(Config(), nnx.Rngs(0)), DelayedScaling(), tokens)
    # The attention-score products have batch dimensions: noted, left as they are.
    assert "layers/1/attn (einsum): it has batch dimensions" in str(notes[0].message)
    owners = {
        "/".join(str(key) for key in path[:-1])
        for path, _ in nnx.to_flat_state(nnx.state(model, te_nnx.Fp8Meta))
    }
    projections = ("attn/q_proj", "attn/k_proj", "attn/v_proj", "attn/o_proj")
    projections += ("mlp/gate_proj", "mlp/up_proj", "mlp/down_proj")
    assert owners == {f"layers/{i}/{name}" for i in range(2) for name in projections}


@pytest.mark.filterwarnings("ignore::te_flax.QuantizeModelNote")
def test_a_few_fp8_steps_train():
    with jax.numpy_dtype_promotion("standard"):
        run = train(fp8=True, steps=3, batch=4, seq_len=32)
    assert run["fp8_states"] == 14
    assert np.isfinite(run["train_loss"]) and run["eval_loss"] < np.log(256) + 0.5
