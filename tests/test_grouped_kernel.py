"""te_flax's grouped GEMM kernels (Pallas Mosaic GPU) against XLA's ragged_dot_general.

The kernels run here in Mosaic GPU's interpret mode (jax 0.11 and newer) on the CPU: the same
program a Hopper GPU runs, its copies, barriers and ``wgmma`` simulated. Each GEMM is checked on
its own against ``lax.ragged_dot_general`` (float8 and bfloat16 operands, empty groups, every row
in one group, group sizes that are not multiples of the tile, rows past the groups), and
``grouped_dense`` through the kernel switch against its XLA lowering for every recipe it takes:
values, gradients and the new FP8 state.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from te_flax._base.jax_compat import mixed_fp8_wgmma, mosaic_gpu_interpreted
from te_flax._ops.grouped import Fp8AtBf16RateWarning, RaggedOnGpuWarning, capacity_on_kernels
from te_flax._ops.kernels import pallas_kernels
from te_flax._ops.kernels.grouped_gemm import (
    Accumulation,
    Tiles,
    aligned_columns,
    group_gemm,
    row_tiles,
    rows_gemm,
    tiles_for,
)
from te_flax._ops.kernels.tile_order import H100_SMS, band_for, tile_at
from te_flax.dense import grouped_dense, grouped_quantizer_set
from te_flax.quantize import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    MMParams,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    QuantizerFactory,
    noop_quantizer_set,
)

interpreted = pytest.mark.skipif(
    not mosaic_gpu_interpreted(), reason="Mosaic GPU's interpret mode needs jax 0.11 or newer"
)
E4M3, E5M2, BF16 = jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.bfloat16
ROWS, DEPTH, COLS, GROUPS = 256, 128, 128, 3
SIZES = {
    "rows past the groups": (70, 0, 130),
    "all in one group": (0, ROWS, 0),
    "no rows": (0, 0, 0),
    "one row each": (1, 1, 1),
}
# Small tiles: several row tiles and a two-stage pipeline over the contraction.
TILES = Tiles(rows=64, cols=64, depth=64, stages=2)


def _operand(key, shape, dtype):
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def _ragged(lhs, rhs, sizes, contract, rhs_group_dims):
    numbers = lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((contract[0],), (contract[1],)), ((), ())),
        lhs_ragged_dimensions=[0],
        rhs_group_dimensions=list(rhs_group_dims),
    )
    as32 = functools.partial(jnp.asarray, dtype=jnp.float32)
    return lax.ragged_dot_general(as32(lhs), as32(rhs), sizes, numbers)


def _pair_id(lhs, rhs):
    return f"{jnp.dtype(lhs).name}x{jnp.dtype(rhs).name}"


def _dtype_pairs(pairs):
    mixed = pytest.mark.skipif(not mixed_fp8_wgmma(), reason="mixed float8 wgmma: jax 0.11")
    return [
        pytest.param(
            lhs, rhs, marks=[mixed] if lhs != rhs else [], id=f"{lhs.__name__}-{rhs.__name__}"
        )
        for lhs, rhs in pairs
    ]


@interpreted
@pytest.mark.parametrize("sizes", list(SIZES.values()), ids=list(SIZES))
@pytest.mark.parametrize(
    ("lhs_dtype", "rhs_dtype"), _dtype_pairs([(BF16, BF16), (E4M3, E4M3), (E5M2, E4M3)])
)
def test_rows_gemm_matches_ragged_dot(sizes, lhs_dtype, rhs_dtype):
    keys = jax.random.split(jax.random.key(0), 2)
    lhs = _operand(keys[0], (ROWS, DEPTH), lhs_dtype)
    rhs = _operand(keys[1], (GROUPS, COLS, DEPTH), rhs_dtype)  # [G, N, C]
    sizes = jnp.array(sizes, jnp.int32)
    scale = jnp.array([0.5, 2.0, 3.0], jnp.float32)
    # 3 persistent blocks: each takes several of the 4 x 2 + 3 tiles, in bands of 3 rows.
    tiles = Tiles(
        rows=64, cols=64, depth=128 // jnp.dtype(lhs_dtype).itemsize, stages=2, programs=3, band=3
    )
    out = rows_gemm(lhs, rhs, sizes, scale, jnp.float32, tiles, interpret=True)
    expected = _ragged(lhs, rhs, sizes, (1, 2), (0,))
    group = jnp.searchsorted(jnp.cumsum(sizes), jnp.arange(ROWS), side="right")
    row_scale = jnp.take(scale, group, mode="fill", fill_value=0.0)[:, None]
    np.testing.assert_allclose(out, expected * row_scale, rtol=1e-5, atol=1e-4)


@interpreted
@pytest.mark.parametrize("split", [False, True], ids=["fast", "split"])
def test_rows_gemm_takes_any_rows_and_a_float8_contraction_of_192(split):
    keys = jax.random.split(jax.random.key(4), 2)
    rows, depth = 200, 192
    lhs = _operand(keys[0], (rows, depth), E4M3)
    rhs = _operand(keys[1], (GROUPS, COLS, depth), E4M3)
    sizes = jnp.array([70, 0, 120], jnp.int32)  # and 10 rows past the groups
    tiles = tiles_for(E4M3, rows, COLS, depth, ragged_rows=True)
    assert (tiles.rows, tiles.cols, tiles.depth) == (64, 128, 64)
    out = rows_gemm(lhs, rhs, sizes, None, jnp.float32, tiles, True, Accumulation(split=split))
    np.testing.assert_allclose(out, _ragged(lhs, rhs, sizes, (1, 2), (0,)), rtol=1e-5, atol=1e-4)


@interpreted
@pytest.mark.parametrize("sizes", list(SIZES.values()), ids=list(SIZES))
@pytest.mark.parametrize(("lhs_dtype", "rhs_dtype"), _dtype_pairs([(BF16, BF16), (E4M3, E5M2)]))
def test_group_gemm_matches_ragged_dot(sizes, lhs_dtype, rhs_dtype):
    keys = jax.random.split(jax.random.key(1), 2)
    lhs = _operand(keys[0], (ROWS, DEPTH), lhs_dtype)  # x [M, K]
    rhs = _operand(keys[1], (ROWS, COLS), rhs_dtype)  # the gradient [M, N]
    sizes = jnp.array(sizes, jnp.int32)
    scale = jnp.array([0.5, 2.0, 3.0], jnp.float32)
    # 2 persistent blocks over the 3 x 2 x 2 tiles, in bands of one row tile.
    tiles = Tiles(
        rows=64, cols=64, depth=128 // jnp.dtype(lhs_dtype).itemsize, stages=3, programs=2, band=1
    )
    source, first_tile, _ = aligned_columns(sizes, ROWS, tiles.depth)

    def aligned(x):
        return jnp.take(x, source, axis=0, mode="fill", fill_value=0).T

    out = group_gemm(aligned(lhs), aligned(rhs), first_tile, scale, jnp.float32, tiles, True)
    expected = _ragged(lhs, rhs, sizes, (0, 0), ()) * scale[:, None, None]
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-4)


# Hopper's float8 wgmma keeps about 14 significant bits of its accumulator (DeepSeek-V3,
# section 3.3.2); interpret mode emulates it (Accumulation.emulated_bits). Positive operands, so
# that the rounding errors of a long contraction add up instead of cancelling: 24 steps of 128.
TENSOR_CORE_BITS, LONG_DEPTH = 14, 24 * 128


def _positive(key, shape):
    return jax.random.uniform(key, shape, minval=0.5, maxval=1.0).astype(E4M3)


def _relative_error(out, lhs, rhs_t):
    exact = np.asarray(lhs, np.float64) @ np.asarray(rhs_t, np.float64).T
    return float(np.max(np.abs(np.asarray(out, np.float64) - exact) / exact))


def _long_contraction(gemm: str, split: bool) -> float:
    """The largest relative error of a float8 GEMM over ``LONG_DEPTH`` on the kernel whose
    tensor cores keep ``TENSOR_CORE_BITS`` bits, promoting its partial sums or not."""
    keys = jax.random.split(jax.random.key(3), 2)
    accumulation = Accumulation(split=split, emulated_bits=TENSOR_CORE_BITS)
    tiles = Tiles(rows=64, cols=64, depth=128, stages=2)
    if gemm == "rows_gemm":  # one group of 64 rows, [64, C] x [1, 64, C]
        lhs, rhs = _positive(keys[0], (64, LONG_DEPTH)), _positive(keys[1], (1, 64, LONG_DEPTH))
        sizes = jnp.array([64], jnp.int32)
        out = rows_gemm(lhs, rhs, sizes, None, jnp.float32, tiles, True, accumulation)
        return _relative_error(out, lhs, rhs[0])
    # group_gemm: one group of LONG_DEPTH rows contracted, [C, 64] x [C, 64] -> [64, 64]
    lhs, rhs = _positive(keys[0], (LONG_DEPTH, 64)), _positive(keys[1], (LONG_DEPTH, 64))
    _, first_tile, _ = aligned_columns(jnp.array([LONG_DEPTH], jnp.int32), LONG_DEPTH, 128)
    out = group_gemm(lhs.T, rhs.T, first_tile, None, jnp.float32, tiles, True, accumulation)
    return _relative_error(out[0], lhs.T, rhs.T)


@interpreted
@pytest.mark.parametrize("gemm", ["rows_gemm", "group_gemm"])
def test_split_accumulation_promotes_every_128_float8_elements(gemm):
    # Promoted every step, each partial sum of 128 products loses at most 2**-13 of itself: the
    # whole contraction stays within 2**-13 (1.2e-4). Left to the tensor cores the running sum
    # is rounded at every step and the error grows with the contraction (7.7e-4 here).
    promoted = _long_contraction(gemm, split=True)
    assert promoted < 2**-13, promoted
    assert _long_contraction(gemm, split=False) > 4 * promoted


def test_split_accumulation_takes_steps_of_at_most_128_elements():
    with pytest.raises(ValueError, match="at most 128 elements"):
        Accumulation(split=True).check(Tiles(depth=256), E4M3, interpret=False)
    with pytest.raises(ValueError, match="interpret=True"):
        Accumulation(emulated_bits=14).check(Tiles(), E4M3, interpret=False)


@pytest.mark.parametrize("seed", range(20))
def test_row_tiles_write_every_row_once(seed):
    rng = np.random.default_rng(seed)
    rows, height, groups = 320, 64, 5
    sizes = rng.multinomial(int(rng.integers(0, rows + 1)), np.ones(groups) / groups)
    table = np.asarray(row_tiles(jnp.array(sizes, jnp.int32), rows, height))
    assert table.shape == (rows // height + groups, 4)
    written = np.zeros(rows, int)
    every = np.append(sizes, rows - sizes.sum())  # the groups, then the rows past them
    ends = np.cumsum(every)
    starts = ends - every
    for group, tile, first, count in table:
        start = tile * height + first
        written[start : start + count] += 1
        if count:  # the rows are the group's (group G: past the groups' total)
            assert starts[group] <= start and start + count <= ends[group]
    np.testing.assert_array_equal(written, 1)


def test_aligned_columns_start_each_group_on_a_tile():
    sizes = jnp.array([70, 0, 130, 1], jnp.int32)
    source, first_tile, width = aligned_columns(sizes, 256, 64)
    np.testing.assert_array_equal(first_tile, [0, 2, 2, 5, 6])
    source = np.asarray(source)
    assert width >= 6 * 64 and source.shape == (width,)
    np.testing.assert_array_equal(source[:70], np.arange(70))
    np.testing.assert_array_equal(source[70:128], 256)  # padding
    np.testing.assert_array_equal(source[128:258], np.arange(70, 200))
    np.testing.assert_array_equal(source[320:321], [200])
    np.testing.assert_array_equal(source[321:], 256)


def _shape(tiles):
    return None if tiles is None else (tiles.rows, tiles.cols, tiles.depth)


def test_tiles_for_the_shapes_the_kernels_take():
    assert _shape(tiles_for(E4M3, 256, 384, 256)) == (128, 128, 128)
    assert _shape(tiles_for(BF16, 192, 64, 64)) == (64, 64, 64)
    assert tiles_for(E4M3, 256, 96, 256) is None  # columns not a multiple of 64
    # A contraction of 64 or 192 float8 elements: steps of 64 bytes.
    assert _shape(tiles_for(E4M3, 256, 128, 192)) == (128, 128, 64)
    assert tiles_for(E4M3, 256, 128, 96) is None  # not a multiple of 64 bytes
    # rows_gemm's rows are any number; group_gemm writes whole row tiles.
    assert _shape(tiles_for(E4M3, 200, 128, 128, ragged_rows=True)) == (64, 128, 128)
    assert tiles_for(E4M3, 200, 128, 128) is None
    with pytest.raises(ValueError, match="multiple of 64"):
        Tiles(rows=32)
    with pytest.raises(ValueError, match="at least 1"):
        Tiles(programs=0)


def test_tiles_for_bands_by_what_the_l2_holds():
    """The band of row tiles: wide where a wave's strips fit half the L2 (the Mixtral wi
    forward: 512 KiB float8 strips), 8 where no band fits (its dgrad: 3.5 MiB strips), at
    most the row tiles there are; wgrad's strips span a group's rows."""
    forward = tiles_for(E4M3, 16384, 28672, 4096, ragged_rows=True)
    dgrad = tiles_for(E5M2, 16384, 4096, 28672, ragged_rows=True)
    assert (forward.band, dgrad.band) == (32, 8)
    assert forward.programs == dgrad.programs == H100_SMS
    assert tiles_for(E4M3, 4096, 28672, 0, span=2048).band == 32  # all 32 row tiles
    assert tiles_for(E4M3, 256, 128, 128).band == 2  # two row tiles in all


def test_tile_at_takes_every_tile_once_in_bands_that_snake():
    rows, cols, band = 7, 5, 3
    row, col = tile_at(jnp.arange(rows * cols), rows, cols, band)
    row, col = np.asarray(row), np.asarray(col)
    tiles = sorted(zip(row.tolist(), col.tolist(), strict=True))
    assert tiles == [(r, c) for r in range(rows) for c in range(cols)]
    # The first band: rows 0-2 fastest, the columns forward; the second backward; the last
    # band has the one row left.
    np.testing.assert_array_equal(row[:6], [0, 1, 2, 0, 1, 2])
    np.testing.assert_array_equal(col[:6], [0, 0, 0, 1, 1, 1])
    np.testing.assert_array_equal(col[15:18], [4, 4, 4])
    np.testing.assert_array_equal(row[30:], [6] * 5)
    np.testing.assert_array_equal(col[30:], [0, 1, 2, 3, 4])


def test_band_for_fits_a_wave_in_half_the_l2():
    mib = 2**20
    assert band_for(mib // 2, 128) == 32  # (32 + 132 / 32) strips of 512 KiB <= 25 MiB
    assert band_for(mib // 2, 8) == 8  # no more than the rows
    assert band_for(4 * mib, 128) == 8  # no band fits: near sqrt(132)
    assert band_for(4 * mib, 3) == 3


# ----------------------------------------------------------------------------- grouped_dense

M, K, N = 128, 128, 256
RECIPES = {
    "none": None,
    "delayed": DelayedScaling(amax_history_len=4),
    "current": Float8CurrentScaling(),
    "mxfp8": MXFP8BlockScaling(),
    "blockwise": Float8BlockScaling(),
    "nvfp4": NVFP4BlockScaling(disable_stochastic_rounding=True),
}


def _assert_bf16_close(actual, want, name):
    """Two bfloat16 ulps of the tensor's largest value apart at most: the kernel scales its
    float32 accumulator before rounding once, XLA rounds the GEMM's output, then the scaled one."""
    scale = float(jnp.max(jnp.abs(want.astype(jnp.float32))))
    np.testing.assert_allclose(
        np.asarray(actual, np.float32),
        np.asarray(want, np.float32),
        atol=2**-7 * scale,
        err_msg=name,
    )


# The group sizes traced, as a router's are: the cases of one shape share the compiled step.
@jax.jit
def _step(x, kernel, bias, cotangent, state, sizes):
    def loss(x, kernel, bias, state):
        out = grouped_dense(x, kernel, sizes, bias=bias, quantizer_set=state)
        return jnp.sum(out.astype(jnp.float32) * cotangent), out

    return jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(x, kernel, bias, state)


# Rows that are not a multiple of 64 and a float8 contraction of 192 (64-byte steps).
ODD_SHAPE = (200, 192, 128)


def _inputs(shape=(M, K, N)):
    rows, hidden, features = shape
    keys = jax.random.split(jax.random.key(2), 4)
    x = _operand(keys[0], (rows, hidden), BF16)
    kernel = jax.random.normal(keys[1], (GROUPS, hidden, features)) * hidden**-0.5
    bias = jax.random.normal(keys[2], (GROUPS, features))
    return x, kernel, bias, jax.random.normal(keys[3], (rows, features))


def _two_steps(recipe, sizes, shape=(M, K, N)):
    state = noop_quantizer_set
    if recipe is not None:
        state = grouped_quantizer_set(QuantizerFactory.create_set(fp8_recipe=recipe), GROUPS)
    x, kernel, bias, cotangent = _inputs(shape)
    sizes = jnp.array(sizes, jnp.int32)
    if jax.tree.leaves(state):  # a recipe with state (delayed scaling): the scales are not 1
        _, grads = _step(x, kernel, bias, cotangent, state, sizes)
        state = grads[3]
    # Without state (no FP8, or scales computed from the tensors) a second step would repeat
    # the first: the same program on the same operands.
    return _step(x, kernel, bias, cotangent, state, sizes)


@interpreted
@pytest.mark.parametrize(
    ("sizes", "shape"),
    [((50, 0, 70), (M, K, N)), ((M, 0, 0), (M, K, N)), ((70, 0, 120), ODD_SHAPE)],
    ids=["rows past, empty", "one group", "odd shape"],
)
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_grouped_dense_on_the_kernels_matches_xla(recipe, sizes, shape):
    if shape == ODD_SHAPE and recipe not in ("none", "delayed"):
        pytest.skip("the odd shape: one float8 and one 16-bit case (block recipes need 128)")
    with pallas_kernels("1"):
        (_, out), grads = _two_steps(RECIPES[recipe], sizes, shape)
    with pallas_kernels("0"):
        (_, expected_out), expected = _two_steps(RECIPES[recipe], sizes, shape)
    for name, actual, want in [("out", out, expected_out), ("d_x", grads[0], expected[0])]:
        _assert_bf16_close(actual, want, name)
    for name, actual, want in zip(("d_kernel", "d_bias"), grads[1:3], expected[1:3], strict=True):
        np.testing.assert_allclose(actual, want, rtol=1e-5, atol=1e-5, err_msg=name)
    for (path, actual), want in zip(
        jax.tree_util.tree_flatten_with_path(grads[3])[0],
        jax.tree.leaves(expected[3]),
        strict=True,
    ):
        np.testing.assert_allclose(actual, want, rtol=1e-6, err_msg=jax.tree_util.keystr(path))


def _kernel_accumulation(recipe, monkeypatch):
    """How each GEMM of a grouped_dense training step asks the kernels to accumulate: traced
    for a GPU with float8 e4m3 operands throughout, ``{"forward" | "dgrad" | "wgrad": split}``."""
    from te_flax._ops import grouped_kernels as grouped

    seen = {}

    def recorded(name, gemm):
        def call(*args, **kwargs):
            lhs, rhs, accumulation = args[0], args[1], args[7]
            if name == "wgrad":
                seen[name] = accumulation.split
            else:  # [M, C] x [G, N, C]: the forward's N is the kernel's features (N), dgrad's K
                seen["forward" if rhs.shape[1] == N else "dgrad"] = accumulation.split
            assert lhs.dtype == E4M3, lhs.dtype
            return gemm(*args, **kwargs)

        return call

    monkeypatch.setattr(grouped, "rows_gemm", recorded("rows", grouped.rows_gemm))
    monkeypatch.setattr(grouped, "group_gemm", recorded("wgrad", grouped.group_gemm))
    state = grouped_quantizer_set(QuantizerFactory.create_set(fp8_recipe=recipe), GROUPS)
    x, kernel, _, _ = _inputs()

    def loss(x, kernel, state):
        out = grouped_dense(x, kernel, jnp.array([50, 0, 70], jnp.int32), quantizer_set=state)
        return jnp.sum(out.astype(jnp.float32))

    with pallas_kernels("auto", assume_gpu=True):
        jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(x, kernel, state)
    return seen


def test_the_kernels_split_accumulation_as_delayed_scaling_asks(monkeypatch):
    # Fast accumulation forward (as cuBLASLt's with Precision.DEFAULT), split backward.
    seen = _kernel_accumulation(DelayedScaling(fp8_format=Format.E4M3), monkeypatch)
    assert seen == {"forward": False, "dgrad": True, "wgrad": True}


@pytest.mark.parametrize(("fprop", "dgrad", "wgrad"), [(True, True, True), (False, False, True)])
def test_the_kernels_split_accumulation_as_the_recipe_asks(fprop, dgrad, wgrad, monkeypatch):
    recipe = Float8CurrentScaling(
        fp8_format=Format.E4M3,  # e4m3 gradients: no mixed float8 wgmma needed (jax 0.10)
        fp8_gemm_fprop=MMParams(use_split_accumulator=fprop),
        fp8_gemm_dgrad=MMParams(use_split_accumulator=dgrad),
        fp8_gemm_wgrad=MMParams(use_split_accumulator=wgrad),
    )
    seen = _kernel_accumulation(recipe, monkeypatch)
    assert seen == {"forward": fprop, "dgrad": dgrad, "wgrad": wgrad}


def _traced_on_a_gpu(x, features=N, recipe=None):
    """Trace a grouped_dense training step as for a GPU (the switch's ``auto``), with warnings
    recorded."""
    kernel = jnp.zeros((GROUPS, x.shape[1], features), jnp.float32)
    sizes = jnp.array([50, 0, 70], jnp.int32)
    state = noop_quantizer_set
    if recipe is not None:
        state = grouped_quantizer_set(QuantizerFactory.create_set(fp8_recipe=recipe), GROUPS)

    def loss(x, kernel):
        out = grouped_dense(x, kernel, sizes, quantizer_set=state)
        return jnp.sum(out.astype(jnp.float32))

    with warnings.catch_warnings(record=True) as caught, pallas_kernels("auto", assume_gpu=True):
        warnings.simplefilter("always")
        jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, kernel)
    return [w for w in caught if issubclass(w.category, RaggedOnGpuWarning)]


def test_ragged_on_a_gpu_without_the_kernel_says_so():
    assert _traced_on_a_gpu(jnp.zeros((M, K), jnp.bfloat16)) == []
    # float32 operands: the kernels take float8 and 16-bit ones.
    (first, *_) = _traced_on_a_gpu(jnp.zeros((M, K), jnp.float32))
    assert "lowering='capacity'" in str(first.message)
    # Feature axes that are not multiples of 64.
    assert _traced_on_a_gpu(jnp.zeros((M, 96), jnp.bfloat16))


@pytest.mark.parametrize("shape", [(200, 192, 128), (200, 128, 64), (130, 64, 192)], ids=str)
def test_the_kernels_take_any_rows_and_float8_contractions_of_64_bytes(shape):
    """Rows that are not a multiple of 64 (the forward GEMM and dgrad; wgrad's are its
    contraction) and float8 contractions of 64 or 192: on the kernels on a GPU, not on XLA's
    ragged_dot, which would expand over every expert."""
    rows, hidden, features = shape
    e4m3 = DelayedScaling(fp8_format=Format.E4M3)  # e4m3 gradients: jax 0.10's wgmma too
    for recipe in (None, e4m3):
        x = jnp.zeros((rows, hidden), jnp.bfloat16)
        assert _traced_on_a_gpu(x, features, recipe) == [], (shape, recipe)


@pytest.mark.skipif(mosaic_gpu_interpreted(), reason="this JAX has the Mosaic GPU interpreter")
def test_switch_mode_1_without_the_interpreter_takes_xla():
    """Where JAX has no Mosaic GPU interpreter, ``pallas_kernels("1")`` runs the XLA lowering
    on a CPU instead of failing (the other kernels run in Triton's interpret mode)."""
    x, kernel, bias, cotangent = _inputs()
    sizes = jnp.array([50, 0, 70], jnp.int32)
    with pallas_kernels("1"):
        (_, out), _ = _step(x, kernel, bias, cotangent, noop_quantizer_set, sizes)
    with pallas_kernels("0"):
        (_, expected), _ = _step(x, kernel, bias, cotangent, noop_quantizer_set, sizes)
    np.testing.assert_array_equal(out, expected)


@interpreted
@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_capacity_lowering_on_the_kernels_matches_batched_dense(recipe):
    """With per-tensor FP8, where the kernels take the operands (a GPU; here the switch's "1"),
    the capacity lowering runs its packed rows through them, each expert ``capacity`` rows: the
    results of the batched ``dense`` it runs elsewhere, the dropped rows (expert 2 has 70 for 64
    slots) too."""
    x, kernel, bias, cotangent = _inputs()
    state = noop_quantizer_set
    if RECIPES[recipe] is not None:
        state = grouped_quantizer_set(QuantizerFactory.create_set(fp8_recipe=RECIPES[recipe]), 3)

    def step(x, kernel, bias, state):
        def loss(x, kernel, bias, state):
            sizes = jnp.array([50, 0, 70], jnp.int32)
            out = grouped_dense(
                x, kernel, sizes, bias=bias, quantizer_set=state, lowering="capacity", capacity=64
            )
            return jnp.sum(out.astype(jnp.float32) * cotangent)

        return jax.grad(loss, argnums=(0, 1, 2, 3))(x, kernel, bias, state)

    results = {}
    for mode in ("1", "0"):
        with pallas_kernels(mode):
            assert capacity_on_kernels(x, kernel, 64, state) == (mode == "1")
            results[mode] = jax.jit(step)(x, kernel, bias, state)
    names = ("d_x", "d_kernel", "d_bias")
    for name, actual, want in zip(names, results["1"][:3], results["0"][:3], strict=True):
        _assert_bf16_close(actual, want, name)
    for actual, want in zip(*map(jax.tree.leaves, (results["1"][3], results["0"][3])), strict=True):
        np.testing.assert_allclose(actual, want, rtol=1e-6)


@pytest.mark.parametrize("recipe", ["none", "mxfp8"])
def test_capacity_lowering_keeps_batched_gemms_without_per_tensor_fp8(recipe):
    """Without FP8 and with block-scaled recipes (16-bit values in the GEMMs) the capacity
    lowering keeps its batched GEMMs on a GPU too (cuBLAS: the faster by the bench's model)."""
    x, kernel, _, _ = _inputs()
    state = noop_quantizer_set
    if RECIPES[recipe] is not None:
        state = grouped_quantizer_set(QuantizerFactory.create_set(fp8_recipe=RECIPES[recipe]), 3)
    with pallas_kernels("1"):
        assert not capacity_on_kernels(x, kernel, 64, state)


def _without_mixed_wgmma(monkeypatch):
    """This JAX as jax 0.10's Mosaic GPU: no e4m3 x e5m2 ``wgmma``."""
    from te_flax._ops.kernels import grouped_gemm

    monkeypatch.setattr(grouped_gemm, "mixed_fp8_wgmma", lambda: False)


def test_hybrid_gradient_gemms_run_on_the_kernels_in_bfloat16_without_mixed_wgmma(monkeypatch):
    """Where Mosaic GPU has no mixed float8 ``wgmma`` (jax 0.10), HYBRID FP8's dgrad (e5m2 x
    e4m3) and wgrad (e4m3 x e5m2) take the kernels with both operands converted to bfloat16
    (exact), no promotion needed, instead of XLA's ragged_dot expanded over every group; the
    forward keeps e4m3 x e4m3."""
    from te_flax._ops import grouped_kernels as grouped

    _without_mixed_wgmma(monkeypatch)
    seen = {}

    def recorded(name, gemm):
        def call(*args, **kwargs):
            lhs, rhs, accumulation = args[0], args[1], args[7]
            # rows_gemm's [G, N, C]: the forward's N is the kernel's features (N), dgrad's K.
            gemm_name = ("forward" if rhs.shape[1] == N else "dgrad") if name == "rows" else name
            seen[gemm_name] = (lhs.dtype, rhs.dtype, accumulation.split)
            return gemm(*args, **kwargs)

        return call

    monkeypatch.setattr(grouped, "rows_gemm", recorded("rows", grouped.rows_gemm))
    monkeypatch.setattr(grouped, "group_gemm", recorded("wgrad", grouped.group_gemm))
    state = grouped_quantizer_set(QuantizerFactory.create_set(fp8_recipe=DelayedScaling()), GROUPS)
    x, kernel, _, _ = _inputs()

    def loss(x, kernel, state):
        out = grouped_dense(x, kernel, jnp.array([50, 0, 70], jnp.int32), quantizer_set=state)
        return jnp.sum(out.astype(jnp.float32))

    with pallas_kernels("auto", assume_gpu=True), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.simplefilter("error", RaggedOnGpuWarning)
        jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(x, kernel, state)
    assert seen == {
        "forward": (E4M3, E4M3, False),
        "dgrad": (BF16, BF16, False),
        "wgrad": (BF16, BF16, False),
    }
    # Said, once for each of the two converted GEMMs: the user's FP8 runs at BF16's rate there.
    said = [str(w.message) for w in caught if issubclass(w.category, Fp8AtBf16RateWarning)]
    assert len(said) == 2, said
    assert "float8_e5m2 by float8_e4m3fn at BF16's tensor-core rate" in said[0]
    assert "float8_e4m3fn by float8_e5m2" in said[1]
    assert all("Format.E4M3" in message and "jax 0.11" in message for message in said)


@pytest.mark.parametrize(
    "mixed",
    [
        pytest.param(True, marks=pytest.mark.skipif(not mixed_fp8_wgmma(), reason="jax 0.11")),
        False,
    ],
    ids=["mixed wgmma", "e4m3 gradients"],
)
def test_float8_gemms_on_the_kernels_in_float8_say_nothing(mixed, monkeypatch):
    """With mixed float8 ``wgmma`` (jax 0.11 on), or without it in DelayedScaling's E4M3
    format (every GEMM e4m3 x e4m3), every grouped GEMM runs in float8: no warning."""
    if not mixed:
        _without_mixed_wgmma(monkeypatch)
    recipe = DelayedScaling() if mixed else DelayedScaling(fp8_format=Format.E4M3)
    state = grouped_quantizer_set(QuantizerFactory.create_set(fp8_recipe=recipe), GROUPS)
    x, kernel, _, _ = _inputs()

    def loss(x, kernel):
        out = grouped_dense(x, kernel, jnp.array([50, 0, 70], jnp.int32), quantizer_set=state)
        return jnp.sum(out.astype(jnp.float32))

    with pallas_kernels("auto", assume_gpu=True), warnings.catch_warnings():
        warnings.simplefilter("error")
        jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, kernel)


@interpreted
def test_hybrid_gradient_gemms_in_bfloat16_match_xla(monkeypatch):
    """The bfloat16 conversion is exact: the step on the kernels (interpret mode) gives the
    XLA lowering's values, gradients and FP8 state, as with mixed float8 ``wgmma``."""
    _without_mixed_wgmma(monkeypatch)
    recipe, sizes = DelayedScaling(amax_history_len=4), (50, 0, 70)
    # _step's cache has no key for mixed wgmma: a program of this recipe and shape traced with
    # it (test_grouped_dense_on_the_kernels_matches_xla) would run here, and this one there.
    _step.clear_cache()
    try:
        with pallas_kernels("1"):
            (_, out), grads = _two_steps(recipe, sizes)
    finally:
        _step.clear_cache()
    with pallas_kernels("0"):
        (_, expected_out), expected = _two_steps(recipe, sizes)
    _assert_bf16_close(out, expected_out, "out")
    _assert_bf16_close(grads[0], expected[0], "d_x")
    np.testing.assert_allclose(grads[1], expected[1], rtol=1e-5, atol=1e-5, err_msg="d_kernel")
    for actual, want in zip(jax.tree.leaves(grads[3]), jax.tree.leaves(expected[3]), strict=True):
        np.testing.assert_allclose(actual, want, rtol=1e-6)


def test_a_bfloat16_converted_gemm_is_probed_as_the_kernel_runs_it(monkeypatch):
    """Without mixed float8 ``wgmma`` a dgrad whose contraction (96) float8 steps cannot tile
    runs on the kernels in bfloat16 (32-element steps): its first-use check tiles it the same
    way and says so."""
    from te_flax._ops import grouped_kernels
    from te_flax._ops.kernels.probes import grouped_gemm_probe

    _without_mixed_wgmma(monkeypatch)
    assert tiles_for(E5M2, 96, 64, 96, ragged_rows=True) is None
    lhs, rhs = jnp.zeros((96, 96), E5M2), jnp.zeros((GROUPS, 64, 96), E4M3)  # [M, N], [G, K, N]
    kernel = functools.partial(
        grouped_kernels.rows_kernel, forward=False, out_dtype=BF16, accumulation=Accumulation()
    )
    sizes = jnp.array([96, 0, 0], jnp.int32)
    probe = grouped_gemm_probe(kernel, None, (lhs, rhs, sizes, None, None), (1, 2))
    assert "float8_e5m2 x float8_e4m3fn as bfloat16" in str(probe.configuration)


@interpreted
@pytest.mark.parametrize("recipe", ["none", "delayed"])
def test_grouped_dense_on_the_kernels_inside_shard_map(recipe):
    """Inside ``shard_map`` (``check_vma``) each device's rows take the kernels, whose results
    vary over the mesh axes as the XLA stage's do: the gradients (the cotangents of varying
    operands) are accepted and equal the XLA stage's."""
    # One device: the varying axes are tracked whatever the axis's size, and Mosaic GPU's
    # interpreter keeps one host state that two devices' programs would share.
    mesh = jax.make_mesh((1,), ("expert",), devices=jax.devices()[:1])
    state = noop_quantizer_set
    if RECIPES[recipe] is not None:
        factory = QuantizerFactory.create_set(fp8_recipe=RECIPES[recipe])
        state = grouped_quantizer_set(factory, GROUPS)
    spec = jax.sharding.PartitionSpec
    rows = jax.sharding.NamedSharding(mesh, spec("expert"))
    x, kernel, _, cotangent = _inputs()
    x, cotangent = jax.device_put((x, cotangent), rows)
    sizes = jnp.array([50, 0, 70], jnp.int32)

    def per_device(x, kernel, cotangent):
        def loss(x, kernel):
            out = grouped_dense(x, kernel, sizes, quantizer_set=state)
            return jnp.sum(out.astype(jnp.float32) * cotangent)

        d_x, d_kernel = jax.grad(loss, argnums=(0, 1))(x, kernel)
        return d_x, lax.psum(d_kernel, "expert")

    step = jax.jit(
        jax.shard_map(
            per_device,
            mesh=mesh,
            in_specs=(spec("expert"), spec(), spec("expert")),
            out_specs=(spec("expert"), spec()),
        )
    )
    with pallas_kernels("1"):
        d_x, d_kernel = step(x, kernel, cotangent)
    with pallas_kernels("0"):
        want_x, want_kernel = step(x, kernel, cotangent)
    _assert_bf16_close(d_x, want_x, "d_x")
    np.testing.assert_allclose(d_kernel, want_kernel, rtol=1e-5, atol=1e-5, err_msg="d_kernel")
