"""Writes the suite's results: ``RESULTS.md`` (tables of ratios), ``results.json`` and a chart.

The text of ``RESULTS.md`` lives here; the targets and their bounds in ``bench.targets``, the
chart in ``bench.plots``. ``RESULTS.md`` links every other ``RESULTS_*.md`` it finds beside it.
"""

from __future__ import annotations

import json
from pathlib import Path

from bench.plots import plot_ratios
from bench.targets import LABELS, evaluate_targets

__all__ = ["evaluate_targets", "results_index", "write"]

# te_flax's deviceless H100 programs by kernel switch (results.json key, TE_FLAX_PALLAS value).
KERNEL_VARIANTS = (("h100_xla", "0"), ("h100", "auto"), ("h100_all", "1"))


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f}"


def _ms(seconds: float) -> str:
    return f"{1000 * seconds:,.0f}"


def _ratio(stats: dict) -> str:
    """A paired ratio: median, and [min, max] over the rounds."""
    return f"{stats['median']:.3f} [{stats['min']:.3f}, {stats['max']:.3f}]"


# Why a target is missed, from profiling the runs (the "Where the CPU time goes" and "Where the
# bytes go" sections show the evidence of each run). Shown only for a target the results miss.
_CPU_TIME_CAUSE = (
    "On a CPU the difference between the two libraries is within the noise of this machine: "
    "the per-round ratios straddle 1 (the [min, max] columns), and the profile shows both "
    "spending the same time in their GEMM fusions, which are most of the step. FP8 is emulated "
    "on a CPU (float8 operands are converted to float32 for float32 GEMMs), so the GEMMs cost "
    "the same in both and te_flax's lighter residuals and fewer memory passes barely show; "
    "other processes shared the two cores during the run (load average above). These figures "
    "point to no library change; the GPU script measures the case that matters."
)
CAUSES = {
    "cpu_time_none": _CPU_TIME_CAUSE,
    "cpu_time_delayed": _CPU_TIME_CAUSE,
    "norm_cost": (
        "XLA:CPU fuses the norm into the GEMM. Without FP8 the whole forward of "
        "`layernorm_dense` (statistics, normalization, the bf16-to-float32 conversions and the "
        "dot) becomes one YNNPACK fusion, which takes longer than the plain `dot_general`'s GEMM "
        "fusion and its conversions together (see the profile of the norm-cost functions), "
        "although the norm on its own takes a few milliseconds. Flax's `nn.LayerNorm` + "
        "`nn.DenseGeneral` is fused the same way (1.30x over the plain GEMM, against 1.31x for "
        "`layernorm_dense`, in a separate run at 4096x1024->4096). With YNNPACK restricted to the "
        "dot (`XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type=individual_dot`) the norm costs "
        "nothing measurable (0.98x; Flax 1.02x; separate run). Under FP8 the float8 conversions "
        "keep the norm out of the GEMM fusion. This is a CPU-compiler effect: on a GPU the GEMM "
        "is a cuBLAS call, which cannot absorb the norm, and the deviceless H100 program runs "
        "the norm as its own fusions."
    ),
    "residuals_none": "See the residual columns: they count every array `jax.vjp` keeps.",
    "residuals_delayed": "See the residual columns: they count every array `jax.vjp` keeps.",
    "h100_bytes": (
        "See the kernel table: the bytes that remain above the bound are those no kernel saves yet."
    ),
}


def _target_table(targets: list[dict]) -> list[str]:
    lines = [
        "| target | bound | measured (worst case) | where | met |",
        "| --- | --- | --- | --- | --- |",
    ]
    for t in targets:
        value = "—" if t["value"] is None else f"{t['value']:.3f}"
        met = "not measured" if t["met"] is None else ("yes" if t["met"] else "**no**")
        lines.append(f"| {t['name']} | {t['bound']} | {value} | {t['where']} | {met} |")
    return lines


def _layer_tables(layers: list[dict], has_h100: bool) -> list[str]:
    lines = [
        "### Ratios te_flax / Flax-only (lower is better for te_flax)",
        "",
        "CPU time: median of the per-round ratios [min, max over the rounds]; "
        '"of minima": ratio of the fastest runs.',
        "",
        "| case | recipe | CPU time | CPU time (of minima) | saved residuals | residuals incl. "
        "params | CPU temp memory |"
        + (" H100 bytes accessed | H100 temp memory |" if has_h100 else ""),
        "| --- | --- | --- | --- | --- | --- | --- |" + (" --- | --- |" if has_h100 else ""),
    ]
    for c in layers:
        for recipe, label in LABELS.items():
            r = c["ratios"][recipe]
            row = (
                f"| {c['case']['name']} | {label} | {_ratio(r['cpu_time'])} | "
                f"{r['cpu_time_of_minima']:.3f} | {r['residual_activations']:.3f} | "
                f"{r['residual_total']:.3f} | {r['cpu_temp_memory']:.3f} |"
            )
            if has_h100:
                row += f" {r['h100_bytes']:.3f} | {r['h100_temp_memory']:.3f} |"
            lines.append(row)
    lines += [
        "",
        "### Absolute figures per candidate",
        "",
        "CPU step time in ms: median (min-max) of the rounds, and the spread (max - min) / median. "
        "Residuals in MiB: saved activations (everything but parameters and FP8 state) / total.",
        "",
        "| case | candidate | CPU step (ms) | spread | GFLOP/s | residuals (MiB) | CPU temp (MiB) "
        "| output vs te_flax |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for c in layers:
        for name, e in c["candidates"].items():
            t = e["cpu_time"]
            flops = c["case"].get("step_flops", 0)
            recipe = name.split("/")[1]
            same = "—" if name.startswith("te_flax") else f"{c['same_function'][recipe]:.1e}"
            lines.append(
                f"| {c['case']['name']} | {_candidate(name)} | {_ms(t['median'])} "
                f"({_ms(t['min'])}-{_ms(t['max'])}) | {t['spread']:.0%} | "
                f"{flops / t['median'] / 1e9:.1f} | {_mib(e['residuals']['activations'])} / "
                f"{_mib(e['residuals']['total'])} | {_mib(e['cpu_memory']['temp'])} | {same} |"
            )
    lines += [
        "",
        "FP8 / BF16 CPU time of the same library (FP8 is emulated on a CPU, so > 1 is expected):",
        "",
        "| case | te_flax | Flax |",
        "| --- | --- | --- |",
    ]
    for c in layers:
        f = c["fp8_vs_bf16"]
        lines.append(f"| {c['case']['name']} | {_ratio(f['te_flax'])} | {_ratio(f['flax'])} |")
    if has_h100:
        lines += [
            "",
            "### Deviceless H100 compile of the same steps",
            "",
            "GEMMs: FP8 cuBLASLt calls / other GEMMs (non-FP8 cuBLAS calls, Triton or cuDNN GEMM "
            "fusions, dots left in fusions). Bytes and flops: XLA's HloCostAnalysis of the "
            "optimized H100 program, which knows nothing of custom calls (it counts each as -1 "
            "byte and -1 flop; those are taken back out), plus each cuBLAS call's operands, result "
            "and 2·M·N·K flops, plus each Pallas kernel (a `__gpu$xla.gpu.triton` custom call) "
            "counted as XLA counts a fusion: every operand read once and every result written "
            "once (its flops are left out). te_flax runs with its kernel switch "
            "`TE_FLAX_PALLAS`: off (`0`, the XLA stages), the default (`auto`: on this CUDA "
            "target the kernels it selects) and every kernel (`1`). Largest: the three entry "
            "instructions that move the most bytes (MiB).",
            "",
            "| case | candidate | kernels | FP8 / other GEMMs | fusions | Pallas kernels | GFLOP "
            "| bytes accessed (MiB) | of which GEMMs | of which kernels | temp (MiB) | largest |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for c in layers:
            for name, e in c["candidates"].items():
                for key, switch in KERNEL_VARIANTS:
                    if key not in e:
                        continue
                    h = e[key]
                    largest = "; ".join(
                        f"{_mib(row['bytes'])} {row['instruction']}"
                        for row in h["top_instructions"][:3]
                    )
                    kernels = switch if name.startswith("te_flax") else "—"
                    lines.append(
                        f"| {c['case']['name']} | {_candidate(name)} | {kernels} | "
                        f"{h['fp8_gemms']} / {h['other_gemms']} | {h['fusions']} | "
                        f"{h.get('kernels', 0)} | {h['flops'] / 1e9:,.1f} | {_mib(h['bytes'])} | "
                        f"{_mib(h['gemm_bytes'])} | {_mib(h.get('kernel_bytes', 0))} | "
                        f"{_mib(h['memory']['temp'])} | {largest} |"
                    )
        lines += ["", *_kernel_table(layers)]
    return lines


def _kernel_table(layers: list[dict]) -> list[str]:
    """Bytes accessed te_flax FP8 / Flax FP8 with the kernels off, by default and all on."""
    lines = [
        "Bytes accessed te_flax FP8 / Flax FP8 by kernel switch, and each Pallas kernel call of "
        "the default program with its bytes:",
        "",
        "| case | kernels off (0) | default (auto) | every kernel (1) | kernel calls (auto, MiB) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for c in layers:
        r = c["ratios"]["delayed"]
        if "h100_bytes_xla" not in r:
            continue
        calls = c["candidates"]["te_flax/delayed"]["h100"].get("kernel_calls", [])
        listed = "; ".join(
            f"{row['instruction'].removeprefix('Pallas kernel ')} {_mib(row['bytes'])}"
            for row in calls
        )
        lines.append(
            f"| {c['case']['name']} | {r['h100_bytes_xla']:.3f} | {r['h100_bytes']:.3f} | "
            f"{_all_kernels(r)} | {listed or '—'} |"
        )
    return [*lines, "", KERNEL_SAVINGS]


def _all_kernels(ratios: dict) -> str:
    """The every-kernel ratio, or why it is missing (its Triton normalize-quantize kernel does
    not lower without a GPU from jax 0.12 on)."""
    if "h100_bytes_all" not in ratios:
        return "— (not on jax 0.12)"
    return f"{ratios['h100_bytes_all']:.3f}"


KERNEL_SAVINGS = (
    "What the kernels save. XLA quantizes a GEMM kernel and transposes it into the layouts "
    "the FP8 GEMMs need in one fusion, but reduces its amax in another (a reduction and a "
    "transpose do not share a fusion), so each float32 kernel is read twice; the quantize "
    "kernel reads each tile once and writes both float8 layouts and the tile's amax, and the "
    "GEMMs read those layouts as written (no float8 transpose is left). In the MLP the "
    "same holds for the gradient of the first GEMM's output: XLA fuses the activation's "
    "backward into its quantization but computes it again from the same inputs for the amax; "
    "the activation-gradient kernel reads the pre-activation and the incoming gradient once "
    "and writes both float8 layouts, the amax and the bias gradient's column sums. The norm "
    "backward "
    "kernel does in one pass what XLA does in three fusions with a float32 intermediate: the "
    "row reductions, dx, and the column sums of dgamma and dbeta. The norm-quantize kernel "
    "moves what XLA's fusion moves (XLA already fuses normalize, quantize and amax), so the "
    "default switch leaves it off."
)


def _bytes_breakdown(layers: list[dict]) -> list[str]:
    """The instructions that move the most bytes, te_flax FP8 beside Flax FP8, worst case."""
    worst = max(layers, key=lambda c: c["ratios"]["delayed"]["h100_bytes"])
    lines = [
        f"The optimized H100 program of {worst['case']['name']} under FP8 (the case with the "
        "highest bytes ratio; te_flax with its default kernel switch): its entry instructions "
        "that move the most bytes (operands read once plus the results, as XLA's cost analysis "
        "counts a fusion, and the same for cuBLAS GEMMs and Pallas kernels; GEMM workspaces "
        "left out). "
        "`results.json` has this list for every case and candidate.",
        "",
    ]
    for impl in ("te_flax", "flax"):
        h = worst["candidates"][f"{impl}/delayed"]["h100"]
        lines += [
            f"{impl} FP8, {_mib(h['bytes'])} MiB in all:",
            "",
            "| MiB | instruction | result | pass | from op |",
            "| --- | --- | --- | --- | --- |",
        ]
        for row in h["top_instructions"]:
            lines.append(
                f"| {_mib(row['bytes'])} | {row['instruction']} | `{row['result']}` | "
                f"{row['pass']} | {row['from']} |"
            )
        lines.append("")
    return lines


def _cpu_profile_tables(layers: list[dict], norm_cost: list[dict]) -> list[str]:
    lines = [
        "Steps of each candidate under the JAX profiler (each instruction's median over three "
        "traced steps): the time XLA:CPU's thunks took, in "
        "GEMM fusions (those holding a `dot`; float8 GEMMs are float32 GEMMs after conversion on "
        "a CPU) and in everything else, with the largest other instructions.",
        "",
        "| case | candidate | in all (ms) | GEMMs (ms) | other (ms) | largest others (ms) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for c in layers:
        for name, e in c["candidates"].items():
            p = e.get("cpu_profile")
            if not p:
                continue
            others = ", ".join(f"{o['name']} {o['ms']:.0f}" for o in p["top_other"][:3])
            lines.append(
                f"| {c['case']['name']} | {_candidate(name)} | {p['total_ms']:,.0f} | "
                f"{p['gemm_ms']:,.0f} ({p['gemms']}) | {p['other_ms']:,.0f} | {others} |"
            )
    if norm_cost:
        lines += [
            "",
            "The norm-cost functions, forward only (the GEMM fusion's result type shows "
            "what it computes; a norm fused into it makes it longer):",
            "",
            "| case | function | in all (ms) | GEMM fusions (ms, result) | other (ms) |",
            "| --- | --- | --- | --- | --- |",
        ]
        for n in norm_cost:
            for name, p in n.get("cpu_profile", {}).items():
                if not p:
                    continue
                gemms = ", ".join(f"{g['ms']:.0f} `{g['result']}`" for g in p["top_gemms"])
                lines.append(
                    f"| {n['case']['name']} | {name} | {p['total_ms']:,.0f} | {gemms} | "
                    f"{p['other_ms']:,.0f} |"
                )
    return lines


def _candidate(name: str) -> str:
    impl, recipe = name.split("/")
    return f"{impl} {'FP8' if recipe == 'delayed' else 'BF16'}"


def _norm_table(norm_cost: list[dict]) -> list[str]:
    lines = [
        "| case | dot_general (ms) | layernorm_dense (ms) | ratio | dense FP8 (ms) "
        "| layernorm_dense FP8 (ms) | ratio FP8 |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for n in norm_cost:
        t = n["times"]
        lines.append(
            f"| {n['case']['name']} | {_ms(t['dot_general']['median'])} | "
            f"{_ms(t['layernorm_dense']['median'])} | {_ratio(n['ratio'])} | "
            f"{_ms(t['dense FP8']['median'])} | {_ms(t['layernorm_dense FP8']['median'])} | "
            f"{_ratio(n['ratio_fp8'])} |"
        )
    return lines


def _shapes(layers: list[dict]) -> list[str]:
    lines = []
    for c in layers:
        case = c["case"]
        extra = (
            f"features {case['features']}"
            if "features" in case
            else f"intermediate {case['intermediate']}, activations {tuple(case['activations'])}"
        )
        lines.append(f"- {case['name']}: x {case['x']} bfloat16, float32 parameters, {extra}.")
    return lines


# What RESULTS.md says about the GPU: nothing measured there (this suite runs on a CPU).
GPU_SECTION = (
    "No GPU figures have been measured yet: every figure in this file comes from a CPU or "
    "from XLA's deviceless compile for an H100, and the two GPU targets above read \"not "
    'measured". On a machine with an NVIDIA GPU (Hopper or newer for FP8 GEMMs), '
    "`scripts/gpu_check` produces them in one run within a time budget (`--budget`, 480 s by "
    "default): it installs the project "
    "with the CUDA build of jaxlib, runs the tests marked `gpu` (the FP8 ops' forward and "
    "backward on the GPU against the CPU emulation of the same inputs, the FP8 state after "
    "three steps, the cuBLASLt FP8 GEMMs the GPU ran, the example GPT trained 200 steps in FP8 "
    "and in BF16) and `python -m bench.gpu` (FP8 vs BF16 and te_flax vs Flax step time and "
    "TFLOP/s, up to 16384 tokens x 8192 hidden), and writes every figure to "
    "`runs/gpu_check/` in at most eight files (`SUMMARY.md`, `summary.json`, "
    "`GPU_RESULTS.md`, `loss.png` and the logs). On a GPU image with JAX preinstalled and no "
    "network, `scripts/gpu_check --system` uses that JAX as it is and installs nothing. "
    "`scripts/gpu_check --smoke` checks the script on a CPU."
)


def results_index(out: Path) -> list[str]:
    """One link per ``RESULTS_*.md`` file in ``out`` (the other benchmarks' results), with the
    first heading of each."""
    lines = []
    for path in sorted(out.glob("RESULTS_*.md")):
        text = path.read_text().splitlines()
        title = next((line.lstrip("# ").strip() for line in text if line.startswith("#")), "")
        lines.append(f"- `bench/{path.name}`" + (f": {title}" if title else ""))
    return lines


def markdown(results: dict, targets: list[dict], others: tuple[str, ...] | list[str] = ()) -> str:
    """``others``: the lines of ``results_index``, listed at the end."""
    env, settings, layers = results["environment"], results["settings"], results["layers"]
    has_h100 = settings["h100"] == "measured"
    lines = [
        "# te_flax benchmarks: te_flax vs Flax-only layers",
        "",
        "te_flax's `LayerNormDenseGeneral` and `LayerNormMLP` against the same layers written "
        "with Flax alone (`nn.LayerNorm` + `nn.DenseGeneral`, with "
        "`flax.linen.fp8_ops.Fp8DirectDotGeneralOp` as `dot_general_cls` under FP8), same "
        "parameters, same delayed-scaling recipe (HYBRID, amax history 1024, state in "
        "`_overwrite_with_gradient`). Reproduce with `python -m bench` "
        "(`python -m bench --quick` for small shapes).",
        "",
        f"Machine: {env['cpu']}, {env['cores']} cores, {env['os']}, {env['devices']}; "
        f"load average {env['load_average_start'][0]:.1f} at the start and "
        f"{env['load_average_end'][0]:.1f} at the end (other processes shared the CPU).",
        f"Versions: Python {env['python']}, jax {env['jax']}, jaxlib {env['jaxlib']}, flax "
        f"{env['flax']}, optax {env['optax']}, numpy {env['numpy']}, te_flax {env['te_flax']}. "
        f"Run {env['date']}, {env['wall_time_s'] / 60:.1f} min, {settings['repeats']} timed rounds "
        f"after {settings['warmup']} warm-up round(s)"
        + (" (quick shapes)." if settings["quick"] else ".")
        + (
            f" The deviceless H100 compiles were redone {env['h100_date']} with "
            f"`python -m bench --h100-only` (jax {env.get('h100_jax', env['jax'])}), which keeps "
            "the CPU figures of the last full run."
            if "h100_date" in env
            else ""
        ),
        "",
        "**No GPU figures have been measured yet**: this machine has no GPU; see "
        "[On a GPU](#on-a-gpu) for the command that measures them.",
        "",
        "![ratios](results.png)",
        "",
        "## Targets",
        "",
        *_target_table(targets),
        "",
    ]
    missed = [t for t in targets if t["met"] is False and t["key"] in CAUSES]
    if missed:
        lines += ["### Why the missed targets are missed", ""]
        for t in missed:
            lines += [f"**{t['name']}.** {CAUSES[t['key']]}", ""]
    lines += [
        "## On a GPU",
        "",
        GPU_SECTION,
        "",
        "## Shapes and dtypes",
        "",
        *_shapes(layers),
        "",
        "## Layers: one training step (forward + backward)",
        "",
        "A step is `jax.value_and_grad` of `mean(square(layer(x)))` with respect to the "
        "variables and the input (as for a layer inside a network), jitted; after each step the "
        'FP8 state is overwritten with its "gradient", as `TrainState.apply_gradients` does. The '
        "optimizer update is left out (identical for both). The candidates of a case run "
        "interleaved, one step each per round in a rotating order, so load from other processes "
        "hits all of them alike; time ratios are taken round by round. Saved residuals: the "
        "arrays `jax.vjp` of the jitted layer forward keeps for the backward, without the "
        'parameters and FP8 state (they are alive during the step anyway); "incl. params" '
        "counts them too. CPU temp memory: `compiled.memory_analysis().temp_size_in_bytes` of the "
        'step. "output vs te_flax": max |difference| / max |output| of the first forward, a '
        "check that both compute the same function (bf16 rounding without FP8; under FP8 Flax "
        "quantizes the bf16 norm output, te_flax the float32 one).",
        "",
        *_layer_tables(layers, has_h100),
        "",
        "## The norm's cost",
        "",
        "Forward time of `layernorm_dense(x, kernel, gamma, beta)` over `lax.dot_general(x, "
        "kernel)` with the same bf16 operands; under FP8 over `te_flax.dense` with the same FP8 "
        "recipe. Median [min, max] of the per-round ratios.",
        "",
        *_norm_table(results["norm_cost"]),
        "",
    ]
    lines += [
        "## Where the CPU time goes",
        "",
        *_cpu_profile_tables(layers, results["norm_cost"]),
        "",
    ]
    if has_h100:
        lines += ["## Where the bytes go (deviceless H100)", "", *_bytes_breakdown(layers)]
    if others:
        lines += ([""] if lines[-1] else []) + ["## Other results", "", *others]
    return "\n".join(lines)


def write(results: dict, out: Path) -> list[Path]:
    """Writes the three files into ``out``; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    targets = evaluate_targets(results)
    results["targets"] = targets
    paths = [out / "RESULTS.md", out / "results.json", out / "results.png"]
    paths[0].write_text(markdown(results, targets, results_index(out)))
    paths[1].write_text(json.dumps(results, indent=1) + "\n")
    plot_ratios(results, paths[2])
    return paths
