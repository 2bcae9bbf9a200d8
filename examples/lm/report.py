"""The compare mode's report: the loss curves of both runs, their ratio over the steps, and a
table of what they measured."""

from __future__ import annotations

import dataclasses
import platform
from pathlib import Path

import jax
import matplotlib
import numpy as np

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt

import te_flax

from .config import Config
from .train import RunResult

__all__ = ["LossRatios", "loss_ratios", "write_report"]


@dataclasses.dataclass
class LossRatios:
    """One run's loss over another's at the steps both measured."""

    steps: list[int]
    train: list[float]  # per training step (both runs saw the same batch)
    eval_steps: list[int]
    eval: list[float]  # per evaluation


def loss_ratios(run: RunResult, reference: RunResult) -> LossRatios:
    """``run``'s train and eval losses divided by ``reference``'s, step by step."""
    train = dict(zip(reference.steps, reference.train_loss, strict=True))
    evals = dict(zip(reference.eval_steps, reference.eval_loss, strict=True))
    steps = [s for s in run.steps if s in train]
    eval_steps = [s for s in run.eval_steps if s in evals]
    own_train = dict(zip(run.steps, run.train_loss, strict=True))
    own_eval = dict(zip(run.eval_steps, run.eval_loss, strict=True))
    return LossRatios(
        steps,
        [own_train[s] / train[s] for s in steps],
        eval_steps,
        [own_eval[s] / evals[s] for s in eval_steps],
    )


def _moving_average(values: list[float], window: int) -> np.ndarray:
    return np.convolve(values, np.ones(window) / window, mode="valid")


def _plot_ratio(axis: plt.Axes, ratios: LossRatios, name: str, reference: str) -> None:
    """The ratio panel: raw per-step train ratio, its moving average, and the eval ratios."""
    axis.axhline(1.0, color="k", lw=0.8)
    axis.plot(ratios.steps, ratios.train, color="C0", alpha=0.25, lw=1, label="train, per step")
    window = max(1, len(ratios.steps) // 20)
    if len(ratios.steps) >= window > 1:
        smooth = _moving_average(ratios.train, window)
        axis.plot(
            ratios.steps[window - 1 :], smooth, color="C0", lw=1.5, label=f"train, mean of {window}"
        )
    axis.plot(ratios.eval_steps, ratios.eval, color="C3", marker="o", label="eval")
    axis.set(xlabel="step", ylabel=f"loss ratio {name} / {reference}")
    axis.grid(alpha=0.3)
    axis.legend(fontsize="small")


def _moe_report(config: Config, results: list[RunResult], out: Path) -> list[str]:
    """``moe.png`` (each run's aux loss and dropped tokens per step) and the report's lines."""
    moe, t = config.model.moe, config.train
    figure, (aux_axis, drop_axis) = plt.subplots(2, 1, figsize=(7, 5), sharex=True)
    for index, result in enumerate(results):
        style = dict(color=f"C{index}", lw=1, label=result.name)
        aux_axis.plot(result.steps, result.aux_loss, **style)
        drop_axis.plot(result.steps, result.tokens_dropped, **style)
    aux_axis.set(ylabel=f"aux loss (coeff {moe.aux_loss_coeff})", title="MoE routing")
    drop_axis.set(xlabel="step", ylabel="assignments dropped")
    for axis in (aux_axis, drop_axis):
        axis.grid(alpha=0.3)
        axis.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(out / "moe.png", dpi=120)
    plt.close(figure)
    assignments = t.batch * t.seq_len * moe.top_k * config.model.layers
    lines = [
        "",
        f"Mixture of experts in every block: {moe.experts} experts, top-{moe.top_k}, capacity "
        f"factor {moe.capacity_factor} ({'dropless' if moe.capacity_factor is None else 'drops'}"
        f"), aux loss coefficient {moe.aux_loss_coeff}; {assignments:,} token-expert "
        "assignments per step over all layers.",
        "",
        "![MoE aux loss and dropped tokens](moe.png)",
        "",
        "| run | first aux loss | final aux loss | dropped, first step | dropped, mean of last "
        "tenth | dropped, whole run |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        tail = r.tokens_dropped[-max(1, len(r.tokens_dropped) // 10) :]
        lines.append(
            f"| {r.name} | {r.aux_loss[0]:.5f} | {r.aux_loss[-1]:.5f} | {r.tokens_dropped[0]:,} | "
            f"{np.mean(tail):,.1f} ({np.mean(tail) / assignments:.2%}) | "
            f"{sum(r.tokens_dropped):,} |"
        )
    return lines


def _worst(stats, metric: str) -> tuple[float, str]:
    """The largest ``metric`` among a step's tensors, and which tensor it is."""
    worst, where = 0.0, "none"
    for path, value in jax.tree_util.tree_flatten_with_path(stats)[0]:
        keys = [getattr(key, "key", str(key)) for key in path]
        if keys[-1] == metric and np.max(value) > worst:
            index = np.unravel_index(np.argmax(value), np.shape(value))
            layer = f" (layer {index[0]})" if index else ""
            worst, where = float(np.max(value)), "/".join(map(str, keys[:-1])) + layer
    return worst, where


def _fp8_health_report(config: Config, result: RunResult, out: Path) -> list[str]:
    """``fp8_health.png`` (saturation and underflow of every GEMM operand over the run,
    measured with ``te_flax.inspect_fp8()``) and the report's lines about it."""
    every = config.train.fp8_stats_every
    te_flax.plot_fp8_stats(
        result.fp8_stats, out / "fp8_health.png", title=f"FP8 health of the {result.name} run"
    )
    last_step, last = result.fp8_stats[-1]
    saturation, saturated = _worst(last, "saturation")
    underflow, underflowed = _worst(last, "underflow")
    return [
        "",
        f"FP8 health of the {result.name} run: every {every} steps a training step ran inside "
        "`te_flax.inspect_fp8()` and measured, for each layer's GEMMs, the fraction of "
        "entries of x, the kernel and the output gradient that saturate (clipped at the "
        "format's largest value) and the fraction of nonzero entries that underflow to zero "
        f"({len(result.fp8_stats)} measurements; such a step took "
        f"{1000 * result.fp8_stats_step_s:.1f} ms against {1000 * result.step_time_s:.1f} ms).",
        "",
        "![FP8 health: saturation and underflow per layer](fp8_health.png)",
        "",
        f"At step {last_step}: largest saturation {saturation:.3%} ({saturated}), largest "
        f"underflow {underflow:.3%} ({underflowed}).",
    ]


def write_report(config: Config, results: list[RunResult]) -> Path:
    """Writes ``loss.png`` and ``report.md`` to ``config.output_dir``; returns the report."""
    out = Path(config.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    compared = len(results) == 2
    figure, axes = plt.subplots(
        2 if compared else 1,
        1,
        figsize=(7, 7 if compared else 4),
        sharex=True,
        squeeze=False,
        height_ratios=[3, 2] if compared else [1],
    )
    axis = axes[0, 0]
    for index, result in enumerate(results):
        color, style = f"C{index}", ("-", "--")[index % 2]
        axis.plot(
            result.steps,
            result.train_loss,
            color=color,
            alpha=0.3,
            lw=1,
            label=f"{result.name} train",
        )
        axis.plot(
            result.eval_steps,
            result.eval_loss,
            color=color,
            ls=style,
            marker="o",
            label=f"{result.name} eval",
        )
    axis.set(ylabel="cross-entropy (nats/byte)", title="FP8 vs BF16")
    axis.grid(alpha=0.3)
    axis.legend()
    ratios = loss_ratios(results[0], results[1]) if compared else None
    if ratios is not None:
        _plot_ratio(axes[1, 0], ratios, results[0].name, results[1].name)
    else:
        axis.set(xlabel="step")
    figure.tight_layout()
    figure.savefig(out / "loss.png", dpi=120)
    plt.close(figure)

    t, m = config.train, config.model
    lines = [
        "# FP8 vs BF16: example GPT",
        "",
        f"Model: {m.layers} layers, d_model {m.d_model}, {m.heads} heads x {m.head_dim}, MLP "
        f"{m.mlp_dim} ({m.activation}), {m.frontend}, {m.block} blocks. Data: "
        f"{config.data or 'Python standard library source (built-in)'}. {t.steps} steps of "
        f"{t.batch} x {t.seq_len} bytes, AdamW lr {t.learning_rate}, seed {t.seed}. "
        f"The fp8 run's recipe: {t.recipe}.",
        f"Machine: {platform.machine()}, {jax.device_count()} x {jax.devices()[0].device_kind}, "
        f"jax {jax.__version__}.",
        "",
        "![loss curves](loss.png)",
        "",
        "| run | final train loss | first eval loss | final eval loss | eval drop | tokens/s "
        "| step time (ms) | first step (s) | parameters |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        drop = 1 - r.eval_loss[-1] / r.eval_loss[0]
        lines.append(
            f"| {r.name} | {r.train_loss[-1]:.4f} | {r.eval_loss[0]:.4f} | {r.eval_loss[-1]:.4f} "
            f"| {drop:.1%} | {r.tokens_per_s:,.0f} | {1000 * r.step_time_s:.1f} | "
            f"{r.first_step_s:.2f} | {r.parameters:,} |"
        )
    lines += [
        "",
        "First step: wall time of a run's first training step, tracing and compiling the jitted "
        "step included (the first-step latency; later steps reuse the compiled program).",
    ]
    if ratios is not None:
        a, b = results
        gap = a.eval_loss[-1] / b.eval_loss[-1] - 1
        lines += ["", f"Final eval loss, {a.name} relative to {b.name}: {gap:+.2%}."]
        points = ", ".join(
            f"{step}: {ratio:.4f}"
            for step, ratio in zip(ratios.eval_steps, ratios.eval, strict=True)
        )
        worst = int(np.argmax(np.abs(np.asarray(ratios.eval) - 1)))
        lines += [
            "",
            f"Eval loss ratio {a.name} / {b.name} at each evaluation (step: ratio): {points}. "
            f"Farthest from 1: {ratios.eval[worst]:.4f} at step {ratios.eval_steps[worst]}.",
        ]
    if all(r.aux_loss for r in results):
        lines += _moe_report(config, results, out)
    for result in results:
        if result.fp8_stats:
            lines += _fp8_health_report(config, result, out)
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path
