"""A model of the grouped GEMM kernels' HBM traffic: their tile schedule over an H100's L2.

``python -m bench.grouped_traffic`` replays the schedule of te_flax's grouped GEMM kernels
(``te_flax/_ops/kernels/grouped_gemm.py``) at the shapes of an MoE layer's six GEMMs and counts
the bytes their operand reads take from HBM, with the order the kernels run now and with the
order of the first kernels (a non-persistent grid, the column tiles fastest), and writes
``bench/RESULTS_grouped_traffic.md``. It is a model, not a measurement: no GPU ran it.

What it reads from the code: the tiles the stage picks for each GEMM
(``grouped_kernels.kernel_tiles``: tile shape, contraction step, persistent blocks, band), the
work items of ``rows_gemm`` (``grouped_gemm.row_tiles``) and the group-aligned layout of wgrad
(``aligned_columns``), and the order of the tiles (``tile_order.tile_at``). What it assumes: the
``programs`` blocks work on consecutive tiles of the order together (a wave) and advance along
the contraction in step, so at each contraction step a wave reads the chunk (one tile's
``depth`` slice) of each distinct operand strip it needs; a chunk comes from HBM unless it is in
an L2 of 50 MB that keeps the most recently used chunks (LRU). Outputs are written once whatever
the order and are not counted. The groups are of equal size (the routed rows spread evenly over
the experts).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np

from te_flax._ops.grouped_kernels import kernel_tiles
from te_flax._ops.kernels.grouped_gemm import Tiles, aligned_columns, row_tiles
from te_flax._ops.kernels.tile_order import H100_L2_BYTES, tile_at

__all__ = ["CASES", "GEMMS", "Gemm", "Traffic", "columns_fastest", "moe_gemms", "traffic"]

RESULTS = Path(__file__).parent / "RESULTS_grouped_traffic.md"
E4M3, E5M2, BF16 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2), jnp.dtype(jnp.bfloat16)

# The order of a grid of tiles: (positions, rows, cols, band) -> (row, col) of each position.
Order = Callable[[np.ndarray, int, int, int], tuple[np.ndarray, np.ndarray]]


def kernel_order(index: np.ndarray, rows: int, cols: int, band: int) -> tuple[np.ndarray, ...]:
    """The kernels' order: ``tile_order.tile_at`` itself, on every position at once."""
    row, col = tile_at(jnp.asarray(index, jnp.int32), rows, cols, band)
    return np.asarray(row), np.asarray(col)


def columns_fastest(index: np.ndarray, rows: int, cols: int, band: int) -> tuple[np.ndarray, ...]:
    """The first kernels' order: each row tile against every column tile in turn (a grid with
    the column axis fastest, launched in order)."""
    del rows, band
    return index // cols, index % cols


@dataclasses.dataclass(frozen=True)
class Gemm:
    """One grouped GEMM of an MoE layer: ``kind`` ``forward`` (``[M, K] x [G, K, N]``),
    ``dgrad`` (``[M, N] x [G, K, N]``, the contraction ``N``) or ``wgrad`` (``[M, K] x [M, N]
    -> [G, K, N]``), with the two operands' dtypes."""

    name: str
    kind: str
    rows: int  # M, the routed rows
    hidden: int  # K
    features: int  # N
    groups: int
    lhs_dtype: jnp.dtype
    rhs_dtype: jnp.dtype

    def tiles(self, programs: int | None = None) -> Tiles:
        """The tiles the grouped GEMM stage picks for these operands (``kernel_tiles``)."""
        spec = jax.ShapeDtypeStruct
        m, k, n, g = self.rows, self.hidden, self.features, self.groups
        if self.kind == "forward":
            operands = (spec((m, k), self.lhs_dtype), spec((g, k, n), self.rhs_dtype), (1, 1))
        elif self.kind == "dgrad":
            operands = (spec((m, n), self.lhs_dtype), spec((g, k, n), self.rhs_dtype), (1, 2))
        else:
            operands = (spec((m, k), self.lhs_dtype), spec((m, n), self.rhs_dtype), (0, 0))
        tiles = kernel_tiles(*operands, g, programs)
        assert tiles is not None, f"{self.name}: the kernels do not take {self}"
        return tiles


@dataclasses.dataclass
class Traffic:
    """Operand bytes read from HBM by one GEMM under one order, and the ideal (each operand
    byte once)."""

    hbm: int
    ideal: int
    waves: int

    @property
    def ratio(self) -> float:
        return self.hbm / self.ideal


def _sizes(gemm: Gemm) -> jax.Array:
    base, extra = divmod(gemm.rows, gemm.groups)
    return jnp.array([base + (g < extra) for g in range(gemm.groups)], jnp.int32)


def _rows_gemm_tiles(gemm: Gemm, tiles: Tiles, order: Order) -> Iterator[tuple]:
    """The forward GEMM's or dgrad's tiles in order: (lhs strip, rhs strip, steps) each, with
    strips named by (operand, index) and ``steps`` contraction steps."""
    contraction = gemm.hidden if gemm.kind == "forward" else gemm.features
    cols = (gemm.features if gemm.kind == "forward" else gemm.hidden) // tiles.cols
    table = np.asarray(row_tiles(_sizes(gemm), gemm.rows, tiles.rows))
    index = np.arange(table.shape[0] * cols)
    items, columns = order(index, table.shape[0], cols, tiles.band)
    steps = contraction // tiles.depth
    for item, col in zip(items.tolist(), columns.tolist(), strict=True):
        group, row_tile, _, count = table[item]
        # Rows past the groups (group G) are written as zeros without a contraction.
        live = count > 0 and group < gemm.groups
        yield ("lhs", int(row_tile)), ("rhs", int(group), col), steps if live else 0, 0


def _group_gemm_tiles(gemm: Gemm, tiles: Tiles, order: Order) -> Iterator[tuple]:
    """wgrad's tiles in order (group slowest): strips of a group's columns of the aligned
    layout, each ``first_tile[g + 1] - first_tile[g]`` steps from ``first_tile[g]``."""
    _, first_tile, _ = aligned_columns(_sizes(gemm), gemm.rows, tiles.depth)
    first_tile = np.asarray(first_tile).tolist()
    rows, cols = gemm.hidden // tiles.rows, gemm.features // tiles.cols
    row_of, col_of = order(np.arange(rows * cols), rows, cols, tiles.band)
    for group in range(gemm.groups):
        steps = first_tile[group + 1] - first_tile[group]
        for row, col in zip(row_of.tolist(), col_of.tolist(), strict=True):
            yield ("lhs", row, group), ("rhs", col, group), steps, first_tile[group]


def traffic(
    gemm: Gemm, tiles: Tiles, order: Order = kernel_order, l2_bytes: int = H100_L2_BYTES
) -> Traffic:
    """The HBM bytes of ``gemm``'s operand reads under ``order`` (the module docstring's
    model), in waves of ``tiles.programs`` tiles."""
    chunk = {
        "lhs": tiles.rows * tiles.depth * gemm.lhs_dtype.itemsize,
        "rhs": tiles.cols * tiles.depth * gemm.rhs_dtype.itemsize,
    }
    walk = _group_gemm_tiles if gemm.kind == "wgrad" else _rows_gemm_tiles
    schedule = list(walk(gemm, tiles, order))
    cache: OrderedDict[tuple, int] = OrderedDict()
    held, hbm, seen = 0, 0, set()
    programs = min(tiles.programs, len(schedule))
    for first in range(0, len(schedule), programs):
        wave = schedule[first : first + programs]
        strips = {}  # each distinct strip of the wave once: its steps and first step
        for lhs, rhs, steps, start in wave:
            for strip in (lhs, rhs):
                strips[strip] = (steps, start)
        for step in range(max(steps for steps, _ in strips.values())):
            for strip, (steps, start) in strips.items():
                if step >= steps:
                    continue
                key, size = (strip, start + step), chunk[strip[0]]
                seen.add(key)
                if key in cache:
                    cache.move_to_end(key)
                    continue
                hbm += size
                cache[key] = size
                held += size
                while held > l2_bytes:
                    held -= cache.popitem(last=False)[1]
    ideal = sum(chunk[key[0][0]] for key in seen)
    return Traffic(hbm=hbm, ideal=ideal, waves=-(-len(schedule) // programs))


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    tokens: int
    hidden: int
    ffn: int
    experts: int
    topk: int

    def describe(self) -> str:
        return (
            f"{self.tokens} tokens, hidden {self.hidden}, ffn {self.ffn} (gated: wi has "
            f"{2 * self.ffn} columns), {self.experts} experts, top-{self.topk}"
        )


CASES = (
    Case("Mixtral 8x7B", tokens=8192, hidden=4096, ffn=14336, experts=8, topk=2),
    Case("DeepSeek-V3-like", tokens=16384, hidden=2048, ffn=1408, experts=64, topk=8),
)
GEMMS = ("wi forward", "wi dgrad", "wi wgrad", "wo forward", "wo dgrad", "wo wgrad")


def moe_gemms(case: Case, fp8: bool) -> list[Gemm]:
    """The six grouped GEMMs of one training step of the MoE layer (HYBRID FP8: e4m3 x e4m3
    forward, e5m2 x e4m3 dgrad, e4m3 x e5m2 wgrad; or bfloat16)."""
    x, w, g = (E4M3, E4M3, E5M2) if fp8 else (BF16, BF16, BF16)
    rows, hidden, ffn, e = case.tokens * case.topk, case.hidden, case.ffn, case.experts
    shapes = {"wi": (hidden, 2 * ffn), "wo": (ffn, hidden)}
    kinds = {"forward": (x, w), "dgrad": (g, w), "wgrad": (x, g)}
    return [
        Gemm(name, name.split()[1], rows, *shapes[name.split()[0]], e, *kinds[name.split()[1]])
        for name in GEMMS
    ]


def _lines(case: Case) -> list[str]:
    lines = [
        f"## {case.name}: {case.describe()}",
        "",
        "| GEMM | operands | tiles (rows x cols, depth, blocks, band) | ideal GB | first kernels "
        "GB (x ideal) | now GB (x ideal) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for fp8 in (True, False):
        for gemm in moe_gemms(case, fp8):
            tiles = gemm.tiles()
            before = traffic(gemm, tiles, columns_fastest)
            after = traffic(gemm, tiles)
            print(f"  {case.name} {gemm.name} fp8={fp8}: {before.hbm / 1e9:.2f} -> "
                  f"{after.hbm / 1e9:.2f} GB", file=sys.stderr)  # fmt: skip
            lines.append(
                f"| {gemm.name} | {gemm.lhs_dtype.name} x {gemm.rhs_dtype.name} | {tiles.rows} "
                f"x {tiles.cols}, {tiles.depth}, {tiles.programs}, {tiles.band} | "
                f"{after.ideal / 1e9:.2f} | {before.hbm / 1e9:.2f} ({before.ratio:.1f}x) | "
                f"{after.hbm / 1e9:.2f} ({after.ratio:.2f}x) |"
            )
    return [*lines, ""]


def main(argv: list[str]) -> None:
    started = time.time()
    body = [line for case in CASES for line in _lines(case)]
    text = "\n".join(
        [
            "# The grouped GEMM kernels' HBM traffic: a model of their tile schedule",
            "",
            f"Produced by `python -m bench.grouped_traffic` ({time.time() - started:.0f} s, "
            f"jax {jax.__version__}). A MODEL, not a measurement (no GPU ran these kernels): "
            "the bench replays the kernels' schedule (the tiles "
            "`grouped_kernels.kernel_tiles` picks, `row_tiles`, `aligned_columns`, the order "
            "of `tile_order.tile_at`) over an LRU "
            "L2 of 50 MB, the persistent blocks of a wave stepping along the contraction "
            "together; see the docstring of `bench/grouped_traffic.py`. GB: the operand bytes "
            "read from HBM (outputs are written once in any order); ideal: each operand byte "
            "once. `first kernels`: the same tiles in the order of the first kernels (a grid "
            "of one block per tile, the column tiles fastest, 132 blocks at a time); `now`: "
            "the persistent grid in bands of row tiles, snaking.",
            "",
            *body,
        ]
    )
    print(text)
    if "--no-write" not in argv:
        RESULTS.write_text(text)


if __name__ == "__main__":
    main(sys.argv[1:])
