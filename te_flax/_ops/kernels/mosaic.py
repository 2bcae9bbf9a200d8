"""What te_flax's Pallas Mosaic GPU kernels share: Pallas Mosaic GPU itself (``plgpu``, imported
when a kernel is first built), their interpret mode, and the tile work of the element-wise
kernels (a ``64 x 64`` tile quantized to float8 in one or both layouts, its amax).

``plgpu`` is ``jax.experimental.pallas.mosaic_gpu``, whose import loads Mosaic GPU's compiler
(MLIR's LLVM and GPU dialects): more than a second, about a third of ``import te_flax``, which a
program that never builds a te_flax kernel (every CPU program under the default switch) does
not need. It is imported at the first read of one of its names, which comes when a kernel is
built, before JAX lowers it.

The element-wise kernels keep the XLA stage's arithmetic bit for bit: ``quantized_tile`` is
``common.saturating_cast`` in the operations Mosaic GPU lowers, and ``tile_amax`` flags a NaN
as ``common.block_amax`` does.
"""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp
from jax import Array, lax
from jax.typing import DTypeLike

from te_flax._ops.kernels.common import saturating_cast

__all__ = [
    "TILE",
    "interpret_params",
    "kernel",
    "layout_outputs",
    "layout_results",
    "layouts_by_xla",
    "plgpu",
    "quantized_tile",
    "tile_amax",
    "tileable",
    "transposed_tile",
    "write_layouts",
]


def _imported_on_first_use(name: str) -> ModuleType:
    """Module ``name``, imported when one of its attributes is first read (as it is if it was
    imported before)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.find_spec(name)  # imports the parent package
    assert spec is not None and spec.loader is not None, name
    spec.loader = importlib.util.LazyLoader(spec.loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    parent, _, child = name.rpartition(".")
    setattr(sys.modules[parent], child, module)  # `from parent import child` finds it
    return module


# (typed loosely: the stubs of some of its classes declare methods implemented at run time)
plgpu: Any = _imported_on_first_use("jax.experimental.pallas.mosaic_gpu")
# ``load`` and ``store`` with a register layout (typed loosely: jax 0.10, which runs the Triton
# versions, has neither).
_REFS: Any = plgpu
TILE = 64  # rows and columns of a block's tile: one warpgroup's register layout of 64 rows
_F32_MAX = float(jnp.finfo(jnp.float32).max)


def interpret_params() -> Any:
    """Mosaic GPU's interpret mode (a kernel on any platform, its copies, barriers and tensor-core
    instructions simulated), from jax 0.11 on."""
    params = getattr(plgpu, "InterpretGPUParams", None)
    if params is None:
        raise NotImplementedError(
            f"Mosaic GPU's interpret mode needs jax 0.11 or newer (this is jax {jax.__version__})"
        )
    return params()


def kernel(
    name: str,
    body: Any,
    out_type: Any,
    grid: dict[str, int],
    scratch: tuple[Any, ...],
    interpret: bool,
    *,
    warpgroup: bool = False,
) -> Any:
    """The Mosaic GPU kernel ``te_flax_{name}`` (the name its ``mosaic_gpu_v2`` call carries in
    the HLO) of ``body(*inputs, *outputs, *scratch)`` over ``grid`` (axis name -> size), in
    ``interpret`` mode where asked; ``warpgroup``: the lowering that infers register layouts
    (the GEMM kernels), else the per-thread one."""
    semantics = plgpu.LoweringSemantics.Warpgroup if warpgroup else plgpu.LoweringSemantics.Lane
    return plgpu.kernel(
        body,
        out_type=out_type,
        grid=tuple(grid.values()),
        grid_names=tuple(grid),
        scratch_types=scratch,
        compiler_params=plgpu.CompilerParams(lowering_semantics=semantics),
        interpret=interpret_params() if interpret else None,
        kernel_name=f"te_flax_{name}",
    )


def tileable(rows: int, columns: int) -> bool:
    """Whether a ``[rows, columns]`` matrix is whole tiles: both sizes multiples of ``TILE``."""
    return rows > 0 and columns > 0 and rows % TILE == 0 and columns % TILE == 0


def quantized_tile(x: Array, scale_inv: Array, q_dtype: DTypeLike) -> Array:
    """``common.saturating_cast`` in the operations Mosaic GPU lowers: a value is finite where
    its magnitude is at most float32's largest (false for a NaN and for an infinity)."""
    limit = float(jnp.finfo(q_dtype).max)
    clipped = jnp.minimum(jnp.maximum(x / scale_inv, -limit), limit)
    return jnp.where(jnp.abs(x) <= _F32_MAX, clipped, jnp.nan).astype(q_dtype)


def tile_amax(x: Array, tiled: bool = False) -> Array:
    """``max(|x|)``, NaN if any value is NaN: a NaN flag of its own, since a reduction in
    interpret mode ignores NaN (as ``common.block_amax``). ``tiled``: ``x`` is in the tiled
    register layout ``wgmma`` uses, which reduces one axis at a time (the strided layout
    reduces the whole tile at once, and no single axis)."""

    def largest(values: Array) -> Array:
        return jnp.max(jnp.max(values, axis=1), axis=0) if tiled else jnp.max(values)

    magnitude = jnp.abs(x)
    nan = largest(jnp.where(magnitude != magnitude, 1.0, 0.0))
    return jnp.where(nan > 0.0, jnp.nan, largest(magnitude))


def transposed_tile(x: Array, x_smem: Any, halves: Any) -> Array:
    """The float32 tile ``x`` transposed, read from the transposed view of shared memory in the
    tiled register layout ``wgmma`` uses (the strided layout cannot read a view whose minor axis
    is strided). That read takes 16-bit values: ``x_smem`` holds ``x`` in its 16-bit dtype, or
    (``halves`` given: two uint16 buffers) a float32 tile goes through its upper and lower
    halves, joined again bit for bit."""
    if halves is None:
        x_t = _REFS.load(x_smem.T, layout=plgpu.Layout.WGMMA, optimized=False)
        return x_t.astype(jnp.float32)
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    halves[0] = lax.shift_right_logical(bits, jnp.uint32(16)).astype(jnp.uint16)
    halves[1] = (bits & jnp.uint32(0xFFFF)).astype(jnp.uint16)
    high, low = (
        _REFS.load(halves.at[k].T, layout=plgpu.Layout.WGMMA, optimized=False).astype(jnp.uint32)
        for k in (0, 1)
    )
    return lax.bitcast_convert_type(lax.shift_left(high, jnp.uint32(16)) | low, jnp.float32)


def write_layouts(
    x: Array,
    x_t: Array | None,
    scale_inv: Array,
    q_dtype: DTypeLike,
    data_smem: list[Any],
    targets: list[Any],
) -> None:
    """Quantizes the float32 tile ``x`` (unless ``targets`` has the transposed layout's place
    alone) and ``x_t``, its transpose (None: not asked for; see ``transposed_tile``), into the
    float8 buffers ``data_smem``, one per layout, and copies each to its place in global memory
    (``targets``, in the same order)."""
    if len(targets) > (x_t is not None):
        _REFS.store(data_smem[0], quantized_tile(x, scale_inv, q_dtype), optimized=False)
    if x_t is not None:
        _REFS.store(data_smem[-1], quantized_tile(x_t, scale_inv, q_dtype), optimized=False)
    plgpu.commit_smem()
    for smem, target in zip(data_smem, targets, strict=True):
        plgpu.copy_smem_to_gmem(smem, target)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def layouts_by_xla(
    x: Array, scale_inv: Array, q_dtype: DTypeLike | None, layouts: tuple[bool, bool]
) -> tuple[Array | None, Array | None, Array]:
    """An element-wise kernel's results by XLA, for a block it does not tile: ``x`` quantized
    as is and transposed (None where not asked for or without ``q_dtype``), and its amax as the
    one partial."""
    values = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(values)).reshape(1)
    if q_dtype is None:
        return None, None, amax
    quantized = saturating_cast(values, scale_inv[0], q_dtype)
    return (
        quantized if layouts[0] else None,
        quantized.T if layouts[1] else None,
        amax,
    )


def layout_outputs(
    rows: int, columns: int, q_dtype: DTypeLike | None, layouts: tuple[bool, bool]
) -> tuple[list[jax.ShapeDtypeStruct], list[Any]]:
    """An element-wise kernel's results on a ``[rows, columns]`` tensor, and their buffers: the
    float8 data in each layout asked for (``[rows, columns]``, ``[columns, rows]``; none without
    ``q_dtype``), then the f32 amax of each tile; a shared-memory tile for each float8 result
    to be copied out from."""
    amax = jax.ShapeDtypeStruct((rows // TILE, columns // TILE), jnp.float32)
    if q_dtype is None:
        return [amax], []
    shapes = ((rows, columns), (columns, rows))
    written = [shape for shape, on in zip(shapes, layouts, strict=True) if on]
    out_type = [jax.ShapeDtypeStruct(shape, q_dtype) for shape in written]
    return [*out_type, amax], [plgpu.SMEM((TILE, TILE), q_dtype) for _ in written]


def layout_results(
    results: list[Array], layouts: tuple[bool, bool]
) -> tuple[Array | None, Array | None, Array]:
    """The results of a kernel built on ``layout_outputs``: the float8 data as is and
    transposed (None where not written) and the tiles' amax, flat."""
    *written, partials = results
    data = iter(written)
    return (
        next(data) if layouts[0] else None,
        next(data) if layouts[1] else None,
        partials.reshape(-1),
    )
