"""Trains the stock decoder twice from the same initial weights and batches, in BF16 and in FP8
through one ``te_flax.quantize_model`` call, and reports both eval losses.

    python -m examples.stock_nnx --steps 300
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import jax
import optax
from flax import nnx

import te_flax
import te_flax.nnx as te_nnx
from examples.lm.data import load_corpus
from examples.stock_nnx.model import Config, Decoder
from te_flax.quantize import DelayedScaling

REPORT = Path(__file__).parent / "REPORT.md"


def loss_fn(model: nnx.Module, inputs: jax.Array, targets: jax.Array) -> jax.Array:
    logits = model(inputs)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def train(fp8: bool, steps: int, batch: int, seq_len: int, seed: int = 0) -> dict:
    corpus = load_corpus()
    model = Decoder(Config(), nnx.Rngs(seed))
    if fp8:
        example, _ = corpus.batch("train", seed, 0, batch, seq_len)
        model = te_flax.quantize_model(model, DelayedScaling(amax_history_len=16), example)
    optimizer = nnx.Optimizer(model, optax.adamw(3e-3, weight_decay=0.01), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, inputs, targets):
        return te_nnx.train_step(model, optimizer, loss_fn, inputs, targets)

    @nnx.jit
    def evaluate(model, inputs, targets):
        return loss_fn(model, inputs, targets)

    start = time.perf_counter()
    for index in range(steps):
        loss = step(model, optimizer, *corpus.batch("train", seed, index, batch, seq_len))
    eval_loss = (
        sum(
            float(evaluate(model, *corpus.batch("eval", seed, index, batch, seq_len)))
            for index in range(8)
        )
        / 8
    )
    return {
        "train_loss": float(loss),
        "eval_loss": eval_loss,
        "seconds": time.perf_counter() - start,
        "fp8_states": len(jax.tree.leaves(nnx.state(model, te_nnx.Fp8Meta))) // 6,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=64)
    args = parser.parse_args(argv)
    with jax.numpy_dtype_promotion("standard"):
        runs = {
            name: train(name == "FP8", args.steps, args.batch, args.seq_len)
            for name in ("BF16", "FP8")
        }
    gap = runs["FP8"]["eval_loss"] / runs["BF16"]["eval_loss"] - 1
    lines = [
        "# A stock NNX decoder in FP8 by one quantize_model call",
        "",
        f"`python -m examples.stock_nnx --steps {args.steps} --batch {args.batch} "
        f"--seq-len {args.seq_len}` (CPU; the built-in text, bytes as tokens)",
        "",
        "| run | FP8 products | train loss | eval loss | seconds |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name, run in runs.items():
        lines.append(
            f"| {name} | {run['fp8_states']} | {run['train_loss']:.4f} | {run['eval_loss']:.4f} "
            f"| {run['seconds']:.0f} |"
        )
    lines += ["", f"FP8 eval loss against BF16: {100 * gap:+.2f}%.", ""]
    REPORT.write_text("\n".join(lines))
    print(REPORT.read_text())
