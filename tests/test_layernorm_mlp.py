"""layernorm_mlp: against an unfused reference, in FP8 against fake-quant, its residuals, errors."""

from __future__ import annotations

import dataclasses
import weakref
from functools import partial

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.test_util import check_grads

from te_flax._ops.activations import activation_forward
from te_flax._ops.lora import lora_delta
from te_flax.dense import dense
from te_flax.layernorm_dense import layernorm_dense_with_norm_output
from te_flax.layernorm_mlp import layernorm_mlp, layernorm_mlp_with_norm_output
from te_flax.quantize import (
    DelayedScaling,
    Float8CurrentScaling,
    Format,
    QuantizerFactory,
    QuantizerSet,
    merge_by_max,
    noop_quantizer_set,
)
from tests.helpers import (
    F32,
    FP8_BACKWARD_TOLERANCE,
    FP8_FORWARD_TOLERANCE,
    HIGHEST,
    amax_of,
    assert_close,
    grad_fake_quant,
    normal,
    reference_norm,
    relative_error,
    straight_through_fake_quant,
    tolerance,
)

HIDDEN, INTERMEDIATE = 16, 32
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
# The activations with an independent reference below (the others are checked in combinations).
CORE = ("gelu", "gelu_exact", "silu", "relu", "quick_gelu", "squared_relu", "linear")
SINGLE = tuple((name,) for name in CORE)
GATED = tuple((name, "linear") for name in CORE)
# Argument order of the differentiated functions below.
NAMES = ("x", "gamma", "beta", "kernel_1", "kernel_2", "bias_1", "bias_2")

# Independent references of the activations, written from their definitions.
REFERENCE_ACTIVATIONS = {
    "gelu": lambda h: 0.5 * h * (1 + jnp.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h**3))),
    "gelu_exact": lambda h: 0.5 * h * (1 + lax.erf(h / np.sqrt(2.0))),
    "silu": lambda h: h / (1 + jnp.exp(-h)),
    "relu": lambda h: jnp.maximum(h, 0.0),
    "quick_gelu": lambda h: h / (1 + jnp.exp(-1.702 * h)),
    "squared_relu": lambda h: jnp.maximum(h, 0.0) ** 2,
    "linear": lambda h: h,
    "tanh": lambda h: (jnp.exp(h) - jnp.exp(-h)) / (jnp.exp(h) + jnp.exp(-h)),
}
# Combinations beyond one activation and a gated pair with "linear": each slice through its own
# activation, the results multiplied (TransformerEngine's unfused LayerNormMLP).
COMBINATIONS = (("gelu", "tanh", "linear"),)


def make_inputs(activation_type, norm_type="layernorm", use_bias=True, dtype=F32, shape=(2, 3)):
    n_act = len(activation_type)
    keys = jax.random.split(jax.random.key(len(activation_type) + 7 * len(shape)), 8)
    return dict(
        x=normal(keys[0], (*shape, HIDDEN), dtype, 2.0) + jnp.asarray(0.5, dtype),
        gamma=1.0 + normal(keys[1], (HIDDEN,), F32, 0.1),
        beta=normal(keys[2], (HIDDEN,), F32, 0.1) if norm_type == "layernorm" else None,
        kernel_1=normal(keys[3], (HIDDEN, n_act, INTERMEDIATE), F32, HIDDEN**-0.5),
        kernel_2=normal(keys[4], (INTERMEDIATE, HIDDEN), F32, INTERMEDIATE**-0.5),
        bias_1=normal(keys[5], (n_act, INTERMEDIATE), F32, 0.1) if use_bias else None,
        bias_2=normal(keys[6], (HIDDEN,), F32, 0.1) if use_bias else None,
        cotangent=normal(keys[7], (*shape, HIDDEN), F32),
    )


def reference_mlp(
    x,
    gamma,
    beta,
    kernel_1,
    kernel_2,
    bias_1,
    bias_2,
    *,
    norm_type,
    activation_type,
    zero_centered_gamma=False,
    scales=None,
    formats=(E4M3, E4M3),
):
    """Unfused float32 norm, GEMM, activation, GEMM; with ``scales`` the same fake-quantized.

    ``scales`` = ``((x_1, kernel_1, grad_1), (x_2, kernel_2, grad_2))`` are the ``scale_inv``
    values the op quantizes each GEMM operand and output gradient with; ``formats`` are the
    forward and gradient float8 types.
    """
    identity = lambda value: value  # noqa: E731
    forward_q = [[identity, identity, identity], [identity, identity, identity]]
    if scales is not None:
        for gemm in range(2):
            forward_q[gemm] = [
                partial(straight_through_fake_quant, scale_inv=scales[gemm][0], dtype=formats[0]),
                partial(straight_through_fake_quant, scale_inv=scales[gemm][1], dtype=formats[0]),
                grad_fake_quant(scales[gemm][2], formats[1]),
            ]
    y = reference_norm(x, gamma, beta, norm_type, zero_centered_gamma)
    # [b.., hidden] x [hidden, n_act, inter] -> [b.., n_act, inter]
    h = jnp.einsum(
        "...d,dai->...ai", forward_q[0][0](y), forward_q[0][1](kernel_1), precision=HIGHEST
    )
    h = forward_q[0][2](h)
    if bias_1 is not None:
        h = h + jnp.broadcast_to(bias_1, h.shape)
    a = REFERENCE_ACTIVATIONS[activation_type[0]](h[..., 0, :])
    for index, name in enumerate(activation_type[1:], start=1):
        a = a * REFERENCE_ACTIVATIONS[name](h[..., index, :])
    # [b.., inter] x [inter, hidden] -> [b.., hidden]
    out = jnp.einsum(
        "...i,id->...d", forward_q[1][0](a), forward_q[1][1](kernel_2), precision=HIGHEST
    )
    out = forward_q[1][2](out)
    return out if bias_2 is None else out + jnp.broadcast_to(bias_2, out.shape)


def te_mlp(x, gamma, beta, kernel_1, kernel_2, bias_1, bias_2, quantizer_sets=None, **options):
    if quantizer_sets is not None:
        options["quantizer_sets"] = quantizer_sets
    return layernorm_mlp(x, gamma, beta, [kernel_1, kernel_2], [bias_1, bias_2], **options)


# The jitted steps of loss_and_grads by function: a function called again (a loop over
# training steps) reuses its compiled step instead of tracing and compiling it again.
_STEPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _step(function, argnums):
    def loss(cotangent, *all_args):
        out = function(*all_args)
        return jnp.sum(out.astype(F32) * cotangent), out

    steps = _STEPS.setdefault(function, {})
    if argnums not in steps:
        shifted = tuple(index + 1 for index in argnums)  # after the cotangent
        steps[argnums] = jax.jit(jax.value_and_grad(loss, shifted, has_aux=True))
    return steps[argnums]


def loss_and_grads(function, inputs, *extra, differentiate_extra=True):
    """Value, output and gradients of ``sum(function(...) * cotangent)`` for every array input
    (and the ``extra`` arguments unless ``differentiate_extra`` is False)."""
    args = [inputs[name] for name in NAMES]
    present = tuple(i for i, a in enumerate(args) if a is not None)
    argnums = present
    if differentiate_extra:
        argnums += tuple(range(len(args), len(args) + len(extra)))
    step = _step(function, argnums)
    (_, out), grads = step(inputs["cotangent"], *args, *extra)
    named = dict(zip((NAMES[i] for i in present), grads[: len(present)], strict=True))
    return out, named, grads[len(present) :]


# ----------------------------------------------------------------------------- no quantization


def _reference_cases():
    """Every activation x norm type x bias x dtype; the fast subset runs every activation once
    and every other option on GELU and SwiGLU."""
    cases = []
    for activation_type in SINGLE + GATED:
        for norm_type in ("layernorm", "rmsnorm"):
            for use_bias in (True, False):
                for dtype in (F32, jnp.bfloat16):
                    fast = (norm_type, use_bias, dtype) == ("layernorm", True, F32) or (
                        activation_type in (("gelu",), ("silu", "linear"))
                    )
                    bias = "bias" if use_bias else "nobias"
                    name = "-".join([*activation_type, norm_type, bias, jnp.dtype(dtype).name])
                    marks = () if fast else (pytest.mark.slow,)
                    cases.append(
                        pytest.param(
                            activation_type, norm_type, use_bias, dtype, id=name, marks=marks
                        )
                    )
    for activation_type in COMBINATIONS:
        name = "-".join([*activation_type, "layernorm", "bias", "float32"])
        cases.append(pytest.param(activation_type, "layernorm", True, F32, id=name))
    return cases


@pytest.mark.parametrize(("activation_type", "norm_type", "use_bias", "dtype"), _reference_cases())
def test_matches_unfused_reference(activation_type, norm_type, use_bias, dtype):
    inputs = make_inputs(activation_type, norm_type, use_bias, dtype)
    options = dict(norm_type=norm_type, activation_type=activation_type)
    out, grads, _ = loss_and_grads(lambda *a: te_mlp(*a, **options), inputs)
    f32_inputs = {k: None if v is None else v.astype(F32) for k, v in inputs.items()}
    expected_out, expected_grads, _ = loss_and_grads(
        lambda *a: reference_mlp(*a, **options), f32_inputs
    )
    assert out.dtype == dtype
    # bf16 rounds the norm output, the kernels, the pre-activation and the activation output:
    # four roundings of 2^-9 in a row, plus the activation's slope on them.
    tol = tolerance(dtype) * (1 if dtype == F32 else 2)
    assert_close(out, expected_out, tol, "out")
    assert set(grads) == set(expected_grads)
    for name, grad in grads.items():
        assert grad.dtype == inputs[name].dtype, name
        assert_close(grad, expected_grads[name], tol, name)


def test_zero_centered_gamma_and_the_pair_order():
    inputs = make_inputs(("silu", "linear"), "rmsnorm")
    args = [inputs[name] for name in NAMES]
    zero_centered = te_mlp(
        *args, norm_type="rmsnorm", zero_centered_gamma=True, activation_type=("linear", "silu")
    )
    expected = reference_mlp(
        *args, norm_type="rmsnorm", zero_centered_gamma=True, activation_type=("silu", "linear")
    )
    assert_close(zero_centered, expected, tolerance(F32))


@pytest.mark.parametrize("activation_type", [("gelu",), ("silu", "linear")], ids="-".join)
def test_gradients_match_finite_differences(activation_type):
    inputs = make_inputs(activation_type, shape=(3,))
    args = [inputs[name] for name in NAMES]
    check_grads(
        lambda *a: te_mlp(*a, norm_type="layernorm", activation_type=activation_type),
        args,
        order=1,
        modes=["rev"],
        atol=2e-2,
        rtol=2e-2,
    )


# ----------------------------------------------------------------------------- FP8


def _scales_used(sets, recipe):
    """The ``scale_inv`` each operand is quantized with in the step that starts from ``sets``.

    None under current scaling, where the reference derives each from the tensor itself.
    """
    if isinstance(recipe, DelayedScaling):
        # As in TransformerEngine's fused op, the first set's gradient quantizer takes GEMM 2's
        # output gradient and the second set's GEMM 1's.
        set_1, set_2 = sets
        return (
            (set_1.x.scale_inv[0], set_1.kernel.scale_inv[0], set_2.dgrad.scale_inv[0]),
            (set_2.x.scale_inv[0], set_2.kernel.scale_inv[0], set_1.dgrad.scale_inv[0]),
        )
    return ((None, None, None), (None, None, None))


def _activation(h, activation_type, inputs):
    if inputs["bias_1"] is not None:
        h = h + jnp.broadcast_to(inputs["bias_1"], h.shape)
    a = REFERENCE_ACTIVATIONS[activation_type[0]](h[..., 0, :])
    return a if len(activation_type) == 1 else a * h[..., 1, :]


RECIPES = [
    DelayedScaling(amax_history_len=4),
    DelayedScaling(amax_history_len=4, fp8_format=Format.E4M3),
    Float8CurrentScaling(),
]


@pytest.mark.parametrize("recipe", RECIPES, ids=["delayed", "delayed-e4m3", "current"])
@pytest.mark.parametrize("activation_type", [("gelu",), ("silu", "linear")], ids="-".join)
def test_fp8_matches_fake_quant_reference_over_steps(recipe, activation_type):
    norm_type = "layernorm"
    inputs = make_inputs(activation_type, norm_type)
    options = dict(norm_type=norm_type, activation_type=activation_type)
    formats = (recipe.fp8_format.forward_dtype, recipe.fp8_format.backward_dtype)
    unquantized_out, unquantized_grads, _ = loss_and_grads(
        lambda *a: reference_mlp(*a, **options), inputs
    )
    sets = QuantizerFactory.create_set(2, fp8_recipe=recipe)

    # Defined once: the three steps reuse one compiled step each (the scales are arguments).
    def fp8_mlp(*args):
        return te_mlp(*args[:-1], quantizer_sets=args[-1], **options)

    def fake_quant_mlp(*args):
        return reference_mlp(*args[:-1], scales=args[-1], formats=formats, **options)

    for _ in range(3):
        scales = _scales_used(sets, recipe)
        out, grads, (new_sets,) = loss_and_grads(fp8_mlp, inputs, sets)
        expected_out, expected_grads, _ = loss_and_grads(
            fake_quant_mlp, inputs, scales, differentiate_extra=False
        )
        # Same scales, same roundings: only summation order differs (a rounding boundary may
        # flip for a handful of elements).
        assert relative_error(out, expected_out) < 5e-3
        assert relative_error(out, unquantized_out) < FP8_FORWARD_TOLERANCE
        for name, grad in grads.items():
            assert relative_error(grad, expected_grads[name]) < 5e-3, name
            assert relative_error(grad, unquantized_grads[name]) < FP8_BACKWARD_TOLERANCE, name
        sets = new_sets


def test_delayed_state_of_both_sets_follows_the_recipe():
    activation_type = ("gelu",)
    inputs = make_inputs(activation_type)
    recipe = DelayedScaling(amax_history_len=3)
    sets = QuantizerFactory.create_set(2, fp8_recipe=recipe)
    y = reference_norm(inputs["x"], inputs["gamma"], inputs["beta"])
    h = jnp.einsum("...d,dai->...ai", y, inputs["kernel_1"], precision=HIGHEST)
    activated = _activation(h, activation_type, inputs)
    _, vjp = jax.vjp(lambda hh: _activation(hh, activation_type, inputs), h)
    (d_h,) = vjp(inputs["cotangent"] @ inputs["kernel_2"].T)
    # TransformerEngine's names: set 0's gradient state is the layer's output gradient (GEMM
    # 2's), set 1's the activation gradient (GEMM 1's output gradient).
    expected_amax = (
        (amax_of(y), amax_of(inputs["kernel_1"]), amax_of(inputs["cotangent"])),
        (amax_of(activated), amax_of(inputs["kernel_2"]), amax_of(d_h)),
    )

    def fp8_mlp(*args):
        return te_mlp(
            *args[:-1], quantizer_sets=args[-1], activation_type=activation_type,
            norm_type="layernorm",
        )  # fmt: skip

    for step in range(4):
        _, _, (new_sets,) = loss_and_grads(fp8_mlp, inputs, sets)
        for gemm in range(2):
            old = (sets[gemm].x, sets[gemm].kernel, sets[gemm].dgrad)
            new = (new_sets[gemm].x, new_sets[gemm].kernel, new_sets[gemm].dgrad)
            for role, (before, after) in enumerate(zip(old, new, strict=True)):
                what = f"step {step} gemm {gemm} role {role}"
                # The pre-activation gradient depends on FP8 roundings of earlier GEMMs.
                rtol = 0.1 if (gemm, role) == (1, 2) else 2e-2
                np.testing.assert_allclose(
                    after.amax_history[0], expected_amax[gemm][role], rtol=rtol, err_msg=what
                )
                np.testing.assert_array_equal(after.amax_history[1:], before.amax_history[:-1])
                fp8_max = float(jnp.finfo(after.q_dtype).max)
                np.testing.assert_allclose(
                    after.scale_inv, jnp.max(after.amax_history) / fp8_max, rtol=1e-6, err_msg=what
                )
        sets = new_sets


def test_reused_sets_merge_by_max():
    activation_type = ("gelu",)
    inputs = make_inputs(activation_type)
    args = [inputs[name] for name in NAMES]
    sets = QuantizerFactory.create_set(2, fp8_recipe=DelayedScaling(amax_history_len=4))
    options = dict(norm_type="layernorm", activation_type=activation_type)

    def new_sets(x_values, sets):
        def loss(sets):
            merged = merge_by_max(sets)
            return sum(jnp.sum(te_mlp(x, *args[1:], merged, **options)) for x in x_values)

        return jax.jit(jax.grad(loss))(sets)

    small, large = inputs["x"], 3.0 * inputs["x"]
    both = new_sets([small, large], sets)
    expected = jax.tree.map(jnp.maximum, new_sets([small], sets), new_sets([large], sets))
    jax.tree.map(np.testing.assert_array_equal, both, expected)


# ----------------------------------------------------------------------------- residuals, remat


def _saved(function, inputs, *extra):
    args = [inputs[name] for name in NAMES]
    _, vjp = jax.vjp(lambda x: function(x, *args[1:], *extra), inputs["x"])
    return [(leaf.shape, jnp.dtype(leaf.dtype)) for leaf in jax.tree.leaves(vjp)]


@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "nofp8"])
def test_no_high_precision_norm_or_activation_output_is_saved(fp8):
    inputs = make_inputs(("gelu",))
    sets = QuantizerFactory.create_set(2, fp8_recipe=DelayedScaling() if fp8 else None)
    saved = _saved(
        lambda *a: te_mlp(*a, norm_type="layernorm", activation_type=("gelu",)), inputs, sets
    )
    batch = inputs["x"].shape[:-1]
    norm_output, activation_output = (*batch, HIDDEN), (*batch, INTERMEDIATE)
    high = [shape for shape, dtype in saved if dtype in (jnp.dtype(F32), jnp.dtype(jnp.bfloat16))]
    low = [shape for shape, dtype in saved if dtype in (jnp.dtype(E4M3), jnp.dtype(E5M2))]
    assert high.count(norm_output) == 1  # x itself
    assert activation_output not in high
    assert (*batch, 1, INTERMEDIATE) in high  # the pre-activation
    if fp8:
        assert sorted(low) == sorted(
            [norm_output, (HIDDEN, 1, INTERMEDIATE), activation_output, (INTERMEDIATE, HIDDEN)]
        )
        assert (HIDDEN, 1, INTERMEDIATE) not in high and (INTERMEDIATE, HIDDEN) not in high
    else:
        assert low == []


def test_checkpoint_policy_decides_what_is_saved():
    inputs = make_inputs(("gelu",))
    args = [inputs[name] for name in NAMES]
    pre_activation = (*inputs["x"].shape[:-1], 1, INTERMEDIATE)

    def saved_shapes(policy):
        function = jax.checkpoint(
            lambda x: te_mlp(x, *args[1:], norm_type="layernorm", ffn1_ckpt_name="my_ffn1"),
            policy=policy,
        )
        _, vjp = jax.vjp(function, inputs["x"])
        return [leaf.shape for leaf in jax.tree.leaves(vjp)]

    keep_named = saved_shapes(jax.checkpoint_policies.save_only_these_names("my_ffn1"))
    keep_nothing = saved_shapes(jax.checkpoint_policies.nothing_saveable)
    assert pre_activation in keep_named
    assert pre_activation not in keep_nothing
    # Both policies give the right gradients.
    reference = jax.grad(lambda x: jnp.sum(te_mlp(x, *args[1:], norm_type="layernorm")))(args[0])
    policies = jax.checkpoint_policies
    for policy in (policies.nothing_saveable, policies.everything_saveable):
        remat = jax.checkpoint(lambda x: te_mlp(x, *args[1:], norm_type="layernorm"), policy=policy)
        grad = jax.grad(lambda x, remat=remat: jnp.sum(remat(x)))(args[0])
        np.testing.assert_allclose(grad, reference, rtol=1e-6)


def test_vmap_of_the_loss_gives_per_example_gradients():
    inputs = make_inputs(("silu", "linear"), shape=(3, 2))
    args = [inputs[name] for name in NAMES]
    options = dict(norm_type="layernorm", activation_type=("silu", "linear"))

    def grad_kernel_1(x, kernel_1):
        return jax.grad(lambda k: jnp.sum(te_mlp(x, *args[1:3], k, *args[4:], **options)))(kernel_1)

    batched = jax.vmap(grad_kernel_1, in_axes=(0, None))(args[0], args[3])
    for i in range(args[0].shape[0]):
        np.testing.assert_allclose(
            batched[i], grad_kernel_1(args[0][i], args[3]), rtol=1e-5, atol=1e-6
        )


# ----------------------------------------------------------------------------- errors


def _call(**changes):
    inputs = make_inputs(changes.pop("activation_for_inputs", ("gelu",)))
    call = dict(
        x=inputs["x"],
        gamma=inputs["gamma"],
        beta=inputs["beta"],
        kernels=[inputs["kernel_1"], inputs["kernel_2"]],
        biases=[inputs["bias_1"], inputs["bias_2"]],
        norm_type="layernorm",
    )
    call.update(changes)
    return layernorm_mlp(**call)


@pytest.mark.parametrize(
    ("changes", "error", "match"),
    [
        (
            dict(kernels=[jnp.ones((HIDDEN, INTERMEDIATE)), jnp.ones((INTERMEDIATE, HIDDEN))]),
            ValueError,
            r"kernels\[0\] has shape \(16, 32\) but must be \[hidden, n_act",
        ),
        (dict(activation_type=("silu", "linear")), ValueError, r"= \[16, 2, intermediate\]"),
        (
            dict(kernels=[jnp.ones((HIDDEN, 1, INTERMEDIATE)), jnp.ones((8, HIDDEN))]),
            ValueError,
            r"kernels\[1\] has shape \(8, 16\) but must be \(32, 16\)",
        ),
        (dict(kernels=[jnp.ones((HIDDEN, 1, INTERMEDIATE))]), TypeError, "kernels must be a pair"),
        (dict(activation_type=("swish",)), ValueError, "unknown activation 'swish'"),
        (dict(activation_type="gelu"), TypeError, "must be a tuple of activation names"),
        (dict(activation_type=()), TypeError, "must be a non-empty tuple"),
        (
            dict(intermediate_dropout_rate=0.1),
            ValueError,
            "intermediate_dropout_rate=0.1 needs intermediate_dropout_rng",
        ),
        (
            dict(low_rank_adaptation_kernels=[jnp.ones((HIDDEN, 1, 4))] * 4),
            ValueError,
            r"low_rank_adaptation_kernels\[1\] has shape \(16, 1, 4\) but must be",
        ),
        (dict(biases=[jnp.ones((INTERMEDIATE,)), None]), ValueError, r"biases\[0\] has shape"),
        (dict(biases=[None, jnp.ones((INTERMEDIATE,))]), ValueError, r"biases\[1\] has shape"),
        (dict(biases=[None]), TypeError, "biases must be a pair"),
        (dict(norm_type="rmsnorm"), ValueError, "beta"),
        (dict(norm_type="batchnorm"), ValueError, "norm_type"),
        (dict(quantizer_sets=noop_quantizer_set), TypeError, "quantizer_sets must be a pair"),
        (
            dict(quantizer_sets=(noop_quantizer_set, QuantizerSet(x=1, kernel=1, dgrad=1))),
            TypeError,
            r"quantizer_sets\[1\]",
        ),
        (dict(kernel_1_axes=("embed", "mlp")), ValueError, "kernel_1_axes"),
        (dict(dot_2_input_axes=("batch", "mlp")), ValueError, "dot_2_input_axes"),
        (dict(ffn1_ckpt_name=1), TypeError, "ffn1_ckpt_name"),
        (dict(x=jnp.ones((2, HIDDEN), jnp.int32)), TypeError, "x must be a floating-point"),
    ],
)
def test_bad_input_is_refused_with_a_clear_error(changes, error, match):
    with pytest.raises(error, match=match):
        _call(**changes)


# ------------------------------------------------- dropout, LoRA and the norm output in the op


def _composed_mlp(inputs, lora, sets, rng, *, rate, dims, alpha, activation_type):
    """The composed path LayerNormMLP ran before the op took the dropout, LoRA and the norm
    output: layernorm_dense, the activation, flax's Dropout, dense, LoRA beside each GEMM, with
    the gradient quantizers exchanged so that grad_0 / grad_1 mean what the fused op's do."""
    set_1, set_2 = sets
    set_1, set_2 = (
        dataclasses.replace(set_1, dgrad=set_2.dgrad),
        dataclasses.replace(set_2, dgrad=set_1.dgrad),
    )
    x, gamma, beta, kernel_1, kernel_2, bias_1, bias_2 = (inputs[name] for name in NAMES)
    pre, ln = layernorm_dense_with_norm_output(
        x, kernel_1, gamma, beta, bias_1, quantizer_set=set_1
    )
    rank = lora[0].shape[-1]
    pre = pre + lora_delta(ln, lora[0], lora[1], 1, rank, alpha).astype(pre.dtype)
    activated = activation_forward(pre, activation_type)
    if rate:
        dropout = nn.Dropout(rate, broadcast_dims=dims)
        activated = dropout.apply({}, activated, deterministic=False, rng=rng)
    out = dense(activated, kernel_2, bias_2, quantizer_set=set_2)
    out = out + lora_delta(activated, lora[2], lora[3], 1, rank, alpha).astype(out.dtype)
    return out, ln


def _fused_mlp(inputs, lora, sets, rng, *, rate, dims, alpha, activation_type):
    x, gamma, beta, kernel_1, kernel_2, bias_1, bias_2 = (inputs[name] for name in NAMES)
    return layernorm_mlp_with_norm_output(
        x, gamma, beta, [kernel_1, kernel_2], [bias_1, bias_2], "layernorm",
        activation_type=activation_type, quantizer_sets=sets, intermediate_dropout_rate=rate,
        intermediate_dropout_rng=rng, intermediate_dropout_dims=dims,
        low_rank_adaptation_kernels=lora, low_rank_adaptation_alpha=alpha,
    )  # fmt: skip


def _lora_kernels(n_act, rank=4):
    keys = jax.random.split(jax.random.key(3), 4)
    shapes = ((HIDDEN, n_act, rank), (n_act, rank, INTERMEDIATE), (INTERMEDIATE, rank))
    shapes += ((rank, HIDDEN),)
    return tuple(normal(key, shape, F32, 0.3) for key, shape in zip(keys, shapes, strict=True))


@pytest.mark.parametrize(
    ("fp8", "rate", "dims", "activation_type"),
    [
        (True, 0.5, (1,), ("silu", "linear")),
        pytest.param(False, 0.25, (), ("gelu",), marks=pytest.mark.slow),
    ],
    ids=["fp8-swiglu-dropout-dims", "nofp8-gelu-dropout"],
)
def test_fused_dropout_lora_and_norm_output_equal_the_composed_path(
    fp8, rate, dims, activation_type
):
    """Values, every gradient (LoRA's too) and the new FP8 state of the fused op with dropout,
    LoRA and the norm output equal the composed path's, with the same dropout key."""
    inputs = make_inputs(activation_type)
    inputs["x"] = normal(jax.random.key(5), (4, 6, HIDDEN), F32, 2.0)
    cotangents = normal(jax.random.key(6), (2, 4, 6, HIDDEN), F32)
    lora = _lora_kernels(len(activation_type))
    recipe = DelayedScaling(amax_history_len=4) if fp8 else None
    sets = QuantizerFactory.create_set(2, fp8_recipe=recipe)
    options = dict(rate=rate, dims=dims, alpha=8.0, activation_type=activation_type)

    def step(mlp, inputs, lora, sets):
        def loss(inputs, lora, sets):
            out, ln = mlp(inputs, lora, sets, jax.random.key(7), **options)
            return jnp.sum(out * cotangents[0]) + jnp.sum(ln * cotangents[1]), out

        return jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(inputs, lora, sets)

    inputs = {k: v for k, v in inputs.items() if k != "cotangent"}
    (_, out), grads = jax.jit(partial(step, _fused_mlp))(inputs, lora, sets)
    (_, expected), expected_grads = jax.jit(partial(step, _composed_mlp))(inputs, lora, sets)
    # The mask drops what it should: a quarter or half of the activation output is zero.
    assert_close(out, expected, 1e-5, "out")
    flat, tree = jax.tree.flatten_with_path(grads)
    expected_flat, expected_tree = jax.tree.flatten_with_path(expected_grads)
    assert tree == expected_tree
    for (path, value), (_, expected_value) in zip(flat, expected_flat, strict=True):
        # The FP8 state (amax histories and scales) is equal bit for bit; gradients within
        # float32 rounding of the same operations fused differently.
        if "amax" in jax.tree_util.keystr(path) or "scale" in jax.tree_util.keystr(path):
            np.testing.assert_array_equal(value, expected_value, jax.tree_util.keystr(path))
        else:
            assert_close(value, expected_value, 1e-5, jax.tree_util.keystr(path))


def test_dropout_mask_is_drawn_from_the_key_and_not_saved():
    """Different keys drop different units, the same key the same ones, and the backward keeps
    no mask: the saved residuals are those of the op without dropout, and the key."""
    inputs = make_inputs(("gelu",))
    sets = QuantizerFactory.create_set(2, fp8_recipe=DelayedScaling())
    args = [inputs[name] for name in NAMES]

    def mlp(key, *args, rate=0.5):
        return te_mlp(
            *args, sets, norm_type="layernorm", intermediate_dropout_rate=rate,
            intermediate_dropout_rng=key,
        )  # fmt: skip

    run = jax.jit(mlp)
    first = run(jax.random.key(0), *args)
    assert np.array_equal(first, run(jax.random.key(0), *args))
    assert not np.array_equal(first, run(jax.random.key(1), *args))

    def saved(rate):
        function = partial(mlp, jax.random.key(0), rate=rate)
        residuals = jax.eval_shape(
            lambda x: jax.tree.leaves(jax.vjp(lambda x: function(x, *args[1:]), x)[1]),
            inputs["x"],
        )
        return [(leaf.shape, str(leaf.dtype)) for leaf in residuals]

    with_dropout, without = saved(0.5), saved(0.0)
    extra = [item for item in with_dropout if item not in without]
    assert extra == [((), "key<fry>")], extra


def test_with_norm_output_takes_the_ops_arguments_by_position_and_by_name():
    """``layernorm_mlp_with_norm_output`` reads its arguments as ``layernorm_mlp`` does
    (positions, names, defaults and keyword-only options), returns the op's output and the
    norm output, and refuses a call that the op refuses."""
    inputs = make_inputs(("gelu",))
    x, gamma, beta = inputs["x"], inputs["gamma"], inputs["beta"]
    kernels, biases = [inputs["kernel_1"], inputs["kernel_2"]], [inputs["bias_1"], None]
    expected = layernorm_mlp(x, gamma, beta, kernels, biases, "layernorm", epsilon=1e-5)
    by_position = layernorm_mlp_with_norm_output(
        x, gamma, beta, kernels, biases, "layernorm", False, 1e-5
    )
    by_name = layernorm_mlp_with_norm_output(
        x=x, gamma=gamma, beta=beta, kernels=kernels, biases=biases, norm_type="layernorm",
        epsilon=1e-5, intermediate_dropout_rate=0.0,
    )  # fmt: skip
    norm = reference_norm(x, gamma, beta, eps=1e-5)
    for out, ln in (by_position, by_name):
        np.testing.assert_array_equal(out, expected)
        assert_close(ln, norm, 1e-5, "norm output")
    # The 20 positional parameters of TransformerEngine's signature, then a 21st: the options
    # after them (intermediate_dropout_rate, ...) are keyword-only, as in layernorm_mlp.
    positional = (x, gamma, beta, kernels, biases, "layernorm", False, 1e-5, False)
    positional += (None,) * 5 + ("ffn1", "ffn2", ("gelu",), None) + (None, None) + (0.0,)
    with pytest.raises(TypeError, match="takes from 6 to 20 positional arguments but 21"):
        layernorm_mlp_with_norm_output(*positional)
    with pytest.raises(TypeError, match="unexpected keyword argument 'dropout_rate'"):
        layernorm_mlp_with_norm_output(
            x, gamma, beta, kernels, biases, "layernorm", dropout_rate=0.1
        )
