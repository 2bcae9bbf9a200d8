"""Encoder training on a single device: TransformerEngine's JAX encoder example on te_flax.

This is TE's ``examples/jax/encoder/test_single_gpu_encoder.py`` (a ``TransformerLayer``
sentence classifier trained with Flax's ``TrainState``), written as a TE user would move it.
The lines that differ from TE's, and why:

* Imports: ``te_flax`` / ``te_flax.linen`` for ``transformer_engine.jax`` /
  ``transformer_engine.jax.flax``; no ``is_scaling_mode_supported``: every recipe runs
  everywhere (emulated on CPUs).
* ``te.autocast(..., mesh_resource=...)`` -> ``te_flax.autocast(enabled=..., recipe=...)``:
  te_flax takes sharding from Flax's logical-axis rules, not a ``MeshResource``.
* Data: a built-in synthetic task (``common.py``) instead of GLUE CoLA through ``datasets`` and
  ``nltk``, so no downloads; hence ``--train-size`` / ``--test-size`` and no
  ``unpack_cached_datasets_if_available``.
* Masks are boolean (True masks out, as in TE), built from the token ids with Flax's
  ``nn.make_attention_mask`` and inverted; TE's example uses uint8 0/1 masks, which te_flax's
  attention refuses (it wants booleans).
* Labels are int32 (TE's are float32 and compared with the int32 argmax, which JAX's strict
  dtype promotion refuses).
* ``Net`` pools the encoder output (mean over the non-padding tokens) rather than flattening
  ``[batch, seq * hidden]``, so that sentences of any length share one head.
* ``dtype=jnp.bfloat16`` on the ``TransformerLayer``: in te_flax ``dtype`` is the compute dtype
  (parameters stay float32, ``param_dtype``); in TE it is the parameter dtype.
* ``--fp8-recipe`` takes a value (TE declares it ``store_true`` with a string default).
* The FP8 state is the ``_overwrite_with_gradient`` collection (TE: ``fp8_metas``); the train
  step handles it exactly as TE's does: every collection but ``params`` comes back from
  ``jax.value_and_grad`` as its new value and is the next step's ``var_collect``.
* Everything else is TE's as written, including the loss function repeated in ``train_step``
  and ``eval_step`` and the first step's recompilation (the initial ``var_collect`` still holds
  ``params``).
* optax's AdamW counts steps in int32 and mixes them with floats, so the step runs under
  standard dtype promotion (the test suite is strict).
* A progress bar (tqdm) over each epoch's steps, and a default of 1,024 training sentences:
  the synthetic task reaches 100% test accuracy in the second epoch (about 1.5 minutes on a
  2-core CPU in FP8), where TE's CoLA size took ten minutes with no output. ``--no-progress``
  turns the bar off.
"""

from __future__ import annotations

import argparse
from functools import partial

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from flax.training import train_state
from tqdm import tqdm

import te_flax as te
import te_flax.linen as te_flax_nn

from .common import RECIPES, get_datasets, get_quantization_recipe_from_name_string

PARAMS_KEY = "params"
DROPOUT_KEY = "dropout"
SR_KEY = "sr_rng"
INPUT_KEY = "input_rng"


class Net(nn.Module):
    """NLP Encoder"""

    num_embed: int

    @nn.compact
    def __call__(self, x, mask, disable_dropout=False):
        valid = (x > 0)[..., None]  # [batch, seq, 1]: not padding
        x = nn.Embed(num_embeddings=self.num_embed, features=256, dtype=jnp.bfloat16)(x)

        te_Encoder = partial(
            te_flax_nn.TransformerLayer,
            hidden_size=256,
            mlp_hidden_size=1024,
            num_attention_heads=8,
            hidden_dropout=0.1,
            attention_dropout=0.1,
            dropout_rng_name=DROPOUT_KEY,
            layer_type=te_flax_nn.TransformerLayerType.ENCODER,
            self_attn_mask_type="padding",
            enable_relative_embedding=False,
            dtype=jnp.bfloat16,
        )
        x = te_Encoder()(x, attention_mask=mask, deterministic=disable_dropout)

        # Mean over the sentence's own tokens: [batch, seq, 256] -> [batch, 256].
        x = jnp.sum(jnp.where(valid, x, 0), axis=1) / jnp.sum(valid, axis=1).astype(x.dtype)

        x = te_flax_nn.DenseGeneral(features=256)(x)

        x = te_flax_nn.DenseGeneral(features=256)(x)

        x = nn.Dense(features=2)(x)
        return x


@jax.jit
def train_step(state, inputs, masks, labels, var_collect, rngs):
    """Computes gradients, loss and accuracy for a single batch."""

    def loss_fn(var_collect, disable_dropout=False):
        logits = state.apply_fn(var_collect, inputs, masks, disable_dropout, rngs=rngs)
        one_hot = jax.nn.one_hot(labels.astype(jnp.int32), 2)
        loss = jnp.mean(optax.softmax_cross_entropy(logits=logits, labels=one_hot))
        return loss, logits

    var_collect = {**var_collect, PARAMS_KEY: state.params}
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    (loss, logits), grads = grad_fn(var_collect)
    accuracy = jnp.mean(jnp.argmax(logits, -1) == labels)

    var_collect, grads = flax.core.pop(grads, PARAMS_KEY)
    state = state.apply_gradients(grads=grads)

    return state, loss, accuracy, var_collect


def train_epoch(state, train_ds, batch_size, rngs, var_collect, progress=None):
    """Train for a single epoch; ``progress`` (a tqdm bar) advances by one per step."""
    train_ds_size = len(train_ds["sentence"])
    steps_per_epoch = train_ds_size // batch_size
    perms = jax.random.permutation(rngs[INPUT_KEY], train_ds_size)
    perms = perms[: steps_per_epoch * batch_size]  # skip incomplete batch
    perms = perms.reshape((steps_per_epoch, batch_size))
    epoch_loss = []
    epoch_accuracy = []

    for perm in perms:
        # Split and reassign to 'rngs' to ensure unique rng for each step
        rngs = {key: jax.random.split(rngs[key])[1] for key in rngs}
        batch_inputs = train_ds["sentence"][perm, ...]
        batch_masks = train_ds["mask"][perm, ...]
        batch_labels = train_ds["label"][perm, ...]
        state, loss, accuracy, var_collect = train_step(
            state, batch_inputs, batch_masks, batch_labels, var_collect, rngs
        )
        epoch_loss.append(loss)
        epoch_accuracy.append(accuracy)
        if progress is not None:
            progress.update()

    avg_loss = np.mean(epoch_loss)
    avg_accuracy = np.mean(epoch_accuracy)
    return state, avg_loss, avg_accuracy, var_collect


@jax.jit
def eval_step(state, inputs, masks, labels, var_collect, rngs):
    """Computes loss and accuracy for a single batch."""

    def loss_fn(var_collect, disable_dropout=False):
        logits = state.apply_fn(var_collect, inputs, masks, disable_dropout, rngs=rngs)
        one_hot = jax.nn.one_hot(labels.astype(jnp.int32), 2)
        loss = jnp.mean(optax.softmax_cross_entropy(logits=logits, labels=one_hot))
        return loss, logits

    var_collect = {**var_collect, PARAMS_KEY: state.params}
    loss, logits = loss_fn(var_collect, disable_dropout=True)
    accuracy = jnp.mean(jnp.argmax(logits, -1) == labels)
    return loss, accuracy


def eval_model(state, test_ds, batch_size, var_collect, rngs):
    """Evaluation loop."""
    test_ds_size = len(test_ds["sentence"])
    num_steps = test_ds_size // batch_size
    valid_size = num_steps * batch_size
    all_loss = []
    all_accuracy = []

    for batch_start in range(0, valid_size, batch_size):
        # Split and reassign to 'rngs' to ensure unique rng for each step
        rngs = {key: jax.random.split(rngs[key])[1] for key in rngs}
        batch_end = batch_start + batch_size
        batch_inputs = test_ds["sentence"][batch_start:batch_end]
        batch_masks = test_ds["mask"][batch_start:batch_end]
        batch_labels = test_ds["label"][batch_start:batch_end]
        loss, accuracy = eval_step(
            state, batch_inputs, batch_masks, batch_labels, var_collect, rngs
        )
        all_loss.append(loss)
        all_accuracy.append(accuracy)

    avg_loss = np.mean(all_loss)
    avg_accuracy = np.mean(all_accuracy)
    return avg_loss, avg_accuracy


def check_fp8(state, var_collect, inputs, masks, labels):
    "Check if model includes FP8."
    rngs = {DROPOUT_KEY: jax.random.PRNGKey(0), SR_KEY: jax.random.PRNGKey(0)}
    func_jaxpr = str(jax.make_jaxpr(train_step)(state, inputs, masks, labels, var_collect, rngs))
    assert "f8_e5m2" in func_jaxpr or "f8_e4m3" in func_jaxpr or "f4_e2m1" in func_jaxpr


def train_and_evaluate(args):
    """Execute model training and evaluation loop."""
    print(args)
    train_ds, test_ds, num_embed = get_datasets(
        args.max_seq_len, args.train_size, args.test_size, args.seed
    )

    rng = jax.random.PRNGKey(args.seed)
    rng, params_rng = jax.random.split(rng)
    rng, dropout_rng = jax.random.split(rng)
    rng, sr_rng = jax.random.split(rng)
    init_rngs = {PARAMS_KEY: params_rng, DROPOUT_KEY: dropout_rng, SR_KEY: sr_rng}

    input_shape = [args.batch_size, args.max_seq_len]
    mask_shape = [args.batch_size, 1, args.max_seq_len, args.max_seq_len]
    label_shape = [args.batch_size]

    if args.use_fp8:  # noqa: SIM108 (TE's lines)
        fp8_recipe = get_quantization_recipe_from_name_string(args.fp8_recipe)
    else:
        fp8_recipe = None

    with (
        jax.numpy_dtype_promotion("standard"),
        te.autocast(enabled=args.use_fp8, recipe=fp8_recipe),
    ):
        encoder = Net(num_embed)
        # We use nn.Embed, thus inputs need to be in int
        inputs = jnp.zeros(input_shape, dtype=jnp.int32)
        masks = jnp.zeros(mask_shape, dtype=jnp.bool_)
        var_collect = encoder.init(init_rngs, inputs, masks)
        tx = optax.adamw(args.lr)
        state = train_state.TrainState.create(
            apply_fn=encoder.apply, params=var_collect[PARAMS_KEY], tx=tx
        )

        if args.use_fp8:
            labels = jnp.zeros(label_shape, dtype=jnp.int32)
            check_fp8(state, var_collect, inputs, masks, labels)

        if args.dry_run:
            labels = jnp.zeros(label_shape, dtype=jnp.int32)
            rngs = {DROPOUT_KEY: dropout_rng, SR_KEY: sr_rng}
            train_step(state, inputs, masks, labels, var_collect, rngs)
            print("PASSED")
            return None

        steps_per_epoch = len(train_ds["sentence"]) // args.batch_size
        for epoch in range(1, args.epochs + 1):
            # Split and reassign to 'rng' to ensure unique rng for each step
            rng, input_rng = jax.random.split(rng)
            rng, dropout_rng = jax.random.split(rng)
            rng, sr_rng = jax.random.split(rng)
            rngs = {INPUT_KEY: input_rng, DROPOUT_KEY: dropout_rng, SR_KEY: sr_rng}

            with tqdm(
                total=steps_per_epoch, desc=f"epoch {epoch}/{args.epochs}", unit="step",
                disable=not args.progress, leave=False,
            ) as progress:  # fmt: skip
                state, train_loss, train_accuracy, var_collect = train_epoch(
                    state, train_ds, args.batch_size, rngs, var_collect, progress
                )

            test_loss, test_accuracy = eval_model(
                state, test_ds, args.test_batch_size, var_collect, rngs
            )

            print(
                f"Epoch: {epoch:>2} "
                f"Train Loss: {train_loss:.6f} "
                f"Train Accuracy: {train_accuracy:.6f} "
                f"Test Loss: {test_loss:.6f} "
                f"Test Accuracy: {test_accuracy:.6f} "
            )

    return [train_loss, train_accuracy, test_loss, test_accuracy]


def encoder_parser(args):
    """Training settings."""
    parser = argparse.ArgumentParser(description="JAX Encoder Example")
    parser.add_argument(
        "--batch-size",
        type=int,
        default=64,
        metavar="N",
        help="input batch size for training (default: 64)",
    )
    parser.add_argument(
        "--test-batch-size",
        type=int,
        default=64,
        metavar="N",
        help="input batch size for testing (default: 64)",
    )
    parser.add_argument(
        "--max-seq-len",
        type=int,
        default=32,
        metavar="N",
        help="maximum sequence length (default: 32)",
    )
    parser.add_argument(
        "--epochs",
        type=int,
        default=3,
        metavar="N",
        help="number of epochs to train (default: 3)",
    )
    parser.add_argument(
        "--train-size",
        type=int,
        default=1024,
        metavar="N",
        help="sentences in the synthetic training set (default: 1024)",
    )
    parser.add_argument(
        "--test-size",
        type=int,
        default=1024,
        metavar="N",
        help="sentences in the synthetic test set (default: 1024)",
    )
    parser.add_argument(
        "--lr",
        type=float,
        default=0.0001,
        metavar="LR",
        help="learning rate (default: 0.0001)",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        default=False,
        help="quickly check a single pass",
    )
    parser.add_argument("--seed", type=int, default=0, metavar="S", help="random seed (default: 0)")
    parser.add_argument(
        "--no-progress",
        dest="progress",
        action="store_false",
        help="no progress bar over each epoch's steps",
    )
    parser.add_argument(
        "--use-fp8",
        action="store_true",
        default=False,
        help="Use FP8 for inference and training without recalibration",
    )
    parser.add_argument(
        "--fp8-recipe",
        default="DelayedScaling",
        choices=sorted(RECIPES),
        help="Use FP8 recipe (default: DelayedScaling)",
    )

    return parser.parse_args(args)


if __name__ == "__main__":
    train_and_evaluate(encoder_parser(None))
