"""How long ``te_flax.explain`` takes on the example language model's training step.

The step is ``examples/lm``'s ``train_step`` (te_flax's ``value_and_grad`` of the
cross-entropy, then AdamW through ``apply_gradients``) for the default configuration (the Linen
GPT, 2 layers under ``nn.scan``, d_model 128, batch 16 x 128 tokens, delayed scaling), its
state given as ``jax.ShapeDtypeStruct``s. ``explain`` is timed for the CPU and for a deviceless
H100, each in a fresh process (the first call a user makes: tracing, lowering, compiling, then
reading the optimized program), and the time of reading alone is the total less
``ExplainReport.compile_seconds``.

Run ``python -m bench.explain``; it writes ``bench/RESULTS_explain.md``.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import json
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

import te_flax

RESULTS = Path(__file__).with_name("RESULTS_explain.md")
TARGETS = ("cpu", "h100")


def measure(target: str) -> dict[str, object]:
    """Builds the example's step and times ``te_flax.explain`` on it for ``target``."""
    from examples.lm.config import load_config
    from examples.lm.train import _linen_frontend, make_optimizer, make_recipe, make_train_step
    from te_flax.training import init_optimizer

    config = load_config(None)
    frontend = _linen_frontend(config)
    tx = make_optimizer(config)
    step = make_train_step(frontend, tx)
    tokens = jax.ShapeDtypeStruct((config.train.batch, config.train.seq_len), jnp.int32)
    with te_flax.autocast(enabled=True, recipe=make_recipe(config)):
        variables = jax.eval_shape(frontend.init, jax.random.key(0))
        opt_state = jax.eval_shape(lambda v: init_optimizer(tx, v), variables)
        state = {"variables": variables, "opt_state": opt_state}
        start = time.perf_counter()
        report = te_flax.explain(step, state, tokens, tokens, target=target)
        total = time.perf_counter() - start
    return {
        "target": report.target,
        "summary": report.summary,
        "total": total,
        "compile": report.compile_seconds,
        "lines": len(report.hlo.splitlines()),
    }


def main() -> None:
    rows = []
    for target in TARGETS:  # each in a fresh process: a user's first call
        command = [sys.executable, "-m", "bench.explain", "--one", target]
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        rows.append(json.loads(done.stdout.splitlines()[-1]))
    lines = [
        "# te_flax.explain on the example's training step",
        "",
        " ".join(line.strip() for line in (__doc__ or "").split("\n\n")[1].splitlines()),
        "",
        f"JAX {jax.__version__}, {os.cpu_count()} CPU cores (shared with other work while "
        "measured). Command: `python -m bench.explain`.",
        "",
        "| target | explain (s) | of it lowering and compiling (s) | reading (s) | HLO lines |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        reading = float(row["total"]) - float(row["compile"])
        lines.append(
            f"| {row['target']} | {row['total']:.1f} | {row['compile']:.1f} | {reading:.2f} "
            f"| {row['lines']} |"
        )
    lines += ["", "Summaries:", ""] + [f"- {row['target']}: {row['summary']}" for row in rows]
    RESULTS.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--one"]:
        print(json.dumps(measure(sys.argv[2])))
    else:
        main()
