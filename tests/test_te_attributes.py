"""TransformerEngine 2.20.2 attributes: clamped SwiGLU (``activation_params``), the quantized
tensors' checkpoint name (``quantization_checkpoint_name``), ``score_mod`` /
``score_mod_bprop`` and ``return_max_logit``, each against a hand-written reference."""

from __future__ import annotations

import contextlib
import io
from functools import partial

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import te_flax.linen as te_nn
import te_flax.nnx as te_nnx
from te_flax._ops import mlp as _mlp
from te_flax._ops.kernels import pallas_kernels
from te_flax.attention import dot_product_attention
from te_flax.dense import dense
from te_flax.layernorm_mlp import layernorm_mlp
from te_flax.quantize import DelayedScaling, Float8CurrentScaling, QuantizerFactory
from tests.helpers import (
    F32,
    FP8_FORWARD_TOLERANCE,
    HIGHEST,
    assert_close,
    grad_fake_quant,
    normal,
    reference_norm,
    relative_error,
    straight_through_fake_quant,
    tolerance,
)

HIDDEN, INTERMEDIATE = 16, 32
CLAMPED = ("clamped_silu", "clamped_linear")
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2

# ----------------------------------------------------------------------------- clamped SwiGLU


def reference_clamped_swiglu(h, limit=7.0, alpha=1.702, offset=1.0):
    """gpt-oss's clamped SwiGLU, written from its definition: ``[..., 2, F] -> [..., F]``."""
    gate = jnp.minimum(h[..., 0, :], limit)
    linear = jnp.minimum(jnp.maximum(h[..., 1, :], -limit), limit)
    return gate / (1 + jnp.exp(-alpha * gate)) * (linear + offset)


def reference_mlp(x, gamma, beta, kernels, biases, fp8_scale_inv=False, **params):
    """Unfused float32 norm, GEMM, clamped SwiGLU, GEMM. With ``fp8_scale_inv`` (a scale, or
    None for current scaling) each GEMM operand is fake-quantized to e4m3 and each GEMM
    output's gradient to e5m2, as the FP8 op quantizes them."""
    operand = gradient = lambda value: value
    if fp8_scale_inv is not False:
        operand = partial(straight_through_fake_quant, scale_inv=fp8_scale_inv, dtype=E4M3)
        gradient = grad_fake_quant(fp8_scale_inv, E5M2)
    ln = reference_norm(x, gamma, beta)
    # [b, s, hidden] x [hidden, 2, inter] -> [b, s, 2, inter]
    h = jnp.einsum("bsh,hai->bsai", operand(ln), operand(kernels[0]), precision=HIGHEST)
    a = reference_clamped_swiglu(gradient(h) + biases[0][None, None], **params)
    # [b, s, inter] x [inter, hidden] -> [b, s, hidden]
    out = jnp.einsum("bsi,ih->bsh", operand(a), operand(kernels[1]), precision=HIGHEST)
    return gradient(out) + biases[1][None, None]


def mlp_inputs(scale=3.0):
    keys = jax.random.split(jax.random.key(0), 6)
    x = normal(keys[0], (2, 3, HIDDEN))
    gamma = 1 + 0.1 * normal(keys[1], (HIDDEN,))
    beta = 0.1 * normal(keys[2], (HIDDEN,))
    # Large enough pre-activations that the clamps cut in on both sides.
    kernels = (
        normal(keys[3], (HIDDEN, 2, INTERMEDIATE), scale=scale / np.sqrt(HIDDEN)),
        normal(keys[4], (INTERMEDIATE, HIDDEN), scale=1 / np.sqrt(INTERMEDIATE)),
    )
    biases = (0.1 * normal(keys[5], (2, INTERMEDIATE)), jnp.zeros(HIDDEN))
    return x, gamma, beta, kernels, biases


PARAMS = {"limit": 1.5, "alpha": 2.0, "glu_linear_offset": 0.5}


def _loss_of(fn):
    # A fixed random cotangent, not a function of the output such as sum(out * sin(out)): with
    # the clamped SwiGLU's outputs of about 20, that loss amplified float32 rounding until the
    # reference's own gradient moved by the tolerance between XLA's optimization levels.
    def loss(x, gamma, beta, kernels, biases):
        out = fn(x, gamma, beta, kernels, biases)
        cotangent = jax.random.normal(jax.random.key(7), out.shape, out.dtype)
        return jnp.sum(out * cotangent), out

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))


@pytest.mark.parametrize("params", [None, PARAMS], ids=["te_defaults", "given"])
def test_clamped_swiglu_matches_the_formula_and_its_gradient(params):
    limit = (params or {}).get("limit", 7.0)
    inputs = mlp_inputs(scale=2 * limit)
    x, gamma, beta, kernels, _ = inputs
    pre = reference_norm(x, gamma, beta) @ kernels[0].reshape(HIDDEN, -1)
    assert jnp.mean(jnp.abs(pre) > limit) > 0.05, "the clamps must cut in"

    def ours(*args):
        return layernorm_mlp(
            *args[:3], args[3], args[4], "layernorm", activation_type=CLAMPED,
            activation_params=params,
        )  # fmt: skip

    expected_params = {} if params is None else {
        "limit": params["limit"], "alpha": params["alpha"], "offset": params["glu_linear_offset"]
    }  # fmt: skip
    (_, out), grads = _loss_of(ours)(*inputs)
    (_, ref), ref_grads = _loss_of(lambda *a: reference_mlp(*a, **expected_params))(*inputs)
    assert_close(out, ref, tolerance(F32), "output")
    for name, got, want in zip(("x", "gamma", "beta"), grads, ref_grads, strict=False):
        assert_close(got, want, tolerance(F32), name)
    assert_close(grads[3][0], ref_grads[3][0], tolerance(F32), "kernel_1")
    assert_close(grads[3][1], ref_grads[3][1], tolerance(F32), "kernel_2")
    assert_close(grads[4][0], ref_grads[4][0], tolerance(F32), "bias_1")


# A fresh delayed-scaling set that the gradient does not differentiate scales just in time,
# each tensor by its own amax, as current scaling does (None: the formula's current scales).
@pytest.mark.parametrize(
    "recipe, scale_inv",
    [(DelayedScaling(), None), (Float8CurrentScaling(), None)],
    ids=["delayed", "current"],
)
def test_clamped_swiglu_under_fp8_matches_the_fake_quantized_formula(recipe, scale_inv):
    inputs = mlp_inputs()
    sets = QuantizerFactory.create_set(2, fp8_recipe=recipe)

    def ours(x, gamma, beta, kernels, biases):
        return layernorm_mlp(
            x, gamma, beta, kernels, biases, "layernorm", activation_type=CLAMPED,
            activation_params=PARAMS, quantizer_sets=sets,
        )  # fmt: skip

    params = {"limit": 1.5, "alpha": 2.0, "offset": 0.5}
    (_, out), grads = _loss_of(ours)(*inputs)
    (_, ref), ref_grads = _loss_of(lambda *a: reference_mlp(*a, scale_inv, **params))(*inputs)
    (_, exact), _ = _loss_of(lambda *a: reference_mlp(*a, **params))(*inputs)
    # The same float8 roundings as the formula fake-quantized (up to a rare neighbouring
    # float8 value), and an FP8 error against the unquantized formula.
    assert relative_error(out, ref) < 1e-2
    assert relative_error(out, exact) < 2 * FP8_FORWARD_TOLERANCE
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        assert relative_error(got, want) < 2e-2


def test_clamped_swiglu_backward_equals_autodiff_of_the_formula_at_the_clamps():
    from te_flax._ops.activations import activation_backward, canonical_activation_params

    params = canonical_activation_params(CLAMPED, PARAMS)
    # Values on both sides of each clamp, and exactly on them.
    values = jnp.array([-3.0, -1.5, -0.4, 0.0, 0.7, 1.5, 2.5], F32)
    pre = jnp.stack(jnp.meshgrid(values, values), axis=0).reshape(2, -1).T[:, :, None]
    grad = normal(jax.random.key(1), pre[..., 0, :].shape)
    _, vjp = jax.vjp(lambda h: reference_clamped_swiglu(h, 1.5, 2.0, 0.5), pre)
    assert_close(activation_backward(grad, pre, CLAMPED, params), vjp(grad)[0], 1e-6)


def test_clamped_swiglu_runs_the_xla_stage_whatever_the_kernel_switch():
    from te_flax._ops.activations import canonical_activation_params

    params = canonical_activation_params(CLAMPED, PARAMS)
    pre = normal(jax.random.key(0), (8, 2, INTERMEDIATE), scale=3.0)
    grad = normal(jax.random.key(1), (8, INTERMEDIATE))
    quantizer = QuantizerFactory.create_set(fp8_recipe=DelayedScaling()).dgrad
    with pallas_kernels("1"):
        result = _mlp.activation_grad(grad, pre, CLAMPED, quantizer, None, params)
    # The kernel would return a prepared (quantized) gradient; the XLA stage a plain array.
    assert isinstance(result, jax.Array)
    _, vjp = jax.vjp(lambda h: reference_clamped_swiglu(h, 1.5, 2.0, 0.5), pre)
    assert_close(result, vjp(grad)[0], 1e-6)


def test_clamped_swiglu_modules_fused_and_composed_paths_agree_linen_and_nnx():
    x = mlp_inputs()[0]
    attributes = dict(
        intermediate_dim=INTERMEDIATE, activations=("clamped_linear", "clamped_silu"),
        activation_params=PARAMS, recipe=DelayedScaling(),
    )  # fmt: skip
    fused = te_nn.LayerNormMLP(**attributes)
    variables = fused.init(jax.random.key(0), x)
    out, _ = fused.apply(variables, x)
    composed, ln = te_nn.LayerNormMLP(**attributes, return_layernorm_output=True).apply(
        variables, x
    )
    assert ln is not None
    np.testing.assert_array_equal(out, composed)
    other = te_nn.LayerNormMLP(**{**attributes, "activation_params": {"limit": 0.5}})
    assert relative_error(other.apply(variables, x)[0], out) > 0.01, "the parameters are used"
    module = te_nnx.LayerNormMLP(HIDDEN, **attributes, rngs=nnx.Rngs(0))
    te_nnx.load_linen_variables(module, variables)
    np.testing.assert_array_equal(module(x)[0], out)


def test_transformer_layer_passes_mlp_activation_params():
    x = mlp_inputs()[0]
    layer = te_nn.TransformerLayer(
        hidden_size=HIDDEN, mlp_hidden_size=INTERMEDIATE, num_attention_heads=2,
        mlp_activations=CLAMPED, mlp_activation_params=PARAMS,
    )  # fmt: skip
    assert layer.children()["mlp"].attributes["activation_params"] == PARAMS
    variables = layer.init(jax.random.key(0), x, deterministic=True)
    out = layer.apply(variables, x, deterministic=True)
    default = layer.clone(mlp_activation_params=None).apply(variables, x, deterministic=True)
    assert out.shape == x.shape and relative_error(out, default) > 1e-3


@pytest.mark.parametrize(
    "activations, params, error, message",
    [
        (("gelu",), {"limit": 7.0}, ValueError, "takes no parameters"),
        (CLAMPED, {"limit": 7.0, "beta": 1.0}, ValueError, "unknown activation_params"),
        (CLAMPED, {"limit": -1.0}, ValueError, "positive"),
        (CLAMPED, {"alpha": "big"}, TypeError, "finite number"),
        (CLAMPED, [("limit", 7.0)], TypeError, "dict or None"),
        (("clamped_silu",), None, ValueError, "one gated pair"),
        (("clamped_silu", "linear"), None, ValueError, "one gated pair"),
    ],
)
def test_bad_activation_params_are_refused(activations, params, error, message):
    x, gamma, beta, kernels, biases = mlp_inputs()
    kernels = (kernels[0][:, : len(activations)], kernels[1])
    biases = (biases[0][: len(activations)], biases[1])
    with pytest.raises(error, match=message):
        layernorm_mlp(
            x, gamma, beta, kernels, biases, "layernorm", activation_type=activations,
            activation_params=params,
        )  # fmt: skip
    with pytest.raises(error, match=message):
        te_nn.LayerNormMLP(
            intermediate_dim=INTERMEDIATE, activations=activations, activation_params=params
        ).init(jax.random.key(0), x)


# ---------------------------------------------------------------- quantization_checkpoint_name

# The quantized operands, and LayerNormMLP's pre-activation (its ffn1_ckpt_name), which its
# backward also needs: without it the first GEMM would run (and quantize) again.
SAVE_FP8 = jax.checkpoint_policies.save_only_these_names("fp8_operands", "ffn1")


def _e4m3_quantizations(jaxpr) -> int:
    """How many conversions to float8_e4m3fn (the forward operands' format) a jaxpr runs."""
    count = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "convert_element_type":
            count += eqn.params["new_dtype"] == jnp.dtype(E4M3)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            count += _e4m3_quantizations(sub)
    return count


def _remat_facts(loss, params):
    """The float8 residuals a remat with the policy saves, and the e4m3 quantizations its
    backward runs again."""
    remat = jax.checkpoint(loss, policy=SAVE_FP8)
    listing = io.StringIO()
    with contextlib.redirect_stdout(listing):
        jax.ad_checkpoint.print_saved_residuals(remat, params)
    # One line per residual: "<dtype>[<shape>] <where it comes from>".
    saved = [line for line in listing.getvalue().splitlines() if line.startswith("f8_")]
    _, backward = jax.vjp(remat, params)
    requantized = _e4m3_quantizations(jax.make_jaxpr(backward)(jnp.ones((), F32)).jaxpr)
    return saved, requantized


@pytest.mark.parametrize(
    "make, n_gemms",
    [
        (lambda **a: te_nn.DenseGeneral(features=8, **a), 1),
        (lambda **a: te_nn.LayerNormDenseGeneral(features=8, **a), 1),
        (lambda **a: te_nn.LayerNormMLP(intermediate_dim=INTERMEDIATE, **a), 2),
    ],
    ids=["DenseGeneral", "LayerNormDenseGeneral", "LayerNormMLP"],
)
def test_quantization_checkpoint_name_lets_remat_save_the_float8_operands(make, n_gemms):
    x = mlp_inputs()[0]
    facts = {}
    for name in ("fp8_operands", None):
        module = make(quantization_checkpoint_name=name, recipe=DelayedScaling())
        variables = module.init(jax.random.key(0), x)

        def loss(variables, module=module):
            # Differentiated with its FP8 state, as a train step is; linear in the output, so
            # that the backward needs the op's residuals only, not the output itself.
            out = module.apply(variables, x)
            out = out[0] if isinstance(out, tuple) else out
            return jnp.sum(out * jnp.cos(jnp.arange(out.size, dtype=F32)).reshape(out.shape))

        facts[name] = _remat_facts(loss, variables)
    saved, requantized = facts["fp8_operands"]
    # Both operands of each GEMM (input and kernel) kept as float8, named; nothing requantized.
    assert len(saved) == 2 * n_gemms, saved
    assert all("named 'fp8_operands'" in line for line in saved)
    assert requantized == 0
    # Unnamed, the policy saves no float8 tensor and the backward quantizes the operands again.
    saved, requantized = facts[None]
    assert saved == [] and requantized >= 2 * n_gemms


def test_quantization_checkpoint_name_in_the_functional_api_and_nnx():
    x = mlp_inputs()[0]
    kernel = normal(jax.random.key(3), (HIDDEN, 8))
    named = QuantizerFactory.create_set(fp8_recipe=DelayedScaling(), checkpoint_name="fp8_operands")
    assert named.checkpoint_name == "fp8_operands"
    saved, requantized = _remat_facts(lambda k: jnp.sum(dense(x, k, quantizer_set=named)), kernel)
    assert len(saved) == 2 and requantized == 0
    module = te_nnx.DenseGeneral(
        HIDDEN, 8, quantization_checkpoint_name="fp8_operands", recipe=DelayedScaling(),
        rngs=nnx.Rngs(0),
    )  # fmt: skip
    assert module.quantization_checkpoint_name == "fp8_operands"
    with pytest.raises(TypeError, match="quantization_checkpoint_name must be a str"):
        te_nn.DenseGeneral(features=8, quantization_checkpoint_name=3).init(jax.random.key(0), x)
    with pytest.raises(TypeError, match="checkpoint_name must be a str"):
        QuantizerFactory.create_set(fp8_recipe=DelayedScaling(), checkpoint_name=("a",))


# ------------------------------------------------------------------ score_mod, return_max_logit

BATCH, SEQ, HEADS, KV_HEADS, HEAD_DIM = 2, 5, 4, 2, 8


def qkv():
    keys = jax.random.split(jax.random.key(7), 3)
    query = normal(keys[0], (BATCH, SEQ, HEADS, HEAD_DIM), scale=2.0)
    key, value = (normal(k, (BATCH, SEQ, KV_HEADS, HEAD_DIM), scale=2.0) for k in keys[1:])
    return query, key, value


def manual_logits(query, key, score_mod=lambda s: s, bias=None):
    """Scaled, modified (then biased) and causally masked logits ``[b, h, q, kv]``, by hand."""
    key = jnp.repeat(key, HEADS // KV_HEADS, axis=2)  # query head n reads kv head n // group
    logits = jnp.einsum("bqhd,bkhd->bhqk", query, key, precision=HIGHEST) / np.sqrt(HEAD_DIM)
    logits = score_mod(logits)
    if bias is not None:
        logits = logits + bias
    causal = jnp.tril(jnp.ones((SEQ, SEQ), bool))[None, None]
    return jnp.where(causal, logits, -jnp.inf)


def manual_attention(query, key, value, score_mod=lambda s: s):
    probs = jax.nn.softmax(manual_logits(query, key, score_mod), axis=-1)
    value = jnp.repeat(value, HEADS // KV_HEADS, axis=2)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, value, precision=HIGHEST)


def _grads(attention):
    cotangent = normal(jax.random.key(9), (BATCH, SEQ, HEADS, HEAD_DIM))
    return jax.jit(jax.value_and_grad(lambda *a: jnp.sum(attention(*a) * cotangent), (0, 1, 2)))


def softcap(score, tensors):
    return tensors["cap"] * jnp.tanh(score / tensors["cap"])


def test_score_mod_equals_the_modified_logits_with_gradients():
    ours = _grads(
        lambda q, k, v: dot_product_attention(
            q, k, v, score_mod=softcap, score_mod_tensors={"cap": 1.5}
        )
    )(*qkv())
    manual = _grads(lambda q, k, v: manual_attention(q, k, v, lambda s: softcap(s, {"cap": 1.5})))
    expected = manual(*qkv())
    assert_close(ours[0], expected[0], tolerance(F32), "value")
    for name, got, want in zip("qkv", ours[1], expected[1], strict=True):
        assert_close(got, want, tolerance(F32), f"d{name}")
    plain = _grads(dot_product_attention)(*qkv())
    assert relative_error(plain[1][0], ours[1][0]) > 0.05, "the modification changes the result"


class _StatefulSoftcap:
    """TE's cuDNN pattern: the forward keeps what the backward callback needs."""

    def __init__(self):
        self.calls = 0

    def forward(self, score, tensors):
        self.tanh = jnp.tanh(score / tensors["cap"])
        return tensors["cap"] * self.tanh

    def backward(self, grad, tensors):
        self.calls += 1
        return grad * (1 - jnp.square(self.tanh)) * tensors["factor"]


def test_score_mod_bprop_is_the_backward_when_given():
    softcaps = _StatefulSoftcap()

    def with_bprop(factor):
        return _grads(
            lambda q, k, v: dot_product_attention(
                q, k, v, score_mod=softcaps.forward, score_mod_bprop=softcaps.backward,
                score_mod_tensors={"cap": 1.5}, score_mod_bprop_tensors={"factor": factor},
            )
        )(*qkv())  # fmt: skip

    autodiff = _grads(
        lambda q, k, v: dot_product_attention(
            q, k, v, score_mod=softcap, score_mod_tensors={"cap": 1.5}
        )
    )(*qkv())
    exact = with_bprop(1.0)
    assert softcaps.calls == 1
    for got, want in zip(exact[1], autodiff[1], strict=True):
        assert_close(got, want, tolerance(F32))
    # A bprop that scales the scores' gradient by 0 leaves the query and key without gradient.
    zeroed = with_bprop(0.0)
    np.testing.assert_array_equal(zeroed[1][0], 0.0)
    np.testing.assert_array_equal(zeroed[1][1], 0.0)
    np.testing.assert_array_equal(zeroed[1][2], exact[1][2])


def test_return_max_logit_is_the_max_of_the_scaled_masked_logits():
    query, key, value = qkv()
    bias = normal(jax.random.key(4), (1, HEADS, SEQ, SEQ))
    out, max_logit = dot_product_attention(query, key, value, bias=bias, return_max_logit=True)
    expected = jnp.max(manual_logits(query, key, bias=bias), axis=(0, 2, 3))
    assert max_logit.shape == (HEADS,) and max_logit.dtype == query.dtype
    assert_close(max_logit, expected, tolerance(F32))
    np.testing.assert_array_equal(out, dot_product_attention(query, key, value, bias=bias))
    # A statistic without a gradient, as TE's fused attention drops its cotangent.
    grads = jax.grad(
        lambda q: jnp.sum(dot_product_attention(q, key, value, return_max_logit=True)[1])
    )(query)
    np.testing.assert_array_equal(grads, 0.0)


def test_return_max_logit_in_linen_and_nnx_modules():
    query, key, value = qkv()
    attributes = dict(
        num_gqa_groups=KV_HEADS, return_max_logit=True, transpose_batch_sequence=False
    )
    linen = te_nn.DotProductAttention(head_dim=HEAD_DIM, num_attention_heads=HEADS, **attributes)
    out, max_logit = linen.apply({}, query, key, value)
    module = te_nnx.DotProductAttention(HEAD_DIM, HEADS, **attributes, rngs=nnx.Rngs(0))
    nnx_out, nnx_max = module(query, key, value)
    expected = jnp.max(manual_logits(query, key), axis=(0, 2, 3))
    assert_close(max_logit, expected, tolerance(F32))
    np.testing.assert_array_equal(nnx_out, out)
    np.testing.assert_array_equal(nnx_max, max_logit)


def _temperature(score, tensors):
    return score * tensors["temperature"]


def test_score_mod_reaches_the_self_attention_of_mha_and_transformer_layer():
    x = mlp_inputs()[0]
    common = dict(hidden_size=HIDDEN, mlp_hidden_size=INTERMEDIATE, num_attention_heads=2)
    plain = te_nn.TransformerLayer(**common)
    variables = plain.init(jax.random.key(0), x, deterministic=True)
    modified = te_nn.TransformerLayer(**common, score_mod=_temperature)
    children = modified.children()
    assert children["attention"].attributes["score_mod"] is _temperature
    reference = plain.apply(variables, x, deterministic=True)

    def run(temperature):
        tensors = {"temperature": temperature}
        return modified.apply(variables, x, deterministic=True, score_mod_tensors=tensors)

    assert_close(run(1.0), reference, tolerance(F32))
    assert relative_error(run(0.25), reference) > 1e-3
    layer = te_nnx.TransformerLayer(**common, score_mod=_temperature, rngs=nnx.Rngs(0))
    te_nnx.load_linen_variables(layer, variables)
    tensors = {"temperature": 0.25}
    np.testing.assert_array_equal(
        layer(x, deterministic=True, score_mod_tensors=tensors), run(0.25)
    )
    mha = te_nn.MultiHeadAttention(head_dim=8, num_attention_heads=2, score_mod=_temperature)
    mha_variables = mha.init(jax.random.key(0), x, x, score_mod_tensors={"temperature": 1.0})
    out, _ = mha.apply(mha_variables, x, x, score_mod_tensors={"temperature": 0.0})
    uniform = mha.clone(score_mod=lambda s, t: s * 0.0).apply(mha_variables, x, x)[0]
    assert_close(out, uniform, tolerance(F32))


@pytest.mark.parametrize(
    "options, error, message",
    [
        (dict(score_mod=lambda graph, score, tensors: score), TypeError, "cuDNN graph"),
        (dict(score_mod=softcap, score_mod_bprop=lambda g: g), TypeError, "score_mod_bprop"),
        (dict(score_mod="softcap"), TypeError, "must be a function"),
        (dict(score_mod_bprop=lambda g, t: g), ValueError, "without score_mod"),
        (dict(score_mod_tensors={"cap": 1.0}), ValueError, "without score_mod"),
        (dict(score_mod=softcap, score_mod_tensors=[1.0]), TypeError, "dict of arrays"),
        (dict(score_mod=lambda s, t: s[..., 0]), ValueError, "shape it was given"),
        (dict(return_max_logit=True, implementation="cudnn"), ValueError, "XLA attention"),
    ],
)
def test_bad_score_mod_is_refused(options, error, message):
    query, key, value = qkv()
    options = {"score_mod_tensors": {"cap": 1.0}, **options} if "score_mod" in options else options
    with pytest.raises(error, match=message):
        dot_product_attention(query, key, value, **options)
