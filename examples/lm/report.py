"""The compare mode's report: a loss plot of both runs and a table of what they measured."""

from __future__ import annotations

import platform
from pathlib import Path

import jax
import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt

from .config import Config
from .train import RunResult

__all__ = ["write_report"]


def write_report(config: Config, results: list[RunResult]) -> Path:
    """Writes ``loss.png`` and ``report.md`` to ``config.output_dir``; returns the report."""
    out = Path(config.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    figure, axis = plt.subplots(figsize=(7, 4))
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
    axis.set(xlabel="step", ylabel="cross-entropy (nats/byte)", title="FP8 vs BF16")
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(out / "loss.png", dpi=120)
    plt.close(figure)

    t, m = config.train, config.model
    lines = [
        "# FP8 vs BF16: example GPT",
        "",
        f"Model: {m.layers} layers, d_model {m.d_model}, {m.heads} heads x {m.head_dim}, MLP "
        f"{m.mlp_dim} ({m.activation}), {m.frontend}. Data: "
        f"{config.data or 'Python standard library source (built-in)'}. {t.steps} steps of "
        f"{t.batch} x {t.seq_len} bytes, AdamW lr {t.learning_rate}, seed {t.seed}. "
        f"The fp8 run's recipe: {t.recipe}.",
        f"Machine: {platform.machine()}, {jax.device_count()} x {jax.devices()[0].device_kind}, "
        f"jax {jax.__version__}.",
        "",
        "![loss curves](loss.png)",
        "",
        "| run | final train loss | first eval loss | final eval loss | eval drop | tokens/s "
        "| step time (ms) | parameters |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        drop = 1 - r.eval_loss[-1] / r.eval_loss[0]
        lines.append(
            f"| {r.name} | {r.train_loss[-1]:.4f} | {r.eval_loss[0]:.4f} | {r.eval_loss[-1]:.4f} "
            f"| {drop:.1%} | {r.tokens_per_s:,.0f} | {1000 * r.step_time_s:.1f} | "
            f"{r.parameters:,} |"
        )
    if len(results) == 2:
        a, b = results
        gap = a.eval_loss[-1] / b.eval_loss[-1] - 1
        lines += ["", f"Final eval loss, {a.name} relative to {b.name}: {gap:+.2%}."]
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path
