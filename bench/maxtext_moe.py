"""MaxText's TransformerEngine MoE block (``te_moe_block=true``) trained through te_flax.

``python -m bench.maxtext_moe --python PATH`` runs MaxText's own trainer
(``maxtext.trainers.pre_train.train``) from the environment of ``PATH`` (a Python with MaxText
0.2.5 and te_flax installed, no TransformerEngine) through ``python -m te_flax run``, which
serves TransformerEngine's import paths from te_flax, on the CPU, on MaxText's synthetic data,
for two tiny MoE models (2 layers, the first dense, vocabulary 256):

- DeepSeek-V3-shaped: MaxText's ``deepseek3-tiny`` (sigmoid routing with a routing bias, scaling
  factor 2.5, a shared expert, 16 experts, top-8);
- gpt-oss-shaped: the same decoder with gpt-oss's expert layout (the top 4 of 8 experts, biases
  on both expert GEMMs: MaxText's ``mlp_bias``);

each three ways from the same initial parameters:

- ``maxtext``: MaxText's own MoE path (``te_moe_block=false``, sparse matmul);
- ``te_flax``: ``te_moe_block=true``: MaxText calls ``transformer_engine.jax.moe.moe``, which is
  ``te_flax.moe.moe``, after ``ep_bootstrap`` (``te_flax.ep``), ``te_gmm_quantization=te_no_quant``;
- ``te_flax mxfp8``: the same with ``te_gmm_quantization=te_mxfp8`` (MaxText's grouped MXFP8
  quantizer sets, ``QuantizerFactory.create_set(n_groups=...)``).

The dense layers run through te_flax in all of them (``quantization=te_no_quant``). It writes
each step's loss (from MaxText's log: ``ln(perplexity)``, 6 significant digits) to
``bench/RESULTS_maxtext_moe.md``.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import subprocess
from pathlib import Path

RESULTS = Path(__file__).with_name("RESULTS_maxtext_moe.md")
STEPS = 20
MODEL = (
    "model_name=deepseek3-tiny override_model_config=true base_num_decoder_layers=2 "
    "first_num_dense_layers=1 vocab_size=256"
)
# gpt-oss's expert layout on the same decoder (the one whose receive counts MaxText collects):
# the top 4 of 8 experts, with biases on both expert GEMMs (MaxText's mlp_bias, which it has
# for gpt-oss). The routing stays the decoder's (sigmoid scores with a routing bias): MaxText's
# DeepSeek decoder scales top-k weights as DeepSeek does, which agrees with TE's moe only for
# sigmoid scores; its shared expert is MaxText's own dense MLP either way.
GPT_OSS_SHAPED = f"{MODEL} num_experts=8 num_experts_per_tok=4 mlp_bias=true"
SHAPES = {"DeepSeek-V3-shaped": MODEL, "gpt-oss-shaped": GPT_OSS_SHAPED}
RUN = (
    f"hardware=cpu dataset_type=synthetic per_device_batch_size=2 max_target_length=32 "
    f"steps={STEPS} learning_rate=3e-3 enable_checkpointing=false "
    "skip_jax_distributed_system=true log_period=1 prefuse_moe_weights=true sparse_matmul=true "
    "quantization=te_no_quant"
)
VARIANTS = {
    "maxtext": "te_moe_block=false",
    "te_flax": "te_moe_block=true te_gmm_quantization=te_no_quant",
    "te_flax mxfp8": "te_moe_block=true te_gmm_quantization=te_mxfp8",
}
NOTES = """\
The model runs in bfloat16 (MaxText's default `dtype`); the three runs start from the same
parameters and data. The te_flax run differs from MaxText's own path by bfloat16 roundings (the
two paths sum the experts in another order, and te_flax's router computes its logits in float32,
as TE promotes them); MXFP8 adds its quantization of the two grouped GEMMs' operands.

Why the gpt-oss-shaped model runs on MaxText's DeepSeek decoder: MaxText 0.2.5 collects the TE
MoE block's receive counts (`te_moe_total_recv_tokens`, sown in `maxtext/models/deepseek.py`)
in its DeepSeek decoder only; `maxtext/models/gpt_oss.py` drops them (`mlp_lnx,
load_balance_loss, _ = self.GptOssMlp(...)`), so with `model_name=gpt-oss-20b
te_moe_block=true` MaxText's train step raises "te_moe_block=True did not produce TE MoE
receive-capacity intermediates" (`maxtext/trainers/pre_train/train.py`, `loss_fn`) after the
model has run, with TransformerEngine as with te_flax. The gpt-oss MoE would not match
MaxText's own path either way: MaxText's own computes gpt-oss's clamped `x * sigmoid(1.702 x) *
(up + 1)` with a router bias, while TE's `moe` (called with
`activation_type=mlp_activations[0]`, `"sigmoid"`) computes `sigmoid(gate) * up` and takes no
bias under softmax scores. So the gpt-oss-shaped model keeps the DeepSeek decoder's routing
(MaxText scales that decoder's top-k weights as DeepSeek does, which agrees with TE's `moe`
for sigmoid scores only) and SwiGLU, and takes gpt-oss's expert count, top-k and expert biases.
"""
STEP = re.compile(r"completed step: (\d+), .* perplexity: ([0-9.]+)")


def _command(python: str, base: str, output: str, shape: str, name: str) -> list[str]:
    run_name = f"{shape}_{name}".replace(" ", "_")
    run_name = f"run_name={run_name} base_output_directory={output}"
    overrides = f"{SHAPES[shape]} {RUN} {VARIANTS[name]} {run_name}".split()
    train = "maxtext.trainers.pre_train.train"
    return [python, "-m", "te_flax", "run", "-m", train, base, *overrides]


def _losses(log: str) -> list[float]:
    return [math.log(float(m.group(2))) for m in STEP.finditer(log)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--python", required=True, help="Python with MaxText 0.2.5 and te_flax")
    parser.add_argument("--output", default="/tmp/maxtext_moe", help="MaxText's output folder")
    options = parser.parse_args()
    base = subprocess.run(
        [options.python, "-c", "import maxtext, os; print(os.path.dirname(maxtext.__file__))"],
        capture_output=True, text=True, check=True,
    ).stdout.strip() + "/configs/base.yml"  # fmt: skip
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("TE_FLAX_AS_TRANSFORMER_ENGINE", None)
    sections = []
    for shape in SHAPES:
        losses, commands = {}, {}
        for name in VARIANTS:
            command = _command(options.python, base, options.output, shape, name)
            done = subprocess.run(command, env=env, capture_output=True, text=True)
            if done.returncode:
                raise SystemExit(f"{shape}, {name}: MaxText failed\n{done.stderr[-4000:]}")
            losses[name] = _losses(done.stderr + done.stdout)
            recorded = " ".join(["python", *command[1:]])
            recorded = recorded.replace(base, "$MAXTEXT/configs/base.yml")
            commands[name] = recorded.replace(options.output, "$OUTPUT")
            print(shape, name, [f"{v:.4f}" for v in losses[name]], flush=True)
        sections.append(_section(shape, losses, commands))
    RESULTS.write_text("\n".join([*HEADER, *sections, NOTES]))
    print(f"wrote {RESULTS}")


HEADER = [
    "# MaxText's TransformerEngine MoE block through te_flax (CPU, tiny models)",
    "",
    "Command: `python -m bench.maxtext_moe --python <a Python with maxtext==0.2.5, "
    "jax==0.12.0.1, flax==0.12.12 and te_flax> [--output OUTPUT]`, which runs MaxText's trainer "
    "for each column of each table below.",
    "",
]


def _section(shape: str, losses: dict[str, list[float]], commands: dict[str, str]) -> str:
    reference = losses["maxtext"]
    lines = [
        f"## {shape}",
        "",
        *(f"- {name}: `{command}`" for name, command in commands.items()),
        "",
        "Loss per step (ln of MaxText's logged perplexity); the last columns are the relative "
        "differences from MaxText's own MoE path.",
        "",
        "| step | " + " | ".join(losses) + " | te_flax vs maxtext | mxfp8 vs maxtext |",
        "| ---: | " + " | ".join("---:" for _ in losses) + " | ---: | ---: |",
    ]
    for step, ours in enumerate(reference):
        row = [f"{losses[name][step]:.5f}" for name in losses]
        diffs = [f"{(losses[n][step] - ours) / ours:+.2e}" for n in ("te_flax", "te_flax mxfp8")]
        lines.append(f"| {step} | " + " | ".join(row + diffs) + " |")
    worst = {
        name: max(abs(a - b) / b for a, b in zip(losses[name], reference, strict=True))
        for name in ("te_flax", "te_flax mxfp8")
    }
    lines += [
        "",
        *(f"Largest relative difference, {n} vs maxtext: {w:.2e}." for n, w in worst.items()),
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
