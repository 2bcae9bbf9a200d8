"""FP8 dot-product attention (a recipe's ``fp8_dpa=True``): numerics, state, shells.

The attention's two GEMMs (``q . k`` and ``p . v``) take float8 operands: queries, keys,
values and probabilities in e4m3, the output and score gradients in e5m2 (HYBRID). Delayed
scaling keeps one GEMM-shaped state per product (postfixes ``_qk`` and ``_pv``).
"""

from __future__ import annotations

from functools import partial

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import te_flax.linen as te_nn
import te_flax.nnx as te_nnx
from te_flax.quantize import DelayedScaling, Float8CurrentScaling, merge_by_max
from te_flax.sharding import make_mesh
from tests.helpers import (
    FP8_BACKWARD_TOLERANCE,
    FP8_FORWARD_TOLERANCE,
    assert_delayed_step,
    current_scale,
    normal,
    relative_error,
)

B, S, H, G, D = 2, 32, 4, 2, 16  # batch, sequence, query heads, key/value heads, head_dim
HISTORY = 4
DELAYED = DelayedScaling(fp8_dpa=True, amax_history_len=HISTORY)
CURRENT = Float8CurrentScaling(fp8_dpa=True)
NAMES = sorted(
    f"{role}{postfix}_{kind}"
    for role in ("x", "kernel", "grad")
    for postfix in ("_qk", "_pv")
    for kind in ("amax_history", "scale_inv")
)
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2


def _qkv(seed=0, dtype=jnp.float32):
    kq, kk, kv, kg = jax.random.split(jax.random.key(seed), 4)
    q = normal(kq, (B, S, H, D), dtype)
    k, v = (normal(key, (B, S, G, D), dtype) for key in (kk, kv))
    return q, k, v, normal(kg, (B, S, H, D))  # the last: the output's cotangent


def _dpa(recipe=None, **attributes):
    return te_nn.DotProductAttention(
        head_dim=D, num_attention_heads=H, num_gqa_groups=G, transpose_batch_sequence=False,
        recipe=recipe, **attributes,
    )  # fmt: skip


@jax.jit
def _step(variables, q, k, v, cotangent):
    """Output and gradients (the FP8 state's is its new value) of ``sum(out * cotangent)``."""
    module = _dpa(DELAYED)

    def loss(variables, q, k, v):
        out = module.apply(merge_by_max(variables), q, k, v)
        return jnp.sum(out.astype(jnp.float32) * cotangent), out

    return jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(variables, q, k, v)


@partial(jax.jit, static_argnums=4)
def _stateless(q, k, v, cotangent, fp8):
    """Output and q/k/v gradients, unquantized or (``fp8``) under current scaling."""

    def loss(q, k, v):
        out = _dpa(CURRENT if fp8 else None).apply({}, q, k, v)
        return jnp.sum(out.astype(jnp.float32) * cotangent), out

    return jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)


def test_fp8_attention_is_close_to_the_unquantized_one():
    dtype = jnp.bfloat16  # the dtype FP8 training computes in; the reference is bf16 attention
    q, k, v, cotangent = _qkv(dtype=dtype)
    expected_grads, expected = _stateless(q, k, v, cotangent, False)
    # Delayed scaling after one step (the scales then follow the tensors), and current scaling.
    variables = jax.jit(_dpa(DELAYED).init)(jax.random.key(0), q, k, v)
    (state, *_), _ = _step(variables, q, k, v, cotangent)
    (_, *delayed_grads), delayed = _step(state, q, k, v, cotangent)
    current_grads, current = _stateless(q, k, v, cotangent, True)
    for name, out, grads in (
        ("delayed", delayed, delayed_grads),
        ("current", current, current_grads),
    ):
        assert out.dtype == dtype
        error = relative_error(out, expected)
        # e4m3 rounds each element by up to 2**-4: a few percent, and never exact.
        assert 1e-3 < error < FP8_FORWARD_TOLERANCE, (name, error)
        for what, grad, expected_grad in zip("qkv", grads, expected_grads, strict=True):
            assert grad.dtype == dtype
            error = relative_error(grad, expected_grad)
            assert 1e-3 < error < FP8_BACKWARD_TOLERANCE, (name, what, error)


def _quantize(x, dtype):
    """Current scaling by hand: ``x / (amax / fp8_max)`` cast to float8, and the scale."""
    scale_inv = current_scale(x, dtype)
    return (x.astype(jnp.float32) / scale_inv).astype(dtype), scale_inv


def test_emulation_equals_a_hand_written_quantize_and_dot():
    q, k, v, cotangent = _qkv(1)
    q_q, q_s = _quantize(q, E4M3)
    k_q, k_s = _quantize(k, E4M3)
    v_q, v_s = _quantize(v, E4M3)
    grouped = q_q.reshape(B, S, G, H // G, D)  # query head n reads key/value head n // 2
    logits = jnp.einsum(
        "bqkgd,bskd->bkgqs", grouped.astype(jnp.float32), k_q.astype(jnp.float32),
        precision="highest",
    ) * (q_s * k_s)  # fmt: skip
    logits = logits.reshape(B, H, S, S) / np.sqrt(D)
    causal = jnp.tril(jnp.ones((S, S), bool))
    probs = jax.nn.softmax(jnp.where(causal, logits, -1e30), axis=-1)
    p_q, p_s = _quantize(probs, E4M3)
    p_q = p_q.reshape(B, G, H // G, S, S)
    out = jnp.einsum(
        "bkgqs,bskd->bqkgd", p_q.astype(jnp.float32), v_q.astype(jnp.float32),
        precision="highest",
    ) * (p_s * v_s)  # fmt: skip
    # dV = p^T . dO on float8 operands: e4m3 probabilities, e5m2 output gradient.
    do_q, do_s = _quantize(cotangent, E5M2)
    do_q = do_q.reshape(B, S, G, H // G, D)
    d_value = jnp.einsum(
        "bqkgd,bkgqs->bskd", do_q.astype(jnp.float32), p_q.astype(jnp.float32),
        precision="highest",
    ) * (do_s * p_s)  # fmt: skip

    def loss(v):
        result = _dpa(CURRENT).apply({}, q, k, v)
        return jnp.sum(result * cotangent), result

    got_d_value, got = jax.grad(loss, has_aux=True)(v)
    # Only the float32 sums' order differs.
    np.testing.assert_allclose(got, out.reshape(B, S, H, D), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got_d_value, d_value, rtol=1e-5, atol=1e-5)


def test_delayed_state_is_updated_through_the_cotangent_and_merged_by_max():
    q, k, v, cotangent = _qkv(2)
    module = _dpa(DELAYED)
    variables = module.init(jax.random.key(0), q, k, v)
    assert sorted(variables) == ["_overwrite_with_gradient"]
    old = variables["_overwrite_with_gradient"]
    assert sorted(old) == NAMES
    (grads, *_), _ = _step(variables, q, k, v, cotangent)
    new = grads["_overwrite_with_gradient"]
    amax = lambda x: (float(jnp.max(jnp.abs(x))), 1e-6)  # noqa: E731
    # Causal: the first query sees only the first key, so the largest probability is 1.
    assert_delayed_step(old, new, "_qk", {"x": amax(q), "kernel": amax(k)})
    assert_delayed_step(
        old, new, "_pv", {"x": (1.0, 0), "kernel": amax(v), "grad": amax(cotangent)}
    )

    # The same state read twice in one step: the updates merge by max, not by sum.
    def twice(variables):
        merged = merge_by_max(variables)
        small = module.apply(merged, q, k, v)
        large = module.apply(merged, 3.0 * q, 3.0 * k, 3.0 * v)
        return jnp.sum(small * cotangent) + jnp.sum(large * cotangent)

    merged = jax.jit(jax.grad(twice))(variables)["_overwrite_with_gradient"]
    for name, x in (("x_qk", q), ("kernel_qk", k), ("kernel_pv", v)):
        history = np.asarray(merged[f"{name}_amax_history"])
        np.testing.assert_allclose(history[0], 3.0 * float(jnp.max(jnp.abs(x))), rtol=1e-6)
        np.testing.assert_array_equal(history[1:], 0.0)


def test_linen_and_nnx_agree_and_keep_the_same_state():
    q, k, v, cotangent = _qkv(3)
    linen = _dpa(DELAYED)
    variables = linen.init(jax.random.key(0), q, k, v)
    dpa = te_nnx.DotProductAttention(
        D, H, num_gqa_groups=G, transpose_batch_sequence=False, recipe=DELAYED, rngs=nnx.Rngs(0)
    )
    state = nnx.to_pure_dict(nnx.state(dpa, te_nnx.Fp8Meta))
    assert sorted(state) == NAMES
    assert jax.tree.map(jnp.shape, state) == jax.tree.map(
        jnp.shape, dict(variables["_overwrite_with_gradient"])
    )
    linen_grad = jax.grad(lambda q: jnp.sum(linen.apply(variables, q, k, v) * cotangent))(q)
    nnx_grad = jax.grad(lambda q: jnp.sum(dpa(q, k, v) * cotangent))(q)
    np.testing.assert_array_equal(dpa(q, k, v), linen.apply(variables, q, k, v))
    np.testing.assert_array_equal(nnx_grad, linen_grad)


@pytest.mark.slow
def test_multi_head_attention_linen_and_nnx_update_the_same_state():
    """The state beside the projections, updated alike by a training step."""
    x = normal(jax.random.key(5), (B, 8, 32))
    linen_mha = te_nn.MultiHeadAttention(
        head_dim=D, num_attention_heads=H, num_gqa_groups=G, recipe=DELAYED,
        transpose_batch_sequence=False,
    )  # fmt: skip
    variables = nn.meta.unbox(linen_mha.init(jax.random.key(1), x, x))
    mha = te_nnx.MultiHeadAttention(
        32, D, H, num_gqa_groups=G, recipe=DELAYED, transpose_batch_sequence=False,
        rngs=nnx.Rngs(0),
    )  # fmt: skip
    te_nnx.load_linen_variables(mha, variables)
    linen_loss = lambda variables: jnp.sum(linen_mha.apply(variables, x, x)[0])  # noqa: E731
    linen_new = jax.grad(linen_loss)(variables)["_overwrite_with_gradient"]
    _, nnx_new = te_nnx.value_and_grad(lambda model: jnp.sum(model(x, x)[0]))(mha)
    nnx_new = nnx.to_pure_dict(nnx_new)
    for name in NAMES:
        np.testing.assert_array_equal(nnx_new[name], linen_new[name], err_msg=name)


def test_attention_layers_keep_the_fp8_attention_state_beside_the_projections():
    x = normal(jax.random.key(4), (B, S, 32))
    layer = te_nn.TransformerLayer(
        hidden_size=32, mlp_hidden_size=64, num_attention_heads=H, num_gqa_groups=G,
        hidden_dropout=0.0, attention_dropout=0.0, enable_relative_embedding=False,
        recipe=DELAYED,
    )  # fmt: skip
    variables = nn.meta.unbox(jax.eval_shape(lambda: layer.init(jax.random.key(0), x)))
    attention = variables["_overwrite_with_gradient"]["attention"]
    # The checkpoint tree: the projections' sub-dicts and the attention GEMMs' variables.
    assert sorted(attention) == sorted([*NAMES, "kv", "out", "query"])
    for name in NAMES:
        shape = (HISTORY,) if name.endswith("amax_history") else (1,)
        assert attention[name].shape == shape and attention[name].dtype == jnp.float32, name
    # Without fp8_dpa the attention keeps no state; current scaling keeps none either.
    for recipe in (DelayedScaling(amax_history_len=HISTORY), CURRENT):
        plain = layer.clone(recipe=recipe)
        state = jax.eval_shape(lambda plain=plain: plain.init(jax.random.key(0), x))
        assert not set(NAMES) & set(state.get("_overwrite_with_gradient", {}).get("attention", {}))
    mha = te_nnx.MultiHeadAttention(32, D, H, num_gqa_groups=G, recipe=DELAYED, rngs=nnx.Rngs(0))
    own = nnx.to_pure_dict(nnx.state(mha, te_nnx.Fp8Meta))
    assert set(NAMES) <= set(own)


def test_fp8_attention_refuses_cudnn_and_context_parallelism():
    q, k, v, _ = _qkv()
    with pytest.raises(ValueError, match=r"FP8 attention .* runs on the XLA attention"):
        _dpa(CURRENT, implementation="cudnn").apply({}, q, k, v)
    module = _dpa(CURRENT, context_parallel_axis="context")
    mesh = make_mesh({"data": 4, "context": 2})
    with jax.set_mesh(mesh), pytest.raises(ValueError, match=r"not built\s+for context parallel"):
        module.apply({}, q, k, v)
