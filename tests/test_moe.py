"""MoEBlock: against a dense per-expert reference, capacity, FP8 state per expert, Linen = NNX."""

from __future__ import annotations

from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import te_flax.linen as te_nn
import te_flax.nnx as te_nnx
from te_flax.quantize import DelayedScaling, Float8CurrentScaling
from te_flax.training import OVERWRITE_WITH_GRADIENT, merge_fp8_state
from te_flax.training import value_and_grad as linen_value_and_grad
from tests.helpers import FP8_FORWARD_TOLERANCE, assert_close, normal, relative_error

ROOT = Path(__file__).resolve().parent.parent
HIDDEN, EXPERTS, TOPK, FFN = 16, 4, 2, 24
X = normal(jax.random.key(1), (2, 12, HIDDEN))
ATTRIBUTES = dict(num_experts=EXPERTS, num_experts_per_tok=TOPK, intermediate_dim=FFN)


def _reference(params, x, kept=None):
    """Every expert on every token, weighted by the router's top-k softmax (zero elsewhere)."""
    tokens = x.reshape(-1, HIDDEN)
    logits = tokens @ params["gate_kernel"]
    top, chosen = jax.lax.top_k(logits, TOPK)
    weights = jax.nn.softmax(top, axis=-1)
    if kept is not None:
        weights = jnp.where(kept, weights, 0.0)
    probs = jnp.zeros_like(logits).at[jnp.arange(tokens.shape[0])[:, None], chosen].set(weights)
    h = jnp.einsum("th,ehaf->teaf", tokens, params["wi_kernel"])
    expert_out = jnp.einsum(
        "tef,efh->teh", jax.nn.silu(h[:, :, 0]) * h[:, :, 1], params["wo_kernel"]
    )
    return jnp.einsum("teh,te->th", expert_out, probs).reshape(x.shape)


LAYER = te_nn.MoEBlock(**ATTRIBUTES)
PARAMS = nn.meta.unbox(jax.jit(LAYER.init)(jax.random.key(0), X))["params"]


def test_dropless_matches_dense_reference_values_and_gradients():
    def loss(params, x, forward):
        return jnp.sum(jnp.sin(forward(params, x)))

    def block(params, x):
        return LAYER.apply({"params": params}, x)[0]

    value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)), static_argnums=2)(
        PARAMS, X, block
    )
    expected, expected_grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)), static_argnums=2)(
        PARAMS, X, _reference
    )
    assert_close(value, expected, 2e-5)
    for name in PARAMS:
        assert relative_error(grads[0][name], expected_grads[0][name]) < 1e-5, name
    assert relative_error(grads[1], expected_grads[1]) < 1e-5


def test_capacity_drops_and_counts():
    layer = te_nn.MoEBlock(**ATTRIBUTES, capacity_factor=0.5, drop_policy="position")
    (y, _), state = jax.jit(lambda p, x: layer.apply({"params": p}, x, mutable=["intermediates"]))(
        PARAMS, X
    )
    stats = state["intermediates"]
    dropped, per_expert = int(stats["tokens_dropped"][0]), stats["tokens_per_expert"][0]
    capacity = 24 * TOPK // EXPERTS // 2
    assert dropped > 0 and int(per_expert.max()) <= capacity
    assert int(per_expert.sum()) + dropped == 24 * TOPK
    # The same as the reference with the dropped assignments' weights at zero.
    logits = X.reshape(-1, HIDDEN) @ PARAMS["gate_kernel"]
    chosen = jnp.sort(jax.lax.top_k(logits, TOPK)[1], axis=-1)  # expert order, as the block
    position = np.zeros(EXPERTS, int)
    kept = np.zeros(chosen.shape, bool)
    for t, row in enumerate(np.asarray(chosen)):
        for slot, expert in enumerate(row):
            kept[t, slot] = position[expert] < capacity
            position[expert] += 1
    order = jnp.argsort(jax.lax.top_k(logits, TOPK)[1], axis=-1)  # top-k order -> expert order
    kept_topk = jnp.take_along_axis(jnp.asarray(kept), jnp.argsort(order, axis=-1), axis=-1)
    assert_close(y, jax.jit(_reference)(PARAMS, X, kept_topk), 2e-5)


@pytest.mark.parametrize(
    "recipe",
    [
        DelayedScaling(amax_history_len=4),
        pytest.param(Float8CurrentScaling(), marks=pytest.mark.slow),
    ],
    ids=["delayed", "current"],
)
def test_fp8_one_state_per_expert(recipe):
    layer = te_nn.MoEBlock(**ATTRIBUTES, recipe=recipe)
    variables = jax.jit(layer.init)(jax.random.key(0), X)
    fp8 = variables.get(OVERWRITE_WITH_GRADIENT, {})
    if isinstance(recipe, DelayedScaling):
        assert fp8["x_0_amax_history"].shape == (EXPERTS, 4)
        assert fp8["grad_1_scale_inv"].shape == (EXPERTS, 1)
    else:
        assert not fp8

    def loss(variables, x):
        return jnp.sum(layer.apply(merge_fp8_state(variables), x)[0] ** 2)

    _, grads = jax.jit(linen_value_and_grad(loss))(variables, X)
    if isinstance(recipe, DelayedScaling):
        new = grads[OVERWRITE_WITH_GRADIENT]
        # Each expert's x amax is the max over its own tokens' rows.
        tokens = X.reshape(-1, HIDDEN)
        chosen = jax.lax.top_k(tokens @ nn.meta.unbox(variables)["params"]["gate_kernel"], TOPK)[1]
        for expert in range(EXPERTS):
            rows = tokens[np.asarray((chosen == expert).any(-1))]
            np.testing.assert_allclose(new["x_0_amax_history"][expert, 0], jnp.abs(rows).max())
        assert float(new["grad_0_amax_history"][:, 0].min()) > 0
    out = jax.jit(layer.apply)(variables, X)[0]
    reference = jax.jit(_reference)(nn.meta.unbox(variables)["params"], X)
    assert relative_error(out, reference) < FP8_FORWARD_TOLERANCE


def test_linen_and_nnx_agree_bit_for_bit():
    recipe = DelayedScaling(amax_history_len=4)
    attributes = dict(
        ATTRIBUTES, recipe=recipe, enable_layernorm=True, aux_loss_coeff=0.01, use_bias=True,
        score_function="sigmoid", use_expert_routing_bias=True,
    )  # fmt: skip
    linen_module = te_nn.MoEBlock(**attributes)
    variables = jax.jit(linen_module.init)(jax.random.key(0), X)
    module = te_nnx.MoEBlock(HIDDEN, **attributes, rngs=nnx.Rngs(5))
    te_nnx.load_linen_variables(module, variables)
    variables = nn.meta.unbox(variables)

    def linen_loss(variables, x):
        y, aux = linen_module.apply(merge_fp8_state(variables), x)
        return jnp.sum(y**2) + aux

    def nnx_loss(model, x):
        y, aux = model(x)
        return jnp.sum(y**2) + aux

    linen_value, linen_grads = jax.jit(linen_value_and_grad(linen_loss))(variables, X)
    nnx_value, nnx_grads = nnx.jit(te_nnx.value_and_grad(nnx_loss, update_fp8_state=True))(
        module, X
    )
    np.testing.assert_array_equal(nnx_value, linen_value)
    nnx_params = nnx.to_pure_dict(nnx.state(module, nnx.Param))
    assert sorted(nnx_params) == sorted(variables["params"])
    flat_nnx = nnx.to_pure_dict(nnx_grads)
    for name, grad in linen_grads["params"].items():
        np.testing.assert_array_equal(flat_nnx[name], grad, err_msg=name)
    # The NNX step wrote the new FP8 state into the module: the Linen gradient of the state.
    for name, new in linen_grads[OVERWRITE_WITH_GRADIENT].items():
        np.testing.assert_array_equal(getattr(module, name)[...], new, err_msg=name)


def test_bad_inputs():
    with pytest.raises(ValueError, match="num_experts_per_tok \\(5\\) is larger than num_experts"):
        te_nn.MoEBlock(num_experts=4, num_experts_per_tok=5).init(jax.random.key(0), X)
    with pytest.raises(ValueError, match="use_expert_routing_bias needs score_function"):
        te_nn.MoEBlock(use_expert_routing_bias=True).init(jax.random.key(0), X)


@pytest.mark.slow
def test_example_lm_trains_a_moe_and_reports_its_routing(tmp_path):
    from examples.lm.config import load_config
    from examples.lm.report import write_report
    from examples.lm.train import train
    from tests.helpers import TINY_LM

    moe = ["model.moe.experts=4", "model.moe.capacity_factor=1.0", "model.activation=swiglu"]
    config = load_config(
        ROOT / "configs" / "lm_moe.yaml",
        [*TINY_LM, *moe, "train.steps=3", "checkpoint_every=0", f"output_dir={tmp_path}"],
    )
    result = train(config, "fp8", progress=False)
    assert len(result.aux_loss) == len(result.tokens_dropped) == 3
    # Two layers, each about the coefficient (0.01) when the routing is near uniform.
    assert 0.01 < result.aux_loss[0] < 0.04 and result.tokens_dropped[0] >= 0
    assert result.variables["params"]["blocks"]["moe"]["wi_kernel"].shape == (2, 4, 32, 2, 64)
    report = write_report(config, [result]).read_text()
    assert "top-2" in report and (tmp_path / "moe.png").exists()
    with pytest.raises(ValueError, match=r"model\.moe\.experts=4 needs model\.frontend=linen"):
        load_config(ROOT / "configs" / "lm_moe.yaml", ["model.frontend=nnx"])


def test_transformer_layer_with_moe_in_place_of_the_mlp():
    attributes = dict(
        hidden_size=HIDDEN, mlp_hidden_size=FFN, num_attention_heads=2, hidden_dropout=0.0,
        attention_dropout=0.0, mlp_activations=("silu", "linear"),
        moe={"num_experts": EXPERTS, "num_experts_per_tok": TOPK, "aux_loss_coeff": 0.01},
    )  # fmt: skip
    layer = te_nn.TransformerLayer(**attributes)
    variables = jax.jit(layer.init)(jax.random.key(0), X)
    params = nn.meta.unbox(variables)["params"]
    assert params["mlp"]["wi_kernel"].shape == (EXPERTS, HIDDEN, 2, FFN)
    assert "scale" in params["mlp"]  # the MLP's pre-norm
    apply = jax.jit(lambda v, x: layer.apply(v, x, deterministic=True, mutable=["intermediates"]))
    out, sown = apply(variables, X)
    assert out.shape == X.shape
    assert float(sown["intermediates"]["mlp"]["aux_loss"][0]) > 0
    module = te_nnx.TransformerLayer(**attributes, rngs=nnx.Rngs(3))
    te_nnx.load_linen_variables(module, variables)
    nnx_out = nnx.jit(lambda m, x: m(x, deterministic=True))(module, X)
    assert relative_error(nnx_out, out) < 1e-6


def test_expert_activation_rounds_once_and_saves_only_the_pre_activation():
    """The experts' gated activation (``MoEBlockDescription.expert_ffn``): float32, rounded once;
    its gradient is ``activation_backward``'s, and the pre-activation is all it saves for the
    backward (JAX's derivative of the bfloat16 chain also saved the activated slice)."""
    from te_flax._ops.activations import (
        activation_backward,
        activation_forward,
        rounded_once_activation,
    )

    names = ("silu", "linear")
    pre = (4 * jax.random.normal(jax.random.key(0), (64, 2, 48))).astype(jnp.bfloat16)
    grad = jax.random.normal(jax.random.key(1), (64, 48)).astype(jnp.bfloat16)
    out, pullback = jax.vjp(lambda p: rounded_once_activation(p, names), pre)
    expected = activation_forward(pre.astype(jnp.float32), names).astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(expected, np.float32))
    np.testing.assert_array_equal(
        np.asarray(pullback(grad)[0], np.float32),
        np.asarray(activation_backward(grad, pre, names), np.float32),
    )
    saved = [leaf.shape for leaf in jax.tree.leaves(pullback) if getattr(leaf, "ndim", 0) > 1]
    assert saved == [pre.shape]
    _, chain_pullback = jax.vjp(lambda p: activation_forward(p, names), pre)
    chain_saved = [leaf.shape for leaf in jax.tree.leaves(chain_pullback) if leaf.ndim > 1]
    assert (64, 48) in chain_saved  # what the custom rule no longer saves
