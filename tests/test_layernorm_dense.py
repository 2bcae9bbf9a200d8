"""``layernorm_dense``: numerics against unfused references, FP8 state, transformations,
residuals, input validation and sharding constraints.

Every gradient is of ``loss = sum(out.astype(f32) * cotangent)`` with a fixed random cotangent;
the gradient with respect to the quantizer set is the new FP8 state.
"""

from __future__ import annotations

import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import jax.test_util
import numpy as np
import optax
import pytest
from jax import lax

from te_flax._base import checks as _validation
from te_flax.layernorm_dense import layernorm_dense, layernorm_dense_with_norm_output
from te_flax.quantize import (
    DelayedScaling,
    Float8CurrentScaling,
    Format,
    QuantizerFactory,
    QuantizerSet,
    merge_by_max,
    noop_quantizer_set,
)
from te_flax.training import OVERWRITE_WITH_GRADIENT, apply_gradients, init_optimizer
from tests.helpers import (
    FP8_BACKWARD_TOLERANCE,
    FP8_FORWARD_TOLERANCE,
    amax_of,
    assert_close,
    current_scale,
    grad_fake_quant,
    reference_dense,
    reference_norm,
    relative_error,
    straight_through_fake_quant,
    tolerance,
)

F32, BF16 = jnp.float32, jnp.bfloat16
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
FP8_MAX = {jnp.dtype(E4M3): 448.0, jnp.dtype(E5M2): 57344.0}
FLOAT8_DTYPES = (jnp.dtype(E4M3), jnp.dtype(E5M2))
HIGH_PRECISION_DTYPES = (jnp.dtype(F32), jnp.dtype(BF16), jnp.dtype(jnp.float16))

# The five differentiable arrays, in the op's argument order; the quantizer set comes sixth.
ARRAYS = ("x", "kernel", "gamma", "beta", "bias")
GRADIENTS = (*ARRAYS, "quantizer_set")

# Normwise relative error allowed between the op under FP8 and a fake-quant reference that uses
# the same scales. Both quantize the same values with the same scale, so they differ only by
# float32 rounding, except where the op's and the reference's float32 norm outputs (computed in
# a different order) fall on opposite sides of a float8 rounding boundary: a handful of
# elements, each off by one float8 ulp, which moves the normwise error by at most ~1e-3. A
# wrong scale (say the new state's instead of the incoming one) rounds every element
# differently and gives errors of several percent.
SAME_SCALES_TOLERANCE = 5e-3

SHAPES = [((8, 16), (16, 24)), ((2, 4, 16), (16, 3, 8)), ((2, 2, 3, 16), (16, 12))]
# Most tests share these shapes, so that they share compiled functions.
SMALL = ((4, 16), (16, 8))
FP8_SHAPES = ((2, 16, 32), (32, 3, 16))

FP8_RECIPES = [
    pytest.param(DelayedScaling(amax_history_len=4), id="delayed-hybrid"),
    pytest.param(DelayedScaling(fp8_format=Format.E4M3, amax_history_len=4), id="delayed-e4m3"),
    pytest.param(Float8CurrentScaling(), id="current-hybrid"),
    pytest.param(Float8CurrentScaling(fp8_format=Format.E4M3), id="current-e4m3"),
]
RECIPES_AND_NONE = [
    pytest.param(None, id="no-fp8"),
    pytest.param(DelayedScaling(amax_history_len=4), id="delayed"),
    pytest.param(Float8CurrentScaling(), id="current"),
]


# ----------------------------------------------------------------------------- inputs


def make_inputs(
    seed,
    x_shape,
    kernel_shape,
    *,
    norm_type="layernorm",
    zero_centered_gamma=False,
    use_bias=True,
    x_dtype=F32,
):
    """Random x (with a non-zero mean), kernel, gamma, beta, bias and output cotangent."""
    # NumPy's generator: jax.random would compile a sampler for every new shape.
    rng = np.random.default_rng(seed)
    hidden, features = kernel_shape[0], tuple(kernel_shape[1:])

    def normal(shape, scale=1.0, shift=0.0, dtype=F32):
        return jnp.asarray((shift + scale * rng.standard_normal(shape)).astype(dtype))

    return {
        "x": normal(x_shape, 2.0, 0.5, x_dtype),
        "kernel": normal(kernel_shape, hidden**-0.5),
        "gamma": normal((hidden,), 0.2, 0.0 if zero_centered_gamma else 1.0),
        "beta": normal((hidden,), 0.1) if norm_type == "layernorm" else None,
        "bias": normal(features, 0.1) if use_bias else None,
        "cotangent": normal(tuple(x_shape[:-1]) + features),
    }


def fresh_state(recipe):
    return QuantizerFactory.create_set(fp8_recipe=recipe)


# ----------------------------------------------------------------------------- the op


def _loss(x, kernel, gamma, beta, bias, quantizer_set, cotangent, **options):
    out = layernorm_dense(x, kernel, gamma, beta, bias, quantizer_set=quantizer_set, **options)
    return jnp.sum(out.astype(F32) * cotangent), out


@functools.cache
def _jitted_value_and_grads(options: tuple):
    loss = functools.partial(_loss, **dict(options))
    return jax.jit(jax.value_and_grad(loss, argnums=tuple(range(6)), has_aux=True))


def run_op(inputs, quantizer_set=noop_quantizer_set, *, jit=True, **options):
    """The op's output and its gradients as a dict (``"quantizer_set"``: the new FP8 state)."""
    if jit:
        fn = _jitted_value_and_grads(tuple(sorted(options.items())))
    else:
        loss = functools.partial(_loss, **options)
        fn = jax.value_and_grad(loss, argnums=tuple(range(6)), has_aux=True)
    args = [inputs[name] for name in ARRAYS]
    (_, out), grads = fn(*args, quantizer_set, inputs["cotangent"])
    return out, dict(zip(GRADIENTS, grads, strict=True))


# ----------------------------------------------------------------------------- references


@functools.cache
def _jitted_reference(norm_type, zero_centered_gamma, epsilon, scaling, fp8_format):
    def value_and_grads(x, kernel, gamma, beta, bias, cotangent, scales):
        def loss(x, kernel, gamma, beta, bias):
            ln = reference_norm(x, gamma, beta, norm_type, zero_centered_gamma, epsilon)
            if scaling is not None:
                forward, backward = fp8_format.forward_dtype, fp8_format.backward_dtype
                if scaling == "delayed":
                    x_scale, kernel_scale, grad_scale = (s.reshape(()) for s in scales)
                else:
                    x_scale = current_scale(lax.stop_gradient(ln), forward)
                    kernel_scale = current_scale(kernel, forward)
                    # With a float32 x the gradient reaching the GEMM output is the cotangent.
                    grad_scale = current_scale(cotangent, backward)
                ln = straight_through_fake_quant(ln, x_scale, forward)
                kernel = straight_through_fake_quant(kernel, kernel_scale, forward)
            out = reference_dense(ln, kernel)
            if scaling is not None:
                out = grad_fake_quant(grad_scale, backward)(out)
            if bias is not None:
                out = out + jnp.broadcast_to(bias, out.shape)
            return jnp.sum(out * cotangent), out

        args = [None if a is None else a.astype(F32) for a in (x, kernel, gamma, beta, bias)]
        (_, out), grads = jax.value_and_grad(loss, argnums=tuple(range(5)), has_aux=True)(*args)
        return out, grads

    return jax.jit(value_and_grads)


def run_reference(
    inputs,
    *,
    norm_type="layernorm",
    zero_centered_gamma=False,
    epsilon=1e-6,
    recipe=None,
    quantizer_set=None,
):
    """Unfused float32 reference output and gradients of x, kernel, gamma, beta and bias.

    With an FP8 ``recipe``: fake-quant of the norm output and kernel (straight-through) and of
    the output gradient, with the scales the op must use: the incoming ``quantizer_set``'s
    ``scale_inv`` for delayed scaling, each tensor's own amax for current scaling. The bias is
    added after the gradient quantization, so dbias is summed from the unquantized gradient.
    """
    scaling, fp8_format, scales = None, None, None
    if recipe is not None:
        fp8_format = recipe.fp8_format
        scaling = "delayed" if isinstance(recipe, DelayedScaling) else "current"
    if scaling == "delayed":
        scales = tuple(getattr(quantizer_set, n).scale_inv for n in ("x", "kernel", "dgrad"))
    fn = _jitted_reference(norm_type, zero_centered_gamma, epsilon, scaling, fp8_format)
    out, grads = fn(*(inputs[name] for name in ARRAYS), inputs["cotangent"], scales)
    return out, dict(zip(ARRAYS, grads, strict=True))


def assert_tree_equal(actual, expected, rtol=0.0):
    actual_leaves, actual_def = jax.tree.flatten(actual)
    expected_leaves, expected_def = jax.tree.flatten(expected)
    assert actual_def == expected_def, (actual_def, expected_def)
    for a, e in zip(actual_leaves, expected_leaves, strict=True):
        assert a.dtype == e.dtype and a.shape == e.shape, (a.dtype, e.dtype, a.shape, e.shape)
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=rtol, atol=0)


def tree_max(*trees):
    return jax.tree.map(lambda *leaves: functools.reduce(jnp.maximum, leaves), *trees)


def tree_sum(*trees):
    return jax.tree.map(lambda *leaves: functools.reduce(jnp.add, leaves), *trees)


# ----------------------------------------------------------------------------- no quantization


NORM_VARIANTS = [
    (norm_type, zero_centered_gamma, use_bias)
    for norm_type in ("layernorm", "rmsnorm")
    for zero_centered_gamma in (False, True)
    for use_bias in (True, False)
]


@functools.cache
def _unquantized_results(x_shape, kernel_shape, x_dtype):
    """Inputs, op results and reference results of every norm variant for one shape and dtype.

    All variants go through one jit: compiling the 48 cases one by one would take most of this
    file's run time.
    """
    inputs_by_variant = {
        variant: make_inputs(
            0,
            x_shape,
            kernel_shape,
            norm_type=variant[0],
            zero_centered_gamma=variant[1],
            use_bias=variant[2],
            x_dtype=x_dtype,
        )
        for variant in NORM_VARIANTS
    }

    def compute(inputs_by_variant):
        results = {}
        for (norm_type, zero_centered_gamma, use_bias), inputs in inputs_by_variant.items():
            options = {"norm_type": norm_type, "zero_centered_gamma": zero_centered_gamma}
            loss = functools.partial(_loss, **options)
            args = [inputs[name] for name in ARRAYS]
            (_, out), grads = jax.value_and_grad(loss, argnums=tuple(range(6)), has_aux=True)(
                *args, noop_quantizer_set, inputs["cotangent"]
            )
            reference = _jitted_reference(norm_type, zero_centered_gamma, 1e-6, None, None)
            expected = reference(*args, inputs["cotangent"], None)
            results[norm_type, zero_centered_gamma, use_bias] = (out, grads), expected
        return results

    return inputs_by_variant, jax.jit(compute)(inputs_by_variant)


@pytest.mark.parametrize(
    "x_dtype", [pytest.param(F32, id="f32"), pytest.param(BF16, id="bf16", marks=pytest.mark.slow)]
)
@pytest.mark.parametrize("x_shape, kernel_shape", SHAPES, ids=["2d", "3d-2features", "4d"])
@pytest.mark.parametrize("use_bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("zero_centered_gamma", [False, True], ids=["gamma", "zc-gamma"])
@pytest.mark.parametrize("norm_type", ["layernorm", "rmsnorm"])
def test_matches_unfused_reference(
    norm_type, zero_centered_gamma, use_bias, x_shape, kernel_shape, x_dtype
):
    inputs_by_variant, results = _unquantized_results(x_shape, kernel_shape, x_dtype)
    variant = (norm_type, zero_centered_gamma, use_bias)
    inputs = inputs_by_variant[variant]
    (out, grads), (expected_out, expected_grads) = results[variant]
    grads = dict(zip(GRADIENTS, grads, strict=True))
    expected_grads = dict(zip(ARRAYS, expected_grads, strict=True))

    assert out.dtype == x_dtype
    assert out.shape == tuple(x_shape[:-1]) + tuple(kernel_shape[1:])
    assert_close(out, expected_out, tolerance(x_dtype), "out")
    for name in ARRAYS:
        if inputs[name] is None:
            assert grads[name] is None, name
            continue
        assert grads[name].dtype == inputs[name].dtype, name
        # Float32 kernel, gamma, beta and bias gradients of a bfloat16 x are computed from
        # bfloat16 operands, so all gradients get x's dtype tolerance.
        assert_close(grads[name], expected_grads[name], tolerance(x_dtype), name)
    assert grads["quantizer_set"] == noop_quantizer_set


@pytest.mark.parametrize("norm_type", ["layernorm", "rmsnorm"])
def test_gradients_pass_numerical_check(norm_type):
    inputs = make_inputs(1, (3, 8), (8, 5), norm_type=norm_type)
    cotangent = inputs["cotangent"]

    def f(x, kernel, gamma, bias, *beta):
        beta = beta[0] if beta else None
        out = layernorm_dense(x, kernel, gamma, beta, bias, norm_type=norm_type)
        return jnp.sum(out * cotangent)

    args = [inputs[name] for name in ("x", "kernel", "gamma", "bias")]
    if norm_type == "layernorm":
        args.append(inputs["beta"])
    jax.test_util.check_grads(f, tuple(args), order=1, modes=["rev"])


def test_epsilon_is_added_to_the_variance():
    # A small x makes the variance comparable to epsilon, so a wrong epsilon shows.
    inputs = make_inputs(2, *SMALL)
    inputs["x"] = 0.1 * inputs["x"]
    for norm_type in ("layernorm", "rmsnorm"):
        if norm_type == "rmsnorm":
            inputs = {**inputs, "beta": None}
        out, grads = run_op(inputs, norm_type=norm_type, epsilon=0.1)
        expected_out, expected_grads = run_reference(inputs, norm_type=norm_type, epsilon=0.1)
        assert_close(out, expected_out, tolerance(F32), norm_type)
        assert_close(grads["x"], expected_grads["x"], tolerance(F32), norm_type)


def test_transpose_batch_sequence_changes_no_math():
    inputs = make_inputs(3, (4, 2, 16), (16, 8))
    out, grads = run_op(inputs)
    transposed_out, transposed_grads = run_op(inputs, transpose_batch_sequence=True)
    np.testing.assert_array_equal(transposed_out, out)
    for name in ARRAYS:
        np.testing.assert_array_equal(transposed_grads[name], grads[name])


@pytest.mark.parametrize(
    "spelling, canonical",
    [
        ("layernorm", "layernorm"),
        ("LayerNorm", "layernorm"),
        ("layer_norm", "layernorm"),
        ("rmsnorm", "rmsnorm"),
        ("RMSNorm", "rmsnorm"),
        ("rms_norm", "rmsnorm"),
    ],
)
def test_transformer_engine_norm_spellings(spelling, canonical):
    assert _validation.canonical_norm_type(spelling) == canonical
    inputs = make_inputs(4, *SMALL, norm_type=canonical)
    args = [inputs[name] for name in ARRAYS]
    np.testing.assert_array_equal(
        layernorm_dense(*args, norm_type=spelling), layernorm_dense(*args, norm_type=canonical)
    )


# ----------------------------------------------------------------------------- FP8 numerics


def _assert_fp8_step(out, grads, inputs, recipe, quantizer_set):
    """The op against the same-scales fake-quant reference and the unquantized reference."""
    fake_out, fake_grads = run_reference(inputs, recipe=recipe, quantizer_set=quantizer_set)
    exact_out, exact_grads = run_reference(inputs)
    errors = {"out": relative_error(out, fake_out)}
    assert errors["out"] < SAME_SCALES_TOLERANCE, errors
    assert relative_error(out, exact_out) < FP8_FORWARD_TOLERANCE
    for name in ARRAYS:
        errors[name] = relative_error(grads[name], fake_grads[name])
        assert errors[name] < SAME_SCALES_TOLERANCE, (name, errors)
        assert relative_error(grads[name], exact_grads[name]) < FP8_BACKWARD_TOLERANCE, name
    # dbias is summed from the unquantized gradient.
    assert_close(grads["bias"], exact_grads["bias"], tolerance(F32), "bias")


@pytest.mark.parametrize("recipe", FP8_RECIPES)
def test_fp8_training_steps_match_fake_quant_reference(recipe):
    quantizer_set = fresh_state(recipe)
    kernel = make_inputs(100, *FP8_SHAPES)["kernel"]
    for step in range(3):
        inputs = {**make_inputs(10 + step, *FP8_SHAPES), "kernel": kernel}
        out, grads = run_op(inputs, quantizer_set)
        assert out.dtype == F32
        _assert_fp8_step(out, grads, inputs, recipe, quantizer_set)
        quantizer_set = grads["quantizer_set"]
        assert isinstance(quantizer_set, QuantizerSet)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", [FP8_RECIPES[0], FP8_RECIPES[2]])
def test_fp8_with_bfloat16_input_matches_unquantized(recipe):
    quantizer_set = fresh_state(recipe)
    for step in range(2):
        inputs = make_inputs(20 + step, *FP8_SHAPES, x_dtype=BF16)
        out, grads = run_op(inputs, quantizer_set)
        exact_out, exact_grads = run_reference(inputs)
        assert out.dtype == BF16 and grads["x"].dtype == BF16
        assert relative_error(out, exact_out) < FP8_FORWARD_TOLERANCE
        for name in ARRAYS:
            assert grads[name].dtype == inputs[name].dtype, name
            error = relative_error(grads[name], exact_grads[name])
            assert error < FP8_BACKWARD_TOLERANCE, (name, error)
        quantizer_set = grads["quantizer_set"]


def test_delayed_scaling_quantizes_with_the_previous_steps_scale():
    """Step 1 uses scale_inv = 1 and saturates; step 2 uses the scale step 1 recorded."""
    recipe = DelayedScaling(amax_history_len=4)
    initial = fresh_state(recipe)
    inputs = make_inputs(30, *FP8_SHAPES)
    # Norm output up to ~3000 and output gradient up to ~3e6: far beyond e4m3's 448 and e5m2's
    # 57344, so quantizing them with scale_inv = 1 saturates most elements.
    inputs["gamma"] = 1000.0 * inputs["gamma"]
    inputs["cotangent"] = 1e6 * inputs["cotangent"]
    exact_out, exact_grads = run_reference(inputs)

    out, grads = run_op(inputs, initial)
    for name in ("x", "kernel", "dgrad"):
        np.testing.assert_array_equal(getattr(initial, name).scale_inv, [1.0])
    fake_out, fake_grads = run_reference(inputs, recipe=recipe, quantizer_set=initial)
    assert relative_error(out, fake_out) < SAME_SCALES_TOLERANCE
    assert relative_error(grads["x"], fake_grads["x"]) < SAME_SCALES_TOLERANCE
    assert relative_error(out, exact_out) > 0.3
    assert relative_error(grads["x"], exact_grads["x"]) > 0.3

    out, grads = run_op(inputs, grads["quantizer_set"])
    assert relative_error(out, exact_out) < FP8_FORWARD_TOLERANCE
    for name in ARRAYS:
        assert relative_error(grads[name], exact_grads[name]) < FP8_BACKWARD_TOLERANCE, name


# ----------------------------------------------------------------------------- FP8 state


@pytest.mark.parametrize(
    "amax_compute_algo, margin, fp8_format",
    [
        ("max", 0, Format.HYBRID),
        ("most_recent", 0, Format.HYBRID),
        ("max", 1, Format.HYBRID),
        ("max", 0, Format.E4M3),
    ],
    ids=["max", "most-recent", "margin-1", "max-e4m3"],
)
def test_delayed_scaling_state_rule(amax_compute_algo, margin, fp8_format):
    recipe = DelayedScaling(
        margin=margin,
        fp8_format=fp8_format,
        amax_history_len=3,
        amax_compute_algo=amax_compute_algo,
    )
    quantizer_set = fresh_state(recipe)
    np.testing.assert_array_equal(quantizer_set.x.scale_inv, [1.0])
    # Per-step magnitudes of the norm output, kernel and output gradient: each quantizer's
    # largest amax enters and, three steps later, leaves its history window.
    ln_factors = [1.0, 4.0, 0.5, 0.25, 2.0]
    kernel_factors = [2.0, 0.5, 8.0, 1.0, 0.25]
    grad_factors = [0.5, 1.0, 3.0, 0.125, 0.25]
    base = make_inputs(40, *FP8_SHAPES)
    for step in range(5):
        inputs = make_inputs(41 + step, *FP8_SHAPES)
        inputs["gamma"] = ln_factors[step] * base["gamma"]
        inputs["kernel"] = kernel_factors[step] * base["kernel"]
        inputs["cotangent"] = grad_factors[step] * inputs["cotangent"]
        out, grads = run_op(inputs, quantizer_set)
        new_set = grads["quantizer_set"]
        # This step quantizes with the incoming state (scale_inv = 1 at the first step)...
        fake_out, _ = run_reference(inputs, recipe=recipe, quantizer_set=quantizer_set)
        assert relative_error(out, fake_out) < SAME_SCALES_TOLERANCE
        # ...and records its own amax for the next.
        ln = reference_norm(inputs["x"], inputs["gamma"], inputs["beta"])
        step_amax = {
            "x": (amax_of(ln), 1e-6),
            "kernel": (amax_of(inputs["kernel"]), 0.0),
            "dgrad": (amax_of(inputs["cotangent"]), 0.0),
        }
        for name, (amax, rtol) in step_amax.items():
            old, new = getattr(quantizer_set, name), getattr(new_set, name)
            assert new.scale_inv.dtype == new.amax_history.dtype == F32
            assert new.scale_inv.shape == (1,) and new.amax_history.shape == (3,)
            np.testing.assert_allclose(new.amax_history[0], amax, rtol=rtol, err_msg=name)
            np.testing.assert_array_equal(new.amax_history[1:], old.amax_history[:-1], name)
            history = np.asarray(new.amax_history)
            reduced = history.max() if amax_compute_algo == "max" else history[0]
            fp8_max = FP8_MAX[jnp.dtype(new.q_dtype)]
            expected_scale_inv = reduced * 2.0**margin / fp8_max
            np.testing.assert_allclose(new.scale_inv, [expected_scale_inv], rtol=1e-6, err_msg=name)
        assert jnp.dtype(new_set.dgrad.q_dtype) == jnp.dtype(fp8_format.backward_dtype)
        quantizer_set = new_set


def test_current_scaling_has_no_state_arrays():
    quantizer_set = fresh_state(Float8CurrentScaling())
    assert jax.tree.leaves(quantizer_set) == []
    _, grads = run_op(make_inputs(50, *SMALL), quantizer_set)
    assert jax.tree.leaves(grads["quantizer_set"]) == []
    assert grads["quantizer_set"] == quantizer_set


# ----------------------------------------------------------------------------- reused state


@functools.cache
def _state_after_one_step(seed=60):
    """A delayed-scaling state with non-trivial history and scales."""
    inputs = make_inputs(seed, *SMALL)
    return run_op(inputs, fresh_state(DelayedScaling(amax_history_len=4)))[1]["quantizer_set"]


def _state_for(recipe):
    """No FP8, a used delayed-scaling state, or a (stateless) current-scaling set."""
    if isinstance(recipe, DelayedScaling):
        return _state_after_one_step()
    return fresh_state(recipe)


def test_state_used_twice_merges_updates_by_max():
    quantizer_set = _state_after_one_step()
    first = make_inputs(61, *SMALL)
    second = make_inputs(62, *SMALL)
    for name in ("kernel", "gamma", "beta", "bias"):
        second[name] = first[name]
    # The first use has the larger norm output, the second the larger output gradient.
    first["gamma"] = 3.0 * first["gamma"]
    second["cotangent"] = 4.0 * second["cotangent"]

    def loss(x1, x2, kernel, gamma, beta, bias, quantizer_set):
        merged = merge_by_max(quantizer_set)
        out1 = layernorm_dense(x1, kernel, 3.0 * gamma, beta, bias, quantizer_set=merged)
        out2 = layernorm_dense(x2, kernel, gamma, beta, bias, quantizer_set=merged)
        return jnp.sum(out1 * first["cotangent"]) + jnp.sum(out2 * second["cotangent"])

    grad_fn = jax.jit(jax.grad(loss, argnums=(2, 6)))
    shared = [second[name] for name in ("kernel", "gamma", "beta", "bias")]
    d_kernel, merged_state = grad_fn(first["x"], second["x"], *shared, quantizer_set)
    single_runs = [run_op(inputs, quantizer_set)[1] for inputs in (first, second)]
    single_states = [grads["quantizer_set"] for grads in single_runs]
    assert_tree_equal(merged_state, tree_max(*single_states), rtol=1e-6)
    # Different uses set the maximum of different quantizers.
    assert single_states[0].x.amax_history[0] > single_states[1].x.amax_history[0]
    assert single_states[1].dgrad.amax_history[0] > single_states[0].dgrad.amax_history[0]
    # Never the sum: the older history entries, equal in both uses, would double.
    summed = tree_sum(*single_states)
    assert not np.allclose(merged_state.x.amax_history, summed.x.amax_history)
    assert not np.allclose(merged_state.dgrad.scale_inv, summed.dgrad.scale_inv)
    # Parameter gradients still add up.
    expected_d_kernel = single_runs[0]["kernel"] + single_runs[1]["kernel"]
    assert_close(d_kernel, expected_d_kernel, tolerance(F32), "kernel")


def test_state_in_scan_over_microbatches_merges_updates_by_max():
    quantizer_set = _state_after_one_step()
    shared = make_inputs(70, *SMALL)
    microbatches = [make_inputs(71 + i, *SMALL) for i in range(3)]
    # Microbatches with different norm-output and output-gradient magnitudes.
    for i, (ln_factor, grad_factor) in enumerate([(1.0, 2.0), (3.0, 0.5), (0.5, 1.0)]):
        microbatches[i]["gamma"] = ln_factor * shared["gamma"]
        microbatches[i]["cotangent"] = grad_factor * microbatches[i]["cotangent"]
        for name in ("kernel", "beta", "bias"):
            microbatches[i][name] = shared[name]
    xs = jnp.stack([m["x"] for m in microbatches])
    gammas = jnp.stack([m["gamma"] for m in microbatches])
    cotangents = jnp.stack([m["cotangent"] for m in microbatches])

    def loss(kernel, beta, bias, quantizer_set):
        merged = merge_by_max(quantizer_set)

        def body(total, microbatch):
            x, gamma, cotangent = microbatch
            out = layernorm_dense(x, kernel, gamma, beta, bias, quantizer_set=merged)
            return total + jnp.sum(out * cotangent), None

        total, _ = lax.scan(body, jnp.zeros((), F32), (xs, gammas, cotangents))
        return total

    d_kernel, merged_state = jax.jit(jax.grad(loss, argnums=(0, 3)))(
        shared["kernel"], shared["beta"], shared["bias"], quantizer_set
    )
    single_runs = [run_op(m, quantizer_set)[1] for m in microbatches]
    single_states = [grads["quantizer_set"] for grads in single_runs]
    assert_tree_equal(merged_state, tree_max(*single_states), rtol=1e-6)
    assert not np.allclose(merged_state.x.amax_history, tree_sum(*single_states).x.amax_history)
    expected_d_kernel = tree_sum(*(grads["kernel"] for grads in single_runs))
    assert_close(d_kernel, expected_d_kernel, tolerance(F32), "kernel")


def test_merged_state_without_update_is_kept_by_the_update_rule():
    used = _state_after_one_step(80)
    unused = _state_after_one_step(81)
    inputs = make_inputs(82, *SMALL)

    def loss(states, marked_together):
        if marked_together:
            merged_used, _ = merge_by_max(states)
        else:
            merged_used, _ = merge_by_max(states[0]), merge_by_max(states[1])
        out = layernorm_dense(
            inputs["x"],
            inputs["kernel"],
            inputs["gamma"],
            inputs["beta"],
            inputs["bias"],
            quantizer_set=merged_used,
        )
        return jnp.sum(out * inputs["cotangent"])

    gradient = jax.jit(jax.grad(loss), static_argnums=1)
    # Marked together with a state that is read, the unread state comes back as it was.
    new_used, new_unused = gradient((used, unused), True)
    assert_tree_equal(new_used, run_op(inputs, used)[1]["quantizer_set"], rtol=1e-6)
    assert_tree_equal(new_unused, unused)
    # Marked alone, JAX gives a state that no op read a zero gradient; the update rule keeps
    # the old value.
    new_used, new_unused = gradient((used, unused), False)
    assert_tree_equal(new_used, run_op(inputs, used)[1]["quantizer_set"], rtol=1e-6)
    assert all(not np.any(leaf) for leaf in jax.tree.leaves(new_unused))
    variables = {"params": {}, OVERWRITE_WITH_GRADIENT: {"used": used, "unused": unused}}
    grads = {"params": {}, OVERWRITE_WITH_GRADIENT: {"used": new_used, "unused": new_unused}}
    tx = optax.sgd(0.1)
    updated, _ = apply_gradients(tx, variables, grads, init_optimizer(tx, variables))
    assert_tree_equal(updated[OVERWRITE_WITH_GRADIENT]["unused"], unused)
    assert_tree_equal(updated[OVERWRITE_WITH_GRADIENT]["used"], new_used)


# ----------------------------------------------------------------------------- transformations


@pytest.mark.parametrize("recipe", RECIPES_AND_NONE)
def test_jit_and_eager_agree(recipe):
    quantizer_set = _state_for(recipe)
    inputs = make_inputs(90, *SMALL)
    jit_out, jit_grads = run_op(inputs, quantizer_set)
    eager_out, eager_grads = run_op(inputs, quantizer_set, jit=False)
    assert_close(eager_out, jit_out, tolerance(F32), "out")
    for name in ARRAYS:
        assert_close(eager_grads[name], jit_grads[name], tolerance(F32), name)
    assert_tree_equal(eager_grads["quantizer_set"], jit_grads["quantizer_set"], rtol=1e-6)


@pytest.mark.parametrize("recipe", RECIPES_AND_NONE)
def test_checkpointed_loss_gives_the_same_gradients(recipe):
    quantizer_set = _state_for(recipe)
    inputs = make_inputs(100, *SMALL)

    def loss(*args):
        return _loss(*args)[0]

    argnums = tuple(range(6))
    args = (*(inputs[name] for name in ARRAYS), quantizer_set, inputs["cotangent"])
    plain = jax.jit(jax.grad(loss, argnums))(*args)
    checkpointed = jax.jit(jax.grad(jax.checkpoint(loss), argnums))(*args)
    for name, a, e in zip(GRADIENTS, checkpointed, plain, strict=True):
        if name == "quantizer_set":
            assert_tree_equal(a, e, rtol=1e-6)
        else:
            assert_close(a, e, tolerance(F32), name)


@pytest.mark.parametrize("recipe", RECIPES_AND_NONE)
def test_vmap_of_grad_gives_per_example_gradients_and_state(recipe):
    quantizer_set = _state_for(recipe)
    n_examples = 3
    inputs = make_inputs(110, (n_examples, 4, 16), (16, 8))
    # Examples of different magnitudes, so that each has its own amax.
    factors = jnp.array([1.0, 5.0, 0.25]).reshape(n_examples, 1, 1)
    inputs["x"] = inputs["x"] * factors
    inputs["cotangent"] = inputs["cotangent"] * factors[::-1]

    def loss(*args):
        return _loss(*args)[0]

    per_example_grad = jax.jit(
        jax.vmap(
            jax.grad(loss, argnums=tuple(range(6))),
            in_axes=(0, None, None, None, None, None, 0),
        )
    )
    args = [inputs[name] for name in ARRAYS]
    batched = per_example_grad(*args, quantizer_set, inputs["cotangent"])
    single = jax.jit(jax.grad(loss, argnums=tuple(range(6))))
    alone = [
        single(args[0][i], *args[1:], quantizer_set, inputs["cotangent"][i])
        for i in range(n_examples)
    ]
    stacked = jax.tree.map(lambda *leaves: jnp.stack(leaves), *alone)
    for name, a, e in zip(GRADIENTS, batched, stacked, strict=True):
        if name == "quantizer_set":
            assert_tree_equal(a, e, rtol=1e-6)
        else:
            assert_close(a, e, tolerance(F32), name)
    if isinstance(recipe, DelayedScaling):
        # Each example recorded its own amax.
        assert len(set(np.asarray(batched[5].x.amax_history[:, 0]).tolist())) == n_examples


# ----------------------------------------------------------------------------- residuals


@pytest.mark.parametrize("x_dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("recipe", RECIPES_AND_NONE)
def test_residuals_keep_only_x_in_high_precision(recipe, x_dtype):
    inputs = make_inputs(120, *SMALL, x_dtype=x_dtype)
    quantizer_set = fresh_state(recipe)

    def f(x, kernel, gamma, beta, bias, quantizer_set):
        return layernorm_dense(x, kernel, gamma, beta, bias, quantizer_set=quantizer_set)

    _, vjp_fn = jax.vjp(f, *(inputs[name] for name in ARRAYS), quantizer_set)
    leaves = jax.tree.leaves(vjp_fn)
    x, kernel = inputs["x"], inputs["kernel"]

    def saved(shape, dtypes):
        return [leaf for leaf in leaves if leaf.shape == shape and jnp.dtype(leaf.dtype) in dtypes]

    # Norm-output shape: x is the only high-precision array of that shape.
    high_precision = saved(x.shape, HIGH_PRECISION_DTYPES)
    assert len(high_precision) == 1, [(leaf.shape, leaf.dtype) for leaf in leaves]
    assert high_precision[0].dtype == x.dtype
    np.testing.assert_array_equal(high_precision[0], x)
    if recipe is None:
        assert saved(x.shape, FLOAT8_DTYPES) == []
        assert saved(kernel.shape, FLOAT8_DTYPES) == []
        assert len(saved(kernel.shape, HIGH_PRECISION_DTYPES)) == 1
    else:
        assert len(saved(x.shape, (jnp.dtype(recipe.fp8_format.forward_dtype),))) == 1
        assert saved(kernel.shape, HIGH_PRECISION_DTYPES) == []
        assert len(saved(kernel.shape, (jnp.dtype(recipe.fp8_format.forward_dtype),))) == 1


# ----------------------------------------------------------------------------- bad inputs


def _valid_arguments():
    inputs = make_inputs(130, (2, 4, 16), (16, 24))
    return {name: inputs[name] for name in ARRAYS}


_DELAYED = QuantizerFactory.create_set(fp8_recipe=DelayedScaling(amax_history_len=4))


def _bad(name, error, message, **overrides):
    return pytest.param(overrides, error, message, id=name)


_PARTIAL_SET = QuantizerSet(x=_DELAYED.x, kernel=_DELAYED.kernel)
_NOT_BOOL = "transpose_batch_sequence must be a bool"
_NOT_A_SET = r"quantizer_set must be a te_flax\.quantize\.QuantizerSet"
_BAD_EPSILON = "epsilon must be a positive finite number"

BAD_ARGUMENTS = [
    _bad("kernel-hidden", ValueError, r"kernel has shape \(8, 24\)", kernel=jnp.ones((8, 24))),
    _bad("kernel-1d", ValueError, r"kernel has shape \(16,\)", kernel=jnp.ones(16), bias=None),
    _bad(
        "kernel-int", TypeError, "kernel must be a floating-point", kernel=jnp.ones((16, 24), int)
    ),
    _bad("x-int", TypeError, "x must be a floating-point array, got int32", x=jnp.ones(16, int)),
    _bad("x-float8", TypeError, "x has dtype float8_e4m3fn", x=jnp.ones((2, 4, 16), E4M3)),
    _bad(
        "gamma-shape", ValueError, r"gamma has shape \(8,\) but must be \(16,\)", gamma=jnp.ones(8)
    ),
    _bad("gamma-rank", ValueError, r"gamma has shape \(1, 16\)", gamma=jnp.ones((1, 16))),
    _bad("gamma-int", TypeError, "gamma must be a floating-point", gamma=jnp.ones(16, int)),
    _bad("beta-shape", ValueError, r"beta has shape \(8,\)", beta=jnp.zeros(8)),
    _bad("beta-rmsnorm", ValueError, "beta must be None for rmsnorm", norm_type="rmsnorm"),
    _bad("beta-none", ValueError, "beta is None but layernorm needs a shift", beta=None),
    _bad(
        "bias-shape", ValueError, r"bias has shape \(12,\) but must be \(24,\)", bias=jnp.zeros(12)
    ),
    _bad("bias-int", TypeError, "bias must be a floating-point", bias=jnp.zeros(24, int)),
    _bad(
        "norm-type",
        ValueError,
        'norm_type must be "layernorm" or "rmsnorm", got \'batchnorm\'',
        norm_type="batchnorm",
    ),
    _bad("norm-type-none", ValueError, "norm_type must be", norm_type=None),
    _bad("epsilon-zero", ValueError, f"{_BAD_EPSILON}, got 0.0", epsilon=0.0),
    _bad("epsilon-negative", ValueError, _BAD_EPSILON, epsilon=-1e-6),
    _bad("epsilon-nan", ValueError, _BAD_EPSILON, epsilon=float("nan")),
    _bad("epsilon-bool", ValueError, _BAD_EPSILON, epsilon=True),
    _bad("zc-gamma-int", TypeError, "zero_centered_gamma must be a bool", zero_centered_gamma=1),
    _bad(
        "ln-axes-length",
        ValueError,
        "layernorm_input_axes=.* names 2 dimensions but x has 3",
        layernorm_input_axes=("batch", "embed"),
    ),
    _bad(
        "dot-axes-length",
        ValueError,
        "dot_input_axes=.* names 4 dimensions but x has 3",
        dot_input_axes=("batch", None, None, "embed"),
    ),
    _bad(
        "kernel-axes-length",
        ValueError,
        "kernel_axes=.* names 1 dimensions but kernel has 2",
        kernel_axes=("embed",),
    ),
    _bad(
        "axes-str",
        TypeError,
        "kernel_axes must be a tuple of logical axis names",
        kernel_axes="embed",
    ),
    _bad("axes-int", TypeError, "must hold axis names", dot_input_axes=("batch", 1, "embed")),
    _bad("partial-set", ValueError, "either fully FP8 or not at all", quantizer_set=_PARTIAL_SET),
    _bad("tbs-int", TypeError, f"{_NOT_BOOL}, got 1", transpose_batch_sequence=1),
    _bad("tbs-str", TypeError, _NOT_BOOL, transpose_batch_sequence="yes"),
    _bad("set-none", TypeError, f"{_NOT_A_SET}, got None", quantizer_set=None),
    _bad("set-recipe", TypeError, _NOT_A_SET, quantizer_set=DelayedScaling()),
]


@pytest.mark.parametrize("overrides, error, message", BAD_ARGUMENTS)
def test_bad_arguments_are_refused_with_a_clear_error(overrides, error, message):
    arguments = {**_valid_arguments(), **overrides}
    with pytest.raises(error, match=message):
        layernorm_dense(**arguments)


def test_empty_axes_mean_no_constraint():
    arguments = _valid_arguments()
    out = layernorm_dense(**arguments)
    constrained = layernorm_dense(
        **arguments, layernorm_input_axes=(), dot_input_axes=(), kernel_axes=()
    )
    np.testing.assert_array_equal(constrained, out)


# ----------------------------------------------------------------------------- sharding

MESH_SHAPE, MESH_AXES = (4, 2), ("data", "model")
AXIS_RULES = (("batch", "data"), ("embed", None), ("mlp", "model"))
AXES = {
    "layernorm_input_axes": ("batch", None, "embed"),
    "dot_input_axes": ("batch", None, "embed"),
    "kernel_axes": ("embed", "mlp"),
}
_CONSTRAINT = re.compile(r"sharding_constraint|mhlo\.sharding|@Sharding")


def _fresh_value_and_grads(**options):
    # A new function object each time: jit's trace cache does not see Flax's axis rules.
    def loss(x, kernel, gamma, beta, bias, quantizer_set, cotangent):
        return _loss(x, kernel, gamma, beta, bias, quantizer_set, cotangent, **options)

    return jax.jit(jax.value_and_grad(loss, argnums=tuple(range(6)), has_aux=True))


def _constraint_lines(hlo_text):
    return [line for line in hlo_text.splitlines() if _CONSTRAINT.search(line)]


@pytest.mark.parametrize("recipe", RECIPES_AND_NONE[:2])
def test_sharding_constraints_apply_only_with_rules_and_mesh(recipe):
    assert len(jax.devices()) == 8
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(MESH_SHAPE), MESH_AXES)
    quantizer_set = _state_for(recipe)
    inputs = make_inputs(140, (8, 4, 16), (16, 24))
    args = (*(inputs[name] for name in ARRAYS), quantizer_set, inputs["cotangent"])

    def lower(**options):
        return _fresh_value_and_grads(**options).lower(*args)

    def run(lowered):
        (_, out), grads = lowered.compile()(*args)
        return out, grads

    baseline = lower()
    baseline_out, baseline_grads = run(baseline)
    with jax.sharding.set_mesh(mesh), nn.logical_axis_rules(AXIS_RULES):
        sharded = lower(**AXES)
        out, grads = run(sharded)
        without_axes = lower()
    with jax.sharding.set_mesh(mesh):
        mesh_only = lower(**AXES)
    with nn.logical_axis_rules(AXIS_RULES):
        rules_only = lower(**AXES)

    for unconstrained in (baseline, without_axes, mesh_only, rules_only):
        assert _constraint_lines(unconstrained.as_text()) == []
    lines = _constraint_lines(sharded.as_text())
    assert_close(out, baseline_out, tolerance(F32), "out")
    for name, a, e in zip(GRADIENTS, grads, baseline_grads, strict=True):
        if name == "quantizer_set":
            assert_tree_equal(a, e, rtol=1e-6)
        else:
            assert_close(a, e, tolerance(F32), name)
    # Forward: x, the GEMM input and the kernel (float8 under FP8); backward: the norm-input
    # gradient and the kernel gradient.
    constrained = sorted(line.rsplit(":", 1)[-1].strip() for line in lines)
    if recipe is None:
        # Without FP8 the backward recomputes the GEMM input, and constrains it again.
        assert constrained.count("tensor<16x24xf32>") == 2, lines
        assert constrained.count("tensor<8x4x16xf32>") >= 3, lines
    else:
        expected = [
            "tensor<16x24xf32>",  # kernel gradient
            "tensor<16x24xf8E4M3FN>",  # quantized kernel
            "tensor<8x4x16xf32>",  # x
            "tensor<8x4x16xf32>",  # norm-input gradient
            # The quantized norm output, twice: first on the layout of the norm input it comes
            # from (each device quantizes its own shard, so a gather would move float8), then
            # on the GEMM's.
            "tensor<8x4x16xf8E4M3FN>",
            "tensor<8x4x16xf8E4M3FN>",
        ]
        assert constrained == sorted(expected), lines
    assert all('{"data"}' in line for line in lines if "8x4x16" in line), lines
    assert all('{"model"}' in line for line in lines if "16x24" in line), lines


def test_with_norm_output_takes_the_ops_arguments_by_position_and_by_name():
    """``layernorm_dense_with_norm_output`` reads its arguments as ``layernorm_dense`` does
    (positions, names and defaults), returns the op's output and the norm output, and refuses
    a call that the op refuses."""
    inputs = make_inputs(0, (3, 16), (16, 5), norm_type="rmsnorm")
    x, kernel, gamma = inputs["x"], inputs["kernel"], inputs["gamma"]
    expected = layernorm_dense(x, kernel, gamma, None, None, "rmsnorm", False, 1e-5)
    by_position = layernorm_dense_with_norm_output(
        x, kernel, gamma, None, None, "rmsnorm", False, 1e-5
    )
    by_name = layernorm_dense_with_norm_output(
        x, kernel, gamma=gamma, beta=None, norm_type="rmsnorm", epsilon=1e-5
    )
    norm = reference_norm(x, gamma, None, "rmsnorm", eps=1e-5)
    for out, ln in (by_position, by_name):
        np.testing.assert_array_equal(out, expected)
        np.testing.assert_allclose(ln, norm, rtol=1e-5, atol=1e-5)
    with pytest.raises(TypeError, match="unexpected keyword argument 'layernorm_type'"):
        layernorm_dense_with_norm_output(x, kernel, gamma, None, layernorm_type="rmsnorm")
