"""The MoE layer of ``bench/moe.py`` on a real GPU, for ``python -m bench.gpu``.

One training step (the gradients of the parameters, the FP8 state and the input) of the
Mixtral-shaped layer, timed interleaved: FP8 and BF16 on te_flax's grouped GEMM kernels (the
ragged lowering; the capacity lowering with FP8), BF16 on the capacity lowering (batched cuBLAS),
and Flax's FP8 einsum on the capacity layout. The speed-ups are against te_flax's BF16 capacity
lowering, as ``bench/RESULTS_moe.md`` models them, and FP8 against BF16 on the same kernels.

``python -m bench.gpu_moe`` (no GPU needed) models the same comparison on the JAX it runs on:
``te_flax.linen.MoEBlock``'s training step compiled deviceless for an H100 in FP8 and in BF16,
dropless (the ragged lowering) and with a capacity factor of 1.25, at the Mixtral shape, a
DeepSeek-V3-like one (64 small experts, top-8) and DeepSeek-V3's own (256 experts, hidden 7168,
expert FFN 2048, top-8; the whole layer on one device, beyond an H100's memory), and modelled
as ``bench/moe.py``'s ``modelled_ms`` models a step (each GEMM or grouped kernel call at
max(FLOPs / derated peak, bytes / derated HBM bandwidth), every other byte at the derated
bandwidth). FP8 is DelayedScaling's default format, HYBRID (e5m2 gradients), and, dropless,
its E4M3 format too (``MoEBlock fp8 e4m3``: the gradients in e4m3, so every grouped GEMM is
e4m3 x e4m3, which jax 0.10's Mosaic GPU runs in float8 where it has no e4m3 x e5m2 ``wgmma``).
It writes its section of ``bench/RESULTS_moe.md`` for that JAX: run it on both ends of the
range.
"""

from __future__ import annotations

import re
import sys
import time
import warnings
from collections.abc import Callable
from functools import partial
from pathlib import Path

from bench.moe import MoECase

__all__ = [
    "GPU_CASE",
    "MODEL_CASES",
    "MODEL_VARIANTS",
    "SMOKE_CASE",
    "VARIANTS",
    "markdown",
    "model_section",
    "modelled_block",
    "run_moe",
]

GPU_CASE = MoECase("H100", tokens=8192, hidden=4096, ffn=14336, experts=8, topk=2)
SMOKE_CASE = MoECase("smoke", tokens=128, hidden=128, ffn=128, experts=4, topk=2)
BASELINE = "te_flax bf16 capacity"
# Row name -> bench.moe variant (the kernel switch is "auto", the default).
VARIANTS = {
    "te_flax fp8 ragged": "te_flax fp8 ragged",
    "te_flax bf16 ragged": "te_flax bf16 ragged",
    "te_flax fp8 capacity": "te_flax fp8 capacity",
    BASELINE: "te_flax bf16 capacity",
    "flax fp8 capacity": "flax fp8 capacity",
}


def run_moe(
    case: MoECase, repeats: int, warmup: int, iterations: int, log: Callable[[str], None]
) -> dict:
    """Step times (median over rounds, per step) of each variant, and the speed-ups."""
    import jax

    from bench import timing
    from bench.moe import make_variant

    runners, result = {}, {"case": case.describe(), "variants": {}}
    for name, variant in VARIANTS.items():
        step, params, state, x = make_variant(variant, case, jax.random.key(0))
        compiled = jax.jit(step).lower(params, state, x).compile()
        text = compiled.as_text()
        result["variants"][name] = {
            "grouped_kernel_calls": text.count('"mosaic_gpu_v2"'),
            "fp8_cublas_gemms": text.count('"__cublas$lt$matmul$f8"'),
        }

        def run(compiled=compiled, args=(params, state, x)):
            for _ in range(iterations):
                out = compiled(*args)
            return out

        runners[name] = run
    log(f"  timing {len(runners)} MoE variants x {repeats} rounds x {iterations} steps")
    times = timing.interleaved(runners, repeats, warmup)
    for name, samples in times.items():
        per_step = [t / iterations for t in samples]
        result["variants"][name]["step_time"] = {**timing.stats(per_step), "samples": per_step}
    result["speedup_over_bf16_capacity"] = {
        name: timing.paired_ratio(times[BASELINE], times[name]) for name in VARIANTS
    }
    result["fp8_over_bf16_kernels"] = timing.paired_ratio(
        times["te_flax bf16 ragged"], times["te_flax fp8 ragged"]
    )
    return result


def markdown(moe: dict) -> list[str]:
    """The MoE section of ``GPU_RESULTS.md``."""
    from bench.report import _ratio

    lines = [
        "",
        "## MoE layer",
        "",
        f"{moe['case']}: one training step with the input's gradient (`bench/moe.py`'s layer), "
        "te_flax's kernel switch at its default. `ragged`: te_flax's grouped GEMM kernels; "
        "`te_flax fp8 capacity`: the packed rows on the same kernels; `te_flax bf16 capacity`: "
        "batched cuBLAS GEMMs. Speed-up: te_flax bf16 capacity's time / the row's (median "
        f"[min, max] of the per-round ratios). FP8 / BF16 on the kernels: "
        f"{_ratio(moe['fp8_over_bf16_kernels'])} (the deviceless model: 1.37x derated, "
        "`bench/RESULTS_moe.md`).",
        "",
        "| variant | step (ms) | spread | speed-up | grouped kernel calls | FP8 cuBLAS GEMMs |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, entry in moe["variants"].items():
        t = entry["step_time"]
        lines.append(
            f"| {name} | {1000 * t['median']:.2f} | {t['spread']:.0%} | "
            f"{_ratio(moe['speedup_over_bf16_capacity'][name])} | "
            f"{entry['grouped_kernel_calls']} | {entry['fp8_cublas_gemms']} |"
        )
    return lines


# ----------------------------------------------------------------------------- the H100 model

MODEL_CASES = (
    MoECase("Mixtral 8x7B", tokens=8192, hidden=4096, ffn=14336, experts=8, topk=2),
    MoECase("DeepSeek-V3-like", tokens=16384, hidden=2048, ffn=1408, experts=64, topk=8),
    # DeepSeek-V3's own routed experts, the whole layer on one device: its float32 parameters
    # and their gradients alone are 90 GB, more than an H100 holds (the memory column says so);
    # a real run shards the experts (expert parallelism). The GEMM and byte shares still show
    # what FP8 buys where each expert sees few rows (512 on average) and the weights dominate.
    MoECase("DeepSeek-V3", tokens=16384, hidden=7168, ffn=2048, experts=256, topk=8),
)
# Row name -> (DelayedScaling's float8 format, "HYBRID" or "E4M3", or None for BF16;
# MoEBlock's capacity factor: None for dropless).
MODEL_VARIANTS = {
    "MoEBlock fp8": ("HYBRID", None),
    "MoEBlock bf16": (None, None),
    "MoEBlock fp8 capacity": ("HYBRID", 1.25),
    "MoEBlock bf16 capacity": (None, 1.25),
    "MoEBlock fp8 e4m3": ("E4M3", None),
}
RESULTS = Path(__file__).parent / "RESULTS_moe.md"
SECTION = "<!-- bench.gpu_moe jax {version} -->"


def _block_step(case: MoECase, fp8: str | None, capacity_factor: float | None):
    """``(step, variables, x)``: one training step of ``MoEBlock`` (its gradients and the
    input's, the FP8 state max-merged as ``te_flax.training`` does), as shapes; ``fp8``:
    DelayedScaling's format by name (``"HYBRID"``, ``"E4M3"``), None for BF16."""
    import jax
    import jax.numpy as jnp

    from bench.moe import _merged_loss
    from te_flax.linen import MoEBlock
    from te_flax.quantize import DelayedScaling, Format

    layer = MoEBlock(
        num_experts=case.experts,
        num_experts_per_tok=case.topk,
        intermediate_dim=case.ffn,
        capacity_factor=capacity_factor,
        recipe=None if fp8 is None else DelayedScaling(fp8_format=Format[fp8]),
    )
    x = jax.ShapeDtypeStruct((case.tokens, case.hidden), jnp.bfloat16)
    variables = jax.eval_shape(layer.init, jax.random.key(0), x)

    def loss(variables, x):
        return jnp.mean(jnp.square(layer.apply(variables, x)[0].astype(jnp.float32)))

    def step(variables, x):
        return jax.value_and_grad(partial(_merged_loss, loss), argnums=(0, 1))(variables, x)

    return step, variables, x


def modelled_block(case: MoECase, fp8: str | None, capacity_factor: float | None) -> dict:
    """The deviceless H100 program of ``MoEBlock``'s step (``fp8``: DelayedScaling's format by
    name, None for BF16): its GEMMs, bytes and modelled time (``bench.moe.modelled_ms``, peak
    and derated)."""
    import jax

    from bench import h100
    from bench.memory import compiled_memory
    from bench.moe import DERATES, modelled_ms
    from te_flax._ops.grouped import Fp8AtBf16RateWarning, RaggedOnGpuWarning
    from te_flax._ops.kernels import pallas_kernels
    from te_flax._tools.hlo import parse_gemms

    sharding = h100._sharding()
    step, variables, x = _block_step(case, fp8, capacity_factor)

    def spec(leaf):
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)

    # Traced as on a GPU; where a GEMM falls to XLA's ragged_dot the row shows it (its warning
    # is what the row measures).
    with pallas_kernels("auto", assume_gpu=True), warnings.catch_warnings():
        warnings.simplefilter("ignore", RaggedOnGpuWarning)
        warnings.simplefilter("ignore", Fp8AtBf16RateWarning)  # the operand types column
        compiled = jax.jit(step).lower(*jax.tree.map(spec, (variables, x))).compile()
    text = compiled.as_text()
    grouped = h100.grouped_kernel_gemms(text)
    row = {
        **h100.count_gemms(text),
        **h100.cost(compiled),
        "gemm_calls": [(g.flops, g.bytes, g.fp8) for g in parse_gemms(text)],
        "kernel_gemm_calls": [(g["flops"], g["bytes"], g["fp8"]) for g in grouped],
        # e4m3 x e5m2 and e5m2 x e4m3 calls (HYBRID's gradient GEMMs), by their flops and bytes
        "mixed_fp8_calls": [
            (g["flops"], g["bytes"])
            for g in grouped
            if g["fp8"] and len(set(g["operand_types"])) > 1
        ],
        "kernel_types": sorted({" x ".join(g["operand_types"]) for g in grouped}),
        "top": h100.instruction_bytes(text, top=4),
        "memory": compiled_memory(compiled),
    }
    row["ms"] = {label: modelled_ms(row, derate)[0] for label, derate in DERATES.items()}
    return row


def _memory_gb(memory: dict[str, int]) -> float:
    """The step's device memory by XLA's memory analysis: arguments, outputs not aliased to
    them and temporaries, in GB (an H100 holds 80)."""
    return (memory["argument"] + memory["output"] - memory["alias"] + memory["temp"]) / 1e9


# What te_flax holds its FP8 MoE step to against BF16 (docs/moe.md), dropless, by this model.
TARGET_BYTES = 0.85
TARGET_SPEEDUP = 1.5


def _met(held: bool) -> str:
    return "met" if held else "**not met**"


def _gemm_bound_ms(row: dict) -> float:
    """The step's GEMM and grouped kernel calls at their peak rates, bytes left out (ms): a
    lower bound on the modelled peak step time whatever else the step moves."""
    from bench.moe import PEAK_FLOPS

    calls = [*row["gemm_calls"], *row["kernel_gemm_calls"]]
    return 1e3 * sum(flops / PEAK_FLOPS["fp8" if fp8 else "bf16"] for flops, _, fp8 in calls)


def _mixed_at_bf16_ms(row: dict) -> float:
    """The row's modelled peak step time (ms) with its mixed-float8 GEMM calls at the BF16 peak
    instead of the FP8 one, every byte as it is."""
    from bench.moe import HBM_BYTES_PER_S, PEAK_FLOPS

    def call_ms(flops: float, nbytes: float, peak: float) -> float:
        return 1e3 * max(flops / peak, nbytes / HBM_BYTES_PER_S)

    slower = sum(
        call_ms(flops, nbytes, PEAK_FLOPS["bf16"]) - call_ms(flops, nbytes, PEAK_FLOPS["fp8"])
        for flops, nbytes in row["mixed_fp8_calls"]
    )
    return row["ms"]["peak"] + slower


def _case_lines(case: MoECase, rows: dict[str, dict]) -> list[str]:
    routed = case.tokens * case.topk
    lines = [
        f"#### {case.name}: {case.describe()} ({routed} routed rows)",
        "",
        "| variant | grouped kernel calls (operand types) | FP8 cuBLAS GEMMs | other GEMMs | "
        "GFLOP | GB accessed | memory GB | step ms peak / derated |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, row in rows.items():
        types = f" ({', '.join(row['kernel_types'])})" if row["grouped_kernels"] else ""
        lines.append(
            f"| {name} | {row['grouped_kernels']}{types} | {row['fp8_gemms']} | "
            f"{row['other_gemms']} | {row['flops'] / 1e9:,.0f} | {row['bytes'] / 1e9:.2f} | "
            f"{_memory_gb(row['memory']):.1f} | "
            f"{row['ms']['peak']:.2f} / {row['ms']['derated']:.2f} |"
        )
    fp8, bf16 = rows["MoEBlock fp8"], rows["MoEBlock bf16"]
    best = {
        label: min(row["ms"][label] for name, row in rows.items() if "bf16" in name)
        for label in ("peak", "derated")
    }
    lines += [
        "",
        f"- Dropless FP8 / BF16 bytes: {fp8['bytes'] / bf16['bytes']:.3f}; FLOPs: "
        f"{fp8['flops'] / bf16['flops']:.2f}.",
        f"- Dropless FP8 speed-up over the best BF16 row (peak / derated): "
        f"{best['peak'] / fp8['ms']['peak']:.2f}x / {best['derated'] / fp8['ms']['derated']:.2f}x;"
        f" over dropless BF16: {bf16['ms']['peak'] / fp8['ms']['peak']:.2f}x / "
        f"{bf16['ms']['derated'] / fp8['ms']['derated']:.2f}x.",
    ]
    bytes_ratio = fp8["bytes"] / bf16["bytes"]
    speedups = {label: best[label] / fp8["ms"][label] for label in best}
    bound = _gemm_bound_ms(fp8)
    lines += [
        "- Targets (docs/moe.md): dropless FP8 / BF16 bytes at most "
        f"{TARGET_BYTES}: {bytes_ratio:.3f}, {_met(bytes_ratio <= TARGET_BYTES)}; speed-up over "
        f"the best BF16 row at least {TARGET_SPEEDUP}x: {speedups['peak']:.2f}x peak, "
        f"{_met(speedups['peak'] >= TARGET_SPEEDUP)}; {speedups['derated']:.2f}x derated, "
        f"{_met(speedups['derated'] >= TARGET_SPEEDUP)}.",
    ]
    if bound > 0:
        lines.append(
            "- Bound: the dropless FP8 step's GEMMs alone, each at the peak rate of the types "
            f"it multiplies in and moving no byte, take {bound:.2f} ms; no fewer bytes could make "
            f"that step more than {best['peak'] / bound:.2f}x faster than the best BF16 row "
            "(peak)."
        )
    if fp8["mixed_fp8_calls"]:
        at_bf16 = _mixed_at_bf16_ms(fp8)
        lines.append(
            f"- The same step with its {len(fp8['mixed_fp8_calls'])} e4m3 x e5m2 GEMMs at BF16's "
            f"rate (the most jax 0.10's Mosaic GPU, without mixed float8 `wgmma`, could give "
            f"HYBRID: bfloat16 products, no byte added): {at_bf16:.2f} ms peak, "
            f"{best['peak'] / at_bf16:.2f}x the best BF16 row."
        )
    cap8, cap16 = rows["MoEBlock fp8 capacity"], rows["MoEBlock bf16 capacity"]
    e4m3 = rows["MoEBlock fp8 e4m3"]
    lines += [
        f"- Dropless FP8 in the E4M3 format (gradients in e4m3 too) / BF16 bytes: "
        f"{e4m3['bytes'] / bf16['bytes']:.3f}; speed-up over the best BF16 row (peak / derated): "
        f"{best['peak'] / e4m3['ms']['peak']:.2f}x / "
        f"{best['derated'] / e4m3['ms']['derated']:.2f}x.",
        f"- Capacity FP8 / BF16 bytes: {cap8['bytes'] / cap16['bytes']:.3f}; speed-up (peak / "
        f"derated): {cap16['ms']['peak'] / cap8['ms']['peak']:.2f}x / "
        f"{cap16['ms']['derated'] / cap8['ms']['derated']:.2f}x.",
        "- Largest instructions of the dropless FP8 step: "
        + "; ".join(
            f"{r['instruction']} -> {r['result']} ({r['bytes'] / 1e9:.2f} GB)" for r in fp8["top"]
        )
        + ".",
        "",
    ]
    return lines


def model_section(cases=MODEL_CASES) -> str:
    """The section of ``bench/RESULTS_moe.md`` for the running JAX."""
    import jax

    started = time.time()
    body = []
    for case in cases:
        rows = {}
        for name, (fp8, factor) in MODEL_VARIANTS.items():
            rows[name] = modelled_block(case, fp8, factor)
            print(
                f"  {case.name} {name}: {rows[name]['bytes'] / 1e9:.2f} GB, "
                f"{rows[name]['ms']['derated']:.2f} ms derated (model)",
                file=sys.stderr,
            )
        body += _case_lines(case, rows)
    return "\n".join(
        [
            SECTION.format(version=jax.__version__),
            f"### MoEBlock on jax {jax.__version__}: FP8 against BF16 (deviceless H100, a model)",
            "",
            f"Produced by `JAX_PLATFORMS=cpu python -m bench.gpu_moe` on jax {jax.__version__} "
            f"({(time.time() - started) / 60:.1f} min; the deviceless compile needs the CUDA "
            "plugin of that JAX: `jax[cuda12]`, which `.venv-oldest` lacks unless added). A "
            "MODEL, not a measurement: "
            "`te_flax.linen.MoEBlock`'s training step (its gradients and the input's, "
            "DelayedScaling or none, float32 parameters, bfloat16 input) compiled deviceless for "
            "an H100 with te_flax's kernel switch at its default, FLOPs and bytes as "
            "`bench/h100.py` counts them, the step time as `bench/moe.py`'s `modelled_ms` "
            "(peaks BF16 989 / FP8 1979 TFLOP/s, HBM 3.35 TB/s; derated: cuBLAS 0.70 / 0.65, "
            "grouped kernels 0.68 / 0.55, HBM 0.90). FP8: DelayedScaling's default HYBRID "
            "format (e4m3 forward, e5m2 gradients); `fp8 e4m3`: its E4M3 format (the gradients "
            "in e4m3 too). Dropless rows: the ragged lowering; "
            "capacity rows: capacity factor 1.25. The best BF16 row is the faster of the two "
            "BF16 rows by each model. Memory: XLA's memory analysis of the compiled step "
            "(arguments, outputs not aliased to them, temporaries); the DeepSeek-V3 rows hold "
            "all 256 experts on one device, more than an H100's 80 GB: a real run shards the "
            "experts.",
            "",
            *body,
        ]
    )


def write_section(text: str, version: str) -> None:
    """Puts ``text`` in place of this JAX's section of ``bench/RESULTS_moe.md`` (or after the
    file's end): each section runs from its marker to the next marker or the end."""
    old = RESULTS.read_text() if RESULTS.exists() else ""
    marker = SECTION.format(version=version)
    pattern = re.compile(re.escape(marker) + r".*?(?=<!-- bench\.gpu_moe |\Z)", re.S)
    if pattern.search(old):
        new = pattern.sub(lambda _: text.rstrip() + "\n\n", old)
    else:
        new = old.rstrip() + "\n\n" + text.rstrip() + "\n"
    RESULTS.write_text(new.rstrip() + "\n")


def main(argv: list[str]) -> None:
    import jax

    text = model_section()
    print(text)
    if "--no-write" not in argv:
        write_section(text, jax.__version__)


if __name__ == "__main__":
    main(sys.argv[1:])
