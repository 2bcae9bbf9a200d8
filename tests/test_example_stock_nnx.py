"""The stock NNX decoder example: one quantize_model call selects its seven projections per
layer (not the embedding or the head), and a few FP8 steps train."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from examples.stock_nnx.train import train


@pytest.mark.filterwarnings("ignore::te_flax.QuantizeModelNote")
def test_a_few_fp8_steps_train():
    with jax.numpy_dtype_promotion("standard"):
        run = train(fp8=True, steps=3, batch=4, seq_len=32)
    assert run["fp8_states"] == 14  # q, k, v, o, gate, up, down per layer; not embed or head
    assert np.isfinite(run["train_loss"]) and run["eval_loss"] < np.log(256) + 0.5
