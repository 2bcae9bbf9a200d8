"""What ``te_flax.inspect_fp8()`` costs: a training step with and without the FP8 statistics.

The step is ``examples/lm``'s training step for the default configuration (the Linen GPT, 2
layers under ``nn.scan``, d_model 128, batch 16 x 128 tokens) under delayed scaling and under
MXFP8 (block-scaled: the block-scale spread is measured too): ``train_step`` as the example
runs it, against ``make_stats_step`` inside ``te_flax.inspect_fp8()``, the step the example
runs every ``train.fp8_stats_every`` steps (statistics of every GEMM operand, the gradients'
included). Both are timed on this machine's CPU, interleaved (``bench.timing``: ratios taken
round by round), after their compiles; the compiles are timed once each. For an H100 the two
programs are compiled deviceless (no GPU: a model of the device, not a measurement) and their
bytes accessed compared (``bench.h100.cost``: XLA's cost analysis of the optimized program,
with the cuBLAS GEMMs and Pallas kernels counted from the HLO); inside the setting the
quantizations run on XLA's stages in place of the Pallas kernels, whose saving is then lost.

Run ``JAX_PLATFORMS=cpu python -m bench.inspect_fp8``; it writes
``bench/RESULTS_inspect_fp8.md``.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_TRITON_OFF = "--xla_gpu_enable_triton_gemm=false"  # deviceless: no autotuner (bench.h100)
if _TRITON_OFF not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_TRITON_OFF}".strip()

import platform  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import te_flax  # noqa: E402
from bench.timing import interleaved, paired_ratio, stats  # noqa: E402

RESULTS = Path(__file__).with_name("RESULTS_inspect_fp8.md")
RECIPES = ("delayed", "mxfp8")
REPEATS, WARMUP = 20, 2


def _steps(recipe: str):
    """The example's plain and statistics steps (jitted), and their arguments."""
    from examples.lm.config import load_config
    from examples.lm.train import (
        _linen_frontend,
        make_optimizer,
        make_recipe,
        make_stats_step,
        make_train_step,
    )
    from te_flax.training import init_optimizer

    config = load_config(None, [f"train.recipe={recipe}"])
    frontend = _linen_frontend(config)
    tx = make_optimizer(config)
    fp8 = make_recipe(config)
    with te_flax.autocast(enabled=True, recipe=fp8):
        variables = frontend.init(jax.random.key(0))
        state = {"variables": variables, "opt_state": init_optimizer(tx, variables)}
        slots = frontend.stats_slots(variables)
    tokens = jax.random.randint(
        jax.random.key(1), (config.train.batch, config.train.seq_len), 0, 256, jnp.int32
    )
    plain = jax.jit(make_train_step(frontend, tx))
    inspected = jax.jit(make_stats_step(frontend, tx))
    return fp8, plain, inspected, state, slots, tokens


def _compile_seconds(fn, *args) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start


def measure_cpu(recipe: str) -> dict[str, object]:
    fp8, plain, inspected, state, slots, tokens = _steps(recipe)

    def run_plain():
        with te_flax.autocast(enabled=True, recipe=fp8):
            return plain(state, tokens, tokens)

    def run_inspected():
        with te_flax.autocast(enabled=True, recipe=fp8), te_flax.inspect_fp8():
            return inspected(state, slots, tokens, tokens)

    compiles = {"plain": _compile_seconds(run_plain), "inspected": _compile_seconds(run_inspected)}
    times = interleaved({"plain": run_plain, "inspected": run_inspected}, REPEATS, WARMUP)
    return {
        "plain": stats(times["plain"]),
        "inspected": stats(times["inspected"]),
        "ratio": paired_ratio(times["inspected"], times["plain"]),
        "compiles": compiles,
    }


def measure_h100(recipe: str) -> dict[str, float]:
    """Bytes accessed of the two programs compiled deviceless for an H100 (a model)."""
    from bench.h100 import cost
    from te_flax._ops.kernels.switch import mode, pallas_kernels
    from te_flax._tools.targets import deviceless_gpus, on_devices

    fp8, plain, inspected, state, slots, tokens = _steps(recipe)
    devices = deviceless_gpus("h100", 1)
    out = {}
    with te_flax.autocast(enabled=True, recipe=fp8), pallas_kernels(mode(), assume_gpu=True):
        args = on_devices((state, tokens, tokens), devices)
        out["plain"] = cost(plain.lower(*args).compile())["bytes"]
        args = on_devices((state, slots, tokens, tokens), devices)
        with te_flax.inspect_fp8():
            out["inspected"] = cost(inspected.lower(*args).compile())["bytes"]
    return out


def render(cpu: dict[str, dict], h100: dict[str, dict]) -> str:
    lines = [
        "# te_flax.inspect_fp8(): the cost of measuring FP8 statistics",
        "",
        __doc__.split("\n\n")[1].replace("\n", " ").strip(),
        "",
        f"JAX {jax.__version__}, {platform.machine()} CPU, {os.cpu_count()} cores (shared with "
        "other work while measured). Command: `JAX_PLATFORMS=cpu python -m bench.inspect_fp8`.",
        "",
        "## CPU step time (measured)",
        "",
        "| recipe | step (ms) | step with statistics (ms) | ratio (median, min-max) | "
        "compile (s) | compile with statistics (s) |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for recipe, row in cpu.items():
        ratio = row["ratio"]
        lines.append(
            f"| {recipe} | {1000 * row['plain']['median']:.1f} | "
            f"{1000 * row['inspected']['median']:.1f} | {ratio['median']:.3f} "
            f"({ratio['min']:.3f}-{ratio['max']:.3f}) | {row['compiles']['plain']:.1f} | "
            f"{row['compiles']['inspected']:.1f} |"
        )
    lines += [
        "",
        "## H100, deviceless compile (a model: XLA's cost analysis, no GPU ran)",
        "",
        "| recipe | bytes accessed | with statistics | ratio |",
        "| --- | ---: | ---: | ---: |",
    ]
    for recipe, row in h100.items():
        lines.append(
            f"| {recipe} | {row['plain']:.4g} | {row['inspected']:.4g} | "
            f"{row['inspected'] / row['plain']:.3f} |"
        )
    delayed = cpu.get("delayed")
    if delayed is not None:
        extra = delayed["ratio"]["median"] - 1
        lines += [
            "",
            f"The example measures one step in 20 (`train.fp8_stats_every`): on this CPU "
            f"{100 * extra / 20:.1f}% of a run's step time under delayed scaling, plus one "
            f"compile of the statistics step ({delayed['compiles']['inspected']:.1f} s).",
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    cpu = {recipe: measure_cpu(recipe) for recipe in RECIPES}
    h100 = {}
    try:
        h100 = {recipe: measure_h100(recipe) for recipe in RECIPES}
    except (RuntimeError, ImportError) as error:  # no CUDA build of jaxlib here
        print(f"no deviceless H100 compile: {error}")
    RESULTS.write_text(render(cpu, h100))
    print(RESULTS.read_text())


if __name__ == "__main__":
    main()
