"""The blockwise FP8 GEMM kernel in Pallas Mosaic GPU against XLA's exact form.

In Mosaic GPU's interpret mode (jax 0.11 and newer) on the CPU: the kernel's output equals
``blockwise_gemm_exact``'s to float32 rounding, for shapes of whole tiles and shapes the kernel
pads, e4m3 and mixed e4m3 x e5m2 operands, float32 and bfloat16 outputs. Then a deviceless
compile for an H100: the kernel lowers to one Mosaic GPU custom call.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from te_flax._base.jax_compat import mosaic_gpu_interpreted
from te_flax._ops.gemm import blockwise_gemm_exact
from te_flax._ops.kernels.blockwise_mosaic import Tiles, blockwise_gemm_kernel, tiles_for
from te_flax._ops.kernels.switch import MOSAIC
from te_flax.quantize import block_scaling
from tests.helpers import F32, USERS_OPTIMIZATION, normal

pytestmark = pytest.mark.skipif(
    not mosaic_gpu_interpreted(), reason="the Mosaic GPU blockwise kernel needs jax 0.11 or newer"
)
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
# (M, N, K): one tile; several tiles each way with 64-wide columns; rows and columns that are
# not multiples of the tile (padded by the kernel's wrapper).
SHAPES = [(64, 128, 128), (128, 192, 512), (256, 256, 1024), (96, 160, 384), (200, 70, 640)]


def _operands(m, n, k, rhs_dtype=E4M3, seed=0):
    """Float8 operands ``[M, K]``, ``[N, K]`` and float32 scales of each row's 128-chunk over
    several octaves, as block scaling gives them."""
    keys = jax.random.split(jax.random.key(seed), 4)
    lhs = normal(keys[0], (m, k), scale=3.0).astype(E4M3)
    rhs = normal(keys[1], (n, k), scale=3.0).astype(rhs_dtype)
    lhs_scale = jnp.exp2(jnp.round(normal(keys[2], (m, k // 128), scale=3.0)))
    rhs_scale = jnp.exp(normal(keys[3], (n, k // 128)))
    return lhs, lhs_scale, rhs, rhs_scale


def _f64(a) -> np.ndarray:
    return np.asarray(jnp.asarray(a, F32), np.float64)


def _rounding_bound(lhs, lhs_scale, rhs, rhs_scale) -> np.ndarray:
    """How far two float32 sums of the same products may differ by their order alone:
    ``(128 + chunks) * eps * sum |terms|`` per output (a chunk's 128 products, then the
    chunks)."""
    chunks = lhs.shape[1] // 128
    a = np.abs(_f64(lhs)).reshape(lhs.shape[0], chunks, 128)
    b = np.abs(_f64(rhs)).reshape(rhs.shape[0], chunks, 128)
    terms = np.einsum("mck,nck,mc,nc->mn", a, b, _f64(lhs_scale), _f64(rhs_scale))
    return (128 + chunks) * np.finfo(np.float32).eps * terms


def _both(args, out_dtype):
    kernel = jax.jit(
        lambda *a: blockwise_gemm_kernel(*a, out_dtype, interpret=True),
        compiler_options=USERS_OPTIMIZATION,
    )
    exact = jax.jit(
        lambda *a: blockwise_gemm_exact(*a, out_dtype), compiler_options=USERS_OPTIMIZATION
    )
    return kernel(*args), exact(*args)


@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_kernel_matches_the_exact_gemm_to_float32_rounding(m, n, k):
    args = _operands(m, n, k)
    out, exact = _both(args, F32)
    assert out.dtype == F32 and out.shape == (m, n)
    difference = np.abs(_f64(out) - _f64(exact))
    assert np.all(difference <= _rounding_bound(*args)), difference.max()


def test_mixed_float8_types_and_a_bfloat16_output():
    """e4m3 x e5m2 (the gradient GEMMs); the float32 sum rounded once to bfloat16, as the
    exact form rounds its own."""
    args = _operands(128, 256, 384, rhs_dtype=E5M2, seed=1)
    out, exact = _both(args, jnp.bfloat16)
    assert out.dtype == jnp.bfloat16 and out.shape == (128, 256)
    # Two float32 sums a rounding apart may round to neighbouring bfloat16 values.
    np.testing.assert_allclose(_f64(out), _f64(exact), rtol=2**-8, atol=0)
    out32, exact32 = _both(args, F32)
    assert np.all(np.abs(_f64(out32) - _f64(exact32)) <= _rounding_bound(*args))


def test_block_scaled_operands_of_a_weight():
    """A weight's 128x128-block scales, repeated over its rows as the GEMM op passes them."""
    lhs, lhs_scale, rhs, _ = _operands(192, 256, 256, seed=2)
    block_scales = jnp.exp(normal(jax.random.key(5), (2, 2)))  # [N / 128, K / 128]
    rhs_scale = block_scaling.expand_tile_rows(block_scales, 256)
    args = (lhs, lhs_scale, rhs, rhs_scale)
    out, exact = _both(args, F32)
    assert np.all(np.abs(_f64(out) - _f64(exact)) <= _rounding_bound(*args))


def test_tiles():
    assert tiles_for(256, 384) == Tiles(rows=64, cols=128)
    assert tiles_for(100, 192) == Tiles(rows=64, cols=64)  # 192 is three 64-column tiles
    with pytest.raises(ValueError, match="rows must be 64"):
        Tiles(rows=128)


def test_contraction_not_whole_chunks_is_refused():
    lhs, lhs_scale, rhs, rhs_scale = _operands(64, 64, 256)
    with pytest.raises(ValueError, match="K a positive multiple of 128"):
        blockwise_gemm_kernel(lhs[:, :200], lhs_scale, rhs[:, :200], rhs_scale, F32, interpret=True)


@pytest.mark.skipif("blockwise_gemm" not in MOSAIC, reason="the Triton kernel runs here")
def test_dense_step_through_the_switch_matches_the_exact_gemms():
    """One ``Float8BlockScaling`` training step of ``dense``: the kernel (interpret mode) for
    its three GEMMs gives the exact form's results to float32 rounding."""
    from te_flax._ops.kernels import pallas_kernels
    from te_flax.dense import dense
    from te_flax.quantize import Float8BlockScaling, QuantizerFactory

    x = normal(jax.random.key(3), (128, 256))
    kernel = normal(jax.random.key(4), (256, 384), scale=0.1)
    quantizers = QuantizerFactory.create_set(fp8_recipe=Float8BlockScaling())

    def loss(x, kernel):
        out = dense(x, kernel, None, quantizer_set=quantizers)
        return jnp.mean(jnp.square(out))

    results = []
    for switch in ("0", "1"):
        with pallas_kernels(switch):
            step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
            results.append(step(x, kernel))
    for actual, expected in zip(*(jax.tree.leaves(r) for r in results), strict=True):
        np.testing.assert_allclose(_f64(actual), _f64(expected), rtol=1e-5, atol=1e-7)


@pytest.mark.gpu_compile
def test_kernel_lowers_to_one_mosaic_gpu_call_for_an_h100():
    """Deviceless H100 compile of the kernel: one ``mosaic_gpu_v2`` custom call named
    ``te_flax_blockwise_gemm`` on the float8 operands and the transposed scales."""
    pytest.importorskip("jax_plugins.xla_cuda12", reason="needs the gpu-compile extra")
    from tests.gpu_target import h100_sharding

    sharding = h100_sharding()

    def spec(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    m, n, k = 256, 384, 512
    step = jax.jit(lambda *a: blockwise_gemm_kernel(*a, jnp.bfloat16, interpret=False))
    lowered = step.lower(
        spec((m, k), E4M3), spec((m, k // 128), F32), spec((n, k), E5M2), spec((n, k // 128), F32)
    )
    calls = [line for line in lowered.compile().as_text().splitlines() if "custom-call(" in line]
    assert len(calls) == 1 and '"mosaic_gpu_v2"' in calls[0]
    assert "te_flax_blockwise_gemm" in calls[0]
    assert f"bf16[{m},{n}]" in calls[0]
    operands = calls[0].split("operand_layout_constraints={")[1].split("}, api_version")[0]
    assert [o.split("{")[0] for o in operands.split(", ")] == [
        f"f8e4m3fn[{m},{k}]",
        f"f8e5m2[{n},{k}]",
        f"f32[{k // 128},{m}]",
        f"f32[{k // 128},{n}]",
    ]
