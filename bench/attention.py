"""Context-parallel attention: peak bytes per device against sequence length, 1 to 8 devices.

``JAX_PLATFORMS=cpu python -m bench.attention`` (``--quick``: shorter sequences) compiles one
training step (forward and backward of a weighted sum of the output) of ``DotProductAttention``
(causal, float32 logits, bf16 inputs, batch 1, 8 heads of 64) with the sequence sharded over a
``context`` mesh axis of 1, 2, 4 and 8 CPU devices, for both strategies (causal load balancing
on), and reads each device's memory from the compiled program (``memory_analysis()``:
arguments + outputs + temporaries). Nothing is run; the figures are XLA's buffer assignment for
the CPU program, whose attention is the XLA maths (the score matrix is materialised, no flash
kernel), so they show how the per-device footprint scales, not a GPU's. Figures go to
``bench/RESULTS_attention.md``.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}".strip()

import argparse  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import te_flax.linen as te_nn  # noqa: E402
from bench.memory import compiled_memory  # noqa: E402
from te_flax.sharding import make_mesh  # noqa: E402

HEADS, HEAD_DIM = 8, 64
OUT = Path(__file__).resolve().parent / "RESULTS_attention.md"


def peak_bytes(seq: int, cp_size: int, strategy: str) -> int:
    """Arguments + outputs + temporaries of one device's compiled training step."""
    module = te_nn.DotProductAttention(
        head_dim=HEAD_DIM,
        num_attention_heads=HEADS,
        attn_mask_type="causal",
        context_parallel_axis="context",
        context_parallel_strategy=strategy,
        context_parallel_causal_load_balanced=cp_size > 1,
    )

    def loss(q, k, v):
        out = module.apply({}, q, k, v)
        return jnp.sum(out.astype(jnp.float32) * jnp.float32(0.5))

    shape = jax.ShapeDtypeStruct((1, seq, HEADS, HEAD_DIM), jnp.bfloat16)
    with jax.set_mesh(make_mesh({"data": 8 // cp_size, "context": cp_size})):
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(shape, shape, shape).compile()
    memory = compiled_memory(compiled)
    return memory["argument"] + memory["output"] + memory["temp"] - memory["alias"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="sequences up to 2048")
    args = parser.parse_args()
    seqs = (512, 1024, 2048) if args.quick else (1024, 2048, 4096, 8192)
    sizes = (1, 2, 4, 8)
    start = time.time()
    load = os.getloadavg()[0]
    rows = []
    for strategy in ("all_gather", "ring"):
        for seq in seqs:
            mib = [peak_bytes(seq, cp, strategy) / 2**20 for cp in sizes]
            rows.append((strategy, seq, mib))
            print(strategy, seq, " ".join(f"{m:.1f}" for m in mib), flush=True)
    minutes = (time.time() - start) / 60
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    command = "JAX_PLATFORMS=cpu python -m bench.attention" + (" --quick" if args.quick else "")
    lines = [
        "# Context-parallel attention: peak bytes per device",
        "",
        f"Produced by `{command}` ({minutes:.1f} min, {when}). One "
        "training step (forward + backward) of `DotProductAttention`, causal, bf16 inputs "
        f"`[1, seq, {HEADS}, {HEAD_DIM}]`, float32 logits, the sequence over a `context` mesh "
        "axis (load balanced when it has more than one device); per-device bytes from the "
        "compiled CPU program (`memory_analysis()`: arguments + outputs + temporaries - "
        "aliased). Compiled, not run.",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores; load average {load:.1f} at the "
        f"start. jax {jax.__version__}. The CPU attention is the XLA maths, which materialises "
        "the scores: one device holds `heads x seq x seq` float32 scores and probabilities, a "
        "context-parallel device `heads x seq/cp x seq` (all-gather: its queries against every "
        "key; ring: one block per step, but autodiff of the loop keeps every step's "
        "probabilities for the backward pass).",
        "",
        "| strategy | seq | "
        + " | ".join(f"{cp} device{'s' * (cp > 1)} (MiB)" for cp in sizes)
        + " | 1 / 8 |",
        "| --- | --- | " + " | ".join("---" for _ in sizes) + " | --- |",
    ]
    for strategy, seq, mib in rows:
        cells = " | ".join(f"{m:.1f}" for m in mib)
        lines.append(f"| {strategy} | {seq} | {cells} | {mib[0] / mib[-1]:.1f}x |")
    OUT.write_text("\n".join(lines) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
