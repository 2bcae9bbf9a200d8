"""The DeepSeek-V3-like MoE shape of ``bench/moe.py``: many small experts, top-8.

``bench/moe.py`` calls ``deepseek_lines`` for its DeepSeek sections (``python -m bench.moe``
writes them into ``bench/RESULTS_moe.md``); they use the same layer, variants and model as its
Mixtral-shaped sections:

- H100 (deviceless compile, a model): DeepSeek-V3's MoE layer, 256 experts of FFN 2048 on
  hidden 7168, top-8, 4096 tokens on one device: the GEMMs, FLOPs and bytes of the compiled
  training step and ``modelled_ms``'s step time, for the grouped GEMM kernels in FP8 and BF16
  and the batched-GEMM capacity lowering (XLA's ``ragged_dot``, which XLA:GPU expands over
  every expert, is left out: 256 experts make it 32x the routed FLOPs);
- expert parallelism (deviceless compile for 8 H100s): the all-to-all bytes of
  ``te_flax.linen.MoEBlock``'s training step at that shape over 8 ways (``bench.moe_wire``'s
  program and reading), BF16 against FP8 on the dispatch wire, beside the dropless buffer's
  size ``EP x tokens per device x top-k x hidden x bytes``;
- CPU (measured): a CPU-sized DeepSeek-like layer (64 experts, top-8, hidden 2048, FFN 1408,
  128 tokens; DeepSeek-V2-Lite's expert shape with V3's top-8), step times of te_flax's
  capacity lowering in FP8 and BF16 (FP8 emulated on a CPU). The ragged lowering is left out:
  XLA:CPU's ``ragged_dot`` multiplies every row by every expert's kernel, 64x the routed
  FLOPs here (22x the capacity lowering's step time at ``--quick``'s size).
"""

from __future__ import annotations

import sys
from typing import Any

from bench import h100
from bench.moe import BASELINE, MOE_BLOCK, MoECase, _h100_tables, cpu_times, h100_figures
from bench.timing import paired_ratio, stats

__all__ = ["CPU_CASE", "CPU_VARIANTS", "EP_WAYS", "H100_CASE", "H100_VARIANTS", "deepseek_lines"]

H100_CASE = MoECase("DeepSeek-V3", tokens=4096, hidden=7168, ffn=2048, experts=256, topk=8)
CPU_CASE = MoECase("DeepSeek-like", tokens=128, hidden=2048, ffn=1408, experts=64, topk=8)
QUICK_H100_CASE = MoECase("DeepSeek-like", tokens=512, hidden=1024, ffn=512, experts=64, topk=8)
QUICK_CPU_CASE = MoECase("DeepSeek-like", tokens=64, hidden=256, ffn=128, experts=64, topk=8)
H100_VARIANTS = {
    "te_flax fp8 ragged kernel": ("te_flax fp8 ragged", "auto"),
    "te_flax bf16 ragged kernel": ("te_flax bf16 ragged", "auto"),
    "te_flax fp8 capacity kernel": ("te_flax fp8 capacity", "auto"),
    BASELINE: (BASELINE, "auto"),
    MOE_BLOCK: (MOE_BLOCK, "auto"),
}
CPU_VARIANTS = ("te_flax fp8 capacity", "te_flax bf16 capacity")
EP_WAYS = 8


def _h100_lines(case: MoECase) -> list[str]:
    rows = h100_figures(case, H100_VARIANTS)
    fp8, bf16 = rows["te_flax fp8 ragged kernel"], rows["te_flax bf16 ragged kernel"]
    return [
        f"## H100 (deviceless, a model): {case.describe()}",
        "",
        "DeepSeek-V3's MoE layer (its 256 routed experts; the shared expert is a dense MLP and "
        "left out) on one device: the layer's arithmetic and traffic, not a deployment (its "
        "float32 expert kernels alone are 30 GB; the expert-parallel section below splits "
        "them). Variants and model as above; XLA's `ragged_dot` rows are left out (XLA:GPU "
        f"expands it over all {case.experts} experts).",
        "",
        *_h100_tables(rows),
        "",
        f"- FP8 / BF16 on the grouped GEMM kernels: bytes {fp8['bytes'] / bf16['bytes']:.3f}, "
        f"modelled speed-up {bf16['ms']['peak'] / fp8['ms']['peak']:.2f}x (peak) / "
        f"{bf16['ms']['derated'] / fp8['ms']['derated']:.2f}x (derated).",
        f"- {case.experts} experts share {case.tokens * case.topk} routed rows: "
        f"{case.tokens * case.topk // case.experts} per expert on average (Mixtral's 8 "
        "experts above get 2048 each). `bench/RESULTS_moe.md`'s `bench.gpu_moe` sections "
        "model `MoEBlock` at this shape with 16384 tokens.",
        "",
    ]


def _ep_lines(case: MoECase, ways: int) -> list[str]:
    """All-to-all bytes of MoEBlock's step over ``ways`` deviceless H100s (bench.moe_wire)."""
    from bench import moe_wire  # its module sets XLA flags: imported after the CPU timings

    devices = moe_wire.h100_devices()
    if devices is None:
        return ["## Expert parallelism", "", "Not measured: no CUDA plugin for the compile.", ""]
    seq = case.tokens // moe_wire.DEVICES
    wire = moe_wire.WireCase(
        case.name, case.experts, case.topk, case.hidden, case.ffn, moe_wire.DEVICES, seq
    )
    parts = {}
    for fp8 in (False, True):
        parts[fp8] = moe_wire.wire_bytes(moe_wire.step_hlo(wire, fp8, ways, devices))
        print(f"  EP {ways} {'fp8' if fp8 else 'bf16'}: {parts[fp8]}", file=sys.stderr)
    per_device = case.tokens // moe_wire.DEVICES
    useful = per_device * case.topk * case.hidden * 2
    lines = [
        f"## Expert parallelism (deviceless compile for {moe_wire.DEVICES} H100s, compiled "
        f"program's bytes): {case.name}, EP {ways}",
        "",
        f"`te_flax.linen.MoEBlock` ({case.experts} experts, top-{case.topk}, hidden "
        f"{case.hidden}, FFN {case.ffn}, bfloat16 activations) under the `ep` rules, "
        f"{case.tokens} tokens ({moe_wire.DEVICES} x {seq}, {per_device} per device), the "
        f"experts split {ways} ways; one device's all-to-all operand bytes per part of the "
        "training step, read from the compiled HLO as `python -m bench.moe_wire` reads them "
        "(`bench/RESULTS_moe_wire.md` has more shapes and ways). BF16: no recipe; FP8: "
        "`DelayedScaling()`, float8 rows and their blocks' amaxes on the dispatch wire.",
        "",
        "| part | BF16 MB | FP8 MB | FP8 / BF16 |",
        "| --- | ---: | ---: | ---: |",
    ]
    for part in parts[False]:
        bf16, fp8 = parts[False][part], parts[True][part]
        ratio = f"{fp8 / bf16:.3f}" if bf16 else "-"
        lines.append(f"| {part} | {bf16 / 1e6:,.1f} | {fp8 / 1e6:,.1f} | {ratio} |")
    buffer = ways * useful
    return [
        *lines,
        "",
        f"- The dispatch moves a dropless buffer (every peer could receive all of a device's "
        f"rows): EP x tokens per device x top-k x hidden x 2 bytes = {ways} x {per_device} x "
        f"{case.topk} x {case.hidden} x 2 = {buffer / 1e6:,.1f} MB in BF16, against "
        f"{useful / 1e6:,.1f} MB of routed rows; a capacity (`capacity_factor`) bounds it.",
        "",
    ]


def _cpu_lines(case: MoECase, repeats: int) -> list[str]:
    times = cpu_times(case, repeats, CPU_VARIANTS)
    lines = [
        f"## CPU (measured): {case.describe()}",
        "",
        f"Median of {repeats} interleaved rounds after one warm-up round, as the CPU section "
        "above (FP8 emulated: it costs more on a CPU, not less).",
        "",
        "| variant | step ms (median) | spread |",
        "| --- | --- | --- |",
    ]
    for variant in CPU_VARIANTS:
        s = stats(times[variant])
        lines.append(f"| {variant} | {s['median'] * 1e3:.1f} | {s['spread']:.2f} |")
    lines += ["", "| ratio (per round) | median | [min, max] |", "| --- | --- | --- |"]
    ratio = paired_ratio(times["te_flax fp8 capacity"], times["te_flax bf16 capacity"])
    lines.append(
        f"| te_flax FP8 / BF16 (capacity) | {ratio['median']:.3f} | "
        f"[{ratio['min']:.3f}, {ratio['max']:.3f}] |"
    )
    return [
        *lines,
        "",
        "The ragged lowering is left out on a CPU (see `bench/moe_deepseek.py`).",
        "",
    ]


def deepseek_lines(quick: bool, repeats: int) -> list[str]:
    """The DeepSeek sections of ``bench/RESULTS_moe.md``: H100 model, EP bytes, CPU times."""
    h100_case = QUICK_H100_CASE if quick else H100_CASE
    lines: list[str] = []
    if (reason := h100.available()) is not None:
        lines += [f"DeepSeek H100 figures not measured: {reason}.", ""]
    else:
        lines += _h100_lines(h100_case)
    lines += _cpu_lines(QUICK_CPU_CASE if quick else CPU_CASE, repeats)
    if reason is None:
        lines += _ep_lines(h100_case, EP_WAYS)
    return lines


def main(argv: list[str]) -> Any:  # pragma: no cover - python -m bench.moe runs it
    print("\n".join(deepseek_lines("--quick" in argv, 3)))


if __name__ == "__main__":
    main(sys.argv[1:])
