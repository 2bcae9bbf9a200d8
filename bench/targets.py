"""The benchmark suite's targets: each bound, and the worst measured value against it."""

from __future__ import annotations

__all__ = ["BOUNDS", "EXPECTED_FP8_GEMMS", "LABELS", "evaluate_targets"]

LABELS = {"none": "no FP8 (BF16)", "delayed": "FP8 delayed"}
EXPECTED_FP8_GEMMS = {"LayerNormDenseGeneral": 3, "LayerNormMLP": 6}
# Each target's bound, by key: "<= x" (at most) or ">= x" (at least). The chart draws those of
# the te_flax / Flax ratios.
BOUNDS = {
    "cpu_time_none": "<= 1.00",
    "cpu_time_delayed": "<= 1.00",
    "norm_cost": "<= 1.10",
    "residuals_none": "<= 0.6",
    "residuals_delayed": "<= 0.5",
    "h100_all_fp8": ">= 1.0",
    "h100_bytes": "<= 0.85",
    "gpu_speedup": ">= 1.5",
    "gpu_time": "<= 1.0",
}


def bound_value(key: str) -> float:
    """The number of a target's bound."""
    return float(BOUNDS[key].split()[-1])


def _worst(values: list[tuple[float, str]], higher_is_worse: bool = True) -> tuple[float, str]:
    return max(values) if higher_is_worse else min(values)


def evaluate_targets(results: dict) -> list[dict]:
    """Each target of the issue: its bound, the worst measured value and where, met or not."""
    layers, targets = results["layers"], []

    def add(key, name, values, higher_is_worse=True, note=""):
        bound = BOUNDS[key]
        if not values:
            targets.append(dict(key=key, name=name, bound=bound, value=None, where=note, met=None))
            return
        value, where = _worst(values, higher_is_worse)
        limit = bound_value(key)
        met = value <= limit if bound.startswith("<=") else value >= limit
        targets.append(dict(key=key, name=name, bound=bound, value=value, where=where, met=met))

    for recipe, label in LABELS.items():
        add(
            f"cpu_time_{recipe}",
            f"CPU step time te_flax / Flax, {label}",
            [(c["ratios"][recipe]["cpu_time"]["median"], c["case"]["name"]) for c in layers],
        )
    add(
        "norm_cost",
        "Norm cost: layernorm_dense / dot_general forward time",
        [(n["ratio"]["median"], n["case"]["name"]) for n in results["norm_cost"]],
    )
    for recipe in ("none", "delayed"):
        add(
            f"residuals_{recipe}",
            f"Saved residual bytes te_flax / Flax, {LABELS[recipe]}",
            [(c["ratios"][recipe]["residual_activations"], c["case"]["name"]) for c in layers],
        )
    with_h100 = [c for c in layers if "h100_bytes" in c["ratios"]["delayed"]]
    gemm_checks = []
    for c in with_h100:
        counts = c["candidates"]["te_flax/delayed"]["h100"]
        expected = EXPECTED_FP8_GEMMS[c["case"]["layer"]]
        fraction = counts["fp8_gemms"] / (counts["fp8_gemms"] + counts["other_gemms"])
        ok = counts["fp8_gemms"] == expected and counts["other_gemms"] == 0
        gemm_checks.append((float(ok) * fraction, c["case"]["name"]))
    add(
        "h100_all_fp8",
        "H100 deviceless: fraction of te_flax FP8 GEMMs that are FP8 cuBLASLt calls",
        gemm_checks,
        higher_is_worse=False,
        note=results["settings"]["h100"],
    )
    add(
        "h100_bytes",
        "H100 deviceless: bytes accessed te_flax FP8 / Flax FP8",
        [(c["ratios"]["delayed"]["h100_bytes"], c["case"]["name"]) for c in with_h100],
        note=results["settings"]["h100"],
    )
    gpu = results.get("gpu")
    add(
        "gpu_speedup",
        "GPU: FP8 / BF16 speed-up of te_flax at the largest shape",
        gpu["speedup"] if gpu else [],
        higher_is_worse=False,
        note="not measured (no GPU); run `python -m bench.gpu` on one",
    )
    add(
        "gpu_time",
        "GPU: time te_flax FP8 / Flax FP8",
        gpu["fp8_time_ratio"] if gpu else [],
        note="not measured (no GPU); run `python -m bench.gpu` on one",
    )
    return targets
