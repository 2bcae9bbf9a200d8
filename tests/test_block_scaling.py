"""Block-scaled recipes (MXFP8, NVFP4): quantization against a NumPy implementation, the ops
against NumPy fake quantization and the unquantized references, and the errors."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from te_flax.dense import dense
from te_flax.layernorm import layernorm
from te_flax.layernorm_dense import layernorm_dense, layernorm_dense_with_norm_output
from te_flax.layernorm_mlp import layernorm_mlp
from te_flax.quantize import (
    LEADING,
    TRAILING,
    BlockScaleQuantizer,
    CurrentScaleQuantizer,
    Format,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    NVFP4Quantizer,
    QuantizeMeta,
    QuantizeMetaSet,
    QuantizerFactory,
    QuantizerSet,
    block_scaling,
    factory,
)
from tests.helpers import (
    BLOCK_BACKWARD_TOLERANCE,
    BLOCK_FORWARD_TOLERANCE,
    F32,
    normal,
    reference_dense,
    reference_norm,
    relative_error,
)

E4M3, E5M2 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)
# The NumPy reference below is of NVFP4's 1x16 blocks without the Hadamard transform; the
# recipe's default 16x16 kernel tiles and transform are tested in test_nvfp4.py.
MXFP8 = MXFP8BlockScaling()
NVFP4 = NVFP4BlockScaling(
    disable_stochastic_rounding=True, disable_rht=True, disable_2d_quantization=True
)
NVFP4_SR = NVFP4BlockScaling()
RECIPES = {
    "mxfp8": MXFP8,
    "mxfp8_hybrid": MXFP8BlockScaling(fp8_format=Format.HYBRID),
    "nvfp4": NVFP4,
}
# Block-scaled GEMMs against NumPy's float64 GEMM of the same dequantized operands.
FAKE_QUANT_TOLERANCE = 1e-5
SR_KEY = jax.random.key(11)


# ----------------------------------------------------------------------------- NumPy reference


def np_e8m0_exponent(scale: np.ndarray) -> np.ndarray:
    """The exponent of the smallest power of two >= scale, clipped to e8m0's [-127, 127]."""
    mantissa, exponent = np.frexp(scale.astype(np.float64))  # scale = mantissa * 2**exponent
    exponent = np.where(mantissa == 0.5, exponent - 1, exponent)  # already a power of two
    exponent = np.where(scale == 0, -127, exponent)
    return np.clip(exponent, -127, 127)


def np_mxfp8(x: np.ndarray, dtype) -> tuple[np.ndarray, np.ndarray]:
    """(float8 data, e8m0 scale bytes) of a [rows, K] matrix, blocks of 32 along K."""
    rows, k = x.shape
    blocks = x.astype(np.float32).reshape(rows, k // 32, 32)
    fp8_max = np.float32(ml_dtypes.finfo(dtype).max)
    exponent = np_e8m0_exponent(np.max(np.abs(blocks), axis=-1) / fp8_max)
    scaled = blocks.astype(np.float64) / np.exp2(exponent)[..., None]
    data = np.clip(scaled, -fp8_max, fp8_max).astype(dtype).reshape(rows, k)
    return data, (exponent + 127).astype(np.uint8)


def np_nvfp4(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.float32]:
    """(e2m1 data, e4m3 scales, float32 tensor scale) of a [rows, K] matrix, blocks of 16."""
    rows, k = x.shape
    blocks = x.astype(np.float32).reshape(rows, k // 16, 16)
    amax = np.float32(np.max(np.abs(blocks)))
    tensor_scale_inv = amax / np.float32(6 * 448) if amax > 0 else np.float32(1)
    block_scale = np.max(np.abs(blocks), axis=-1) / np.float32(6) / tensor_scale_inv
    scale = np.clip(block_scale, 0, 448).astype(ml_dtypes.float8_e4m3fn)
    divisor = (scale.astype(np.float32) * tensor_scale_inv)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        scaled = np.where(divisor > 0, blocks / divisor, 0)
    data = np.clip(scaled, -6, 6).astype(ml_dtypes.float4_e2m1fn).reshape(rows, k)
    return data, scale, tensor_scale_inv


def np_dequantize(data, scale, tensor_scale_inv=1.0) -> np.ndarray:
    rows, k = data.shape
    block = k // scale.shape[-1]
    values = data.astype(np.float64).reshape(rows, k // block, block)
    return (values * scale.astype(np.float64)[..., None] * tensor_scale_inv).reshape(rows, k)


def np_fake_quant(x: np.ndarray, recipe) -> np.ndarray:
    """``x [rows, K]`` quantized and dequantized in blocks along K, in float64."""
    if isinstance(recipe, NVFP4BlockScaling):
        return np_dequantize(*np_nvfp4(x))
    data, scale_bytes = np_mxfp8(x, recipe.fp8_format.forward_dtype)
    return np_dequantize(data, np.exp2(scale_bytes.astype(np.float64) - 127))


def _bytes(array) -> np.ndarray:
    return np.asarray(array).view(np.uint8)


# ----------------------------------------------------------------------------- quantization


def _special_rows(fp8_max: float, k: int = 64) -> np.ndarray:
    """Rows of blocks at the edges: zeros, denormals, the format's max and beyond, huge values."""
    rng = np.random.default_rng(0)
    ramp = np.linspace(-1, 1, k, dtype=np.float32)
    rows = [
        np.zeros(k, np.float32),
        ramp * np.float32(1e-40),  # float32 denormals
        ramp * np.float32(2.0**-120),  # a scale near e8m0's smallest
        ramp * np.float32(fp8_max),  # the largest element exactly at the format's max
        ramp * np.float32(fp8_max * 2.0**10),  # a power of two times the max
        ramp * np.float32(fp8_max * (1 + 2.0**-10)),  # just above: the scale rounds up
        ramp * np.float32(1e36),
        # One spike per block over values that land on e4m3's subnormals.
        np.where(np.arange(k) % 32 == 0, 3.0, 3.0 * 2.0**-13 * ramp).astype(np.float32),
        rng.standard_normal(k).astype(np.float32),
        (rng.standard_normal(k) * 1e-3).astype(np.float32),
        (rng.standard_normal(k) * 1e4).astype(np.float32),
    ]
    return np.stack(rows)


@pytest.mark.parametrize("input_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_mxfp8_scales_and_data_match_numpy_bit_for_bit(fp8_dtype, input_dtype):
    x = _special_rows(float(ml_dtypes.finfo(fp8_dtype).max))
    x = np.asarray(jnp.asarray(x).astype(input_dtype).astype(F32))  # what the quantizer sees
    data, scale = jax.jit(block_scaling.quantize_mxfp8, static_argnums=1)(
        jnp.asarray(x).astype(input_dtype), fp8_dtype
    )
    expected_data, expected_scale = np_mxfp8(x, fp8_dtype)
    np.testing.assert_array_equal(_bytes(scale), expected_scale)
    # float32 denormal inputs are flushed to zero by XLA:CPU before they are scaled; all
    # other elements match exactly.
    denormal = (x != 0) & (np.abs(x) < np.finfo(np.float32).tiny)
    np.testing.assert_array_equal(_bytes(data)[~denormal], _bytes(expected_data)[~denormal])
    flushed = np.asarray(data.astype(F32))[denormal] == 0
    assert np.all(flushed | (_bytes(data)[denormal] == _bytes(expected_data)[denormal]))
    assert np.any(np.abs(np.asarray(data.astype(F32))) < ml_dtypes.finfo(fp8_dtype).smallest_normal)
    assert scale.dtype == jnp.float8_e8m0fnu and data.dtype == fp8_dtype
    # The edges come out as designed: zeros at scale 2**-127, the max at scale 1, no overflow.
    assert np.all(_bytes(scale)[0] == 0) and np.all(np.asarray(data[0], F32) == 0)
    assert np.asarray(jnp.abs(data[3].astype(F32))).max() == ml_dtypes.finfo(fp8_dtype).max
    assert np.all(_bytes(scale)[3] == 127)
    if input_dtype == jnp.float32:  # bfloat16 rounds "just above the max" to the max
        assert np.all(_bytes(scale)[5] == 128)


def test_e8m0_round_up_at_the_edges():
    scales = jnp.array(
        [0.0, 1e-45, 2.0**-127, 2.0**-127 * 1.5, 2.0**-126, 1.0, 1.0 + 2**-23, 0.75, 2.0**100],
        F32,
    )
    got = _bytes(block_scaling.e8m0_round_up(scales))
    np.testing.assert_array_equal(got, [0, 0, 0, 1, 1, 127, 128, 127, 227])
    assert np.isnan(np.asarray(block_scaling.e8m0_round_up(jnp.array([jnp.inf, jnp.nan]))[0], F32))


def test_nvfp4_scales_and_data_match_numpy_bit_for_bit():
    x = _special_rows(6 * 448.0)[[0, 3, 7, 8, 9, 10]]  # keep the tensor amax finite and moderate
    tensor_scale_inv = block_scaling.nvfp4_tensor_scale_inv(jnp.max(jnp.abs(jnp.asarray(x))))
    data, scale = jax.jit(block_scaling.quantize_nvfp4)(jnp.asarray(x), tensor_scale_inv)
    expected_data, expected_scale, expected_tensor_scale_inv = np_nvfp4(x)
    assert float(tensor_scale_inv) == expected_tensor_scale_inv
    np.testing.assert_array_equal(_bytes(scale), _bytes(expected_scale))
    np.testing.assert_array_equal(_bytes(data), _bytes(expected_data))
    assert data.dtype == jnp.float4_e2m1fn and scale.dtype == jnp.float8_e4m3fn
    # The tensor amax maps to e2m1's max (6) at e4m3's max block scale (448).
    assert float(jnp.max(scale.astype(F32))) == 448.0
    assert float(jnp.max(jnp.abs(data.astype(F32)))) == 6.0
    # Small blocks far below the tensor's amax underflow to scale 0 and data 0, never NaN.
    assert not np.any(np.isnan(np.asarray(data.astype(F32))))


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_mxfp8_requantizing_is_idempotent(fp8_dtype):
    # Without the denormal rows: XLA:CPU flushes denormal products to zero, so their
    # dequantized values are not what was quantized.
    x = jnp.asarray(np.delete(_special_rows(float(ml_dtypes.finfo(fp8_dtype).max)), [1, 2], 0))
    data, scale = block_scaling.quantize_mxfp8(x, fp8_dtype)
    again_data, again_scale = block_scaling.quantize_mxfp8(
        block_scaling.dequantize_blocks(data, scale), fp8_dtype
    )
    # q(dq(q(x))) == q(x), bytes and all, except where a block's largest quantized magnitude is
    # exactly half the format's max: its amax then is itself a power of two times the max, so
    # the requantization picks half the scale and twice the data (the same values).
    half = ml_dtypes.finfo(fp8_dtype).max / 2
    peak = np.abs(np.asarray(data.astype(F32))).reshape(*scale.shape, 32).max(-1)
    same = peak != half
    assert same.mean() > 0.5
    np.testing.assert_array_equal(_bytes(again_scale)[same], _bytes(scale)[same])
    blocks = lambda d: _bytes(d).reshape(*scale.shape, 32)  # noqa: E731
    np.testing.assert_array_equal(blocks(again_data)[same], blocks(data)[same])
    np.testing.assert_array_equal(
        _bytes(again_scale)[~same].astype(int), _bytes(scale)[~same].astype(int) - 1
    )
    np.testing.assert_array_equal(
        block_scaling.dequantize_blocks(again_data, again_scale),
        block_scaling.dequantize_blocks(data, scale),
    )


def test_nvfp4_requantizing_is_idempotent():
    x = normal(jax.random.key(0), (64, 128), scale=3.0)
    quantizer = NVFP4Quantizer()
    operand = quantizer.quantize(x, 1, (TRAILING,))[0].trailing
    again = quantizer.quantize(operand.dequantize(), 1, (TRAILING,))[0].trailing
    assert float(again.tensor_scale_inv) == float(operand.tensor_scale_inv)
    np.testing.assert_array_equal(_bytes(again.scale_inv), _bytes(operand.scale_inv))
    np.testing.assert_array_equal(_bytes(again.data), _bytes(operand.data))


def test_stochastic_rounding_is_unbiased_between_neighbouring_e2m1_values():
    values = jnp.array([0.2, 0.75, 1.2, 2.5, 3.3, 4.5, 5.9, -0.3, -4.8, 6.0, 0.0], F32)
    draws = 4000
    y = jnp.broadcast_to(values, (draws, values.size))
    rounded = jax.jit(block_scaling.stochastic_round_e2m1)(y, jax.random.key(0))
    grid = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6])
    below = np.array([grid[grid <= abs(v)].max() for v in np.asarray(values)])
    above = np.array([grid[grid >= abs(v)].min() for v in np.asarray(values)])
    magnitudes = np.abs(np.asarray(rounded))
    assert np.all((magnitudes == below) | (magnitudes == above))
    assert np.all(np.sign(np.asarray(rounded)) * np.sign(np.asarray(values)) >= 0)
    # Mean within 4 standard errors of the exact value.
    spread = (above - below) / 2 / np.sqrt(draws)
    np.testing.assert_array_less(np.abs(np.asarray(rounded).mean(0) - values), 4 * spread + 1e-7)
    # Exactly representable values never move; the key decides the draw.
    assert np.all(np.asarray(rounded[:, -2:]) == np.asarray(values[-2:]))
    again = block_scaling.stochastic_round_e2m1(y, jax.random.key(0))
    np.testing.assert_array_equal(again, rounded)


def test_each_use_is_quantized_from_high_precision_along_its_contraction():
    x = normal(jax.random.key(1), (4, 8, 64))  # [tokens (4, 8), features 64]
    operand, _ = BlockScaleQuantizer().quantize(x, 2, (TRAILING, LEADING))
    rows = np.asarray(x).reshape(32, 64)
    np.testing.assert_array_equal(
        np.asarray(operand.trailing.dequantize()), np_fake_quant(rows, MXFP8).astype(np.float32)
    )
    np.testing.assert_array_equal(
        np.asarray(operand.leading.dequantize()), np_fake_quant(rows.T, MXFP8).astype(np.float32)
    )
    assert operand.trailing.row_shape == (4, 8) and operand.leading.row_shape == (64,)
    assert operand.keep(LEADING).trailing is None


# ----------------------------------------------------------------------------- ops


def _dense_case(seed=0, tokens=(4, 16), hidden=64, features=96):
    keys = jax.random.split(jax.random.key(seed), 4)
    x = normal(keys[0], (*tokens, hidden), scale=2.0)
    kernel = normal(keys[1], (hidden, features), scale=hidden**-0.5)
    bias = normal(keys[2], (features,), scale=0.1)
    cotangent = normal(keys[3], (*tokens, features))
    return x, kernel, bias, cotangent


@pytest.mark.parametrize("name", ["mxfp8", "mxfp8_hybrid", "nvfp4"])
def test_dense_matches_numpy_fake_quantization_in_every_gemm(name):
    recipe = RECIPES[name]
    x, kernel, bias, cotangent = _dense_case()
    quantizer_set = QuantizerFactory.create_set(fp8_recipe=recipe)
    f = lambda x, k, b: dense(x, k, b, quantizer_set=quantizer_set)  # noqa: E731
    out, vjp = jax.vjp(jax.jit(f), x, kernel, bias)
    d_x, d_kernel, d_bias = vjp(cotangent)
    x2, g2 = np.asarray(x).reshape(64, 64), np.asarray(cotangent).reshape(64, 96)
    k2 = np.asarray(kernel)
    q = lambda m: np_fake_quant(m, recipe)  # noqa: E731
    if isinstance(recipe, MXFP8BlockScaling):  # gradients in the format's backward dtype

        def grad_quant(m):
            data, scale_bytes = np_mxfp8(m, recipe.fp8_format.backward_dtype)
            return np_dequantize(data, np.exp2(scale_bytes.astype(np.float64) - 127))
    else:
        grad_quant = q
    # Forward: x along the hidden axis, the kernel along its input axis.
    expected_out = q(x2) @ q(k2.T).T + np.asarray(bias)
    # dgrad: the gradient and the kernel along the features; wgrad: x and the gradient along
    # the tokens. Each is a quantization of its own from high precision.
    expected_d_x = grad_quant(g2) @ q(k2).T
    expected_d_kernel = q(x2.T) @ grad_quant(g2.T).T
    for got, expected in (
        (out, expected_out),
        (d_x, expected_d_x),
        (d_kernel, expected_d_kernel),
    ):
        assert relative_error(np.asarray(got).reshape(expected.shape), expected) < (
            FAKE_QUANT_TOLERANCE
        )
    np.testing.assert_allclose(d_bias, np.asarray(cotangent).sum((0, 1)), rtol=1e-5, atol=1e-5)


def _unquantized_errors(f, args, quantizer_sets, cotangent):
    def run(sets):
        out, vjp = jax.vjp(jax.jit(lambda *a: f(*a, sets)), *args)
        return out, vjp(cotangent)

    out, grads = run(quantizer_sets)
    reference_out, reference_grads = run(None)
    return relative_error(out, reference_out), [
        relative_error(g, r) for g, r in zip(grads, reference_grads, strict=True)
    ]


def _sets(recipe, n=1):
    return QuantizerFactory.create_set(n, fp8_recipe=recipe, sr_key=SR_KEY)


def _mlp(activation_type):
    def f(x, gamma, beta, kernel_1, kernel_2, sets):
        sets = sets if sets is not None else (None, None)
        sets = tuple(QuantizerSet() if s is None else s for s in sets)
        return layernorm_mlp(
            x,
            gamma,
            beta,
            [kernel_1, kernel_2],
            [None, None],
            "layernorm",
            activation_type=activation_type,
            quantizer_sets=sets,
        )

    return f


@pytest.mark.parametrize("name", ["mxfp8", "mxfp8_hybrid", "nvfp4", "nvfp4_sr"])
@pytest.mark.parametrize("op", ["dense", "layernorm_dense", "gelu_mlp", "swiglu_mlp"])
def test_ops_match_the_unquantized_reference_at_the_formats_tolerance(op, name):
    recipe = NVFP4_SR if name == "nvfp4_sr" else RECIPES[name]
    base = name[:5]
    x, kernel, bias, cotangent = _dense_case()
    keys = jax.random.split(jax.random.key(5), 3)
    gamma = 1 + normal(keys[0], (64,), scale=0.1)
    beta = normal(keys[1], (64,), scale=0.1)
    if op == "dense":
        f = lambda x, k, b, qs: dense(x, k, b, quantizer_set=qs or QuantizerSet())  # noqa: E731
        args, sets = (x, kernel, bias), _sets(recipe)
    elif op == "layernorm_dense":

        def f(x, k, g, b, qs):
            return layernorm_dense(x, k, g, b, quantizer_set=qs or QuantizerSet())

        args, sets = (x, kernel, gamma, beta), _sets(recipe)
    else:
        activation = ("gelu",) if op == "gelu_mlp" else ("silu", "linear")
        kernel_1 = normal(keys[2], (64, len(activation), 128), scale=64**-0.5)
        kernel_2 = normal(keys[0], (128, 64), scale=128**-0.5)
        f, args, sets = _mlp(activation), (x, gamma, beta, kernel_1, kernel_2), _sets(recipe, 2)
        cotangent = normal(keys[1], x.shape)
    forward_error, backward_errors = _unquantized_errors(f, args, sets, cotangent)
    assert forward_error < BLOCK_FORWARD_TOLERANCE[base], forward_error
    assert max(backward_errors) < BLOCK_BACKWARD_TOLERANCE[base], backward_errors
    # Quantization really happened: the results are not the unquantized ones.
    assert forward_error > 1e-3


def test_layernorm_fake_quantizes_its_output_in_blocks_along_the_hidden_axis():
    x = normal(jax.random.key(2), (32, 64), scale=3.0)
    gamma, beta = jnp.ones(64), jnp.zeros(64)
    out = layernorm(x, gamma, beta, quantizer=BlockScaleQuantizer())
    expected = np_fake_quant(np.asarray(reference_norm(x, gamma, beta)), MXFP8)
    assert relative_error(out, expected) < 1e-3  # the norm's float32 rounding may flip a value
    grad = jax.grad(lambda x: jnp.sum(layernorm(x, gamma, beta, quantizer=NVFP4Quantizer())))(x)
    reference = jax.grad(lambda x: jnp.sum(layernorm(x, gamma, beta)))(x)
    np.testing.assert_array_equal(grad, reference)  # straight through


@pytest.mark.parametrize("recipe", [MXFP8, NVFP4], ids=["mxfp8", "nvfp4"])
def test_saved_residuals_are_the_quantized_backward_layouts(recipe):
    x, kernel, bias, _ = _dense_case()
    qs = _sets(recipe)
    _, vjp = jax.vjp(lambda x, k, b: dense(x, k, b, quantizer_set=qs), x, kernel, bias)
    dtypes = {jnp.dtype(leaf.dtype) for leaf in jax.tree.leaves(vjp) if leaf.size > 64}
    # Nothing of x's or the kernel's size is kept in high precision.
    assert jnp.dtype(F32) not in dtypes, dtypes


def test_inference_needs_no_blocked_token_count_but_training_does():
    x, kernel, bias, _ = _dense_case(tokens=(5, 4))  # 20 tokens
    qs = _sets(MXFP8)
    out = jax.jit(lambda x: dense(x, kernel, bias, quantizer_set=qs))(x)
    assert relative_error(out, reference_dense(x, kernel, bias)) < BLOCK_FORWARD_TOLERANCE["mxfp8"]
    with pytest.raises(ValueError, match=r"leading axes \(5, 4\) \(20 elements\).*tokens"):
        jax.grad(lambda x: jnp.sum(dense(x, kernel, bias, quantizer_set=qs)))(x)


@pytest.mark.parametrize(
    ("recipe", "hidden", "block"), [(MXFP8, 48, 32), (NVFP4, 40, 16)], ids=["mxfp8", "nvfp4"]
)
def test_a_contraction_that_cannot_be_blocked_is_refused(recipe, hidden, block):
    x = jnp.ones((32, hidden))
    with pytest.raises(ValueError, match=f"blocks of {block} .*not a multiple of {block}"):
        dense(x, jnp.ones((hidden, 64)), quantizer_set=_sets(recipe))
    with pytest.raises(ValueError, match=f"blocks of {block}"):
        layernorm_dense(
            x, jnp.ones((hidden, 64)), jnp.ones(hidden), None, norm_type="rmsnorm",
            quantizer_set=_sets(recipe),
        )  # fmt: skip


def test_stochastic_rounding_follows_its_key():
    x, kernel, bias, cotangent = _dense_case()

    def grads(key):
        qs = QuantizerFactory.create_set(fp8_recipe=NVFP4_SR, sr_key=key)
        _, vjp = jax.vjp(lambda x, k: dense(x, k, bias, quantizer_set=qs), x, kernel)
        return vjp(cotangent)

    first, again, other = (grads(jax.random.key(seed)) for seed in (1, 1, 2))
    jax.tree.map(np.testing.assert_array_equal, first, again)
    assert not np.array_equal(first[0], other[0])
    # The forward rounds to nearest: the key only changes the backward.
    qs = [
        QuantizerFactory.create_set(fp8_recipe=NVFP4_SR, sr_key=jax.random.key(seed))
        for seed in (1, 2)
    ]
    np.testing.assert_array_equal(
        dense(x, kernel, bias, quantizer_set=qs[0]), dense(x, kernel, bias, quantizer_set=qs[1])
    )
    # The set's gradient through jax.grad: no gradient for the key.
    key_grad = jax.grad(
        lambda qs: jnp.sum(dense(x, kernel, bias, quantizer_set=qs)), allow_int=True
    )(qs[0]).dgrad.key
    assert key_grad.dtype == jax.dtypes.float0


def test_layernorm_dense_with_norm_output_under_mxfp8():
    x, kernel, _, _ = _dense_case()
    gamma, beta = jnp.ones(64), jnp.zeros(64)
    out, ln = layernorm_dense_with_norm_output(x, kernel, gamma, beta, quantizer_set=_sets(MXFP8))
    np.testing.assert_allclose(ln, reference_norm(x, gamma, beta), rtol=1e-5, atol=1e-5)
    unquantized = layernorm_dense(x, kernel, gamma, beta)
    assert relative_error(out, unquantized) < BLOCK_FORWARD_TOLERANCE["mxfp8"]


# ----------------------------------------------------------------------------- errors


def test_recipe_arguments_are_checked():
    with pytest.raises(ValueError, match="E5M2"):
        MXFP8BlockScaling(fp8_format=Format.E5M2)
    with pytest.raises(ValueError, match="float4"):
        MXFP8BlockScaling(fp8_format=Format.E2M1)
    with pytest.raises(TypeError, match="Format"):
        MXFP8BlockScaling(fp8_format="e4m3")
    with pytest.raises(ValueError, match="E2M1"):
        NVFP4BlockScaling(fp4_format=Format.E4M3)
    with pytest.raises(TypeError, match="bool"):
        NVFP4BlockScaling(disable_stochastic_rounding=1)


def test_stochastic_rounding_without_a_key_rounds_to_nearest_and_says_so_once(monkeypatch):
    # TransformerEngine's result: a set made without an RNG state rounds to nearest.
    monkeypatch.setattr(factory, "_WARNED_NO_KEY", [])
    with pytest.warns(UserWarning, match=r"without an RNG key.*round to nearest"):
        qs = QuantizerFactory.create_set(fp8_recipe=NVFP4_SR)
    assert qs.dgrad.key is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process
        assert QuantizerFactory.create_set(fp8_recipe=NVFP4_SR).dgrad.key is None


def _nvfp4_set_with_te_state(state):
    """An NVFP4 set made as TransformerEngine's modules make one: the gradient's RNG state
    in its QuantizeMeta."""
    meta = QuantizeMetaSet(
        x=QuantizeMeta(),
        kernel=QuantizeMeta(),
        grad=QuantizeMeta(stochastic_rounding_rng_state=state),
    )
    return QuantizerFactory.create_set(fp8_recipe=NVFP4_SR, quantize_meta_set=meta)


def test_transformer_engines_rng_state_is_the_stochastic_rounding_key():
    state = jnp.array([1, 2, 3, 4], jnp.uint32)
    first, again = _nvfp4_set_with_te_state(state), _nvfp4_set_with_te_state(state)
    other = _nvfp4_set_with_te_state(state + 1)
    data = [jax.random.key_data(qs.dgrad.key) for qs in (first, again, other)]
    np.testing.assert_array_equal(data[0], data[1])
    assert not np.array_equal(data[0], data[2])


def test_a_set_mixing_block_and_tensor_scaling_is_refused():
    mixed = QuantizerSet(BlockScaleQuantizer(), CurrentScaleQuantizer(), BlockScaleQuantizer())
    with pytest.raises(ValueError, match="mixes block-scaled and per-tensor"):
        dense(jnp.ones((32, 64)), jnp.ones((64, 32)), quantizer_set=mixed)
    with pytest.raises(ValueError, match="float4_e2m1fn"):
        dense(
            jnp.ones((32, 64)),
            jnp.ones((64, 32)),
            quantizer_set=QuantizerSet(
                NVFP4Quantizer(q_dtype=jnp.float8_e4m3fn), NVFP4Quantizer(), NVFP4Quantizer()
            ),
        )
