"""Draws the FP8-state page's figure: where one training step reads and writes the FP8 state.

The variable names and shapes in the figure are those of a real ``te_flax.linen.DenseGeneral``
under delayed scaling, so the picture follows the library. ``scripts/docs`` draws it at every
build (into ``docs/_static``).
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

import te_flax.linen as te_nn
from te_flax.quantize import DelayedScaling
from te_flax.training import OVERWRITE_WITH_GRADIENT


def fp8_variables(history: int = 16) -> dict[str, tuple[int, ...]]:
    """The FP8 state of one DenseGeneral: variable name -> shape."""
    layer = te_nn.DenseGeneral(features=8, recipe=DelayedScaling(amax_history_len=history))
    variables = jax.eval_shape(layer.init, jax.random.key(0), jnp.ones((2, 8)))
    return {name: v.shape for name, v in variables[OVERWRITE_WITH_GRADIENT].items()}


def _box(ax, center, text, color, width=3.0, height=1.1):
    x, y = center
    ax.add_patch(
        FancyBboxPatch(
            (x - width / 2, y - height / 2), width, height, boxstyle="round,pad=0.05", fc=color,
            ec="0.3", lw=1,
        )
    )  # fmt: skip
    ax.text(x, y, text, ha="center", va="center", fontsize=8.5, family="monospace")


def _arrow(ax, start, end, label="", offset=(0.0, 0.0)):
    ax.add_patch(
        FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=14, lw=1.2, color="0.2")
    )
    if label:
        middle = ((start[0] + end[0]) / 2 + offset[0], (start[1] + end[1]) / 2 + offset[1])
        ax.text(*middle, label, ha="center", va="center", fontsize=8, style="italic")


def draw(path: Path) -> None:
    names = fp8_variables()
    state_text = "\n".join(f"{name} {list(shape)}" for name, shape in sorted(names.items()))
    fig, ax = plt.subplots(figsize=(11, 6.4))
    ax.set_xlim(0, 11)
    ax.set_ylim(0, 6.6)
    ax.axis("off")
    ax.text(5.5, 6.4, "One training step: how the FP8 state of a te_flax.linen.DenseGeneral "
            "moves (delayed scaling)", ha="center", fontsize=10, weight="bold")  # fmt: skip
    # The state, as stored between steps.
    _box(ax, (1.85, 3.3), "", "#fdf3d8", width=3.3, height=3.6)
    ax.text(1.85, 4.7, f"FP8 state at step t\ncollection {OVERWRITE_WITH_GRADIENT!r}",
            ha="center", va="center", fontsize=8.5, weight="bold")  # fmt: skip
    ax.text(1.85, 3.1, state_text, ha="center", va="center", fontsize=8, family="monospace")
    # The differentiated loss: forward, then backward.
    forward, backward, step = (5.6, 5.3), (5.6, 3.3), (5.6, 1.0)
    _box(ax, forward, "forward\nq(x), q(kernel) with the\nstored scale_inv; record amax",
         "#dbe9f6")  # fmt: skip
    _box(ax, backward, "backward\nq(grad); push each amax\ninto its history; new scale_inv",
         "#dbe9f6")  # fmt: skip
    _box(ax, step, "train step\nparams -> optax\nFP8 state <- its gradient", "#e3f1dc")
    merge = (9.3, 3.3)
    _box(ax, merge, "state read k times\n(layer twice, nn.scan,\nmicrobatches):\n"
         "merge_by_max at the\ntop of the loss", "#f6dede", width=2.9, height=1.9)  # fmt: skip
    _arrow(ax, (3.55, 4.6), (forward[0] - 1.55, forward[1]), "read", (-0.1, 0.25))
    _arrow(ax, (forward[0], forward[1] - 0.6), (backward[0], backward[1] + 0.6),
           "residuals (float8 x, kernel)", (1.25, 0.0))  # fmt: skip
    _arrow(ax, (backward[0], backward[1] - 0.6), (step[0], step[1] + 0.6),
           "gradient of the state\n= the new state", (-1.0, 0.0))  # fmt: skip
    _arrow(ax, (backward[0] + 1.55, backward[1]), (merge[0] - 1.5, merge[1]), "k new states",
           (0.0, 0.25))  # fmt: skip
    _arrow(ax, (merge[0], merge[1] - 1.0), (step[0] + 1.55, step[1] + 0.2),
           "their elementwise\nmax, not their sum", (0.75, 0.1))  # fmt: skip
    _arrow(ax, (step[0] - 1.55, step[1]), (1.85, 1.45), "overwrite: the state at t+1",
           (-0.3, -0.35))  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    draw(Path(__file__).parent / "_static" / "fp8_state_flow.png")
