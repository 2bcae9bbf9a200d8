"""``te_flax.dense.dense``: unquantized and FP8 numerics, FP8 state updates, residuals, errors."""

from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType
from jax.test_util import check_grads

from te_flax.dense import dense
from te_flax.quantize import (
    CurrentScaleQuantizer,
    DelayedScaling,
    Float8CurrentScaling,
    Format,
    QuantizerFactory,
    QuantizerSet,
    merge_by_max,
    noop_quantizer_set,
    scaling,
)
from tests.helpers import (
    F32,
    FP8_BACKWARD_TOLERANCE,
    FP8_FORWARD_TOLERANCE,
    amax_of,
    assert_close,
    current_scale,
    grad_fake_quant,
    reference_dense,
    relative_error,
    straight_through_fake_quant,
    tolerance,
)

BF16 = jnp.bfloat16
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2

# Normwise error allowed against the fake-quant reference that uses the same scales: only the
# accumulation order and the rounding of the output dtype differ.
SAME_SCALES_TOLERANCE = 5e-3

# name: (x shape, kernel shape, contracting_dims)
SHAPES = {
    "matrix": ((8, 16), (16, 24), None),
    "two_features": ((2, 4, 16), (16, 3, 8), None),
    "two_contracting": ((2, 3, 4, 8), (4, 8, 5), ((2, 3), (0, 1))),
}

FORMATS = {"hybrid": Format.HYBRID, "e4m3": Format.E4M3}

# Per step: the magnitudes of x, the kernel and the output gradient. They shrink from step to
# step, so that quantizing with the previous step's scale never saturates.
STEP_MAGNITUDES = ((2.0, 1.0, 1.0), (1.0, 0.5, 0.5), (0.5, 0.25, 0.25))


def _n_contract(contracting_dims) -> int:
    return 1 if contracting_dims is None else len(contracting_dims[0])


def _out_shape(x_shape, kernel_shape, n_contract):
    return tuple(x_shape[: len(x_shape) - n_contract]) + tuple(kernel_shape[n_contract:])


def _normal(rng, shape, dtype, scale):
    # NumPy draws: jax.random would compile a sampler for every shape.
    return jnp.asarray(scale * rng.standard_normal(shape), F32).astype(dtype)


def _inputs(seed, shape_name, x_dtype=F32, param_dtype=F32, magnitudes=(1.0, 1.0, 1.0)):
    """x, kernel, bias and a cotangent for the output, and the number of contracted axes."""
    x_shape, kernel_shape, contracting_dims = SHAPES[shape_name]
    n = _n_contract(contracting_dims)
    x_scale, kernel_scale, grad_scale = magnitudes
    rng = np.random.default_rng(seed)
    x = _normal(rng, x_shape, x_dtype, x_scale)
    kernel = _normal(rng, kernel_shape, param_dtype, kernel_scale)
    bias = _normal(rng, kernel_shape[n:], param_dtype, 0.5)
    cotangent = _normal(rng, _out_shape(x_shape, kernel_shape, n), F32, grad_scale)
    return x, kernel, bias, cotangent, n


_STATIC = (
    "contracting_dims",
    "transpose_batch_sequence",
    "input_axes",
    "kernel_axes",
    "output_axes",
)


@functools.partial(jax.jit, static_argnames=_STATIC)
def _value_and_grads(
    x,
    kernel,
    bias,
    cotangent,
    quantizer_set,
    contracting_dims=None,
    transpose_batch_sequence=False,
    input_axes=None,
    kernel_axes=None,
    output_axes=None,
):
    def loss(x, kernel, bias, quantizer_set):
        out = dense(
            x,
            kernel,
            bias,
            contracting_dims=contracting_dims,
            transpose_batch_sequence=transpose_batch_sequence,
            input_axes=input_axes,
            kernel_axes=kernel_axes,
            output_axes=output_axes,
            quantizer_set=quantizer_set,
        )
        return jnp.sum(out.astype(F32) * cotangent), out

    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(
        x, kernel, bias, quantizer_set
    )
    return out, grads


def _run(x, kernel, bias, cotangent, quantizer_set=noop_quantizer_set, **kwargs):
    """dense's output and the gradients of ``sum(out * cotangent)`` w.r.t. all four inputs.

    The gradient w.r.t. ``quantizer_set`` is the new FP8 state.
    """
    return _value_and_grads(x, kernel, bias, cotangent, quantizer_set, **kwargs)


@functools.partial(jax.jit, static_argnums=4)
def _reference(x, kernel, bias, cotangent, n_contract):
    """The float32 output and gradients (x, kernel, bias) of the unquantized GEMM."""

    def forward(x, kernel, bias):
        return reference_dense(x, kernel, bias, n_contract)

    args = tuple(None if a is None else a.astype(F32) for a in (x, kernel, bias))
    out, vjp = jax.vjp(forward, *args)
    return out, vjp(cotangent.astype(F32))


@functools.partial(jax.jit, static_argnums=(4, 6))
def _fake_quant_reference(x, kernel, bias, grad, n_contract, scales, fmt):
    """Output and gradients of a float32 GEMM of fake-quantized operands, with fixed scales.

    x and the kernel are fake-quantized forward (straight through backward), the gradient of
    the GEMM's output backward; the bias is added after the GEMM, so its gradient is the
    unquantized one.
    """
    x_scale, kernel_scale, grad_scale = scales
    quantize_grad = grad_fake_quant(grad_scale, fmt.backward_dtype)

    def forward(x, kernel, bias):
        x = straight_through_fake_quant(x, x_scale, fmt.forward_dtype)
        kernel = straight_through_fake_quant(kernel, kernel_scale, fmt.forward_dtype)
        out = quantize_grad(reference_dense(x, kernel, None, n_contract))
        return out + jnp.broadcast_to(bias, out.shape)

    out, vjp = jax.vjp(forward, x.astype(F32), kernel.astype(F32), bias.astype(F32))
    return out, vjp(grad.astype(F32))


@functools.partial(jax.jit, static_argnums=(5, 6))
def _fp8_expectations(x, kernel, bias, cotangent, delayed_quantizers, n_contract, fmt):
    """The references for one FP8 step of dense, from the scales that step must use.

    ``delayed_quantizers`` is the (x, kernel, dgrad) state before the step, or None for current
    scaling, whose scales come from the tensors themselves.
    """
    grad = cotangent.astype(x.dtype)  # the output gradient dense's backward receives
    if delayed_quantizers is None:
        scales = (
            current_scale(x, fmt.forward_dtype),
            current_scale(kernel, fmt.forward_dtype),
            current_scale(grad, fmt.backward_dtype),
        )
    else:
        scales = tuple(quantizer.scale_inv[0] for quantizer in delayed_quantizers)
    return {
        "fake_quant": _fake_quant_reference(x, kernel, bias, grad, n_contract, scales, fmt),
        "unquantized": _reference(x, kernel, bias, grad, n_contract),
        "amax": {"x": amax_of(x), "kernel": amax_of(kernel), "dgrad": amax_of(grad)},
    }


def _delayed_set(fmt=Format.HYBRID, history=2, **recipe):
    recipe = DelayedScaling(fp8_format=fmt, amax_history_len=history, **recipe)
    return QuantizerFactory.create_set(fp8_recipe=recipe)


def _current_set(fmt=Format.HYBRID):
    return QuantizerFactory.create_set(fp8_recipe=Float8CurrentScaling(fp8_format=fmt))


_amax = jax.jit(amax_of)


def _all_finite(array) -> bool:
    return bool(np.all(np.isfinite(np.asarray(array, np.float32))))


def _assert_trees_equal(actual, expected):
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        assert a.dtype == e.dtype
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(e, np.float32))


# ----------------------------------------------------------------------------- no quantization


@pytest.mark.parametrize("x_dtype", [F32, BF16], ids=["x_f32", "x_bf16"])
@pytest.mark.parametrize("use_bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("shape_name", SHAPES)
def test_unquantized_matches_float32_reference(shape_name, use_bias, x_dtype):
    x, kernel, bias, cotangent, n = _inputs(0, shape_name, x_dtype)
    bias = bias if use_bias else None
    contracting_dims = SHAPES[shape_name][2]

    out, (d_x, d_kernel, d_bias, d_state) = _run(
        x, kernel, bias, cotangent, contracting_dims=contracting_dims
    )
    ref_out, (ref_x, ref_kernel, ref_bias) = _reference(x, kernel, bias, cotangent, n)

    tol = tolerance(x_dtype)
    assert out.dtype == x_dtype and d_x.dtype == x_dtype
    assert d_kernel.dtype == kernel.dtype
    assert_close(out, ref_out, tol, "out")
    assert_close(d_x, ref_x, tol, "d_x")
    assert_close(d_kernel, ref_kernel, tol, "d_kernel")
    if use_bias:
        assert d_bias.dtype == bias.dtype
        assert_close(d_bias, ref_bias, tol, "d_bias")
    else:
        assert d_bias is None
    assert d_state == noop_quantizer_set


@pytest.mark.parametrize(
    ("shape_name", "negative_dims"),
    [
        ("matrix", ((-1,), (0,))),
        ("two_features", ((-1,), (0,))),
        ("two_features", ((-1,), (-3,))),
        ("two_contracting", ((-2, -1), (0, 1))),
        ("two_contracting", ((-2, -1), (-3, -2))),
    ],
)
def test_negative_contracting_dims_equal_the_positive_ones(shape_name, negative_dims):
    x, kernel, bias, cotangent, _ = _inputs(1, shape_name)
    default = SHAPES[shape_name][2]
    out, grads = _run(x, kernel, bias, cotangent, contracting_dims=default)
    out_negative, grads_negative = _run(x, kernel, bias, cotangent, contracting_dims=negative_dims)
    _assert_trees_equal((out_negative, grads_negative), (out, grads))


def test_explicit_last_axis_contraction_equals_the_default():
    x, kernel, bias, cotangent, _ = _inputs(2, "two_features")
    out, grads = _run(x, kernel, bias, cotangent)
    out_explicit, grads_explicit = _run(x, kernel, bias, cotangent, contracting_dims=((2,), (0,)))
    _assert_trees_equal((out_explicit, grads_explicit), (out, grads))


@pytest.mark.parametrize(
    ("fp8", "x_dtype", "param_dtype"),
    [
        *((False, x, p) for x, p in [(BF16, BF16), (F32, BF16), (jnp.float16, F32)]),
        *((True, x, p) for x, p in [(BF16, F32), (BF16, BF16), (F32, BF16), (jnp.float16, F32)]),
    ],
    ids=[
        *(f"unquantized-{x}_{p}" for x, p in [("bf16", "bf16"), ("f32", "bf16"), ("f16", "f32")]),
        *(
            f"fp8-{x}_{p}"
            for x, p in [("bf16", "f32"), ("bf16", "bf16"), ("f32", "bf16"), ("f16", "f32")]
        ),
    ],
)
def test_output_and_gradient_dtypes(fp8, x_dtype, param_dtype):
    x, kernel, bias, cotangent, _ = _inputs(3, "matrix", x_dtype, param_dtype)
    quantizer_set = _delayed_set() if fp8 else noop_quantizer_set
    out, (d_x, d_kernel, d_bias, d_state) = _run(x, kernel, bias, cotangent, quantizer_set)
    assert out.dtype == x_dtype
    assert (d_x.dtype, d_kernel.dtype, d_bias.dtype) == (x_dtype, param_dtype, param_dtype)
    assert jax.tree.structure(d_state) == jax.tree.structure(quantizer_set)
    assert all(leaf.dtype == F32 for leaf in jax.tree.leaves(d_state))
    assert all(_all_finite(a) for a in (out, d_x, d_kernel, d_bias))


@pytest.mark.parametrize("shape_name", SHAPES)
def test_check_grads_float32(shape_name):
    x, kernel, bias, _, _ = _inputs(4, shape_name)
    contracting_dims = SHAPES[shape_name][2]

    def f(x, kernel, bias):
        return dense(x, kernel, bias, contracting_dims=contracting_dims)

    check_grads(f, (x, kernel, bias), order=1, modes=("rev",))


# ----------------------------------------------------------------------------- FP8


@pytest.mark.parametrize(
    ("shape_name", "x_dtype"),
    [
        *((name, F32) for name in SHAPES),
        pytest.param("two_features", BF16, marks=pytest.mark.slow),
    ],
    ids=[*(f"{name}-x_f32" for name in SHAPES), "two_features-x_bf16"],
)
@pytest.mark.parametrize("format_name", FORMATS)
@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
def test_fp8_steps_match_fake_quant_reference(recipe_name, format_name, shape_name, x_dtype):
    fmt = FORMATS[format_name]
    delayed = recipe_name == "delayed"
    state = _delayed_set(fmt) if delayed else _current_set(fmt)
    contracting_dims = SHAPES[shape_name][2]
    if delayed:
        # The first step quantizes with the initial scale_inv of 1.
        for quantizer in (state.x, state.kernel, state.dgrad):
            np.testing.assert_array_equal(quantizer.scale_inv, [1.0])

    for step, magnitudes in enumerate(STEP_MAGNITUDES):
        x, kernel, bias, cotangent, n = _inputs(10 + step, shape_name, x_dtype, F32, magnitudes)
        out, (d_x, d_kernel, d_bias, new_state) = _run(
            x, kernel, bias, cotangent, state, contracting_dims=contracting_dims
        )
        used_scales = None if not delayed else (state.x, state.kernel, state.dgrad)
        expected = _fp8_expectations(x, kernel, bias, cotangent, used_scales, n, fmt)
        fq_out, (fq_x, fq_kernel, _) = expected["fake_quant"]
        ref_out, (ref_x, ref_kernel, ref_bias) = expected["unquantized"]
        what = f"step {step + 1}"

        assert out.dtype == x_dtype and d_x.dtype == x_dtype and d_kernel.dtype == F32
        assert relative_error(out, fq_out) < SAME_SCALES_TOLERANCE, what
        assert relative_error(d_x, fq_x) < SAME_SCALES_TOLERANCE, what
        assert relative_error(d_kernel, fq_kernel) < SAME_SCALES_TOLERANCE, what
        assert relative_error(out, ref_out) < FP8_FORWARD_TOLERANCE, what
        assert relative_error(d_x, ref_x) < FP8_BACKWARD_TOLERANCE, what
        assert relative_error(d_kernel, ref_kernel) < FP8_BACKWARD_TOLERANCE, what
        # The GEMMs really ran in FP8.
        assert relative_error(out, ref_out) > 1e-3, what
        assert relative_error(d_x, ref_x) > 1e-3, what
        assert relative_error(d_kernel, ref_kernel) > 1e-3, what

        # dbias is summed from the unquantized output gradient.
        assert d_bias.dtype == F32
        assert_close(d_bias, ref_bias, 1e-6, what)

        assert jax.tree.structure(new_state) == jax.tree.structure(state)
        if delayed:
            for name, amax in expected["amax"].items():
                old, new = getattr(state, name), getattr(new_state, name)
                history = np.asarray(new.amax_history)
                np.testing.assert_array_equal(history[0], amax, err_msg=f"{what} {name}")
                np.testing.assert_array_equal(
                    history[1:], np.asarray(old.amax_history)[:-1], err_msg=f"{what} {name}"
                )
                np.testing.assert_allclose(
                    new.scale_inv,
                    [history.max() / scaling.fp8_max(new.q_dtype)],
                    rtol=1e-6,
                    err_msg=f"{what} {name}",
                )
        state = new_state


def test_delayed_scaling_with_most_recent_amax_and_margin():
    state = _delayed_set(history=3, amax_compute_algo="most_recent", margin=1)
    for step, magnitudes in enumerate(STEP_MAGNITUDES):
        x, kernel, bias, cotangent, _ = _inputs(20 + step, "matrix", magnitudes=magnitudes)
        _, (*_, new_state) = _run(x, kernel, bias, cotangent, state)
        for name, tensor in {"x": x, "kernel": kernel, "dgrad": cotangent}.items():
            new = getattr(new_state, name)
            expected = 2.0 * _amax(tensor) / scaling.fp8_max(new.q_dtype)
            np.testing.assert_allclose(new.scale_inv, [expected], rtol=1e-6, err_msg=name)
        state = new_state


@pytest.mark.parametrize("format_name", FORMATS)
def test_saturating_delayed_scale_clips_instead_of_overflowing(format_name):
    fmt = FORMATS[format_name]
    state = _delayed_set(fmt)
    # A scale far too small for the data: x / scale_inv exceeds every float8 format's range.
    tiny = jnp.full((1,), 1e-6, F32)
    state = dataclasses.replace(
        state,
        x=dataclasses.replace(state.x, scale_inv=tiny),
        kernel=dataclasses.replace(state.kernel, scale_inv=tiny),
        dgrad=dataclasses.replace(state.dgrad, scale_inv=tiny),
    )
    x, kernel, bias, cotangent, n = _inputs(30, "matrix")
    out, (d_x, d_kernel, d_bias, new_state) = _run(x, kernel, bias, cotangent, state)
    fq_out, (fq_x, fq_kernel, _) = _fake_quant_reference(
        x, kernel, bias, cotangent, n, (tiny[0],) * 3, fmt
    )
    for actual in (out, d_x, d_kernel, d_bias, *jax.tree.leaves(new_state)):
        assert _all_finite(actual)
    assert relative_error(out, fq_out) < SAME_SCALES_TOLERANCE
    assert relative_error(d_x, fq_x) < SAME_SCALES_TOLERANCE
    assert relative_error(d_kernel, fq_kernel) < SAME_SCALES_TOLERANCE


@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
def test_all_zero_tensors_keep_the_scale_and_give_finite_results(recipe_name):
    state = _delayed_set() if recipe_name == "delayed" else _current_set()
    x, kernel, bias, cotangent, _ = _inputs(31, "matrix")
    # One real step first, so that the delayed state holds a scale other than the initial one.
    _, (*_, state) = _run(x, kernel, bias, cotangent, state)
    zeros_x, zeros_cotangent = jnp.zeros_like(x), jnp.zeros_like(cotangent)
    out, (d_x, d_kernel, d_bias, new_state) = _run(zeros_x, kernel, bias, zeros_cotangent, state)
    np.testing.assert_array_equal(out, jnp.broadcast_to(bias, out.shape))
    for gradient in (d_x, d_kernel, d_bias):
        np.testing.assert_array_equal(gradient, jnp.zeros_like(gradient))
    if recipe_name == "delayed":
        for name in ("x", "dgrad"):
            old, new = getattr(state, name), getattr(new_state, name)
            np.testing.assert_array_equal(new.scale_inv, old.scale_inv, err_msg=name)
            np.testing.assert_array_equal(new.amax_history[0], 0.0, err_msg=name)


# ----------------------------------------------------------------------------- reused state


@pytest.mark.parametrize("format_name", FORMATS)
def test_reused_state_merges_updates_by_max(format_name):
    fmt = FORMATS[format_name]
    x, kernel, bias, cotangent, _ = _inputs(40, "matrix")
    _, (*_, state) = _run(x, kernel, bias, cotangent, _delayed_set(fmt, history=3))
    # Use a has the larger x, use b the larger output gradient: the merged x state must come
    # from a, the merged gradient state from b.
    x_a, _, _, cotangent_a, _ = _inputs(41, "matrix", magnitudes=(4.0, 1.0, 0.5))
    x_b, _, _, cotangent_b, _ = _inputs(42, "matrix", magnitudes=(0.5, 1.0, 4.0))

    def use(x, cotangent, quantizer_set):
        out = dense(x, kernel, bias, quantizer_set=quantizer_set)
        return jnp.sum(out.astype(F32) * cotangent)

    def single(x, cotangent):
        return jax.jit(jax.grad(lambda qs: use(x, cotangent, qs)))(state)

    def both(quantizer_set):
        quantizer_set = merge_by_max(quantizer_set)
        return use(x_a, cotangent_a, quantizer_set) + use(x_b, cotangent_b, quantizer_set)

    merged = jax.jit(jax.grad(both))(state)
    update_a, update_b = single(x_a, cotangent_a), single(x_b, cotangent_b)
    _assert_trees_equal(merged, jax.tree.map(jnp.maximum, update_a, update_b))
    np.testing.assert_array_equal(np.asarray(merged.x.amax_history)[0], _amax(x_a))
    np.testing.assert_array_equal(np.asarray(merged.dgrad.amax_history)[0], _amax(cotangent_b))
    np.testing.assert_array_equal(
        np.asarray(merged.x.amax_history)[1:], np.asarray(state.x.amax_history)[:-1]
    )
    # Not the sum that plain autodiff would give.
    assert float(merged.kernel.scale_inv[0]) < float(
        update_a.kernel.scale_inv[0] + update_b.kernel.scale_inv[0]
    )


def test_reused_state_inside_scan_merges_by_max():
    x, kernel, bias, cotangent, _ = _inputs(43, "matrix")
    state = _delayed_set(history=3)
    xs = jnp.stack([x * 0.5, x * 3.0, x])
    cotangents = jnp.stack([cotangent * 2.0, cotangent, cotangent * 0.25])

    def microbatches(quantizer_set):
        quantizer_set = merge_by_max(quantizer_set)

        def body(total, inputs):
            x, cotangent = inputs
            out = dense(x, kernel, bias, quantizer_set=quantizer_set)
            return total + jnp.sum(out.astype(F32) * cotangent), None

        return lax.scan(body, jnp.zeros((), F32), (xs, cotangents))[0]

    merged = jax.jit(jax.grad(microbatches))(state)
    np.testing.assert_array_equal(merged.x.amax_history, [_amax(xs[1]), 0.0, 0.0])
    np.testing.assert_array_equal(merged.dgrad.amax_history, [_amax(cotangents[0]), 0.0, 0.0])
    np.testing.assert_array_equal(merged.kernel.amax_history, [_amax(kernel), 0.0, 0.0])


# ----------------------------------------------------------------------------- residuals


@pytest.mark.parametrize("x_dtype", [F32, BF16], ids=["x_f32", "x_bf16"])
@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
def test_fp8_saves_float8_operands_not_high_precision_copies(recipe_name, x_dtype):
    x, kernel, bias, _, _ = _inputs(50, "matrix", x_dtype)
    state = _delayed_set(history=5) if recipe_name == "delayed" else _current_set()
    _, vjp = jax.vjp(lambda x, k, b, qs: dense(x, k, b, quantizer_set=qs), x, kernel, bias, state)
    residuals = [(leaf.shape, jnp.dtype(leaf.dtype)) for leaf in jax.tree.leaves(vjp)]
    assert (x.shape, jnp.dtype(E4M3)) in residuals
    assert (kernel.shape, jnp.dtype(E4M3)) in residuals
    high_precision = [(shape, dtype) for shape, dtype in residuals if jnp.finfo(dtype).bits >= 16]
    for shape, dtype in high_precision:
        assert shape not in (x.shape, kernel.shape), (shape, dtype)
        assert int(np.prod(shape)) <= 5, (shape, dtype)  # only scales and amax histories


def test_unquantized_saves_x_and_kernel():
    x, kernel, bias, _, _ = _inputs(51, "matrix")
    _, vjp = jax.vjp(lambda x, k, b: dense(x, k, b), x, kernel, bias)
    residuals = [(leaf.shape, jnp.dtype(leaf.dtype)) for leaf in jax.tree.leaves(vjp)]
    assert sorted(residuals) == sorted([(x.shape, jnp.dtype(F32)), (kernel.shape, jnp.dtype(F32))])


# ----------------------------------------------------------------------------- layout, sharding


@pytest.mark.parametrize("recipe_name", ["none", "delayed", "current"])
def test_transpose_batch_sequence_changes_nothing(recipe_name):
    state = {
        "none": noop_quantizer_set,
        "delayed": _delayed_set(),
        "current": _current_set(),
    }[recipe_name]
    x, kernel, bias, cotangent, _ = _inputs(60, "two_features")  # x: [seq, batch, hidden]
    axes = {
        "input_axes": ("sequence", "batch", "embed"),
        "kernel_axes": ("embed", "heads", "kv"),
        "output_axes": ("sequence", "batch", "heads", "kv"),
    }
    for _ in range(2):
        result = _run(x, kernel, bias, cotangent, state, transpose_batch_sequence=False, **axes)
        transposed = _run(x, kernel, bias, cotangent, state, transpose_batch_sequence=True, **axes)
        _assert_trees_equal(transposed, result)
        state = result[1][3]


def test_logical_axes_without_rules_change_nothing():
    x, kernel, bias, cotangent, _ = _inputs(61, "two_features")
    state = _delayed_set()
    plain = _run(x, kernel, bias, cotangent, state)
    with_axes = _run(
        x,
        kernel,
        bias,
        cotangent,
        state,
        input_axes=("batch", "length", "embed"),
        kernel_axes=("embed", None, "mlp"),
        output_axes=("batch", "length", None, "mlp"),
    )
    empty_axes = _run(x, kernel, bias, cotangent, state, input_axes=(), output_axes=())
    _assert_trees_equal(with_axes, plain)
    _assert_trees_equal(empty_axes, plain)


_MESH_AXES = {
    "input_axes": ("batch", "length", "embed"),
    "kernel_axes": ("embed", None, "mlp"),
    "output_axes": ("batch", "length", None, "mlp"),
}
_MESH_RULES = (("batch", "data"), ("mlp", "model"), ("embed", None), ("length", None))


@pytest.mark.slow
@pytest.mark.parametrize("recipe_name", ["none", "delayed"])
def test_sharded_run_matches_single_device(recipe_name):
    state = noop_quantizer_set if recipe_name == "none" else _delayed_set()
    x, kernel, bias, cotangent, _ = _inputs(62, "two_features")
    out, grads = _run(x, kernel, bias, cotangent, state, **_MESH_AXES)
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    with jax.set_mesh(mesh), nn.logical_axis_rules(_MESH_RULES):
        sharded_out, sharded_grads = _run(x, kernel, bias, cotangent, state, **_MESH_AXES)
    assert_close(sharded_out, out, tolerance(F32), "out")
    names = ("d_x", "d_kernel", "d_bias")
    for name, actual, expected in zip(names, sharded_grads[:3], grads[:3], strict=True):
        assert_close(actual, expected, tolerance(F32), name)
    _assert_trees_equal(sharded_grads[3], grads[3])


# ----------------------------------------------------------------------------- bad inputs


def _array(shape, dtype=F32):
    return jnp.ones(shape, dtype)


_X, _KERNEL = _array((8, 16)), _array((16, 24))
_X4, _KERNEL3 = _array((2, 3, 4, 8)), _array((4, 8, 5))

_BAD_CALLS = [
    # Contraction sizes and axes.
    pytest.param(
        dict(x=_X, kernel=_array((12, 24))),
        ValueError,
        r"kernel has \(12,\) input features but x has \(16,\) \(x\.shape\[1:\]\)",
        id="contraction_size_mismatch",
    ),
    pytest.param(
        dict(x=_X4, kernel=_array((8, 4, 5)), contracting_dims=((2, 3), (0, 1))),
        ValueError,
        r"kernel has \(8, 4\) input features but x has \(4, 8\)",
        id="multi_axis_contraction_size_mismatch",
    ),
    pytest.param(
        dict(x=_X4, kernel=_array((3, 4, 5)), contracting_dims=((1, 2), (0, 1))),
        ValueError,
        "x must contract its trailing axes and kernel its leading axes",
        id="x_dims_not_trailing",
    ),
    pytest.param(
        dict(x=_X, kernel=_array((24, 16)), contracting_dims=((1,), (1,))),
        ValueError,
        "x must contract its trailing axes and kernel its leading axes",
        id="kernel_dims_not_leading",
    ),
    pytest.param(
        dict(x=_X4, kernel=_KERNEL3, contracting_dims=((3, 2), (1, 0))),
        ValueError,
        "in order",
        id="dims_out_of_order",
    ),
    pytest.param(
        dict(x=_X4, kernel=_KERNEL3, contracting_dims=((2, 3), (0,))),
        ValueError,
        "is not supported",
        id="dims_of_different_lengths",
    ),
    pytest.param(
        dict(x=_X, kernel=_KERNEL, contracting_dims=((), ())),
        ValueError,
        "is not supported",
        id="no_contracted_dims",
    ),
    pytest.param(
        dict(x=_X, kernel=_array((16,))),
        ValueError,
        "has no output axes",
        id="kernel_without_output_axes",
    ),
    pytest.param(
        dict(x=_X, kernel=_KERNEL, contracting_dims=((3,), (0,))),
        ValueError,
        "contracting_dims",
        id="x_dim_out_of_range",
    ),
    pytest.param(
        dict(x=_X, kernel=_KERNEL, contracting_dims=((1,), (2,))),
        ValueError,
        "contracting_dims",
        id="kernel_dim_out_of_range",
    ),
    # Malformed contracting_dims.
    pytest.param(
        dict(x=_X, kernel=_KERNEL, contracting_dims=(1, 0)),
        TypeError,
        "contracting_dims must be a pair of tuples of ints",
        id="dims_not_tuples",
    ),
    pytest.param(
        dict(x=_X, kernel=_KERNEL, contracting_dims=1),
        TypeError,
        "contracting_dims must be a pair of tuples of ints",
        id="dims_an_int",
    ),
    pytest.param(
        dict(x=_X, kernel=_KERNEL, contracting_dims=((1,),)),
        TypeError,
        "contracting_dims must be a pair of tuples of ints",
        id="dims_not_a_pair",
    ),
    pytest.param(
        dict(x=_X, kernel=_KERNEL, contracting_dims=((1,), (0,), (0,))),
        TypeError,
        "contracting_dims must be a pair of tuples of ints",
        id="dims_a_triple",
    ),
    pytest.param(
        dict(x=_X, kernel=_KERNEL, contracting_dims=((None,), (0,))),
        TypeError,
        "contracting_dims must be a pair of tuples of ints",
        id="dims_holding_none",
    ),
    pytest.param(
        dict(x=_X, kernel=_KERNEL, contracting_dims=(("last",), (0,))),
        TypeError,
        "contracting_dims must be a pair of tuples of ints",
        id="dims_holding_a_name",
    ),
    pytest.param(
        dict(x=_X, kernel=_KERNEL, contracting_dims=((1.5,), (0,))),
        TypeError,
        "contracting_dims must be a pair of tuples of ints",
        id="dims_holding_a_float",
    ),
    pytest.param(
        dict(x=_X, kernel=_KERNEL, contracting_dims=(("1",), ("0",))),
        TypeError,
        "contracting_dims must be a pair of tuples of ints",
        id="dims_holding_digit_strings",
    ),
    # dtypes.
    pytest.param(
        dict(x=_array((8, 16), jnp.int32), kernel=_KERNEL),
        TypeError,
        "x must be a floating-point array, got int32",
        id="integer_x",
    ),
    pytest.param(
        dict(x=_X, kernel=_array((16, 24), jnp.int8)),
        TypeError,
        "kernel must be a floating-point array, got int8",
        id="integer_kernel",
    ),
    pytest.param(
        dict(x=_X, kernel=_KERNEL, bias=_array((24,), jnp.int32)),
        TypeError,
        "bias must be a floating-point array, got int32",
        id="integer_bias",
    ),
    pytest.param(
        dict(x=[[1.0] * 16] * 8, kernel=_KERNEL),
        TypeError,
        "x must be a floating-point array, got list",
        id="list_x",
    ),
    pytest.param(
        dict(x=_array((8, 16), E4M3), kernel=_KERNEL),
        TypeError,
        "x has dtype float8_e4m3fn; pass high-precision values",
        id="float8_x",
    ),
    pytest.param(
        dict(x=_X, kernel=_array((16, 24), E5M2)),
        TypeError,
        "kernel has dtype float8_e5m2; pass high-precision values",
        id="float8_kernel",
    ),
    pytest.param(
        dict(x=_X, kernel=_KERNEL, bias=_array((24,), E4M3)),
        TypeError,
        "bias has dtype float8_e4m3fn; pass high-precision values",
        id="float8_bias",
    ),
    # Bias shape.
    pytest.param(
        dict(x=_X, kernel=_KERNEL, bias=_array((16,))),
        ValueError,
        r"bias has shape \(16,\) but must be \(24,\)",
        id="bias_of_input_size",
    ),
    pytest.param(
        dict(x=_array((2, 4, 16)), kernel=_array((16, 3, 8)), bias=_array((8,))),
        ValueError,
        r"bias has shape \(8,\) but must be \(3, 8\)",
        id="bias_missing_a_feature_axis",
    ),
    pytest.param(
        dict(x=_X4, kernel=_KERNEL3, bias=_array((8, 5)), contracting_dims=((2, 3), (0, 1))),
        ValueError,
        r"bias has shape \(8, 5\) but must be \(5,\)",
        id="bias_with_a_contracted_axis",
    ),
    # Logical axes.
    pytest.param(
        dict(x=_X, kernel=_KERNEL, input_axes=("batch",)),
        ValueError,
        r"input_axes=\('batch',\) names 1 dimensions but x has 2",
        id="input_axes_too_short",
    ),
    pytest.param(
        dict(x=_X, kernel=_KERNEL, kernel_axes=("embed", "mlp", "extra")),
        ValueError,
        "kernel_axes=.* names 3 dimensions but kernel has 2",
        id="kernel_axes_too_long",
    ),
    pytest.param(
        dict(x=_array((2, 4, 16)), kernel=_array((16, 3, 8)), output_axes=("batch", "mlp")),
        ValueError,
        "output_axes=.* names 2 dimensions but the output has 4",
        id="output_axes_wrong_length",
    ),
    pytest.param(
        dict(x=_X4, kernel=_KERNEL3, contracting_dims=((2, 3), (0, 1)), output_axes=("a",) * 4),
        ValueError,
        "output_axes=.* names 4 dimensions but the output has 3",
        id="output_axes_of_multi_axis_contraction",
    ),
    pytest.param(
        dict(x=_X, kernel=_KERNEL, input_axes="batch"),
        TypeError,
        "input_axes must be a tuple of logical axis names",
        id="input_axes_a_string",
    ),
    pytest.param(
        dict(x=_X, kernel=_KERNEL, kernel_axes=("embed", 3)),
        TypeError,
        "kernel_axes must hold axis names",
        id="kernel_axes_holding_an_int",
    ),
    # transpose_batch_sequence.
    pytest.param(
        dict(x=_X, kernel=_KERNEL, transpose_batch_sequence=1),
        TypeError,
        "transpose_batch_sequence must be a bool, got 1",
        id="transpose_batch_sequence_int",
    ),
    pytest.param(
        dict(x=_X, kernel=_KERNEL, transpose_batch_sequence="yes"),
        TypeError,
        "transpose_batch_sequence must be a bool",
        id="transpose_batch_sequence_str",
    ),
    pytest.param(
        dict(x=_X, kernel=_KERNEL, transpose_batch_sequence=None),
        TypeError,
        "transpose_batch_sequence must be a bool",
        id="transpose_batch_sequence_none",
    ),
    # Quantizer sets.
    pytest.param(
        dict(x=_X, kernel=_KERNEL, quantizer_set=DelayedScaling()),
        TypeError,
        r"quantizer_set must be a te_flax\.quantize\.QuantizerSet",
        id="recipe_instead_of_set",
    ),
    pytest.param(
        dict(x=_X, kernel=_KERNEL, quantizer_set=None),
        TypeError,
        r"quantizer_set must be a te_flax\.quantize\.QuantizerSet",
        id="none_instead_of_set",
    ),
    pytest.param(
        dict(
            x=_X,
            kernel=_KERNEL,
            quantizer_set=QuantizerSet(
                x=CurrentScaleQuantizer(E4M3), kernel=CurrentScaleQuantizer(E4M3)
            ),
        ),
        ValueError,
        r"quantizes \['x', 'kernel'\] but not the rest",
        id="partial_set_without_dgrad",
    ),
    pytest.param(
        dict(x=_X, kernel=_KERNEL, quantizer_set=QuantizerSet(dgrad=CurrentScaleQuantizer(E5M2))),
        ValueError,
        "either fully FP8 or not at all",
        id="partial_set_only_dgrad",
    ),
    pytest.param(
        dict(
            x=_X,
            kernel=_KERNEL,
            quantizer_set=QuantizerSet(
                CurrentScaleQuantizer(E5M2),
                CurrentScaleQuantizer(E5M2),
                CurrentScaleQuantizer(E4M3),
            ),
        ),
        ValueError,
        "x and kernel are both float8_e5m2",
        id="e5m2_x_and_kernel",
    ),
    pytest.param(
        dict(
            x=_X,
            kernel=_KERNEL,
            quantizer_set=QuantizerSet(
                CurrentScaleQuantizer(E4M3),
                CurrentScaleQuantizer(E5M2),
                CurrentScaleQuantizer(E5M2),
            ),
        ),
        ValueError,
        "dgrad and kernel are both float8_e5m2",
        id="e5m2_dgrad_and_kernel",
    ),
    pytest.param(
        dict(
            x=_X,
            kernel=_KERNEL,
            quantizer_set=QuantizerSet(
                CurrentScaleQuantizer(E5M2),
                CurrentScaleQuantizer(E4M3),
                CurrentScaleQuantizer(E5M2),
            ),
        ),
        ValueError,
        "x and dgrad are both float8_e5m2",
        id="e5m2_x_and_dgrad",
    ),
    pytest.param(
        dict(
            x=_X,
            kernel=_KERNEL,
            quantizer_set=QuantizerSet(
                CurrentScaleQuantizer(E4M3),
                CurrentScaleQuantizer(BF16),
                CurrentScaleQuantizer(E5M2),
            ),
        ),
        ValueError,
        r"quantizer_set\.kernel quantizes to .*bfloat16.* only float8_e4m3fn and float8_e5m2",
        id="set_quantizing_to_bfloat16",
    ),
]


@pytest.mark.parametrize(("arguments", "error", "message"), _BAD_CALLS)
def test_bad_input_is_refused_with_a_clear_error(arguments, error, message):
    with pytest.raises(error, match=message):
        dense(**arguments)


def test_valid_calls_next_to_the_refused_ones_run():
    """The boundaries of the checks above: these calls are accepted."""
    assert dense(_X, _KERNEL, contracting_dims=[[1], [0]]).shape == (8, 24)
    assert dense(_X4, _KERNEL3, _array((5,)), contracting_dims=((2, 3), (0, 1))).shape == (2, 3, 5)
    assert dense(_X, _KERNEL, input_axes=(None, None), kernel_axes=()).shape == (8, 24)
    assert dense(_X.astype(jnp.float16), _KERNEL).dtype == jnp.float16
