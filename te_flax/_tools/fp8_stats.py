"""Reading FP8 statistics (``te_flax.inspect_fp8()``): a table per layer and tensor, and a plot
over steps.

Both take the statistics as te_flax keeps them, whatever the front end: Linen's
``"fp8_stats"`` collection (``variables["fp8_stats"]``, ``grads["fp8_stats"]``), NNX's
``nnx.state(model, te_flax.nnx.Fp8Stats)``, or the plain dicts ``jax.device_get`` makes of
either. Each tensor's statistics are a dict named ``{x,kernel,grad}{postfix}_stats``; its
arrays may carry leading axes (scanned layers, the groups of a grouped GEMM), each index of
which becomes a row (a line) of its own, ``path[i]``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

__all__ = ["TensorStats", "flatten_fp8_stats", "fp8_stats_table", "plot_fp8_stats"]

_ROLES = ("x", "kernel", "grad")
_SUFFIX = "_stats"


@dataclasses.dataclass(frozen=True)
class TensorStats:
    """One tensor's statistics in one GEMM: ``layer`` (the module path, with ``[i]`` for an
    index of a leading axis), ``gemm`` (the postfix, ``""`` for a single-GEMM layer), ``role``
    (``x``, ``kernel`` or ``grad``) and ``values`` (statistic name -> float)."""

    layer: str
    gemm: str
    role: str
    values: dict[str, float]

    @property
    def name(self) -> str:
        """``layer`` and ``gemm`` together: the GEMM's name in a table or legend."""
        return f"{self.layer}{self.gemm}"


def _key_name(key: Any) -> str | int | None:
    for attribute in ("key", "name", "idx"):
        if hasattr(key, attribute):
            value = getattr(key, attribute)
            return value if isinstance(value, str | int) else str(value)
    return None


def _split_name(variable: str) -> tuple[str, str] | None:
    """``("x", "_0")`` for ``"x_0_stats"``; None for a name that is no statistics variable."""
    if not variable.endswith(_SUFFIX):
        return None
    stem = variable[: -len(_SUFFIX)]
    for role in _ROLES:
        if stem == role or stem.startswith(role + "_"):
            return role, stem[len(role) :]
    return None


def flatten_fp8_stats(stats: Any) -> list[TensorStats]:
    """Every tensor's statistics in ``stats`` (see the module docstring), one entry per index
    of the leading axes, in path order.

    Raises:
      ValueError: ``stats`` holds no statistics (e.g. a variable dict whose ``"fp8_stats"``
        was not selected, or a step run outside ``te_flax.inspect_fp8()``).
    """
    groups: dict[tuple[tuple[str, ...], str], dict[str, np.ndarray]] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(stats)[0]:
        names = [_key_name(key) for key in path]
        keys = [str(n) for n in names if n is not None and n not in ("value", "raw_value")]
        where = next((i for i, k in enumerate(keys) if _split_name(k) is not None), None)
        if where is None or where + 1 >= len(keys):
            continue
        statistic = keys[-1]
        groups.setdefault((tuple(keys[:where]), keys[where]), {})[statistic] = np.asarray(leaf)
    if not groups:
        raise ValueError(
            "no FP8 statistics found: pass the 'fp8_stats' collection (Linen: "
            "variables['fp8_stats'] or grads['fp8_stats']; NNX: nnx.state(model, "
            "te_flax.nnx.Fp8Stats)) of a step run inside te_flax.inspect_fp8(), got a tree "
            "without {x,kernel,grad}*_stats entries"
        )
    found: list[TensorStats] = []
    for (layer_path, variable), values in sorted(groups.items()):
        role, gemm = _split_name(variable)  # type: ignore[misc]
        shape = np.broadcast_shapes(*(v.shape for v in values.values()))
        for index in np.ndindex(*shape):
            suffix = f"[{','.join(map(str, index))}]" if index else ""
            row = {
                name: float(np.broadcast_to(value, shape)[index]) for name, value in values.items()
            }
            found.append(TensorStats("/".join(layer_path) + suffix, gemm, role, row))
    return found


def _percent(value: float) -> str:
    return f"{100 * value:.3g}%"


def fp8_stats_table(
    stats: Any, saturation_limit: float = 1e-3, underflow_limit: float = 1e-2
) -> str:
    """A text table of FP8 statistics: one row per layer, GEMM and tensor.

    Columns: the layer, the tensor (``x``, ``kernel``, ``grad`` with the GEMM's postfix),
    ``amax``, ``scale_inv``, ``saturation`` and ``underflow`` (percent of entries), the block
    scales' ``log2`` range (block-scaled recipes) and a note where saturation or underflow
    passes the limits.

    Args:
      stats: the statistics (module docstring).
      saturation_limit: the saturated fraction from which a row is noted (default 0.1%).
      underflow_limit: the underflowed fraction from which a row is noted (default 1%). NVFP4
        (e2m1 values) underflows several percent of a normal tensor by design.

    Returns:
      The table as lines of text (``print`` it).

    Example usage::

      >>> import numpy as np
      >>> from te_flax import fp8_stats_table
      >>> stats = {"mlp": {"x_0_stats": {"amax": np.float32(4.0), "scale_inv": np.float32(1.0),
      ...                                "saturation": np.float32(0.0),
      ...                                "underflow": np.float32(0.25)}}}
      >>> print(fp8_stats_table(stats))
      layer  tensor  amax  scale_inv  saturation  underflow  log2 range  note
      mlp    x_0     4     1          0%          25%        -           underflows
    """
    rows = [
        ("layer", "tensor", "amax", "scale_inv", "saturation", "underflow", "log2 range", "note")
    ]
    for entry in flatten_fp8_stats(stats):
        v = entry.values
        notes = []
        if v.get("saturation", 0.0) >= saturation_limit:
            notes.append("saturates")
        if v.get("underflow", 0.0) >= underflow_limit:
            notes.append("underflows")
        if v.get("scale_inv", 1.0) == 0.0:
            notes = ["not measured"]
        spread = v.get("block_scale_log2_range")
        rows.append(
            (
                entry.layer,
                entry.role + entry.gemm,
                f"{v.get('amax', math.nan):.4g}",
                f"{v.get('scale_inv', math.nan):.4g}",
                _percent(v.get("saturation", math.nan)),
                _percent(v.get("underflow", math.nan)),
                "-" if spread is None else f"{spread:.3g}",
                ", ".join(notes),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]
    return "\n".join(lines)


def _as_history(history: Any) -> list[tuple[int, list[TensorStats]]]:
    items: Iterable[tuple[Any, Any]] = history.items() if isinstance(history, Mapping) else history
    steps = []
    for item in items:
        if not isinstance(item, Sequence) or len(item) != 2:
            raise TypeError(
                "plot_fp8_stats(history=...) takes (step, statistics) pairs or a mapping "
                f"step -> statistics, got an item {type(item).__name__}"
            )
        step, stats = item
        steps.append((int(step), flatten_fp8_stats(stats)))
    if not steps:
        raise ValueError("plot_fp8_stats(history=...) got no steps; collect at least one")
    return sorted(steps, key=lambda pair: pair[0])


def _pyplot() -> Any:
    try:
        import matplotlib.pyplot as plt  # an optional dependency
    except ImportError as error:
        raise ImportError(
            "te_flax.plot_fp8_stats needs matplotlib, an optional dependency: pip install "
            "matplotlib; te_flax.fp8_stats_table prints the same "
            "statistics as text without it"
        ) from error
    return plt


def plot_fp8_stats(
    history: Any,
    path: str | Path | None = None,
    metrics: Sequence[str] = ("saturation", "underflow"),
    title: str = "FP8 health",
) -> Any:
    """A figure of FP8 statistics over steps: one row of panels per metric, one column per
    tensor role (``x``, ``kernel``, ``grad``), one line per layer's GEMM.

    Fractions (``saturation``, ``underflow``) are plotted in percent on a symmetric-log axis,
    so that a zero and a rare event both show.

    Args:
      history: ``[(step, statistics), ...]`` or ``{step: statistics}``, the statistics as
        ``fp8_stats_table`` takes them (copy them to the host, ``jax.device_get``, as you
        collect them).
      path: where to save the figure (PNG by its suffix); None: not saved.
      metrics: the statistics to plot (default saturation and underflow; any of ``amax``,
        ``scale_inv`` and the block-scale statistics too).
      title: the figure's title.

    Returns:
      The ``matplotlib.figure.Figure``.

    Raises:
      ImportError: matplotlib is not installed (an optional dependency).
    """
    plt = _pyplot()
    steps = _as_history(history)
    series: dict[tuple[str, str, str], list[tuple[int, float]]] = {}
    for step, entries in steps:
        for entry in entries:
            if entry.values.get("scale_inv") == 0.0:
                continue  # not measured at this step (an evaluation's gradients)
            for metric in metrics:
                if metric in entry.values:
                    key = (metric, entry.role, entry.name)
                    series.setdefault(key, []).append((step, entry.values[metric]))
    roles = [role for role in _ROLES if any(key[1] == role for key in series)]
    figure, axes = plt.subplots(
        len(metrics), max(len(roles), 1), figsize=(4.2 * max(len(roles), 1), 2.8 * len(metrics)),
        sharex=True, squeeze=False,
    )  # fmt: skip
    for row, metric in enumerate(metrics):
        fraction = metric in ("saturation", "underflow")
        for column, role in enumerate(roles):
            axis = axes[row][column]
            for (name_metric, name_role, name), points in sorted(series.items()):
                if (name_metric, name_role) != (metric, role):
                    continue
                xs, ys = zip(*points, strict=True)
                scale = 100.0 if fraction else 1.0
                axis.plot(xs, [scale * y for y in ys], lw=1, marker=".", label=name)
            axis.set_title(f"{role}: {metric}", fontsize="small")
            axis.set_ylabel(f"{metric} (%)" if fraction else metric, fontsize="small")
            axis.set_yscale("symlog", linthresh=1e-3 if fraction else 1e-6)
            axis.grid(alpha=0.3)
            if row == len(metrics) - 1:
                axis.set_xlabel("step")
    labelled: dict[str, Any] = {}
    for axis in figure.axes:
        for line in axis.get_lines():
            labelled.setdefault(line.get_label(), line)
    if labelled:
        axes[0][-1].legend(
            list(labelled.values()), list(labelled), fontsize="x-small", loc="upper left",
            bbox_to_anchor=(1.02, 1.0),
        )  # fmt: skip
    figure.suptitle(title)
    figure.tight_layout()
    if path is not None:
        figure.savefig(Path(path), dpi=120, bbox_inches="tight")
    return figure
