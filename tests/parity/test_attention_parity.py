"""te_flax's attention and transformer layers against TransformerEngine 2.20.2's, beyond the
layer suite: an input width other than hidden_size, packed sequences."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip(
    "transformer_engine.jax.flax", reason="needs TransformerEngine (scripts/parity)"
)

import te_flax.linen as te_nn
from tests.parity import te_reference as ref

TOLERANCE = 1e-5


def test_transformer_layer_input_width_other_than_hidden_size(parity_results):
    """hidden_size=16 sets the attention width; the input and output are 24 wide."""
    attributes = dict(hidden_size=16, mlp_hidden_size=32, num_attention_heads=4)
    theirs, ours = ref.TE.TransformerLayer(**attributes), te_nn.TransformerLayer(**attributes)
    x = jax.random.normal(jax.random.key(1), (2, 6, 24))
    cotangent = jax.random.normal(jax.random.key(2), x.shape)
    te_variables = nn.meta.unbox(theirs.init(jax.random.key(0), x, deterministic=True))
    our_variables = nn.meta.unbox(ours.init(jax.random.key(0), x, deterministic=True))
    assert jax.tree.map(jnp.shape, te_variables) == jax.tree.map(jnp.shape, our_variables)

    def loss(module, variables):
        def value_of(variables, x):
            return jnp.sum(module.apply(variables, x, deterministic=True) * cotangent)

        return jax.value_and_grad(value_of, argnums=(0, 1))(variables, x)

    (_, te_grads), (_, our_grads) = (
        loss(theirs, te_variables),
        loss(ours, te_variables),
    )
    errors = {
        "output": ref.relative_error(
            ours.apply(te_variables, x, deterministic=True),
            theirs.apply(te_variables, x, deterministic=True),
        ),
        "parameter gradients": max(
            ref.relative_error(a, b)
            for a, b in zip(jax.tree.leaves(our_grads), jax.tree.leaves(te_grads), strict=True)
        ),
    }
    parity_results[("TransformerLayer input width 24, hidden_size 16", "none")] = {
        **errors,
        "FP8 state": 0.0,
    }
    for what, error in errors.items():
        assert error <= TOLERANCE, f"{what}: {error:.2e}"


@pytest.mark.parametrize(
    "strategy, cp_size", [("DualChunkSwap", 2), ("DualChunkSwap", 4), ("Striped", 4)]
)
def test_causal_load_balancing_reorders_as_te(strategy, cp_size):
    from transformer_engine.jax import attention as te_attention

    from te_flax import attention

    x = jnp.arange(2 * 16 * 3).reshape(2, 16, 3)
    ours = attention.reorder_causal_load_balancing(
        x, attention.ReorderStrategy[strategy], cp_size, 1
    )
    theirs = te_attention.reorder_causal_load_balancing(
        x, te_attention.ReorderStrategy[strategy], cp_size, 1
    )
    np.testing.assert_array_equal(ours, theirs)
    back = te_attention.inverse_reorder_causal_load_balancing(
        theirs, te_attention.ReorderStrategy[strategy], cp_size, 1
    )
    np.testing.assert_array_equal(
        attention.inverse_reorder_causal_load_balancing(
            ours, attention.ReorderStrategy[strategy], cp_size, 1
        ),
        back,
    )


def test_packed_attention_equals_te_segment_ids(parity_results):
    """te_flax's packed attention against TE's pure-JAX attention (its CPU path takes masks,
    not descriptors) given the mask the segments stand for (TE's rank-5 uint8 form)."""
    from te_flax.attention import SequenceDescriptor

    ids = jnp.asarray([[1, 1, 1, 2, 2, 2, 2, 0], [1, 1, 1, 1, 1, 2, 2, 0]], jnp.int32)
    pos = jnp.asarray([[0, 1, 2, 0, 1, 2, 3, 0], [0, 1, 2, 3, 4, 0, 1, 0]], jnp.int32)
    attributes = dict(
        head_dim=8, num_attention_heads=2, qkv_layout="thd_thd_thd", max_segments_per_seq=2,
        attn_mask_type="padding_causal", transpose_batch_sequence=False,
    )  # fmt: skip
    keys = jax.random.split(jax.random.key(3), 3)
    q, k, v = (jax.random.normal(key, (2, 8, 2, 8)) for key in keys)
    same = (ids[:, :, None] == ids[:, None, :]) & (ids[:, :, None] > 0)
    # TE's pure-JAX path takes a padding_causal mask as it is given (its fused path adds the
    # causal part itself): the mask TE gets carries the causality too.
    causal = jnp.tril(jnp.ones((8, 8), jnp.bool_))
    mask = jnp.logical_not(same & causal)[:, None, None].astype(jnp.uint8)  # [b, 1, 1, q, kv]
    theirs = ref.TE.DotProductAttention(**attributes).apply(
        {}, q, k, v, mask[:, 0], deterministic=True
    )
    ours = te_nn.DotProductAttention(**attributes).apply(
        {}, q, k, v, SequenceDescriptor.from_segment_ids_and_pos(ids, pos), deterministic=True
    )
    valid = (ids > 0)[..., None, None]
    error = ref.relative_error(jnp.where(valid, ours, 0.0), jnp.where(valid, theirs, 0.0))
    parity_results[("DotProductAttention packed (segment ids)", "none")] = {
        "output": error,
        "parameter gradients": 0.0,
        "FP8 state": 0.0,
    }
    assert error <= TOLERANCE


def test_a_row_of_queries_broadcasts_against_the_masks_batch_as_in_te():
    """MaxText's lazy init: one dummy row of queries with the real batch's mask."""
    from transformer_engine.jax.flax import DotProductAttention as TEDotProductAttention

    seq = 16
    q = jax.random.normal(jax.random.key(0), (1, seq, 2, 8))
    mask = jnp.zeros((2, 1, seq, seq), jnp.uint8).at[1, :, :, seq // 2 :].set(1)
    options = dict(
        head_dim=8,
        num_attention_heads=2,
        attn_mask_type="padding",
        transpose_batch_sequence=False,
    )
    theirs = TEDotProductAttention(**options).apply({}, q, q, q, mask)
    ours = te_nn.DotProductAttention(**options).apply({}, q, q, q, mask)
    assert ours.shape == theirs.shape == (2, seq, 2, 8)
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)
