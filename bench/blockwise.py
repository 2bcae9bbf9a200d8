"""Blockwise FP8 (``Float8BlockScaling``) against per-tensor current scaling and BF16.

One training step (``value_and_grad``) of ``layernorm_mlp`` (SwiGLU, bfloat16 activations):

- deviceless H100 compile (XLA's real GPU compiler, no GPU): the GEMM kinds (cuBLAS FP8 calls,
  other GEMMs, Pallas kernels) and the bytes the step moves (``bench.h100.cost``: XLA's cost
  analysis plus each GEMM's and kernel's operands and results), with blockwise FP8's GEMMs as
  the exact XLA form (``TE_FLAX_PALLAS=0``) and as the Pallas kernel (``auto``);
- CPU time of the same step at a smaller size (median of interleaved runs).

Run ``JAX_PLATFORMS=cpu python -m bench.blockwise``; it writes ``bench/RESULTS_blockwise.md``.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_TRITON_OFF = "--xla_gpu_enable_triton_gemm=false"
if _TRITON_OFF not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_TRITON_OFF}".strip()

import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench import h100  # noqa: E402
from te_flax._ops.kernels import pallas_kernels  # noqa: E402
from te_flax.layernorm_mlp import layernorm_mlp  # noqa: E402
from te_flax.quantize import Float8BlockScaling, Float8CurrentScaling, QuantizerFactory  # noqa: E402

RESULTS = Path(__file__).with_name("RESULTS_blockwise.md")
COMMAND = "JAX_PLATFORMS=cpu python -m bench.blockwise"
RECIPES = {
    "bf16": None,
    "current": Float8CurrentScaling(),
    "blockwise": Float8BlockScaling(),
}
H100_SIZE = (4096, 2048, 8192)  # tokens, hidden, intermediate
CPU_SIZE = (512, 512, 1024)


def _step(recipe):
    sets = QuantizerFactory.create_set(2, fp8_recipe=recipe)

    def loss(x, gamma, kernels):
        out = layernorm_mlp(
            x, gamma, None, kernels, [None, None], "rmsnorm",
            activation_type=("silu", "linear"), quantizer_sets=sets,
        )  # fmt: skip
        return jnp.mean(jnp.square(out.astype(jnp.float32)))

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def _shapes(size, sharding=None):
    tokens, hidden, ffn = size

    def spec(shape, dtype=jnp.float32):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    kernels = [spec((hidden, 2, ffn), jnp.bfloat16), spec((ffn, hidden), jnp.bfloat16)]
    return spec((tokens, hidden), jnp.bfloat16), spec((hidden,)), kernels


def h100_rows() -> list[dict]:
    """The deviceless H100 figures of each recipe (blockwise: exact XLA path and kernel)."""
    sharding = h100._sharding()
    rows = []
    for name, recipe in RECIPES.items():
        switches = ("0", "auto") if name == "blockwise" else ("0",)
        for switch in switches:
            with pallas_kernels(switch, assume_gpu=True):
                compiled = _step(recipe).lower(*_shapes(H100_SIZE, sharding)).compile()
            text = compiled.as_text()
            gemms, cost = h100.count_gemms(text), h100.cost(compiled)
            blockwise_kernels = text.count('"__gpu$xla.gpu.triton"') and sum(
                "te_flax_blockwise_gemm" in line
                for line in text.splitlines()
                if "__gpu$xla.gpu.triton" in line
            )
            label = (
                name
                if name != "blockwise"
                else f"blockwise ({'kernel' if switch == 'auto' else 'exact XLA'})"
            )
            rows.append(
                {
                    "recipe": label,
                    "fp8_gemms": gemms["fp8_gemms"],
                    "other_gemms": gemms["other_gemms"],
                    "blockwise_kernels": blockwise_kernels,
                    "gb": cost["bytes"] / 1e9,
                    "gemm_gb": cost["gemm_bytes"] / 1e9,
                }
            )
    return rows


def cpu_rows(repeats: int = 5) -> list[dict]:
    """Median CPU time of each recipe's step, runs interleaved so that load hits all alike."""
    keys = jax.random.split(jax.random.key(0), 3)
    tokens, hidden, ffn = CPU_SIZE
    x = jax.random.normal(keys[0], (tokens, hidden), jnp.bfloat16)
    kernels = [
        (jax.random.normal(keys[1], (hidden, 2, ffn)) * hidden**-0.5).astype(jnp.bfloat16),
        (jax.random.normal(keys[2], (ffn, hidden)) * ffn**-0.5).astype(jnp.bfloat16),
    ]
    args = (x, jnp.ones((hidden,)), kernels)
    steps = {name: _step(recipe) for name, recipe in RECIPES.items()}
    for step in steps.values():
        jax.block_until_ready(step(*args))  # compile
    samples: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            start = time.perf_counter()
            jax.block_until_ready(step(*args))
            samples[name].append(time.perf_counter() - start)
    bf16 = statistics.median(samples["bf16"])
    return [
        {"recipe": name, "ms": 1e3 * statistics.median(s), "vs_bf16": statistics.median(s) / bf16}
        for name, s in samples.items()
    ]


def main() -> None:
    lines = [
        "# Blockwise FP8 against per-tensor current scaling and BF16",
        "",
        f"Produced by `{COMMAND}` ({platform.machine()}, JAX {jax.__version__}). One training "
        "step (`value_and_grad`) of `layernorm_mlp` (RMSNorm, SwiGLU, bfloat16 input and "
        "kernels).",
        "",
    ]
    reason = h100.available()
    if reason is None:
        tokens, hidden, ffn = H100_SIZE
        lines += [
            f"## Deviceless H100 compile ({tokens} tokens, hidden {hidden}, intermediate {ffn})",
            "",
            "GEMM kinds in the optimized program and the bytes it moves (a model from the "
            "compiled HLO, not a measurement on a GPU).",
            "",
            "| recipe | FP8 cuBLAS GEMMs | other GEMMs | blockwise kernel calls | GB moved "
            "| GB in cuBLAS GEMMs |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for r in h100_rows():
            lines.append(
                f"| {r['recipe']} | {r['fp8_gemms']} | {r['other_gemms']} | "
                f"{r['blockwise_kernels']} | {r['gb']:.2f} | {r['gemm_gb']:.2f} |"
            )
        lines.append("")
    else:
        lines += [f"Deviceless H100 compile skipped: {reason}.", ""]
    tokens, hidden, ffn = CPU_SIZE
    lines += [
        f"## CPU time ({tokens} tokens, hidden {hidden}, intermediate {ffn})",
        "",
        "Median of 5 interleaved runs. On a CPU every FP8 GEMM is emulated, so this measures "
        "the cost of the emulation (blockwise: the exact path's per-chunk GEMMs), not a GPU's.",
        "",
        "| recipe | ms per step | vs BF16 |",
        "| --- | --- | --- |",
    ]
    for r in cpu_rows():
        lines.append(f"| {r['recipe']} | {r['ms']:.1f} | {r['vs_bf16']:.2f}x |")
    RESULTS.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
