"""Routing and permutation properties: distinct experts, the round trip, capacity, aux loss."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from te_flax.permutation import (
    pure_jax_token_combine,
    pure_jax_token_dispatch,
    routing_map_to_selected_experts,
)
from te_flax.router import (
    drop_over_capacity,
    expert_capacity,
    fused_moe_aux_loss,
    update_expert_bias,
)
from te_flax.router import fused_topk_with_score_function as eager_topk

# One compilation per configuration rather than one per primitive.
fused_topk_with_score_function = jax.jit(
    eager_topk,
    static_argnums=1,
    static_argnames=("use_pre_softmax", "num_groups", "group_topk", "score_function",
                     "routing_map_format"),
)  # fmt: skip

TOKENS, EXPERTS = 24, 8
LOGITS = jax.random.normal(jax.random.key(0), (TOKENS, EXPERTS))


@pytest.mark.parametrize(
    "options",
    [
        dict(use_pre_softmax=True),
        dict(score_function="sigmoid", expert_bias=jnp.linspace(-1.0, 1.0, EXPERTS)),
        dict(score_function="sqrtsoftplus", num_groups=4, group_topk=2),
    ],
    ids=["pre-softmax", "sigmoid+bias", "grouped sqrtsoftplus"],
)
def test_each_token_gets_k_distinct_experts(options):
    topk = 4
    probs, routing_map = fused_topk_with_score_function(LOGITS, topk, **options)
    assert probs.dtype == jnp.float32 and routing_map.dtype == jnp.bool_
    np.testing.assert_array_equal(routing_map.sum(-1), topk)
    np.testing.assert_array_equal(probs > 0, routing_map)
    # Softmax over the chosen, or normalised chosen scores: each token's weights sum to 1.
    if "use_pre_softmax" not in options:
        np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-6)
    selected, _ = routing_map_to_selected_experts(probs, routing_map, topk)
    assert all(len(set(row)) == topk for row in np.asarray(selected).tolist())
    if "num_groups" in options:  # every token's experts lie in at most group_topk groups
        groups = np.asarray(selected) // (EXPERTS // 4)
        assert max(len(set(row)) for row in groups.tolist()) <= 2


def test_softmax_probabilities_and_gradient():
    probs, _ = fused_topk_with_score_function(LOGITS, 2)
    top2 = jax.lax.top_k(LOGITS, 2)
    expected = jax.nn.softmax(top2[0], axis=-1)
    np.testing.assert_allclose(jnp.take_along_axis(probs, top2[1], -1), expected, rtol=1e-6)
    # The gradient reaches only the chosen logits.
    grad = jax.grad(lambda z: jnp.sum(fused_topk_with_score_function(z, 2)[0] ** 2))(LOGITS)
    chosen = fused_topk_with_score_function(LOGITS, 2)[1]
    assert np.all(np.asarray(grad)[~np.asarray(chosen)] == 0)


def test_expert_bias_moves_the_choice_not_the_weights():
    bias = jnp.zeros(EXPERTS).at[3].set(10.0)  # expert 3 always chosen
    probs, routing_map = fused_topk_with_score_function(
        LOGITS, 2, score_function="sigmoid", expert_bias=bias
    )
    assert bool(routing_map[:, 3].all())
    scores = jax.nn.sigmoid(LOGITS)
    chosen = np.where(np.asarray(routing_map))
    weights = np.asarray(scores)[chosen].reshape(TOKENS, 2)
    np.testing.assert_allclose(
        np.asarray(probs)[chosen].reshape(TOKENS, 2), weights / weights.sum(-1, keepdims=True),
        rtol=1e-6,
    )  # fmt: skip
    new_bias = update_expert_bias(bias, routing_map.sum(0))
    assert float(new_bias[3]) < 10.0  # the overloaded expert's bias goes down


def test_bitmap_routing_map():
    _, bytemap = fused_topk_with_score_function(jnp.tile(LOGITS, (1, 2)), 3)
    _, bitmap = fused_topk_with_score_function(jnp.tile(LOGITS, (1, 2)), 3, routing_map_format=1)
    assert bitmap.shape == (TOKENS, 2) and bitmap.dtype == jnp.uint8
    unpacked = np.unpackbits(np.asarray(bitmap), axis=-1, bitorder="little")[:, : 2 * EXPERTS]
    np.testing.assert_array_equal(unpacked.astype(bool), bytemap)


def test_aux_loss_of_uniform_routing_is_the_coefficient():
    probs = jnp.full((TOKENS, EXPERTS), 1.0 / EXPERTS)
    counts = jnp.full((EXPERTS,), TOKENS * 2 // EXPERTS, jnp.int32)
    np.testing.assert_allclose(fused_moe_aux_loss(probs, counts, 2, 0.01), 0.01, rtol=1e-6)
    # Everything on one expert costs E times as much.
    skewed = jnp.zeros((TOKENS, EXPERTS)).at[:, 0].set(1.0)
    counts = jnp.zeros(EXPERTS, jnp.int32).at[0].set(TOKENS * 2)
    np.testing.assert_allclose(fused_moe_aux_loss(skewed, counts, 2, 0.01), 0.08, rtol=1e-6)


@pytest.mark.parametrize("align_size", [0, 4])
def test_permutation_round_trip(align_size):
    topk = 3
    x = jax.random.normal(jax.random.key(1), (2, TOKENS // 2, 16))
    probs, routing_map = fused_topk_with_score_function(LOGITS, topk)
    selected, _ = routing_map_to_selected_experts(probs, routing_map, topk)
    dispatch = jax.jit(pure_jax_token_dispatch, static_argnums=(2, 3, 4))
    rows, state, group_sizes = dispatch(x, selected, EXPERTS, topk, align_size)
    assert int(group_sizes.sum()) <= rows.shape[0]
    if align_size:
        assert np.all(np.asarray(group_sizes) % align_size == 0)
    # Group g holds exactly the tokens routed to g.
    ends = np.cumsum(np.asarray(group_sizes))
    flat = np.asarray(x).reshape(TOKENS, 16)
    for expert, (start, end) in enumerate(zip(np.r_[0, ends[:-1]], ends, strict=True)):
        expected = flat[np.asarray(routing_map)[:, expert]]
        block = np.asarray(rows[start:end])
        np.testing.assert_array_equal(block[: len(expected)], expected)
        assert not block[len(expected) :].any()  # alignment rows are zero

    # Combining is linear in the rows: its gradient is the inverse gather of the cotangent.
    def combine(rows, weights):
        return pure_jax_token_combine(rows, state, weights, topk, 2, TOKENS // 2)

    back, vjp = jax.jit(lambda r: jax.vjp(lambda r: combine(r, jnp.ones((TOKENS, topk))), r))(rows)
    np.testing.assert_allclose(back, topk * x, rtol=1e-6)
    (grad,) = vjp(x)
    np.testing.assert_allclose(combine(grad, jnp.ones((TOKENS, topk))), topk * x, rtol=1e-6)


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_capacity_drops_the_right_tokens(policy):
    topk = 2
    capacity = expert_capacity(TOKENS, EXPERTS, topk, capacity_factor=1.0)
    assert capacity == TOKENS * topk // EXPERTS
    probs, routing_map = fused_topk_with_score_function(
        LOGITS + 0.5 * jnp.arange(EXPERTS, dtype=jnp.float32)[None, :], topk
    )
    selected, weights = routing_map_to_selected_experts(probs, routing_map, topk)
    drop = jax.jit(drop_over_capacity, static_argnums=(2, 3, 4))
    kept_experts, kept_weights = drop(selected, weights, EXPERTS, capacity, policy)
    selected, weights = np.asarray(selected), np.asarray(weights)
    kept_experts, kept_weights = np.asarray(kept_experts), np.asarray(kept_weights)
    dropped = kept_experts == EXPERTS
    assert dropped.any()  # the skewed logits overload the last experts
    np.testing.assert_array_equal(kept_weights[dropped], 0)
    np.testing.assert_array_equal(kept_experts[~dropped], selected[~dropped])
    for expert in range(EXPERTS):
        routed = selected == expert
        kept = routed & ~dropped
        assert kept.sum() == min(capacity, routed.sum())
        if policy == "probs":  # the kept weights are the largest ones
            if (routed & dropped).any():
                assert weights[kept].min() >= weights[routed & dropped].max()
        else:  # the kept ones are the first tokens
            tokens = np.where(routed.any(-1))[0]
            np.testing.assert_array_equal(np.where(kept.any(-1))[0], tokens[:capacity])


def test_dropless_capacity_and_bad_inputs():
    assert expert_capacity(TOKENS, EXPERTS, 2, None) is None
    with pytest.raises(ValueError, match="topk must be an int from 1 to the number of experts"):
        eager_topk(LOGITS, EXPERTS + 1)
    with pytest.raises(ValueError, match="only supported with score_function='sigmoid'"):
        eager_topk(LOGITS, 2, expert_bias=jnp.zeros(EXPERTS))
    with pytest.raises(ValueError, match="multiple of group_topk"):
        eager_topk(LOGITS, 3, num_groups=4, group_topk=2)
    with pytest.raises(ValueError, match="capacity_factor must be a positive number"):
        expert_capacity(TOKENS, EXPERTS, 2, 0.0)
