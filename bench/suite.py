"""The benchmark suite: every CPU and deviceless-H100 measurement, in one process.

For each case (a layer at a shape) the four candidates — te_flax and Flax-only, each without
FP8 and with FP8 delayed scaling — are built from the same parameters, compiled, checked to
compute the same function, measured for saved residuals and compiled memory, timed
interleaved, and compiled deviceless for an H100. Then the norm's cost is timed: the forward
of ``layernorm_dense`` against a plain ``dot_general`` of the same shapes. The results go to
``bench/RESULTS.md``, ``bench/results.json`` and ``bench/results.png``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from jax import lax

from bench import h100, report, timing
from bench.cpu_profile import profile
from bench.memory import compiled_memory, saved_residuals
from bench.models import IMPLS, RECIPES, Case, build, make_grad_step, with_new_fp8_state
from te_flax._base.jax_compat import pallas_triton_kept
from te_flax.dense import dense
from te_flax.layernorm_dense import layernorm_dense
from te_flax.quantize import DelayedScaling, QuantizerFactory

__all__ = [
    "CASES",
    "QUICK_CASES",
    "environment",
    "main",
    "rerun_h100",
    "run_h100",
    "run_layer_case",
    "run_norm_cost",
]

BENCH_DIR = Path(__file__).parent

# Default shapes: sized so that the whole run stays near ten minutes on a 2-core CPU.
CASES = (
    Case("LayerNormDenseGeneral", batch=4, seq=1024, hidden=1024, features=4096),
    Case("LayerNormMLP", batch=2, seq=1024, hidden=2048, features=4096),
    Case(
        "LayerNormMLP",
        batch=2,
        seq=1024,
        hidden=1024,
        features=2816,
        activations=("silu", "linear"),
    ),
)
QUICK_CASES = (
    Case("LayerNormDenseGeneral", batch=2, seq=512, hidden=512, features=2048),
    Case("LayerNormMLP", batch=2, seq=512, hidden=512, features=2048),
)


def environment() -> dict:
    """Versions and the machine, without paths or host names."""
    import flax
    import jaxlib
    import numpy as np
    import optax

    import te_flax

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            names = [line.split(":", 1)[1].strip() for line in cpuinfo if "model name" in line]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "os": f"{platform.system()} {platform.release()} {platform.machine()}",
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "flax": flax.__version__,
        "optax": optax.__version__,
        "numpy": np.__version__,
        "te_flax": te_flax.__version__,
        "devices": f"{jax.device_count()} x {jax.devices()[0].device_kind}",
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "load_average_start": list(os.getloadavg()),
    }


def _relative_difference(a: jax.Array, b: jax.Array) -> float:
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))


def run_layer_case(case: Case, repeats: int, warmup: int, with_h100: bool, log) -> dict:
    """All measurements of one case; see the module docstring."""
    keys = [(impl, recipe) for recipe in RECIPES for impl in IMPLS]
    candidates = {key: build(case, *key) for key in keys}
    result: dict = {"case": {"name": case.name, **case.describe()}, "candidates": {}}
    outputs, runners, profiled = {}, {}, {}
    for key, candidate in candidates.items():
        name = "/".join(key)
        entry = result["candidates"][name] = {}
        start = time.perf_counter()
        compiled = jax.jit(make_grad_step(candidate)).lower(candidate.variables, candidate.x)
        compiled = compiled.compile()
        entry["cpu_compile_s"] = time.perf_counter() - start
        entry["cpu_memory"] = compiled_memory(compiled)
        outputs[key], entry["residuals"] = saved_residuals(
            candidate.apply, candidate.variables, candidate.x
        )
        state = {"variables": candidate.variables}

        def run(compiled=compiled, state=state, x=candidate.x):
            loss, (grads, x_grad) = compiled(state["variables"], x)
            state["variables"] = with_new_fp8_state(state["variables"], grads)
            return loss, grads, x_grad

        runners[name] = run
        profiled[name] = (compiled, (candidate.variables, candidate.x))
    result["same_function"] = {
        recipe: _relative_difference(outputs["te_flax", recipe], outputs["flax", recipe])
        for recipe in RECIPES
    }
    log(f"  timing {len(runners)} candidates x {repeats} rounds (+{warmup} warm-up)")
    times = timing.interleaved(runners, repeats, warmup)
    for name, samples in times.items():
        result["candidates"][name]["cpu_time"] = {**timing.stats(samples), "samples": samples}
    log("  CPU profile of one step per candidate")
    for name, (compiled, args) in profiled.items():
        result["candidates"][name]["cpu_profile"] = profile(compiled, args)
    if with_h100:
        run_h100(candidates, result, log)
    result["ratios"] = {recipe: _ratios(result["candidates"], recipe) for recipe in RECIPES}
    result["fp8_vs_bf16"] = {
        impl: timing.paired_ratio(times[f"{impl}/delayed"], times[f"{impl}/none"]) for impl in IMPLS
    }
    return result


def run_h100(candidates: dict, result: dict, log) -> None:
    """The deviceless H100 compiles of a case's candidates, into ``result["candidates"]``.

    ``h100`` is each candidate with te_flax's default kernel switch (``"auto"``: on this CUDA
    target the kernels it selects); te_flax's candidates are also compiled with the kernels
    off (``h100_xla``, the XLA stages) and with every kernel on (``h100_all``).
    """
    for key, candidate in candidates.items():
        name = "/".join(key)
        entry = result["candidates"].setdefault(name, {})
        log(f"  deviceless H100 compile: {name}")
        entry["h100"] = h100.analyze(candidate)
        if key[0] == "te_flax":
            entry["h100_xla"] = h100.analyze(candidate, "0")
            # Every kernel: the normalize-quantize kernel that only "1" runs is Triton's, which
            # jax 0.12 cannot lower without a GPU.
            if pallas_triton_kept():
                entry["h100_all"] = h100.analyze(candidate, "1")
            else:
                entry.pop("h100_all", None)  # from an earlier run on another JAX


def _ratios(entries: dict, recipe: str) -> dict:
    te, fl = entries[f"te_flax/{recipe}"], entries[f"flax/{recipe}"]
    ratios = {
        "cpu_time": timing.paired_ratio(te["cpu_time"]["samples"], fl["cpu_time"]["samples"]),
        "cpu_time_of_minima": te["cpu_time"]["min"] / fl["cpu_time"]["min"],
        "cpu_temp_memory": te["cpu_memory"]["temp"] / fl["cpu_memory"]["temp"],
        "residual_activations": te["residuals"]["activations"] / fl["residuals"]["activations"],
        "residual_total": te["residuals"]["total"] / fl["residuals"]["total"],
    }
    if "h100" in te:
        ratios["h100_bytes"] = te["h100"]["bytes"] / fl["h100"]["bytes"]
        ratios["h100_temp_memory"] = te["h100"]["memory"]["temp"] / fl["h100"]["memory"]["temp"]
        for variant in ("xla", "all"):
            if f"h100_{variant}" in te:
                te_bytes = te[f"h100_{variant}"]["bytes"]
                ratios[f"h100_bytes_{variant}"] = te_bytes / fl["h100"]["bytes"]
    return ratios


def rerun_h100(out: Path, log) -> dict:
    """The results in ``out/results.json`` with only the deviceless H100 compiles redone.

    For a change that touches the GPU program only: the CPU figures stay those of the last full
    run (their date is kept as ``environment.date``; ``h100_date`` is the new compiles').
    """
    import json

    results = json.loads((out / "results.json").read_text())
    for layer in results["layers"]:
        case = Case(**_case_arguments(layer["case"]))
        log(f"{case.name}")
        keys = [(impl, recipe) for recipe in RECIPES for impl in IMPLS]
        run_h100({key: build(case, *key) for key in keys}, layer, log)
        layer["ratios"] = {recipe: _ratios(layer["candidates"], recipe) for recipe in RECIPES}
    results["settings"]["h100"] = "measured"
    results["environment"]["h100_date"] = datetime.datetime.now(datetime.UTC).strftime(
        "%Y-%m-%d %H:%M UTC"
    )
    results["environment"]["h100_jax"] = jax.__version__
    return results


def _case_arguments(described: dict) -> dict:
    """The ``Case`` arguments of a case as ``Case.describe`` wrote it to results.json."""
    batch, seq, hidden = described["x"]
    features = described.get("features", described.get("intermediate"))
    arguments = dict(layer=described["layer"], batch=batch, seq=seq, hidden=hidden)
    if "activations" in described:
        arguments["activations"] = tuple(described["activations"])
    return {**arguments, "features": features}


def run_norm_cost(case: Case, repeats: int, warmup: int) -> dict:
    """Forward of ``layernorm_dense`` over a plain ``dot_general``, same shapes and dtypes.

    Both GEMMs take the bf16 input and a bf16 kernel, so the difference is the norm. Under FP8,
    ``layernorm_dense`` is compared with ``te_flax.dense`` (the same FP8 GEMM without a norm).
    """
    keys = jax.random.split(jax.random.key(0), 2)
    x = jax.random.normal(keys[0], (case.batch, case.seq, case.hidden), jnp.bfloat16)
    kernel = (jax.random.normal(keys[1], (case.hidden, case.features)) * 0.02).astype(x.dtype)
    gamma, beta = jnp.ones(case.hidden), jnp.zeros(case.hidden)
    fp8_set = QuantizerFactory.create_set(fp8_recipe=DelayedScaling())
    dims = (((2,), (0,)), ((), ()))
    functions = {
        "dot_general": (lambda x, k: lax.dot_general(x, k, dims), (x, kernel)),
        "layernorm_dense": (
            lambda x, k, g, b: layernorm_dense(x, k, g, b),
            (x, kernel, gamma, beta),
        ),
        "dense FP8": (lambda x, k, q: dense(x, k, quantizer_set=q), (x, kernel, fp8_set)),
        "layernorm_dense FP8": (
            lambda x, k, g, b, q: layernorm_dense(x, k, g, b, quantizer_set=q),
            (x, kernel, gamma, beta, fp8_set),
        ),
    }
    runners, compiled_functions = {}, {}
    for name, (function, args) in functions.items():
        compiled = compiled_functions[name] = jax.jit(function).lower(*args).compile()
        runners[name] = lambda compiled=compiled, args=args: compiled(*args)
    times = timing.interleaved(runners, repeats, warmup)
    return {
        "case": {"name": case.name, **case.describe()},
        "cpu_profile": {
            name: profile(compiled_functions[name], functions[name][1]) for name in functions
        },
        "times": {name: {**timing.stats(t), "samples": t} for name, t in times.items()},
        "ratio": timing.paired_ratio(times["layernorm_dense"], times["dot_general"]),
        "ratio_fp8": timing.paired_ratio(times["layernorm_dense FP8"], times["dense FP8"]),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small shapes, for a fast check")
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds (default 7)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds (default 1)")
    parser.add_argument("--no-h100", action="store_true", help="skip the deviceless compile")
    parser.add_argument(
        "--h100-only",
        action="store_true",
        help="redo only the deviceless H100 compiles; keep the CPU figures of results.json",
    )
    parser.add_argument(
        "--out", type=Path, default=BENCH_DIR, help="output folder (default: bench/)"
    )
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0:
        parser.error("--repeats must be >= 1 and --warmup >= 0")
    start = time.perf_counter()

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - start:6.0f} s] {message}", flush=True)

    h100_reason = "skipped (--no-h100)" if args.no_h100 else h100.available()
    if h100_reason:
        log(f"deviceless H100 compile unavailable: {h100_reason}")
    if args.h100_only:
        if h100_reason:
            parser.error(f"--h100-only: the deviceless compile is unavailable: {h100_reason}")
        results = rerun_h100(args.out, log)
        paths = report.write(results, args.out)
        log("wrote " + ", ".join(str(path) for path in paths))
        return
    cases = QUICK_CASES if args.quick else CASES
    results = {
        "environment": environment(),
        "settings": {
            "repeats": args.repeats,
            "warmup": args.warmup,
            "quick": args.quick,
            "h100": h100_reason or "measured",
        },
        "layers": [],
        "norm_cost": [],
    }
    for case in cases:
        log(f"{case.name}")
        results["layers"].append(
            run_layer_case(case, args.repeats, args.warmup, not h100_reason, log)
        )
    for case in cases:
        if case.layer == "LayerNormDenseGeneral":
            log(f"norm cost: {case.name}")
            results["norm_cost"].append(run_norm_cost(case, args.repeats, args.warmup))
    if not h100_reason:
        # The XLA stages against their recorded bytes (bench/xla_stages.py): flagged here too.
        from bench import xla_stages

        configurations = xla_stages.CONFIGURATIONS
        check = xla_stages.check(configurations[:-1] if args.quick else configurations, log)
        results["xla_stages"] = {"jax": check["jax"], "regressed": check["regressed"]}
        if check["regressed"]:
            log("REGRESSED: the XLA stages' bytes, see above (python -m bench.xla_stages)")
    results["environment"]["load_average_end"] = list(os.getloadavg())
    results["environment"]["wall_time_s"] = time.perf_counter() - start
    paths = report.write(results, args.out)
    log("wrote " + ", ".join(str(path) for path in paths))
