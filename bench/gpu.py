"""``python -m bench.gpu``: te_flax vs Flax-only, FP8 vs BF16, on a real GPU, in one short run.

The same candidates and training step as the CPU suite (``bench/models.py``), at GPU sizes up
to 16384 tokens x 8192 hidden, timed interleaved (each timed call runs ``--iterations`` steps
back to back, then waits). Writes ``GPU_RESULTS.md`` and ``gpu_results.json``: step time,
achieved TFLOP/s (GEMM flops of the step / time), te_flax / Flax and FP8 / BF16 ratios, the
FP8 GEMM count of each compiled program, and the GPU targets. Then the MoE layer of
``bench/moe.py`` (``bench/gpu_moe.py``: FP8 and BF16 on te_flax's grouped GEMM kernels against
BF16 capacity; ``--no-moe`` skips it).

``--smoke`` runs it on the CPU with tiny shapes, to check the script without a GPU; its
figures mean nothing, and it writes to a temporary folder unless ``--out`` is given.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from bench import gpu_moe

BENCH_DIR = Path(__file__).parent

# (layer, batch, seq, hidden, features[, activations]); the last is the largest.
GPU_CASES = (
    ("LayerNormDenseGeneral", 4, 1024, 4096, 4096),
    ("LayerNormDenseGeneral", 16, 1024, 8192, 8192),
    ("LayerNormMLP", 4, 1024, 4096, 16384),
    ("LayerNormMLP", 16, 1024, 8192, 32768),
)
SMOKE_CASES = (
    ("LayerNormDenseGeneral", 2, 64, 128, 256),
    ("LayerNormMLP", 2, 64, 128, 256),
    ("LayerNormMLP", 2, 64, 128, 256, ("silu", "linear")),
)


def _parse(argv):
    parser = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds (default 7)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds (default 2)")
    parser.add_argument(
        "--iterations", type=int, default=None, help="steps per timed call (default 10; smoke 1)"
    )
    parser.add_argument("--out", type=Path, default=None, help="output folder (default bench/)")
    parser.add_argument("--no-moe", action="store_true", help="skip the MoE layer")
    args = parser.parse_args(argv)
    if args.iterations is None:
        args.iterations = 1 if args.smoke else 10
    if args.repeats < 1 or args.warmup < 0 or args.iterations < 1:
        parser.error("--repeats and --iterations must be >= 1, --warmup >= 0")
    return args


def _run_case(case, repeats: int, warmup: int, iterations: int, log) -> dict:
    import jax

    from bench import h100, timing
    from bench.memory import compiled_memory
    from bench.models import IMPLS, RECIPES, build, make_grad_step, with_new_fp8_state

    runners, result = {}, {"case": {"name": case.name, **case.describe()}, "candidates": {}}
    for recipe in RECIPES:
        for impl in IMPLS:
            name = f"{impl}/{recipe}"
            candidate = build(case, impl, recipe)
            compiled = jax.jit(make_grad_step(candidate)).lower(candidate.variables, candidate.x)
            compiled = compiled.compile()
            result["candidates"][name] = {
                **h100.count_gemms(compiled.as_text()),
                "memory": compiled_memory(compiled),
            }
            state = {"variables": candidate.variables}

            def run(compiled=compiled, state=state, x=candidate.x):
                for _ in range(iterations):
                    loss, (grads, x_grad) = compiled(state["variables"], x)
                    state["variables"] = with_new_fp8_state(state["variables"], grads)
                return loss, grads, x_grad

            runners[name] = run
    log(f"  timing {len(runners)} candidates x {repeats} rounds x {iterations} steps")
    times = timing.interleaved(runners, repeats, warmup)
    flops = case.step_flops()
    for name, samples in times.items():
        per_step = [t / iterations for t in samples]
        entry = result["candidates"][name]
        entry["step_time"] = {**timing.stats(per_step), "samples": per_step}
        entry["tflops"] = flops / entry["step_time"]["median"] / 1e12
    result["te_over_flax"] = {
        recipe: timing.paired_ratio(times[f"te_flax/{recipe}"], times[f"flax/{recipe}"])
        for recipe in RECIPES
    }
    # Speed-up: BF16 time / FP8 time of the same library.
    result["fp8_speedup"] = {
        impl: timing.paired_ratio(times[f"{impl}/none"], times[f"{impl}/delayed"]) for impl in IMPLS
    }
    return result


def _markdown(results: dict) -> str:
    from bench.report import _mib, _ratio

    env, layers = results["environment"], results["layers"]
    smoke = results["settings"]["smoke"]
    lines = [
        "# te_flax on a GPU: te_flax vs Flax-only, FP8 vs BF16",
        "",
        (
            "**Smoke run on a CPU with tiny shapes: these figures check the script and mean "
            "nothing about GPU performance.**"
            if smoke
            else "Measured on a GPU."
        ),
        "",
        f"Device: {env['devices']}. Versions: Python {env['python']}, jax {env['jax']}, jaxlib "
        f"{env['jaxlib']}, flax {env['flax']}, te_flax {env['te_flax']}. XLA_FLAGS: "
        f"`{env['xla_flags'] or '(none)'}`. Run {env['date']}; {results['settings']['repeats']} "
        f"timed rounds of {results['settings']['iterations']} steps after "
        f"{results['settings']['warmup']} warm-up rounds. Reproduce with `python -m bench.gpu`.",
        "",
        f"Cases measured: {results['settings']['cases_done']}.",
        "",
        "Candidates, step and recipe as in `RESULTS.md`: bf16 activations, float32 parameters, "
        "FP8 delayed scaling (HYBRID, history 1024); a step is forward + backward "
        "(`value_and_grad` with respect to variables and input) and the FP8-state overwrite.",
        "",
        "## Targets",
        "",
        "| target | bound | measured | where | met |",
        "| --- | --- | --- | --- | --- |",
    ]
    for t in results["targets"]:
        met = "yes" if t["met"] else "**no**"
        lines.append(f"| {t['name']} | {t['bound']} | {t['value']:.3f} | {t['where']} | {met} |")
    lines += [
        "",
        "## Ratios",
        "",
        "Median [min, max] of the per-round ratios.",
        "",
        "| case | te_flax / Flax, BF16 | te_flax / Flax, FP8 | FP8 speed-up te_flax "
        "| FP8 speed-up Flax |",
        "| --- | --- | --- | --- | --- |",
    ]
    for c in layers:
        lines.append(
            f"| {c['case']['name']} | {_ratio(c['te_over_flax']['none'])} | "
            f"{_ratio(c['te_over_flax']['delayed'])} | {_ratio(c['fp8_speedup']['te_flax'])} | "
            f"{_ratio(c['fp8_speedup']['flax'])} |"
        )
    lines += [
        "",
        "## Per candidate",
        "",
        "| case | candidate | step (ms) | spread | TFLOP/s | cuBLASLt FP8 / other GEMMs "
        "| temp (MiB) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for c in layers:
        for name, e in c["candidates"].items():
            impl, recipe = name.split("/")
            t = e["step_time"]
            lines.append(
                f"| {c['case']['name']} | {impl} {'FP8' if recipe == 'delayed' else 'BF16'} | "
                f"{1000 * t['median']:.3f} | {t['spread']:.0%} | {e['tflops']:.3g} | "
                f"{e['fp8_gemms']} / {e['other_gemms']} | {_mib(e['memory']['temp'])} |"
            )
    if "moe" in results:
        lines += gpu_moe.markdown(results["moe"])
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> Path:
    args = _parse(argv)
    if args.smoke:
        os.environ["JAX_PLATFORMS"] = "cpu"
    import json
    import time

    import jax

    from bench.models import Case
    from bench.suite import environment

    if not args.smoke and jax.devices()[0].platform != "gpu":
        sys.exit("python -m bench.gpu needs a GPU; use --smoke to check it on a CPU")
    out = args.out or BENCH_DIR
    if args.smoke and args.out is None:
        out = Path(tempfile.mkdtemp(prefix="bench_gpu_smoke_"))
    start = time.perf_counter()

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - start:6.0f} s] {message}", flush=True)

    results = {
        "environment": environment(),
        "settings": {
            "smoke": args.smoke,
            "repeats": args.repeats,
            "warmup": args.warmup,
            "iterations": args.iterations,
        },
        "layers": [],
    }
    cases = [Case(*spec) for spec in (SMOKE_CASES if args.smoke else GPU_CASES)]
    out.mkdir(parents=True, exist_ok=True)
    path = out / "GPU_RESULTS.md"
    # Written after every case, so a run stopped by a time limit leaves what it measured.
    for index, case in enumerate(cases, 1):
        log(case.name)
        results["layers"].append(_run_case(case, args.repeats, args.warmup, args.iterations, log))
        results["targets"] = _targets(results["layers"])
        results["settings"]["cases_done"] = f"{index} of {len(cases)}"
        results["environment"]["wall_time_s"] = time.perf_counter() - start
        (out / "gpu_results.json").write_text(json.dumps(results, indent=1) + "\n")
        path.write_text(_markdown(results))
    if not args.no_moe:
        case = gpu_moe.SMOKE_CASE if args.smoke else gpu_moe.GPU_CASE
        log(f"MoE layer: {case.describe()}")
        results["moe"] = gpu_moe.run_moe(case, args.repeats, args.warmup, args.iterations, log)
        (out / "gpu_results.json").write_text(json.dumps(results, indent=1) + "\n")
        path.write_text(_markdown(results))
    log(f"wrote {path} and {out / 'gpu_results.json'}")
    return path


def _targets(layers: list[dict]) -> list[dict]:
    """The GPU targets over the cases measured so far."""
    largest = max(layers, key=lambda c: c["case"]["step_flops"])
    speedup = largest["fp8_speedup"]["te_flax"]["median"]
    worst = max(layers, key=lambda c: c["te_over_flax"]["delayed"]["median"])
    return [
        {
            "key": "gpu_speedup",
            "name": "FP8 / BF16 speed-up of te_flax at the largest shape",
            "bound": ">= 1.5",
            "value": speedup,
            "where": largest["case"]["name"],
            "met": speedup >= 1.5,
        },
        {
            "key": "gpu_time",
            "name": "Time te_flax FP8 / Flax FP8 (worst case)",
            "bound": "<= 1.0",
            "value": worst["te_over_flax"]["delayed"]["median"],
            "where": worst["case"]["name"],
            "met": worst["te_over_flax"]["delayed"]["median"] <= 1.0,
        },
    ]


if __name__ == "__main__":
    main()
