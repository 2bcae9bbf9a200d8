"""The encoder example (TE's single-device encoder on te_flax): its data, and that it trains in
FP8 with delayed scaling, its FP8 state carried from step to step as TE's train step does."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from examples.encoder import encoder
from examples.encoder.common import MARKER, get_datasets

FP8 = "_overwrite_with_gradient"


def test_synthetic_data_is_balanced_padded_and_masked_in_te_convention():
    train_ds, test_ds, num_embed = get_datasets(max_seq_len=16, train_size=256, test_size=64)
    sentence, label, mask = train_ds["sentence"], train_ds["label"], train_ds["mask"]
    assert sentence.shape == (256, 16) and mask.shape == (256, 1, 16, 16)
    assert sentence.max() < num_embed and 0.35 < label.mean() < 0.65
    np.testing.assert_array_equal(label, (sentence == MARKER).any(axis=1))
    # True masks out: exactly the pairs with a padding query or key.
    padding = sentence == 0
    np.testing.assert_array_equal(mask[:, 0], padding[:, :, None] | padding[:, None, :])
    assert not np.array_equal(test_ds["sentence"][:64], sentence[:64])


def test_fp8_recipe_is_chosen_by_te_name():
    args = encoder.encoder_parser(["--use-fp8", "--fp8-recipe", "MXFP8BlockScaling"])
    assert args.use_fp8 and args.fp8_recipe == "MXFP8BlockScaling"
    with pytest.raises(SystemExit):
        encoder.encoder_parser(["--fp8-recipe", "E4M3"])


def test_encoder_trains_in_fp8_and_updates_its_fp8_state(monkeypatch, capsys):
    steps = []  # (loss, var_collect in, var_collect out) of each executed step
    train_step = encoder.train_step

    def recording_train_step(state, inputs, masks, labels, var_collect, rngs):
        out = train_step(state, inputs, masks, labels, var_collect, rngs)
        if not isinstance(out[1], jax.core.Tracer):  # check_fp8 traces the step
            steps.append((float(out[1]), var_collect, out[3]))
        return out

    monkeypatch.setattr(encoder, "train_step", recording_train_step)
    args = encoder.encoder_parser(
        ["--use-fp8", "--epochs", "2", "--train-size", "384", "--test-size", "128"]
    )
    _, _, test_loss, test_accuracy = encoder.train_and_evaluate(args)

    assert len(steps) == 12
    losses = [loss for loss, _, _ in steps]
    assert 0.55 < losses[0] < 1.0  # about ln 2 for two balanced classes
    assert np.mean(losses[-3:]) < 0.6 * losses[0], losses
    assert test_loss < 0.4 and test_accuracy > 0.85, (test_loss, test_accuracy)
    assert "Epoch:  2" in capsys.readouterr().out
    # The FP8 collection comes back from jax.value_and_grad as the next step's state: the
    # initial scale_inv of 1 and empty histories become the measured ones.
    initial, final = steps[0][1][FP8], steps[-1][2][FP8]
    assert set(initial) == {"TransformerLayer_0", "DenseGeneral_0", "DenseGeneral_1"}
    qkv_before = initial["TransformerLayer_0"]["attention"]["qkv"]
    qkv_after = final["TransformerLayer_0"]["attention"]["qkv"]
    assert (np.asarray(qkv_before["x_amax_history"]) == 0).all()
    assert (np.asarray(qkv_before["x_scale_inv"]) == 1).all()
    for name in ("x", "kernel", "grad"):
        assert (np.asarray(qkv_after[f"{name}_amax_history"])[:12] > 0).all(), name
        assert (np.asarray(qkv_after[f"{name}_scale_inv"]) != 1).all(), name
    mlp_after = final["TransformerLayer_0"]["mlp"]
    assert (np.asarray(mlp_after["grad_1_amax_history"])[:12] > 0).all()
