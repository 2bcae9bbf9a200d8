"""The MoE layer of ``bench/moe.py`` on a real GPU, for ``python -m bench.gpu``.

One training step (the gradients of the parameters, the FP8 state and the input) of the
Mixtral-shaped layer, timed interleaved: FP8 and BF16 on te_flax's grouped GEMM kernels (the
ragged lowering; the capacity lowering with FP8), BF16 on the capacity lowering (batched cuBLAS),
and Flax's FP8 einsum on the capacity layout. The speed-ups are against te_flax's BF16 capacity
lowering, as ``bench/RESULTS_moe.md`` models them, and FP8 against BF16 on the same kernels.
"""

from __future__ import annotations

from collections.abc import Callable

from bench.moe import MoECase

__all__ = ["GPU_CASE", "SMOKE_CASE", "VARIANTS", "markdown", "run_moe"]

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
