"""``layernorm``: forward and gradients against the reference, FP8 output, input checks."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from te_flax.layernorm import layernorm
from te_flax.quantize import (
    CurrentScaleQuantizer,
    DelayedScaleQuantizer,
    DelayedScaling,
    Float8CurrentScaling,
    QuantizerFactory,
    merge_by_max,
)
from tests import helpers

F32, BF16 = jnp.float32, jnp.bfloat16
E4M3 = jnp.float8_e4m3fn


def _inputs(shape, dtype, norm_type, seed=0):
    """x in ``dtype``; gamma and beta in float32 (beta None for rmsnorm); a cotangent."""
    keys = jax.random.split(jax.random.key(seed), 4)
    hidden = shape[-1]
    x = helpers.normal(keys[0], shape, dtype, scale=2.0)
    gamma = 1.0 + helpers.normal(keys[1], (hidden,), F32, scale=0.1)
    beta = helpers.normal(keys[2], (hidden,), F32, scale=0.1) if norm_type == "layernorm" else None
    cotangent = helpers.normal(keys[3], shape, dtype)
    return x, gamma, beta, cotangent


def _loss(norm, cotangent):
    """``sum(norm(x, gamma, beta) * cotangent)`` in float32, for jax.grad."""

    def loss(x, gamma, beta):
        out = norm(x, gamma, beta)
        return jnp.sum((out * cotangent.astype(out.dtype)).astype(F32))

    return loss


def _grads(norm, x, gamma, beta, cotangent):
    argnums = (0, 1) if beta is None else (0, 1, 2)
    return jax.grad(_loss(norm, cotangent), argnums=argnums)(x, gamma, beta)


def _rmsnorm(x, gamma, beta):
    return layernorm(x, gamma, beta, "rmsnorm")


def _delayed_quantizer(scale_inv=0.01, history=(3.0, 1.0, 0.5, 0.0)):
    quantizer = QuantizerFactory.create_set(
        fp8_recipe=DelayedScaling(amax_history_len=len(history))
    ).x
    assert isinstance(quantizer, DelayedScaleQuantizer)
    return dataclasses.replace(
        quantizer,
        scale_inv=jnp.array([scale_inv], F32),
        amax_history=jnp.array(history, F32),
    )


# ----------------------------------------------------------------------------- vs the reference


@pytest.mark.parametrize("shape", [(4, 16), (2, 3, 16)])
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("zero_centered_gamma", [False, True])
@pytest.mark.parametrize("norm_type", ["layernorm", "rmsnorm"])
def test_forward_and_gradients_match_reference(norm_type, zero_centered_gamma, dtype, shape):
    x, gamma, beta, cotangent = _inputs(shape, dtype, norm_type)
    if zero_centered_gamma:
        gamma = gamma - 1.0
    options = {"norm_type": norm_type, "zero_centered_gamma": zero_centered_gamma}

    def norm(x, gamma, beta):
        return layernorm(x, gamma, beta, **options)

    def reference(x, gamma, beta):
        return helpers.reference_norm(x, gamma, beta, **options)

    out = norm(x, gamma, beta)
    assert out.dtype == x.dtype and out.shape == x.shape
    tol = helpers.tolerance(dtype)
    helpers.assert_close(out, reference(x, gamma, beta), tol, "out")

    grads = _grads(norm, x, gamma, beta, cotangent)
    expected = _grads(reference, x, gamma, beta, cotangent)
    assert [g.dtype for g in grads] == [x.dtype, gamma.dtype] + ([] if beta is None else [F32])
    # d_x is rounded to x's dtype; gamma's and beta's gradients are float32 sums of exact terms.
    helpers.assert_close(grads[0], expected[0], tol, "d_x")
    for name, actual, wanted in zip(("d_gamma", "d_beta"), grads[1:], expected[1:], strict=False):
        helpers.assert_close(actual, wanted, helpers.tolerance(F32) * 4, name)


@pytest.mark.parametrize("norm_type", ["layernorm", "rmsnorm"])
def test_epsilon_enters_as_in_the_reference(norm_type):
    # Small-variance rows, where an epsilon of 0.01 changes the result by a lot.
    x, gamma, beta, cotangent = _inputs((4, 16), F32, norm_type)
    x = 0.1 * x

    def norm(x, gamma, beta):
        return layernorm(x, gamma, beta, norm_type, epsilon=1e-2)

    def reference(x, gamma, beta):
        return helpers.reference_norm(x, gamma, beta, norm_type, eps=1e-2)

    tol = helpers.tolerance(F32)
    out = norm(x, gamma, beta)
    helpers.assert_close(out, reference(x, gamma, beta), tol)
    assert helpers.relative_error(out, layernorm(x, gamma, beta, norm_type)) > 0.05
    grads = _grads(norm, x, gamma, beta, cotangent)
    expected = _grads(reference, x, gamma, beta, cotangent)
    helpers.assert_tree_close(grads, expected, tol * 4)


@pytest.mark.parametrize("zero_centered_gamma", [False, True])
@pytest.mark.parametrize("norm_type", ["layernorm", "rmsnorm"])
def test_check_grads_reverse_mode(norm_type, zero_centered_gamma):
    x, gamma, beta, _ = _inputs((3, 8), F32, norm_type, seed=1)

    def norm(*args):
        beta_arg = args[2] if len(args) == 3 else None
        return layernorm(args[0], args[1], beta_arg, norm_type, zero_centered_gamma)

    args = (x, gamma) if beta is None else (x, gamma, beta)
    check_grads(norm, args, order=1, modes=["rev"], atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype", [F32, BF16, jnp.float16])
def test_output_dtype_is_x_dtype_whatever_gamma_dtype(dtype):
    x = jnp.ones((2, 8), dtype)
    assert layernorm(x, jnp.ones(8, BF16), jnp.zeros(8, F32)).dtype == dtype
    assert layernorm(x, jnp.ones(8, F32), None, "rmsnorm").dtype == dtype


@pytest.mark.parametrize("norm_type", ["layernorm", "rmsnorm"])
def test_jit_matches_eager(norm_type):
    x, gamma, beta, _ = _inputs((2, 3, 16), BF16, norm_type)
    eager = layernorm(x, gamma, beta, norm_type)
    jitted = jax.jit(layernorm, static_argnums=(3,))(x, gamma, beta, norm_type)
    helpers.assert_close(jitted, eager, helpers.tolerance(BF16))


# ----------------------------------------------------------------------------- numerics


def test_large_offset_input_is_accurate_in_float32():
    # mean 1000, std 1: E[x^2] - E[x]^2 in float32 would lose the variance entirely; the
    # two-pass variance keeps it.
    key_x, key_gamma = jax.random.split(jax.random.key(2))
    x = 1000.0 + jax.random.normal(key_x, (8, 256), F32)
    gamma = 1.0 + 0.1 * jax.random.normal(key_gamma, (256,), F32)
    beta = jnp.zeros(256, F32)
    out = layernorm(x, gamma, beta)

    x64 = np.asarray(x, np.float64)
    centered = x64 - x64.mean(-1, keepdims=True)
    expected = centered / np.sqrt(np.mean(centered**2, -1, keepdims=True) + 1e-6)
    expected = expected * np.asarray(gamma, np.float64)
    np.testing.assert_allclose(np.asarray(out, np.float64), expected, atol=1e-3)

    # The gradient stays as accurate: compare with the reference computed at zero offset.
    cotangent = jax.random.normal(jax.random.key(3), x.shape, F32)
    grads = _grads(layernorm, x, gamma, beta, cotangent)
    shifted = x - jnp.mean(x, -1, keepdims=True)
    expected_grads = _grads(helpers.reference_norm, shifted, gamma, beta, cotangent)
    helpers.assert_tree_close(grads, expected_grads, 1e-3)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_constant_row_gives_beta_and_finite_gradients(dtype):
    # A constant row has zero variance: only epsilon keeps 1/sigma finite.
    x = jnp.stack([jnp.full((16,), 3.0), jnp.linspace(-1.0, 1.0, 16)]).astype(dtype)
    gamma = jnp.linspace(0.5, 1.5, 16, dtype=F32)
    beta = jnp.linspace(-0.2, 0.2, 16, dtype=F32)
    out = layernorm(x, gamma, beta)
    np.testing.assert_allclose(np.asarray(out[0], np.float32), beta.astype(dtype), atol=0)
    cotangent = jnp.ones_like(x).at[:, ::2].set(-0.5)
    grads = _grads(layernorm, x, gamma, beta, cotangent)
    for grad in grads:
        assert bool(jnp.all(jnp.isfinite(grad.astype(F32))))


def test_zero_row_rmsnorm_gives_zero_and_finite_gradients():
    x = jnp.zeros((2, 16), F32).at[1].set(1.0)
    gamma = jnp.ones(16, F32)
    out = layernorm(x, gamma, None, "rmsnorm")
    np.testing.assert_array_equal(out[0], np.zeros(16))
    grads = _grads(_rmsnorm, x, gamma, None, jnp.ones_like(x))
    assert all(bool(jnp.all(jnp.isfinite(grad))) for grad in grads)


# ----------------------------------------------------------------------------- norm_type spellings


@pytest.mark.parametrize(
    ("spelling", "canonical"),
    [
        ("LayerNorm", "layernorm"),
        ("layer_norm", "layernorm"),
        ("LAYERNORM", "layernorm"),
        ("layer-norm", "layernorm"),
        ("RMSNorm", "rmsnorm"),
        ("rms_norm", "rmsnorm"),
        ("RmsNorm", "rmsnorm"),
    ],
)
def test_transformer_engine_norm_type_spellings(spelling, canonical):
    x, gamma, beta, cotangent = _inputs((2, 3, 16), F32, canonical)

    def norm_as(norm_type):
        return lambda x, gamma, beta: layernorm(x, gamma, beta, norm_type)

    np.testing.assert_array_equal(
        norm_as(spelling)(x, gamma, beta), norm_as(canonical)(x, gamma, beta)
    )
    jax.tree.map(
        np.testing.assert_array_equal,
        _grads(norm_as(spelling), x, gamma, beta, cotangent),
        _grads(norm_as(canonical), x, gamma, beta, cotangent),
    )


# ----------------------------------------------------------------------------- with a quantizer


@pytest.mark.parametrize("norm_type", ["layernorm", "rmsnorm"])
def test_delayed_quantizer_fake_quantizes_with_the_stored_scale(norm_type):
    x, gamma, beta, _ = _inputs((4, 16), F32, norm_type)
    quantizer = _delayed_quantizer(scale_inv=0.01)
    unquantized = layernorm(x, gamma, beta, norm_type)
    out = layernorm(x, gamma, beta, norm_type, quantizer=quantizer)
    assert out.dtype == x.dtype
    np.testing.assert_array_equal(out, helpers.fake_quant(unquantized, 0.01, E4M3))
    # The FP8 output is still the norm output, up to e4m3 rounding.
    assert helpers.relative_error(out, unquantized) < helpers.FP8_FORWARD_TOLERANCE


@pytest.mark.parametrize("norm_type", ["layernorm", "rmsnorm"])
def test_current_quantizer_fake_quantizes_with_the_outputs_amax(norm_type):
    x, gamma, beta, _ = _inputs((2, 3, 16), F32, norm_type)
    quantizer = QuantizerFactory.create_set(fp8_recipe=Float8CurrentScaling()).x
    assert isinstance(quantizer, CurrentScaleQuantizer)
    unquantized = layernorm(x, gamma, beta, norm_type)
    out = layernorm(x, gamma, beta, norm_type, quantizer=quantizer)
    scale_inv = helpers.current_scale(unquantized, E4M3)
    # The scale may differ from amax / 448 in its last bit (a multiply by 1 / 448).
    np.testing.assert_allclose(out, helpers.fake_quant(unquantized, scale_inv, E4M3), rtol=1e-6)
    # The largest element lands exactly on the format's maximum.
    np.testing.assert_allclose(jnp.max(jnp.abs(out)), helpers.amax_of(unquantized), rtol=1e-6)


def test_quantized_bfloat16_output_is_the_fake_quant_in_bfloat16():
    x, gamma, beta, _ = _inputs((4, 16), BF16, "layernorm")
    quantizer = _delayed_quantizer(scale_inv=0.02)
    unquantized = layernorm(x.astype(F32), gamma, beta)
    out = layernorm(x, gamma, beta, quantizer=quantizer)
    assert out.dtype == BF16
    expected = helpers.fake_quant(unquantized, 0.02, E4M3).astype(BF16)
    np.testing.assert_array_equal(out.astype(F32), expected.astype(F32))


@pytest.mark.parametrize("recipe", [DelayedScaling(amax_history_len=4), Float8CurrentScaling()])
@pytest.mark.parametrize("norm_type", ["layernorm", "rmsnorm"])
def test_gradient_passes_straight_through_the_quantization(norm_type, recipe):
    x, gamma, beta, cotangent = _inputs((2, 3, 16), F32, norm_type)
    quantizer = QuantizerFactory.create_set(fp8_recipe=recipe).x

    def quantized(x, gamma, beta):
        return layernorm(x, gamma, beta, norm_type, quantizer=quantizer)

    def plain(x, gamma, beta):
        return layernorm(x, gamma, beta, norm_type)

    grads = _grads(quantized, x, gamma, beta, cotangent)
    expected = _grads(plain, x, gamma, beta, cotangent)
    np.testing.assert_array_equal(grads[0], expected[0])
    # gamma and beta see the same incoming gradient, so their gradients are unchanged too.
    jax.tree.map(np.testing.assert_array_equal, grads[1:], expected[1:])


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("norm_type", ["layernorm", "rmsnorm"])
def test_gradient_of_delayed_quantizer_is_its_new_state(norm_type, jit):
    x, gamma, beta, cotangent = _inputs((4, 16), F32, norm_type)
    history = (3.0, 1.0, 0.5, 0.0)
    quantizer = _delayed_quantizer(scale_inv=0.01, history=history)

    def loss(quantizer):
        out = layernorm(x, gamma, beta, norm_type, quantizer=quantizer)
        return jnp.sum(out * cotangent)

    grad_fn = jax.jit(jax.grad(loss)) if jit else jax.grad(loss)
    new_state = grad_fn(quantizer)
    assert isinstance(new_state, DelayedScaleQuantizer)
    assert new_state.q_dtype == quantizer.q_dtype
    amax = helpers.amax_of(helpers.reference_norm(x, gamma, beta, norm_type))
    np.testing.assert_allclose(new_state.amax_history[0], amax, rtol=1e-5)
    np.testing.assert_array_equal(new_state.amax_history[1:], history[:-1])
    expected_scale_inv = jnp.max(new_state.amax_history) / 448.0
    np.testing.assert_allclose(new_state.scale_inv, [expected_scale_inv], rtol=1e-6)
    assert new_state.scale_inv.shape == (1,) and new_state.scale_inv.dtype == F32


def test_reused_delayed_quantizer_merges_its_updates_by_max():
    x, gamma, beta, _ = _inputs((4, 16), F32, "layernorm")
    quantizer = _delayed_quantizer(scale_inv=0.01, history=(0.5, 0.25, 0.0))
    small_gamma = 0.5 * gamma

    def loss(quantizer):
        quantizer = merge_by_max(quantizer)
        small = layernorm(x, small_gamma, beta, quantizer=quantizer)
        large = layernorm(x, gamma, beta, quantizer=quantizer)
        return jnp.sum(small) + jnp.sum(large)

    new_state = jax.jit(jax.grad(loss))(quantizer)
    amax = jnp.maximum(
        helpers.amax_of(helpers.reference_norm(x, small_gamma, beta)),
        helpers.amax_of(helpers.reference_norm(x, gamma, beta)),
    )
    np.testing.assert_allclose(new_state.amax_history, [amax, 0.5, 0.25], rtol=1e-5)
    np.testing.assert_allclose(new_state.scale_inv, [amax / 448.0], rtol=1e-5)


def test_gradient_of_current_quantizer_is_the_stateless_quantizer():
    x, gamma, beta, cotangent = _inputs((4, 16), F32, "layernorm")
    quantizer = QuantizerFactory.create_set(fp8_recipe=Float8CurrentScaling()).x

    def loss(x, quantizer):
        return jnp.sum(layernorm(x, gamma, beta, quantizer=quantizer) * cotangent)

    _, new_state = jax.grad(loss, argnums=(0, 1))(x, quantizer)
    assert new_state == quantizer


# ----------------------------------------------------------------------------- input checks


def _valid():
    return jnp.ones((2, 8), F32), jnp.ones(8, F32), jnp.zeros(8, F32)


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.bool_])
def test_non_floating_or_float8_x_is_refused(dtype):
    x, gamma, beta = _valid()
    with pytest.raises(TypeError, match=r"^x (must be a floating-point array|has dtype)"):
        layernorm(x.astype(dtype), gamma, beta)


def test_python_list_x_is_refused():
    _, gamma, beta = _valid()
    with pytest.raises(TypeError, match="x must be a floating-point array"):
        layernorm([[1.0] * 8], gamma, beta)


def test_scalar_x_is_refused():
    with pytest.raises(ValueError, match="at least one axis"):
        layernorm(jnp.float32(1.0), jnp.ones(1), jnp.zeros(1))


@pytest.mark.parametrize("shape", [(4,), (8, 1), (1, 8), ()])
def test_gamma_of_the_wrong_shape_is_refused(shape):
    x, _, beta = _valid()
    with pytest.raises(ValueError, match=r"gamma has shape .* but must be \(8,\)"):
        layernorm(x, jnp.ones(shape), beta)


def test_beta_of_the_wrong_shape_is_refused():
    x, gamma, _ = _valid()
    with pytest.raises(ValueError, match=r"beta has shape \(4,\) but must be \(8,\)"):
        layernorm(x, gamma, jnp.zeros(4))


def test_integer_gamma_is_refused():
    x, _, beta = _valid()
    with pytest.raises(TypeError, match="gamma must be a floating-point array"):
        layernorm(x, jnp.ones(8, jnp.int32), beta)


def test_beta_for_rmsnorm_is_refused():
    x, gamma, beta = _valid()
    with pytest.raises(ValueError, match="beta must be None for rmsnorm"):
        layernorm(x, gamma, beta, "rmsnorm")


def test_missing_beta_for_layernorm_is_refused():
    x, gamma, _ = _valid()
    with pytest.raises(ValueError, match=r"beta is None but layernorm needs a shift"):
        layernorm(x, gamma, None)
    with pytest.raises(ValueError, match="beta is None"):
        layernorm(x, gamma, None, "layernorm")


@pytest.mark.parametrize("norm_type", ["batchnorm", "", "rms", None, 1])
def test_unknown_norm_type_is_refused(norm_type):
    x, gamma, beta = _valid()
    with pytest.raises(ValueError, match='norm_type must be "layernorm" or "rmsnorm"'):
        layernorm(x, gamma, beta, norm_type)


@pytest.mark.parametrize("epsilon", [0.0, -1e-6, float("nan"), float("inf"), True, "1e-6", None])
def test_bad_epsilon_is_refused(epsilon):
    x, gamma, beta = _valid()
    with pytest.raises(ValueError, match="epsilon must be a positive finite number"):
        layernorm(x, gamma, beta, epsilon=epsilon)


@pytest.mark.parametrize("flag", [1, 0, "yes", None])
def test_non_bool_zero_centered_gamma_is_refused(flag):
    x, gamma, beta = _valid()
    with pytest.raises(TypeError, match="zero_centered_gamma must be a bool"):
        layernorm(x, gamma, beta, zero_centered_gamma=flag)


def test_quantizer_set_in_place_of_a_quantizer_is_refused():
    x, gamma, beta = _valid()
    quantizer_set = QuantizerFactory.create_set(fp8_recipe=DelayedScaling())
    with pytest.raises(TypeError, match="quantizer must be a DelayedScaleQuantizer"):
        layernorm(x, gamma, beta, quantizer=quantizer_set)
    with pytest.raises(TypeError, match="quantizer must be a DelayedScaleQuantizer"):
        layernorm(x, gamma, beta, quantizer=DelayedScaling())


def test_quantizer_to_a_non_float8_dtype_is_refused():
    x, gamma, beta = _valid()
    with pytest.raises(ValueError, match="only float8_e4m3fn and float8_e5m2"):
        layernorm(x, gamma, beta, quantizer=CurrentScaleQuantizer(jnp.bfloat16))
