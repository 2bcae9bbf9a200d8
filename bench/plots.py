"""The benchmark suite's chart: te_flax / Flax ratios per layer, with the targets' bounds."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt

from bench.targets import LABELS, bound_value

__all__ = ["plot_ratios"]

# The chart's panels: (ratio, title), and the target each recipe's bars are held to.
_METRICS = [
    ("cpu_time", "CPU time"),
    ("residual_activations", "saved residuals"),
    ("h100_bytes", "H100 bytes accessed"),
]
_TARGET_KEYS = {
    ("cpu_time", "none"): "cpu_time_none",
    ("cpu_time", "delayed"): "cpu_time_delayed",
    ("residual_activations", "none"): "residuals_none",
    ("residual_activations", "delayed"): "residuals_delayed",
    ("h100_bytes", "delayed"): "h100_bytes",
}


def plot_ratios(results: dict, path: Path) -> None:
    """Bar chart of the ratios (dashed lines: the bounds), written to ``path``."""
    layers = results["layers"]
    metrics = _METRICS
    norm_cost = results["norm_cost"]
    panels = len(metrics) + bool(norm_cost)
    figure, axes = plt.subplots(1, panels, figsize=(4.2 * panels, 4.6))
    width = 0.8 / len(layers)
    for axis, (metric, title) in zip(axes, metrics, strict=False):
        for index, c in enumerate(layers):
            values, errors = [], [[], []]
            for recipe in LABELS:
                value = c["ratios"][recipe].get(metric)
                if isinstance(value, dict):
                    errors[0].append(value["median"] - value["min"])
                    errors[1].append(value["max"] - value["median"])
                    value = value["median"]
                else:
                    errors[0].append(0)
                    errors[1].append(0)
                values.append(float("nan") if value is None else value)
            positions = [x + (index - (len(layers) - 1) / 2) * width for x in range(len(LABELS))]
            has_errors = any(errors[0]) or any(errors[1])
            axis.bar(
                positions,
                values,
                width,
                yerr=errors if has_errors else None,
                capsize=3,
                color=f"C{index}",
                label=c["case"]["name"],
            )
        for x, recipe in enumerate(LABELS):
            if (metric, recipe) in _TARGET_KEYS:
                bound = bound_value(_TARGET_KEYS[metric, recipe])
                axis.hlines(bound, x - 0.45, x + 0.45, colors="k", linestyles="--", lw=1)
        axis.axhline(1.0, color="grey", lw=0.5)
        axis.set_xticks(range(len(LABELS)), ["BF16", "FP8 delayed"])
        axis.set_title(f"{title}: te_flax / Flax")
        axis.grid(axis="y", alpha=0.3)
    if norm_cost:
        axis = axes[-1]
        for index, n in enumerate(norm_cost):
            stats = [n["ratio"], n["ratio_fp8"]]
            axis.bar(
                [x + index * 0.3 for x in range(2)],
                [r["median"] for r in stats],
                0.3,
                yerr=[
                    [r["median"] - r["min"] for r in stats],
                    [r["max"] - r["median"] for r in stats],
                ],
                capsize=3,
                color="C7",
            )
        axis.hlines(bound_value("norm_cost"), -0.45, 0.45, colors="k", linestyles="--", lw=1)
        axis.axhline(1.0, color="grey", lw=0.5)
        axis.set_xticks(range(2), ["BF16: / dot_general", "FP8: / dense"])
        axis.set_title("norm cost: layernorm_dense / GEMM")
        axis.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("ratio (dashed: target)")
    handles, labels = axes[0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="lower center", ncol=len(layers), fontsize=8)
    figure.tight_layout(rect=(0, 0.07, 1, 1))
    figure.savefig(path, dpi=110)
    plt.close(figure)
