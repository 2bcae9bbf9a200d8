"""te_flax's token permutation against TransformerEngine 2.20.2's pure-JAX one, run side by side.

TE's router (``fused_topk_with_score_function``, ``fused_moe_aux_loss``) and its MoE block run
only as CUDA kernels, which do not run on a CPU; its pure-JAX dispatch and combine do.
``roll_to_expert_id`` is left out: TE's sizes do not match its own sorted rows there (without
padding it rolls the sizes twice, with padding its placeholder rows are rolled into a group);
te_flax's group ``i`` is expert ``i + roll_to_expert_id``, its padding rows sorted last.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip(
    "transformer_engine.jax.permutation", reason="needs TransformerEngine (scripts/parity)"
)

from transformer_engine.jax import permutation as te_permutation

from te_flax import permutation

EXPERTS, TOPK = 8, 2


@pytest.mark.parametrize(("align_size", "roll"), [(0, None), (4, None)])
def test_dispatch_and_combine_match_transformer_engine(align_size, roll):
    x = jax.random.normal(jax.random.key(0), (2, 12, 16))
    logits = jax.random.normal(jax.random.key(1), (24, EXPERTS))
    selected = jax.lax.top_k(logits, TOPK)[1]
    weights = jax.nn.softmax(jax.lax.top_k(logits, TOPK)[0], axis=-1)
    ours = permutation.pure_jax_token_dispatch(x, selected, EXPERTS, TOPK, align_size, roll)
    theirs = te_permutation.pure_jax_token_dispatch(x, selected, EXPERTS, TOPK, align_size, roll)
    np.testing.assert_array_equal(ours[2], theirs[2])  # group sizes
    np.testing.assert_array_equal(ours[0], theirs[0])  # the sorted rows
    rows = jnp.tanh(ours[0])  # the experts' outputs, in the dispatch order
    combined = permutation.pure_jax_token_combine(rows, ours[1], weights, TOPK, 2, 12)
    expected = te_permutation.pure_jax_token_combine(rows, theirs[1], weights, TOPK, 2, 12)
    np.testing.assert_allclose(combined, expected, rtol=1e-6, atol=1e-6)
    selected_ours = permutation.routing_map_to_selected_experts(
        jnp.zeros((24, EXPERTS)).at[jnp.arange(24)[:, None], selected].set(weights),
        jnp.zeros((24, EXPERTS), bool).at[jnp.arange(24)[:, None], selected].set(True),
        TOPK,
    )
    selected_theirs = te_permutation.routing_map_to_selected_experts(
        jnp.zeros((24, EXPERTS)).at[jnp.arange(24)[:, None], selected].set(weights),
        jnp.zeros((24, EXPERTS), bool).at[jnp.arange(24)[:, None], selected].set(True),
        TOPK,
    )
    np.testing.assert_array_equal(selected_ours[0], selected_theirs[0])
    np.testing.assert_array_equal(selected_ours[1], selected_theirs[1])
