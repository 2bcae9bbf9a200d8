"""The order in which the grouped GEMM kernels' persistent blocks take their output tiles.

The grouped GEMM kernels run a persistent grid: ``programs`` blocks (one per SM), each looping
over output tiles. Block ``p`` takes tiles ``p``, ``p + programs``, ``p + 2 * programs``, ...
of one linear order, so at any moment the blocks work on about ``programs`` consecutive tiles of
that order (a wave), and a wave's tiles share whatever operand tiles they have in common through
the L2 cache. The order decides how often an operand comes from HBM again.

Taking the columns fastest (the first kernels' order, each row tile against every column tile
in turn) gives a wave of one row tile against ``programs`` column tiles: the wave reads
``programs + 1`` operand strips, and a group's rhs (a Mixtral ``wi``: 117 MB in float8) streams
through the 50 MB L2 once per row tile. ``tile_at`` instead takes the rows in bands of ``band``
row tiles: within a band the row varies fastest and the column advances every ``band`` tiles,
so a wave is ``band`` row tiles against ``programs / band`` column tiles (``band +
programs / band`` strips), and the band's rows stay in L2 while its columns stream past once.
Every other band runs its columns backward (a snake, as ``plgpu.planar_snake``), so the column
tiles a band ends on are the first the next one reads. ``bench/grouped_traffic.py`` models the
HBM traffic of both orders over an L2 of 50 MB.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from jax import lax

__all__ = ["H100_L2_BYTES", "H100_SMS", "band_for", "tile_at"]

# An H100 SXM: its SMs (the persistent grid's blocks) and its L2 cache.
H100_SMS = 132
H100_L2_BYTES = 50 * 2**20


def tile_at(index: Any, rows: int, cols: int, band: int) -> tuple[Any, Any]:
    """The output tile ``(row, col)`` at position ``index`` of the order of a ``rows x cols``
    grid of tiles, for ``0 <= index < rows * cols``: bands of ``band`` rows (the last one may
    be narrower), in each band the row fastest, every other band's columns backward.

    ``index`` is an int32 scalar inside a kernel, or an array of positions (``bench``'s
    traffic model), with the same arithmetic either way.
    """
    index = jnp.asarray(index, jnp.int32)
    per_band = band * cols
    band_index = lax.div(index, jnp.int32(per_band))
    within = lax.rem(index, jnp.int32(per_band))
    first_row = band_index * band
    height = jnp.minimum(jnp.int32(band), rows - first_row)  # the last band's rows
    row = first_row + lax.rem(within, height)
    col = lax.div(within, height)
    backward = lax.rem(band_index, jnp.int32(2)) == 1
    return row, jnp.where(backward, cols - 1 - col, col)


def band_for(
    strip_bytes: int, rows: int, programs: int = H100_SMS, l2_bytes: int = H100_L2_BYTES
) -> int:
    """The row tiles of a band, a power of two at most ``rows``, for strips of ``strip_bytes``
    (one tile's operand over the whole contraction).

    A wave of ``programs`` tiles is ``band`` row tiles against ``programs / band`` column
    tiles, and reads ``band + programs / band`` strips. Where they fit half the L2 together
    (the other half for the output tiles written through it, and for a real cache's
    imperfect eviction), the band's rows are still there for the next wave, and the widest
    such band reads each column strip the fewest times: the largest power of two that fits
    (``bench/grouped_traffic.py`` compares the bands). Where no band fits
    (a long contraction: dgrad), every wave reads its strips anew, fewest at ``band`` near
    ``sqrt(programs)``: 8 for an H100's 132 blocks. Powers of two keep the bands on the
    boundaries of groups whose rows are a multiple of the tiles.
    """
    fits = [
        band
        for band in (2**k for k in range(rows.bit_length()))
        if band <= rows and (band + programs / band) * strip_bytes <= l2_bytes // 2
    ]
    if fits:
        return fits[-1]
    root = 1 << max(int(programs**0.5).bit_length() - 1, 0)
    return max(1, min(rows, root))
