"""The small problems that check each kernel configuration on its first use (``first_use``).

A probe keeps what the kernel compiles differently for (the operands' dtypes, the tiles the
kernel picks from their shapes, its static options) and shrinks the rest: a few hundred rows
and columns, a contraction of a few tile steps, a few groups, some of them empty, rows past
the groups. ``PROBES`` makes one for the dispatches whose kernel and XLA stage both take the
operands (``switch.dispatch`` looks a kernel up there when its call passes no probe); the
other kernels' entry points build theirs, with the XLA stage's arithmetic of the kernel's
module as the reference (``by_xla``, ``layouts_by_xla``: what the kernels run for the blocks
they do not tile).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import Array

from te_flax._ops.kernels.activation_grad_mosaic import by_xla as activation_grad_by_xla
from te_flax._ops.kernels.activation_quantize_mosaic import by_xla as activation_quantize_by_xla
from te_flax._ops.kernels.common import row_blocks
from te_flax._ops.kernels.first_use import Probe, random_operand
from te_flax._ops.kernels.grouped_gemm import kernel_dtypes, tiles_for
from te_flax._ops.kernels.mosaic import layouts_by_xla
from te_flax._ops.kernels.norm_backward_mosaic import by_xla as norm_backward_by_xla

__all__ = [
    "PROBES",
    "Probe",
    "activation_grad_probe",
    "activation_quantize_probe",
    "grouped_gemm_probe",
    "norm_backward_probe",
    "quantize_probe",
]

# The persistent blocks a grouped GEMM probe runs on (its grid has a few tiles per block).
_PROBE_PROGRAMS = 3
# A kernel's XLA stage as ``dispatch`` calls it, and its operands: -> a probe, or None where
# the configuration cannot be read from them.
_Builder = Callable[[Callable[..., Any], Callable[..., Any], tuple[Any, ...]], Probe | None]


def _small(size: int, multiple: int) -> int:
    """A size of at most a few tiles that is a multiple of ``multiple`` exactly where ``size``
    is a multiple of twice it (the kernels choose 128-wide tiles or 128-byte steps there, 64
    elsewhere): ``4 * multiple``, or ``3 * multiple`` (``size`` of ``multiple`` residue)."""
    return 4 * multiple if size % (2 * multiple) == 0 else 3 * multiple


def _contraction(size: int, step: int) -> int:
    """A contraction of more steps than the kernels' copies run ahead (4 stages): 6 steps of
    128 bytes where ``size`` is a multiple of 128 bytes, else 5 of 64 (``step``: elements of
    64 bytes)."""
    return 12 * step if size % (2 * step) == 0 else 5 * step


def _rows(size: int) -> int:
    """Rows for a ragged row count: whole 128-row tiles, whole 64-row tiles or a last partial
    tile, as ``size`` has them."""
    if size % 128 == 0:
        return 256
    return 192 if size % 64 == 0 else 200


def _group_sizes(rows: int, groups: int) -> np.ndarray:
    """``rows`` rows over ``groups`` groups: a third in the first, none in the middle ones,
    the rest but 8 (rows past the groups) in the last."""
    sizes = np.zeros(groups, np.int32)
    sizes[0] = rows // 3 if groups > 1 else rows - 8
    if groups > 1:
        sizes[-1] = rows - rows // 3 - 8
    return sizes


def grouped_gemm_probe(
    kernel: Callable[..., Array],
    xla: Callable[..., Array],
    args: tuple[Any, ...],
    contract: tuple[int, int],
) -> Probe:
    """The check of a grouped GEMM (``_grouped_gemm``'s ``(lhs, rhs, group_sizes, ids,
    scale)``): the forward GEMM (``contract`` (1, 1)), dgrad ((1, 2)) or wgrad ((0, 0)) with
    the same dtypes, tiles and options, at a few tiles of each axis and at most four groups."""
    lhs, rhs, group_sizes, _, scale = args
    groups = min(group_sizes.shape[0], 4)
    # The type the kernel multiplies in (bfloat16 for a float8 pair without mixed wgmma).
    types = kernel_dtypes(lhs.dtype, rhs.dtype)
    dtype = lhs.dtype if types is None else types[0]
    step = 64 // jnp.dtype(dtype).itemsize  # elements of the 64-byte contraction step
    if contract == (0, 0):  # [M, K] x [M, N] -> [G, K, N]
        rows = 200
        hidden, features = _small(lhs.shape[1], 64), _small(rhs.shape[1], 64)
        shapes = ((rows, hidden), (rows, features))
        tiles = tiles_for(dtype, lhs.shape[1], rhs.shape[1], 0)
    else:  # [M, C] x [G, ., .] -> [M, cols]
        rows = _rows(lhs.shape[0])
        depth = _contraction(lhs.shape[1], step)
        cols_axis = 2 if contract == (1, 1) else 1
        cols = _small(rhs.shape[cols_axis], 64)
        rhs_shape = [groups, depth, depth]
        rhs_shape[cols_axis] = cols
        shapes = ((rows, depth), tuple(rhs_shape))
        tiles = tiles_for(dtype, lhs.shape[0], rhs.shape[cols_axis], lhs.shape[1], True)
    options = getattr(kernel, "keywords", {})
    # On a few persistent blocks, so that each takes several tiles in turn (its barriers and
    # buffers carried from one tile to the next), as the real problem's blocks do.
    kernel = partial(kernel, programs=_PROBE_PROGRAMS)

    def operands() -> tuple[Any, ...]:
        sizes = _group_sizes(rows, groups)
        ids = np.searchsorted(np.cumsum(sizes), np.arange(rows), side="right")
        small_scale = None
        if scale is not None:
            small_scale = np.linspace(0.5, 2.0, groups, dtype=np.float32)
        return (
            random_operand(0, shapes[0], lhs.dtype),
            random_operand(1, shapes[1], rhs.dtype),
            sizes,
            ids.astype(np.int32),
            small_scale,
        )

    assert tiles is not None, "a probe for a GEMM the kernels do not take"
    accumulation = options.get("accumulation")
    split = accumulation is not None and accumulation.split
    role = {(1, 1): "forward", (1, 2): "dgrad", (0, 0): "wgrad"}[contract]
    out_dtype = jnp.dtype(options.get("out_dtype", lhs.dtype)).name
    configuration = (
        f"{role} {_pair(lhs, rhs)}"
        + ("" if dtype == lhs.dtype else f" as {jnp.dtype(dtype).name}")
        + f" -> {out_dtype}, {tiles.rows} x {tiles.cols} tiles "
        f"{tiles.depth} deep, {'split' if split else 'fast'} accumulation"
        + (", group scales" if scale is not None else "")
        + f", {_PROBE_PROGRAMS} persistent blocks"
    )
    return Probe(configuration, operands, kernel, xla)


def _pair(lhs: Any, rhs: Any) -> str:
    return f"{jnp.dtype(lhs.dtype).name} x {jnp.dtype(rhs.dtype).name}"


def _blockwise_gemm_probe(
    kernel: Callable[..., Array], xla: Callable[..., Array], args: tuple[Any, ...]
) -> Probe | None:
    """The check of the blockwise FP8 GEMM (``(lhs, lhs_scale_inv, rhs, rhs_scale_inv)``, the
    scales per row or per 128 rows, and per 128 of K): 192 x 256 or 192 x 192, K of 512."""
    lhs, lhs_scale, rhs, rhs_scale = args
    out_dtype = getattr(xla, "keywords", {}).get("out_dtype")
    if out_dtype is None:
        return None
    rows, cols, depth = 192, _small(rhs.shape[0], 64), 512
    per_row = (lhs_scale.shape[0] == lhs.shape[0], rhs_scale.shape[0] == rhs.shape[0])

    def scales(seed: int, size: int, row_wise: bool) -> np.ndarray:
        shape = (size if row_wise else -(-size // 128), depth // 128)
        return np.exp2(np.round(random_operand(seed, shape, np.float32)))

    def operands() -> tuple[Any, ...]:
        return (
            random_operand(0, (rows, depth), lhs.dtype),
            scales(1, rows, per_row[0]),
            random_operand(2, (cols, depth), rhs.dtype),
            scales(3, cols, per_row[1]),
        )

    configuration = (
        f"{_pair(lhs, rhs)} -> {jnp.dtype(out_dtype).name}, scales per "
        + " and per ".join("row" if each else "128 rows" for each in per_row)
        + f", tiles of {128 if cols % 128 == 0 else 64} columns"
    )
    return Probe(configuration, operands, kernel, xla)


# An element-wise kernel's problem: one block of 128 rows (two row tiles); its results with
# the tiles' amax partials reduced to the amax and partial sums to sums (the XLA stage has one
# of each), and a scale small enough that some values saturate.
_ROWS, _SCALE_INV = 128, 2.0**-7


def _reduced(results: tuple[Any, ...]) -> tuple[Any, ...]:
    """``(data, transposed, amax partials, [column sums])`` with the partials' max and the
    sums' sum over row tiles."""
    data, transposed, partials, *sums = results
    summed = [jnp.sum(x, axis=0) for x in sums if x is not None]
    return (data, transposed, jnp.max(partials), *summed)


def _scale_inv() -> np.ndarray:
    return np.full((1,), _SCALE_INV, np.float32)


def quantize_probe(
    tiles: Callable[..., Any], dtype: Any, quantizer: Any, layouts: tuple[bool, bool]
) -> Probe | None:
    """The check of the quantize kernel (``tiles``: its Mosaic GPU or Triton version) on a
    ``[128, 192]`` block of ``dtype`` in the quantizer's float8 type and ``layouts``."""
    q_dtype = getattr(quantizer, "q_dtype", None)
    if q_dtype is None:
        return None

    def kernel(x: Array, scale_inv: Array, *, interpret: bool) -> tuple[Any, ...]:
        return _reduced(tiles(x, scale_inv, q_dtype, layouts, interpret=interpret))

    def xla(x: Array, scale_inv: Array) -> tuple[Any, ...]:
        return _reduced(layouts_by_xla(x, scale_inv, q_dtype, layouts))

    def operands() -> tuple[Any, ...]:
        return random_operand(0, (_ROWS, 192), dtype), _scale_inv()

    configuration = f"{_names(dtype, q_dtype)}, layouts {_layouts(layouts)}"
    return Probe(configuration, operands, kernel, xla)


def activation_quantize_probe(
    tiles: Callable[..., Any],
    dtype: Any,
    activation_type: tuple[str, ...],
    quantizer: Any,
    layouts: tuple[bool, bool],
) -> Probe | None:
    """The check of the activation-quantize kernel on ``[128, n_act * 128]`` pre-activations."""
    q_dtype = getattr(quantizer, "q_dtype", None)
    if q_dtype is None:
        return None
    options = (activation_type, q_dtype, layouts)

    def kernel(pre: Array, scale_inv: Array, *, interpret: bool) -> tuple[Any, ...]:
        return _reduced(tiles(pre, scale_inv, *options, interpret=interpret))

    def xla(pre: Array, scale_inv: Array) -> tuple[Any, ...]:
        return _reduced(activation_quantize_by_xla(pre, scale_inv, *options))

    def operands() -> tuple[Any, ...]:
        return random_operand(0, (_ROWS, 128 * len(activation_type)), dtype), _scale_inv()

    configuration = (
        f"{'-'.join(activation_type)} {_names(dtype, q_dtype)}, layouts {_layouts(layouts)}"
    )
    return Probe(configuration, operands, kernel, xla)


def activation_grad_probe(
    tiles: Callable[..., Any],
    dtypes: tuple[Any, Any],
    activation_type: tuple[str, ...],
    quantizer: Any,
    with_bias: bool,
) -> Probe | None:
    """The check of the activation-backward kernel on ``[128, n_act * 128]`` pre-activations
    and ``[128, 128]`` gradients (``dtypes``: theirs)."""
    q_dtype = getattr(quantizer, "q_dtype", None)
    if q_dtype is None:
        return None
    options = (activation_type, q_dtype, with_bias)

    def kernel(pre: Array, grad: Array, scale_inv: Array, *, interpret: bool) -> Any:
        return _reduced(tiles(pre, grad, scale_inv, *options, interpret=interpret))

    def xla(pre: Array, grad: Array, scale_inv: Array) -> Any:
        return _reduced(activation_grad_by_xla(pre, grad, scale_inv, *options))

    def operands() -> tuple[Any, ...]:
        width = 128 * len(activation_type)
        pre = random_operand(0, (_ROWS, width), dtypes[0])
        return pre, random_operand(1, (_ROWS, 128), dtypes[1], 100.0), _scale_inv()

    configuration = f"{'-'.join(activation_type)} {_names(dtypes[1], q_dtype)}" + (
        ", bias gradient" if with_bias else ""
    )
    return Probe(configuration, operands, kernel, xla)


def norm_backward_probe(
    backward: Callable[..., Any],
    dtypes: tuple[Any, Any],
    hidden: int,
    with_mean: bool,
    with_beta: bool,
) -> Probe | None:
    """The check of the norm-backward kernel on 128 rows of the norm's ``hidden`` size
    (``dtypes``: the output gradient's and ``x``'s; ``with_mean``: layernorm, not rmsnorm)."""
    blocks = row_blocks(_ROWS, hidden)
    if blocks is None:
        return None

    def kernel(d_out: Any, x: Any, mean: Any, rsigma: Any, gamma: Any, *, interpret: bool) -> Any:
        inputs = (d_out, x, mean, rsigma, gamma, with_beta, dtypes[1], blocks)
        d_x, *sums = backward(*inputs, interpret=interpret)
        return d_x, *(jnp.sum(partial, axis=0) for partial in sums if partial is not None)

    def xla(d_out: Any, x: Any, mean: Any, rsigma: Any, gamma: Any) -> Any:
        d_x, *sums = norm_backward_by_xla(d_out, x, mean, rsigma, gamma, with_beta, dtypes[1])
        return d_x, *(jnp.sum(partial, axis=0) for partial in sums if partial is not None)

    def operands() -> tuple[Any, ...]:
        x = random_operand(1, (_ROWS, hidden), dtypes[1]).astype(np.float32)
        mean = x.mean(axis=1) if with_mean else None
        centred = x - mean[:, None] if mean is not None else x
        rsigma = 1.0 / np.sqrt(np.mean(centred**2, axis=1) + 1e-6)
        gamma = 1.0 + random_operand(2, (hidden,), np.float32, 0.1)
        d_out = random_operand(0, (_ROWS, hidden), dtypes[0])
        return d_out, x.astype(dtypes[1]), mean, rsigma.astype(np.float32), gamma

    configuration = (
        f"{'layernorm' if with_mean else 'rmsnorm'}, hidden {hidden}, "
        f"{_names(dtypes[0], dtypes[1])}" + (", beta" if with_beta else "")
    )
    return Probe(configuration, operands, kernel, xla)


def _names(*dtypes: Any) -> str:
    return " -> ".join(jnp.dtype(dtype).name for dtype in dtypes)


def _layouts(layouts: tuple[bool, bool]) -> str:
    return " and ".join(
        name for name, on in zip(("rows", "transposed"), layouts, strict=True) if on
    )


PROBES: dict[str, _Builder] = {"blockwise_gemm": _blockwise_gemm_probe}
