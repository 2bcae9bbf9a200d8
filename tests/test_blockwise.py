"""Blockwise FP8 (``Float8BlockScaling``): the recipe, its quantization, the exact GEMM against a
float64 reference of the same block math, the ops and modules, outliers, and the Pallas kernel."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import te_flax
import te_flax.linen as te_nn
import te_flax.nnx as te_nnx
from te_flax._ops.gemm import blockwise_gemm_exact
from te_flax._ops.kernels.blockwise import blockwise_gemm_kernel
from te_flax.dense import dense
from te_flax.layernorm_mlp import layernorm_mlp
from te_flax.quantize import (
    LEADING,
    TRAILING,
    Float8BlockQuantizer,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    MMParams,
    QuantizerFactory,
    block_scaling,
)
from te_flax.sharding import make_mesh
from te_flax.training import OVERWRITE_WITH_GRADIENT
from tests.helpers import F32, normal, relative_error

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
RECIPE = Float8BlockScaling()


def _f64(a) -> np.ndarray:
    return np.asarray(jnp.asarray(a, F32), np.float64)


def reference_gemm(lhs, lhs_scale, rhs, rhs_scale) -> np.ndarray:
    """The recipe's GEMM in float64: per 128 of K, the FP8 product times both chunk scales."""
    m, k = lhs.shape
    n = rhs.shape[0]
    ls = _f64(block_scaling.expand_tile_rows(lhs_scale, m))  # [M, C]
    rs = _f64(block_scaling.expand_tile_rows(rhs_scale, n))  # [N, C]
    a, b = _f64(lhs), _f64(rhs)
    out = np.zeros((m, n))
    for c in range(k // 128):
        chunk = slice(128 * c, 128 * (c + 1))
        out += (a[:, chunk] @ b[:, chunk].T) * ls[:, c : c + 1] * rs[:, c][None, :]
    return out


def reference_quantize(x: np.ndarray, dtype, tile_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """``x [rows, K]`` quantized in float64 with tiles of ``tile_rows x 128``: power-of-two
    scales at or above ``amax / fp8_max``, data rounded by the float8 cast."""
    rows, k = x.shape
    tiles = x.reshape(rows // tile_rows, tile_rows, k // 128, 128)
    amax = np.abs(tiles).max(axis=(1, 3), keepdims=True)
    fp8_max = float(jnp.finfo(dtype).max)
    scale_inv = np.where(amax > 0, 2.0 ** np.ceil(np.log2(amax / fp8_max)), 1.0)
    data = np.asarray(jnp.asarray(tiles / scale_inv, F32).astype(dtype).astype(F32), np.float64)
    return data.reshape(rows, k), scale_inv[:, 0, :, 0]


def _quantize(quantizer, x, uses):
    return jax.jit(lambda x: quantizer.quantize(x, 1, uses)[0])(x)


# ----------------------------------------------------------------------------- the recipe


def test_recipe_has_te_fields_and_defaults():
    assert RECIPE.fp8_format is Format.E4M3 and not RECIPE.use_f32_scales
    assert (RECIPE.x_block_scaling_dim, RECIPE.w_block_scaling_dim) == (1, 2)
    assert RECIPE.grad_block_scaling_dim == 1
    assert RECIPE.fp8_gemm_fprop == MMParams(use_split_accumulator=True)
    assert RECIPE.fp8_quant_bwd_grad.power_2_scale
    assert not Float8BlockScaling(use_f32_scales=True).fp8_quant_fwd_weight.power_2_scale
    assert RECIPE.float8_block_scaling() and not RECIPE.mxfp8() and not RECIPE.delayed()
    hybrid = QuantizerFactory.create_set(fp8_recipe=Float8BlockScaling(fp8_format=Format.HYBRID))
    assert (hybrid.x.q_dtype, hybrid.kernel.q_dtype, hybrid.dgrad.q_dtype) == (E4M3, E4M3, E5M2)
    qs = QuantizerFactory.create_set(fp8_recipe=RECIPE)
    assert (qs.x.block_dims, qs.kernel.block_dims, qs.dgrad.block_dims) == (1, 2, 1)
    assert jax.tree.leaves(qs) == []  # no state: scales are block-local


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(fp8_format=Format.E5M2), r"Format\.E5M2.*Format\.HYBRID"),
        (dict(x_block_scaling_dim=3), r"x_block_scaling_dim=3.*must be 1"),
        (dict(x_block_scaling_dim=2), r"two 128x128-block operands.*give one of them 1"),
        (dict(fp8_gemm_dgrad=MMParams(False)), r"split accumulation.*use_split_accumulator=True"),
    ],
)
def test_recipe_refuses(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Float8BlockScaling(**kwargs)


# ----------------------------------------------------------------------------- quantization


def test_tiles_and_blocks_match_the_float64_reference_and_blocks_transpose():
    x = normal(jax.random.key(0), (256, 384), scale=3.0)
    x = x * jnp.exp(normal(jax.random.key(1), (256, 1)))  # rows of very different sizes
    operand = _quantize(Float8BlockQuantizer(E4M3, block_dims=1), x, (TRAILING, LEADING))
    for use, matrix in ((TRAILING, x), (LEADING, x.T)):
        tensor = operand.for_contraction((1,) if use == TRAILING else (0,))
        data, scale = reference_quantize(_f64(matrix), E4M3, 1)
        np.testing.assert_array_equal(_f64(tensor.data), data)  # each use from high precision
        np.testing.assert_array_equal(_f64(tensor.scale_inv), scale)
    weight = _quantize(Float8BlockQuantizer(E4M3, block_dims=2), x, (LEADING, TRAILING))
    data, scale = reference_quantize(_f64(x), E4M3, 128)
    assert weight.trailing.scale_inv.shape == (2, 3)
    np.testing.assert_array_equal(_f64(weight.trailing.data), data)
    np.testing.assert_array_equal(_f64(weight.trailing.scale_inv), scale)
    np.testing.assert_array_equal(_f64(weight.leading.data), data.T)  # the same float8 blocks
    np.testing.assert_array_equal(_f64(weight.leading.scale_inv), scale.T)
    # Within e4m3's rounding, and its underflow below the tile's amax / 448 / 2**9.
    atol = float(jnp.max(jnp.abs(x))) * 2.0**-16
    np.testing.assert_allclose(_f64(weight.leading.dequantize()), _f64(x.T), rtol=2**-4, atol=atol)


def test_f32_scales_are_amax_over_fp8_max():
    x = normal(jax.random.key(2), (4, 256))
    operand = _quantize(Float8BlockQuantizer(E4M3, power_2_scale=False), x, (TRAILING,))
    amax = np.abs(_f64(x)).reshape(4, 2, 128).max(-1)
    np.testing.assert_allclose(_f64(operand.trailing.scale_inv), amax / 448.0, rtol=1e-7)


@pytest.mark.parametrize(
    ("block_dims", "shape", "uses", "message"),
    [
        (1, (4, 200), (TRAILING,), r"blocks of 128 .* trailing axes \(200,\).*pad them"),
        (2, (256, 96), (LEADING,), r"128x128 tiles .* \(96,\).*w_block_scaling_dim=1"),
    ],
)
def test_shape_errors_say_which_axes_to_pad(block_dims, shape, uses, message):
    quantizer = Float8BlockQuantizer(E4M3, block_dims=block_dims)
    with pytest.raises(ValueError, match=message):
        quantizer.quantize(jnp.ones(shape), 1, uses)


# ----------------------------------------------------------------------------- the GEMM


def _operands(m=96, n=192, k=384, seed=3):
    keys = jax.random.split(jax.random.key(seed), 2)
    lhs = normal(keys[0], (m, k), scale=4.0)
    rhs = normal(keys[1], (k, n)) * jnp.exp(jnp.linspace(-3, 3, n))[None, :]  # many sizes
    lhs_q = _quantize(Float8BlockQuantizer(E4M3), lhs, (TRAILING,))
    padded = jnp.pad(rhs, ((0, 0), (0, (-n) % 128)))
    rhs_q = _quantize(Float8BlockQuantizer(E4M3, block_dims=2), padded, (LEADING,))
    r = rhs_q.leading
    return lhs_q.trailing, r.data[:n], r.scale_inv, lhs, rhs


def test_exact_gemm_is_the_float64_block_math_to_float32_rounding():
    lhs, rhs_data, rhs_scale, *_ = _operands(n=256)
    out = blockwise_gemm_exact(lhs.data, lhs.scale_inv, rhs_data, rhs_scale, F32)
    expected = reference_gemm(lhs.data, lhs.scale_inv, rhs_data, rhs_scale)
    np.testing.assert_allclose(_f64(out), expected, rtol=1e-5, atol=1e-6 * np.abs(expected).max())


def test_pallas_kernel_interpret_matches_the_exact_gemm():
    # 96 x 160 outputs: neither a multiple of the kernel's 64x64 tiles (masked edges).
    lhs, _, _, _, w = _operands(n=160)
    rhs = _quantize(Float8BlockQuantizer(E4M3), w.T, (TRAILING,)).trailing
    args = (lhs.data, lhs.scale_inv, rhs.data, rhs.scale_inv)
    exact = blockwise_gemm_exact(*args, jnp.bfloat16)
    kernel = blockwise_gemm_kernel(*args, jnp.bfloat16, interpret=True)
    assert kernel.dtype == jnp.bfloat16 and kernel.shape == (96, 160)
    np.testing.assert_allclose(_f64(kernel), _f64(exact), rtol=2**-8, atol=1e-6)
    exact32 = blockwise_gemm_exact(*args, F32)
    kernel32 = blockwise_gemm_kernel(*args, F32, interpret=True)
    np.testing.assert_allclose(_f64(kernel32), _f64(exact32), rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- the ops


def test_dense_forward_and_gradients_are_the_block_math():
    keys = jax.random.split(jax.random.key(4), 3)
    x = normal(keys[0], (2, 64, 256))  # 128 tokens
    w = normal(keys[1], (256, 128), scale=0.1)
    weights = normal(keys[2], (2, 64, 128))
    qs = QuantizerFactory.create_set(fp8_recipe=RECIPE)

    def loss(x, w):
        return jnp.sum(dense(x, w, None, quantizer_set=qs) * weights)

    out, (dx, dw) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, w)
    out = dense(x, w, None, quantizer_set=qs)
    x2, g2 = _f64(x.reshape(128, 256)), _f64(weights.reshape(128, 128))
    xq, xs = reference_quantize(x2, E4M3, 1)
    wq, ws = reference_quantize(_f64(w), E4M3, 128)  # [in, out] in 128x128 blocks
    fwd = reference_gemm(xq, xs, wq.T, ws.T)
    gq, gs = reference_quantize(g2, E4M3, 1)  # dgrad: along the output features
    dgrad = reference_gemm(gq, gs, wq, ws)  # the same weight blocks, transposed
    xtq, xts = reference_quantize(x2.T, E4M3, 1)  # wgrad: along the tokens
    gtq, gts = reference_quantize(g2.T, E4M3, 1)
    wgrad = reference_gemm(xtq, xts, gtq, gts)
    for got, expected in ((out, fwd), (dx, dgrad), (dw, wgrad)):
        got = _f64(got).reshape(expected.shape)
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


@jax.jit
def _outlier_errors(x, w):
    exact = jnp.dot(x, w, precision=jax.lax.Precision.HIGHEST)
    errors = {}
    for name, recipe in (
        ("blockwise", RECIPE),
        ("current", Float8CurrentScaling(fp8_format=Format.E4M3)),
    ):
        out = dense(x, w, None, quantizer_set=QuantizerFactory.create_set(fp8_recipe=recipe))
        errors[name] = jnp.linalg.norm(out - exact) / jnp.linalg.norm(exact)
    return errors


def test_outlier_channels_blockwise_error_far_below_current_scaling(capsys):
    # A few input channels (in one of the eight 1x128 tiles of a row) far larger than the rest,
    # whose weights are zero: the error is that of the ordinary channels. One per-tensor scale
    # pushes them towards e4m3's subnormals; a tile without an outlier keeps its own scale.
    keys = jax.random.split(jax.random.key(5), 2)
    x = normal(keys[0], (64, 1024))
    outliers = jnp.array([3, 50, 100])
    w = normal(keys[1], (1024, 128), scale=0.03).at[outliers].set(0.0)
    errors = {}
    for factor in (1e3, 3e4):
        errors[factor] = {
            name: float(e)
            for name, e in _outlier_errors(x.at[:, outliers].multiply(factor), w).items()
        }
    with capsys.disabled():
        print(f"\nrelative error with outlier channels (factor: errors): {errors}")
    # 1000x: e4m3's own range (2**17 from subnormal to max) still holds the ordinary channels,
    # so both errors are e4m3's rounding; at 30000x per-tensor scaling loses them.
    assert errors[1e3]["blockwise"] < 0.045 and errors[1e3]["current"] < 0.045
    assert errors[3e4]["blockwise"] < 0.05
    assert errors[3e4]["current"] > 2 * errors[3e4]["blockwise"]


def test_layernorm_mlp_trains_close_to_high_precision():
    keys = jax.random.split(jax.random.key(6), 4)
    x = normal(keys[0], (128, 128))
    kernels = [normal(keys[1], (128, 2, 256), scale=0.08), normal(keys[2], (256, 128), scale=0.06)]
    gamma, beta = jnp.ones((128,)), jnp.zeros((128,))
    sets = QuantizerFactory.create_set(2, fp8_recipe=RECIPE)

    def loss(kernels, quantizer_sets):
        out = layernorm_mlp(
            x, gamma, beta, kernels, [None, None], "layernorm",
            activation_type=("silu", "linear"), quantizer_sets=quantizer_sets,
        )  # fmt: skip
        return jnp.mean(jnp.square(out))

    plain = jax.jit(jax.grad(loss))(kernels, QuantizerFactory.create_set(2, fp8_recipe=None))
    fp8 = jax.jit(jax.grad(loss))(kernels, sets)
    for got, expected in zip(fp8, plain, strict=True):
        assert relative_error(got, expected) < 0.08


# ----------------------------------------------------------------------------- modules


def test_linen_and_nnx_modules_and_autocast():
    x = normal(jax.random.key(7), (2, 64, 128))
    module = te_nn.LayerNormMLP(intermediate_dim=256, activations=("gelu", "linear"))
    with te_flax.autocast(enabled=True, recipe=RECIPE):
        variables = jax.jit(module.init)(jax.random.key(0), x)
        under_autocast, _ = jax.jit(module.apply)(variables, x)
    assert OVERWRITE_WITH_GRADIENT not in variables  # blockwise keeps no FP8 state
    linen_out, _ = jax.jit(module.clone(recipe=RECIPE).apply)(variables, x)
    np.testing.assert_array_equal(np.asarray(under_autocast), np.asarray(linen_out))
    plain, _ = jax.jit(module.apply)(variables, x)
    assert 0 < relative_error(linen_out, plain) < 0.1
    twin = te_nnx.LayerNormMLP(
        128, intermediate_dim=256, activations=("gelu", "linear"), recipe=RECIPE,
        rngs=nnx.Rngs(0),
    )  # fmt: skip
    nnx.update(twin, nnx.State(_nnx_params(variables["params"])))
    nnx_out = nnx.jit(lambda module, x: module(x)[0])(twin, x)
    np.testing.assert_array_equal(np.asarray(nnx_out), np.asarray(linen_out))
    dense_module = te_nn.DenseGeneral(features=128, recipe=RECIPE)
    params = jax.jit(dense_module.init)(jax.random.key(1), x)
    grads = jax.jit(jax.grad(lambda p: jnp.sum(dense_module.apply(p, x) ** 2)))(params)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))


def _nnx_params(params):
    return jax.tree.map(lambda v: nnx.Param(v), nn.unbox(params))


def test_sharded_step_equals_one_device():
    # 8 CPU devices: tokens over "data" (4), the kernel's input features over "fsdp" (2). The
    # scales are block-local, so each device's blocks need no amax from the others.
    mesh = make_mesh({"data": 4, "fsdp": 2})
    keys = jax.random.split(jax.random.key(8), 2)
    x = normal(keys[0], (512, 256))
    w = normal(keys[1], (256, 128), scale=0.1)
    qs = QuantizerFactory.create_set(fp8_recipe=RECIPE)

    def step(x, w):
        return jax.value_and_grad(
            lambda x, w: jnp.sum(jnp.square(dense(x, w, None, quantizer_set=qs))), (0, 1)
        )(x, w)

    single = jax.jit(step)(x, w)
    specs = (jax.P("data", None), jax.P("fsdp", None))
    placed = [
        jax.device_put(a, jax.NamedSharding(mesh, s)) for a, s in zip((x, w), specs, strict=True)
    ]
    sharded = jax.jit(step)(*placed)
    for got, expected in zip(jax.tree.leaves(sharded), jax.tree.leaves(single), strict=True):
        np.testing.assert_allclose(_f64(got), _f64(expected), rtol=1e-5, atol=1e-5)
